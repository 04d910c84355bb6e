"""MTP speculative decoding at --tp 2 (gloo, a worker process): the tensor-parallel cases of
test_serve_speculative.py, in a file of their own so that ``--dist loadfile`` can give them to the
other worker (the two files together were the suite's longest, ~120 s on one worker)."""

from __future__ import annotations

from functools import lru_cache

import pytest

from exl3tools.runtime import sampling
from exl3tools.runtime.runner import load_runner
from tests.conftest import DSV3_MTP, fixture_dir, model_dir
from tests.test_serve_speculative import PROMPT, chained_and_host_drafts, draft_server


@pytest.mark.slow
def test_served_drafts_at_tp2_stay_on_the_device(monkeypatch):
    """--tp 2 (gloo, a worker process) with the fixed-shape step: rounds keep their drafts on the
    device (the worker gets them by broadcasts), and a greedy and a seeded sampled request give
    what rounds that read every depth on the host give (EXL3TOOLS_CHAINED_DRAFTS=0)."""
    import httpx

    path = fixture_dir("glm5_moe_dsa-tp-4.0bpw-mcg") / "model"
    with draft_server(path, monkeypatch, tp=2) as (app, client, rounds):   # one worker spawned for every mode
        got = chained_and_host_drafts(client, monkeypatch, rounds)
        stats = app.state.server.engine.stats()
        assert app.state.server.engine.runner.cache_tokens_used() == 0 and stats["spec_drafted_tokens"] > 0
        metrics = {ln.split()[0]: float(ln.split()[1])
                   for ln in httpx.get(str(client.base_url.join("/metrics"))).text.splitlines()
                   if ln.startswith("exl3tools_spec_")}
        assert metrics["exl3tools_spec_draft_tokens"] == stats["spec_drafted_tokens"]
    assert got["1"] == got["0"]


@lru_cache(maxsize=None)
def _tp1_greedy(path: str, prompt: tuple[int, ...]) -> list[int]:
    """16 greedy tokens at TP 1 (the eager and static GLM-5 cases read the same ones)."""
    with load_runner(path, max_cache_tokens=256, block_size=4) as r:
        r.add_sequence(0)
        want, new = [], list(prompt)
        for _ in range(16):
            want.append(int(r.step([(0, new)])[0].argmax()))
            new = [want[-1]]
    return want


@pytest.mark.parametrize("name,paged_head,decode,moe", [("glm5_moe_dsa-tp-4.0bpw-mcg", "1", "eager", "tp"),
                                                         ("glm5_moe_dsa-tp-4.0bpw-mcg", "1", "static", "tp"),
                                                         (DSV3_MTP, "1", "static", "ep")])
def test_tp2_drafts_in_lockstep_and_stay_greedy(name, paged_head, decode, moe, request, monkeypatch):
    """--tp 2 (gloo, CPU processes) on the GLM-5 tp fixture and the synthetic DeepSeek-V3 (whole
    experts a rank: its 128-wide experts do not cut in two): every rank runs its part of the MTP
    head in step with rank 0 (draft, verify, accept, free); oracle drafts with 0-2 accepted per
    step give exactly the TP=1 greedy text, with the head's cache in blocks (mtp_paged, the
    default: the workers run each draft call rank 0 makes, "hdraft"), decode eager and static.
    (The EXL3TOOLS_MTP_PAGED=0 head at TP 2: test_runtime_mla_tp.py's MTP cases.)"""
    monkeypatch.setenv("EXL3TOOLS_MTP_PAGED", paged_head)
    path = model_dir(name, request)
    prompt = PROMPT[:24]
    want = _tp1_greedy(str(path), tuple(prompt))
    with load_runner(path, tp=2, max_cache_tokens=256, block_size=4, speculative_tokens=2, decode=decode,
                     moe=moe) as r:
        r.add_sequence(0, prompt)
        out = [int(r.step([(0, prompt)])[0].argmax())]
        step, seen = 0, set()
        while len(out) < 12:
            oracle = want[len(out):len(out) + 2]
            wrong = step % 3
            it = iter(t if j != wrong else (t + 1) % 1024 for j, t in enumerate(oracle))
            drafts, qrows = r.draft(0, out[-1], 2, lambda row, it=it: next(it))
            target = r.verify([(0, [out[-1]] + drafts)])
            a, bonus = sampling.accept_drafts(target, qrows, drafts, 0.0, 0, 1.0, None)
            seen.add(a)
            r.accept(0, a + 1)
            out += drafts[:a] + [bonus]
            step += 1
        assert out == want[:len(out)] and seen == {0, 1, 2}
        r.free_sequence(0)
        cached = r.add_sequence(1, prompt)             # after the free: prefix hit, drafts again
        assert cached > 0
        out1 = [int(r.step([(1, prompt[cached:])])[0].argmax())]
        drafts, qrows = r.draft(1, out1[-1], 2, lambda row: int(row.argmax()))
        target = r.verify([(1, [out1[-1]] + drafts)])
        a, bonus = sampling.accept_drafts(target, qrows, drafts, 0.0, 0, 1.0, None)
        r.accept(1, a + 1)
        out1 += drafts[:a] + [bonus]
        assert out1 == want[:len(out1)]
        # two sequences drafting in one pass (the engine's draft_many; the workers' list commands)
        r.add_sequence(2)
        out2 = [int(r.step([(2, prompt[:9])])[0].argmax())]
        greedy = lambda row: int(row.argmax())   # noqa: E731
        for _ in range(3):
            (d1, q1), (d2, q2) = r.draft_many([(1, out1[-1], 2, greedy), (2, out2[-1], 1, greedy)])
            target = r.verify([(1, [out1[-1]] + d1), (2, [out2[-1]] + d2)])
            for sid, out, d, q, t in ((1, out1, d1, q1, target[:3]), (2, out2, d2, q2, target[3:])):
                a, bonus = sampling.accept_drafts(t, q, d, 0.0, 0, 1.0, None)
                r.accept(sid, a + 1)
                out += d[:a] + [bonus]
        assert out1 == want[:len(out1)]

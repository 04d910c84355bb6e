"""MTP speculative decoding in serve (issue 14): the Runner drafts with the checkpoint's MTP head,
verifies every row in one target forward over the paged cache, keeps the accepted prefix and gives
the rejected slots back; the engine decides with runtime.sampling.accept_drafts.

On the GLM-5 fixture (MLA + DSA + MTP head), and where marked on a synthetic DeepSeek-V3 checkpoint
(``DSV3_MTP``: MLA + MTP head, no indexer): greedy decoding through draft/verify/accept equals
plain greedy decoding and leaves the cache exactly as long as the emitted text, blocks included;
the served answers with --speculative-tokens 1..3 equal those without (openai client, real server);
usage reports accepted/rejected drafts; and rejection sampling keeps the target's distribution
(chi-square over many draws from real model logits)."""

from __future__ import annotations

from contextlib import contextmanager
from functools import lru_cache

import pytest
import torch

from exl3tools.runtime import sampling
from exl3tools.runtime.runner import load_runner
from tests.conftest import DSV3_MTP, fixture_dir, model_dir

NAME = "glm5_moe_dsa-3.0bpw-mul1"
MTP_MODELS = [NAME, DSV3_MTP]        # GLM-5's head with its DSA indexer, DeepSeek-V3's without
PROMPT = list(range(3, 43))          # 40 tokens: past the fixture's index_topk (32), sparse attention on


def asked_ids(client, temperature: float) -> list[int]:
    """PROMPT's 12 completion token ids from a served model "m" (seed 7: a sampled run repeats)."""
    r = client.completions.create(model="m", prompt=PROMPT, max_tokens=12, temperature=temperature, seed=7,
                                  extra_body={"ignore_eos": True, "return_token_ids": True})
    return r.model_dump()["choices"][0]["token_ids"]


def _greedy_plain(path, n):
    with load_runner(path, max_cache_tokens=256, block_size=4) as r:
        r.add_sequence(0)
        out, new = [], PROMPT
        for _ in range(n):
            out.append(int(r.step([(0, new)])[0].argmax()))
            new = [out[-1]]
        return out


@pytest.mark.parametrize("name", MTP_MODELS)
def test_draft_verify_accept_is_greedy_decoding_and_rolls_back(name, request):
    """The random MTP head never guesses right, so the drafts here are the true greedy
    continuation with draft j + 1 corrupted at step j % 4: every step accepts 0, 1, 2 or 3 drafts in
    turn, and the rejected slots must be given back exactly for the text to stay greedy."""
    path = model_dir(name, request)
    n = 40
    want = _greedy_plain(path, n + 4)
    with load_runner(path, max_cache_tokens=256, block_size=4, speculative_tokens=3) as r:
        r.add_sequence(0)
        out = [int(r.step([(0, PROMPT)])[0].argmax())]
        seen = set()
        step = 0
        while len(out) < n:
            oracle = want[len(out):len(out) + 3]
            wrong = step % 4                          # the draft that is corrupted (3: none)
            it = iter(t if j != wrong else (t + 1) % 2048 for j, t in enumerate(oracle))
            drafts, qrows = r.draft(0, out[-1], 3, lambda row, it=it: next(it))
            target = r.verify([(0, [out[-1]] + drafts)])
            a, bonus = sampling.accept_drafts(target, qrows, drafts, 0.0, 0, 1.0, None)
            assert a == min(wrong, 3)
            seen.add(a)
            r.accept(0, a + 1)
            out += drafts[:a] + [bonus]
            step += 1
            # the cache holds the prompt and every emitted token but the newest; no block past it
            assert r.sequence_length(0) == len(PROMPT) + len(out) - 1
            assert len(r.blocks.table(0)) == -(-r.sequence_length(0) // 4)
        assert out == want[:len(out)] and seen == {0, 1, 2, 3}
        # a mid-run block hashed for the prefix cache holds the real tokens: a new sequence with
        # this text reuses it and gets the plain logits
        hist = PROMPT + out[:-1]
        cached = r.add_sequence(1, hist)
        assert cached >= 40
        got = r.step([(1, hist[cached:])])[0]
        assert int(got.argmax()) == out[-1]


# GLM-5's head only: DSV3_MTP's case ran the same accept_drafts over another model's rows (its head
# drafting by sampling.sample: test_drafts_chain_on_the_device[synth-deepseek_v3-sampled])
@pytest.mark.parametrize("name", [NAME])
def test_rejection_sampling_keeps_the_target_distribution(name, request):
    """First emitted token of a verdict over real model logits (target at the last token, MTP
    draft rows): its frequency over 6000 seeded draws matches the target's distribution."""
    path = model_dir(name, request)
    with load_runner(path, max_cache_tokens=256, speculative_tokens=2) as r:
        r.add_sequence(0)
        last = int(r.step([(0, PROMPT)])[0].argmax())
        gen = torch.Generator().manual_seed(0)
        drafts, qrows = r.draft(0, last, 2, lambda row: sampling.sample(row, 1.0, 20, 1.0, gen))
        target = r.verify([(0, [last] + drafts)])
    T, K = 1.0, 20                                   # top-k 20: a support small enough to count
    p = sampling.distribution(target[0], T, K, 1.0)
    support = torch.nonzero(p > 0).flatten().tolist()
    counts = dict.fromkeys(support, 0)
    n = 6000
    for s in range(n):
        g = torch.Generator().manual_seed(1000 + s)
        # a fresh draft per trial, drawn from q as the engine does
        d0 = sampling.sample(qrows[0], T, K, 1.0, g)
        a, bonus = sampling.accept_drafts(target[:2], qrows[:1], [d0], T, K, 1.0, g)
        tok = d0 if a >= 1 else bonus
        counts[tok] += 1
    expected = {t: n * float(p[t]) for t in support}
    big = [t for t in support if expected[t] >= 5]
    chi2 = sum((counts[t] - expected[t]) ** 2 / expected[t] for t in big)
    rest_obs = sum(counts[t] for t in support if t not in big)
    rest_exp = sum(expected[t] for t in support if t not in big)
    if rest_exp >= 5:
        chi2 += (rest_obs - rest_exp) ** 2 / rest_exp
    df = len(big) - (0 if rest_exp >= 5 else 1)
    # 0.1 % critical value of chi-square, Wilson-Hilferty approximation
    z = 3.09
    crit = df * (1 - 2 / (9 * df) + z * (2 / (9 * df)) ** 0.5) ** 3
    assert chi2 < crit, (chi2, crit, df)
    assert sum(counts[t] for t in support) == n


openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")


def _concurrent(client) -> list:
    """Three concurrent greedy completions of a served model "m" (the third with logprobs: no
    drafts), their responses."""
    import concurrent.futures as cf

    kw = dict(model="m", temperature=0, extra_body={"ignore_eos": True, "return_token_ids": True})
    jobs = [dict(prompt=PROMPT, max_tokens=12), dict(prompt=PROMPT[:20], max_tokens=7),
            dict(prompt=PROMPT[5:], max_tokens=9, logprobs=2)]
    with cf.ThreadPoolExecutor(3) as pool:
        return list(pool.map(lambda j: client.completions.create(**kw, **j), jobs))


@contextmanager
def draft_server(path, monkeypatch, **cfg):
    """A live server of "m" with 3 MTP drafts and the fixed-shape step forced (graphs on the CPU):
    (app, client, rounds), rounds getting each verify_device's (its rows' sequences, whether the
    drafts stayed on the device). ``cfg``: more ServeConfig fields (tp)."""
    import openai

    from exl3tools.runtime import speculative
    from exl3tools.server.app import ServeConfig, create_app
    from exl3tools.server.testing import LiveServer

    rounds, real = [], speculative.SpeculativeSteps.verify_device
    monkeypatch.setattr(speculative.SpeculativeSteps, "verify_device",     # (the rows' sequences, on the device)
                        lambda self, *a: (lambda out: rounds.append(({s for s, _ in a[0]}, out is not None))
                                          or out)(real(self, *a)))
    app = create_app(ServeConfig(model_path=str(path), served_model_name="m", max_batch=4, max_context=160,
                                 block_size=4, speculative_tokens=3, cuda_graphs="force", **cfg))
    with LiveServer(app) as s:
        yield app, openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0, timeout=120), rounds


def chained_and_host_drafts(client, monkeypatch, rounds) -> dict[str, list]:
    """A greedy and a seeded sampled request's ids with drafts read from the host a depth
    (EXL3TOOLS_CHAINED_DRAFTS=0, key "0") and kept on the device ("1"). One server serves both:
    the variable is read at each draft. A first request caches the prompt, so every compared
    request starts from the same blocks. Asserts that only "1" verified drafts on the device."""
    asked_ids(client, 0.0)
    got = {}
    for chained in ("0", "1"):
        monkeypatch.setenv("EXL3TOOLS_CHAINED_DRAFTS", chained)
        rounds.clear()
        got[chained] = [asked_ids(client, t) for t in (0.0, 0.8)]
        assert any(d for _, d in rounds) == (chained == "1"), rounds
    return got


def _served(path, k: int):
    """_concurrent's completions from a server of ``k`` drafts: their token ids, usages and the
    engine's stats."""
    import httpx

    from exl3tools.server.app import ServeConfig, create_app
    from exl3tools.server.testing import LiveServer

    cfg = ServeConfig(model_path=str(path), served_model_name="m", max_batch=4, max_context=160, block_size=4,
                      speculative_tokens=k)
    app = create_app(cfg)
    with LiveServer(app) as s:
        client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0, timeout=120)
        rs = _concurrent(client)
        stats = app.state.server.engine.stats()
        assert app.state.server.engine.runner.cache_tokens_used() == 0
        metrics = {ln.split()[0]: float(ln.split()[1]) for ln in httpx.get(f"{s.url}/metrics").text.splitlines()
                   if ln.startswith("exl3tools_spec_")}
        assert metrics["exl3tools_spec_draft_tokens"] == stats["spec_drafted_tokens"]
        return [r.model_dump()["choices"][0]["token_ids"] for r in rs], [r.usage for r in rs], stats


@lru_cache(maxsize=None)
def _served_plain(path: str):
    """``_served(path, 0)``: the no-draft server's answers, which two tests compare with (no draft
    setting reaches a server of --speculative-tokens 0: Runner's mtp_paged needs k > 0)."""
    return _served(path, 0)


@pytest.mark.parametrize("name", MTP_MODELS)
def test_served_greedy_text_is_the_same_with_drafts(name, request):
    path = model_dir(name, request)
    plain, _, st0 = _served_plain(str(path))
    assert st0["spec_drafted_tokens"] == 0
    for k in (1, 3):
        got, usage, st = _served(path, k)
        assert got == plain, k
        assert st["spec_drafted_tokens"] > 0 and 0 <= st["spec_accepted_tokens"] <= st["spec_drafted_tokens"]
        d = usage[0].completion_tokens_details
        assert d.accepted_prediction_tokens + d.rejected_prediction_tokens > 0
        assert usage[2].completion_tokens_details is None          # the logprobs request drafted nothing


@pytest.mark.parametrize("name,tp,ks", [(NAME, 1, (3, 3)), (DSV3_MTP, 1, (3, 3)), (NAME, 1, (3, 1)),
                                        pytest.param("glm5_moe_dsa-tp-4.0bpw-mcg", 2, (3, 1), marks=pytest.mark.slow)])
def test_verify_with_device_drafts_equals_the_host_round(name, tp, ks, request, monkeypatch):
    """Runner.draft_device + verify_device (the drafts never read before the verify) against
    draft_many + verify with a host read a depth (EXL3TOOLS_CHAINED_DRAFTS=0) over two rounds of
    two sequences drafting ``ks`` (one draft kept each round, accept given the verified tokens):
    the same drafts, the same verify logits, the same cache afterwards. Mixed k: the smaller
    row's drafts are padded to the larger k on the device and its verdict reads its own rows.
    At TP 2 (gloo, a worker process) the worker gets each depth's tokens and the drafts it
    verifies by device broadcasts: a wrong token there changes the drafts and logits (its heads'
    share is in every all-reduce)."""
    path = model_dir(name, request)
    K = max(ks)
    out = {}
    # both modes in one runner (at TP 2: one worker spawned, not two), each on sequences of its own,
    # freed after it; EXL3TOOLS_CHAINED_DRAFTS is read at each draft. No prefix caching: the second
    # mode's prompts are computed as the first's were, not read back from its blocks
    with load_runner(path, max_cache_tokens=512, block_size=4, speculative_tokens=3, decode="static", tp=tp,
                     prefix_caching=False) as r:
        for device in (False, True):
            monkeypatch.setenv("EXL3TOOLS_CHAINED_DRAFTS", "1" if device else "0")
            last = {}
            for s, p in ((2 * device, PROMPT), (2 * device + 1, PROMPT[5:17])):
                r.add_sequence(s)
                last[s] = int(r.step([(s, p)])[0].argmax())
            got = []
            for _ in range(2):
                reqs = [(s, last[s], k, None) for s, k in zip(last, ks, strict=True)]
                if device:
                    dd = r.draft_device(reqs)
                    logits = r.verify_device([(s, last[s]) for s in last], dd)
                    assert logits is not None and dd.tokens.shape == (2, K)
                    padded = dd.tokens.tolist()
                    drafts = [t[:k] for t, k in zip(padded, ks, strict=True)]
                    rows = [logits[i * (K + 1):i * (K + 1) + k + 1] for i, k in enumerate(ks)]
                else:
                    drafts = [d for d, _ in r.draft_many(reqs)]
                    logits = r.verify([(s, [last[s]] + d) for s, d in zip(last, drafts, strict=True)])
                    rows = list(logits.split([k + 1 for k in ks]))
                got.append((drafts, [x.float().cpu() for x in rows]))
                for i, s in enumerate(list(last)):
                    r.accept(s, 2, tokens=[last[s]] + padded[i] if device else None)
                    last[s] = int(rows[i][1].argmax())
            got.append(r.cache_tokens_used())
            for s in last:
                r.free_sequence(s)
            assert r.cache_tokens_used() == 0
            out[device] = got
    assert out[True][-1] == out[False][-1]
    for (d0, l0), (d1, l1) in zip(out[False][:-1], out[True][:-1], strict=True):
        assert d1 == d0
        for a, b in zip(l0, l1, strict=True):
            assert ((b - a).abs().max() / a.abs().max()).item() < 1e-4


@pytest.mark.parametrize("name", MTP_MODELS)
def test_served_greedy_drafts_stay_on_the_device_through_the_verify(name, request, monkeypatch):
    """The fixed-shape step (graphs forced on the CPU): greedy rows drafting the same k keep their
    drafts on the device through the verify (draft_device / verify_device; the host reads the
    drafts with the verdicts once); one request's greedy text equals drafting with a host read
    between each (EXL3TOOLS_CHAINED_DRAFTS=0: the same rows, so the same verdicts), and so does a
    seeded sampled one's (its drafts drawn on the device: Draw). Three concurrent requests (rows
    of other k take the host path) finish with drafts made: their texts are not compared, since
    timing decides their batches and this random model's near-tied argmaxes flip with a batch's
    rows. One server for every mode and the concurrent requests (draft_server)."""
    with draft_server(model_dir(name, request), monkeypatch) as (app, client, rounds):
        got = chained_and_host_drafts(client, monkeypatch, rounds)
        assert got["1"] == got["0"]
        # both requests (a sequence each: the engine numbers them) verified drafts kept on the device
        assert len({s for sids, device in rounds if device for s in sids}) == 2, rounds
        rounds.clear()
        drafted = app.state.server.engine.stats()["spec_drafted_tokens"]
        rs = _concurrent(client)
        assert app.state.server.engine.stats()["spec_drafted_tokens"] > drafted and any(d for _, d in rounds)
        assert rs[2].usage.completion_tokens_details is None
        assert app.state.server.engine.runner.cache_tokens_used() == 0


def test_served_rounds_of_mixed_k_stay_on_the_device(monkeypatch):
    """Three concurrent greedy requests of different max_tokens: the rounds where one nears its
    end (a smaller k) keep their drafts on the device, padded to the largest k, and every
    verdict is read from the row's own verify rows: each accept keeps exactly the drafts that
    match the argmaxes of that row's first k + 1 rows (the verify's rows K + 1 apart), plus one."""
    from exl3tools.server.app import ServeConfig, create_app
    from exl3tools.server.testing import LiveServer

    monkeypatch.setenv("EXL3TOOLS_CHAINED_DRAFTS", "1")
    path = fixture_dir(NAME) / "model"
    cfg = ServeConfig(model_path=str(path), served_model_name="m", max_batch=4, max_context=160, block_size=4,
                      speculative_tokens=3, cuda_graphs="force", prefill_wait_s=0.3)
    app = create_app(cfg)
    rounds, accepts = [], []
    with LiveServer(app) as s:
        runner = app.state.server.engine.runner
        verify, accept = runner.verify_device, runner.accept

        def spy_verify(lasts, dd):
            out = verify(lasts, dd)
            if out is not None:
                rounds.append(([sid for sid, _ in lasts], dd.tokens.tolist(), [len(q) for q in dd.rows],
                               out.float().argmax(-1).tolist(), len(accepts), dict(lasts)))
            return out

        runner.verify_device = spy_verify
        runner.accept = lambda sid, n, tokens=None: accepts.append((sid, n, tokens)) or accept(sid, n, tokens=tokens)
        client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0, timeout=120)
        kw = dict(model="m", temperature=0, extra_body={"ignore_eos": True, "return_token_ids": True})
        import concurrent.futures as cf

        jobs = [dict(prompt=PROMPT, max_tokens=14), dict(prompt=PROMPT[:20], max_tokens=6),
                dict(prompt=PROMPT[3:30], max_tokens=10)]
        with cf.ThreadPoolExecutor(3) as pool:
            rs = list(pool.map(lambda j: client.completions.create(**kw, **j), jobs))
        assert runner.cache_tokens_used() == 0
    assert [len(r.choices[0].model_dump()["token_ids"]) for r in rs] == [14, 6, 10]
    mixed, bonus = 0, {}
    for sids, tokens, ks, preds, at, lasts in rounds:
        K = len(tokens[0])
        mixed += len(set(ks)) > 1
        for i, (sid, k) in enumerate(zip(sids, ks, strict=True)):
            assert lasts[sid] == bonus.pop(sid, lasts[sid])     # the round before's token after the kept drafts
            mine = preds[i * (K + 1):i * (K + 1) + k + 1]
            a = next((j for j in range(k) if tokens[i][j] != mine[j]), k)
            got = next(x for x in accepts[at:] if x[0] == sid)
            assert got[1] == a + 1 and len(got[2]) == K + 1 and got[2][1:k + 1] == tokens[i][:k], (got, a, k, K)
            bonus[sid] = mine[a]
    assert mixed, [r[2] for r in rounds]


def test_served_greedy_text_with_the_heads_own_cache(monkeypatch):
    """The eager head with its own growing cache (EXL3TOOLS_MTP_PAGED=0; the paged head is the
    default, test_served_greedy_text_is_the_same_with_drafts) through the server (eager decode,
    whose verify rows are computed as plain decoding's: the static step's batched rows can flip
    this random model's near-tied argmax with or without drafts): the same greedy text as without
    drafts, drafts made and counted."""
    path = fixture_dir(NAME) / "model"
    plain, _, _ = _served_plain(str(path))
    monkeypatch.setenv("EXL3TOOLS_MTP_PAGED", "0")
    got, _, st = _served(path, 2)
    assert got == plain and st["spec_drafted_tokens"] > 0


@pytest.mark.parametrize("paged_head", ["0", "1"])
def test_drafting_sequences_survive_preemption(paged_head, monkeypatch):
    """A cache of ~2.5 sequences while four draft at once: sequences are preempted (their draft
    state goes with their blocks) and re-admitted; greedy answers equal the no-draft server's.
    Also with the head's cache in the blocks (mtp_paged: a re-admitted sequence's head starts at
    its cached length)."""
    monkeypatch.setenv("EXL3TOOLS_MTP_PAGED", paged_head)
    import concurrent.futures as cf

    from exl3tools.server.app import ServeConfig, create_app
    from exl3tools.server.testing import LiveServer

    def run(k):
        cfg = ServeConfig(model_path=str(fixture_dir(NAME) / "model"), served_model_name="m", max_batch=4,
                          max_context=64, block_size=4, max_cache_tokens=100, speculative_tokens=k)
        app = create_app(cfg)
        with LiveServer(app) as s:
            client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0, timeout=120)
            kw = dict(model="m", max_tokens=20, temperature=0, extra_body={"ignore_eos": True, "return_token_ids": True})
            with cf.ThreadPoolExecutor(4) as pool:
                rs = list(pool.map(lambda i: client.completions.create(prompt=PROMPT[i:i + 20], **kw), range(4)))
            eng = app.state.server.engine
            assert eng.runner.cache_tokens_used() == 0
            return [r.model_dump()["choices"][0]["token_ids"] for r in rs], eng.preempted_total, eng.spec_drafted

    plain, pre0, _ = run(0)
    got, pre2, drafted = run(2)
    assert pre0 > 0 and pre2 > 0 and drafted > 0
    assert got == plain


def _draft_rounds(path, together: bool, decode: str = "eager", device: str = "cpu", backend: str = "auto",
                  greedy: bool = False, sampled: bool = False):
    """Three sequences of different prompt lengths and draft counts, drafted (one pass or one at a
    time), verified and accepted over two rounds (one round keeps a draft) on the model at
    ``path``: every draft's rows. ``greedy``: every draft the argmax (draw None), not fixed tokens;
    ``sampled``: drawn by seeded ``Draw`` settings (sequence 1 greedy beside them)."""
    from exl3tools.runtime.speculative import Draw
    prompts = {0: PROMPT, 1: PROMPT[5:17], 2: PROMPT[::-1][:30]}
    ks = {0: 1, 1: 3, 2: 2}

    def fixed(s, rnd):
        it = iter([(s * 37 + rnd * 11 + j * 5) % 2048 for j in range(3)])
        return lambda row, it=it: next(it)

    got = []
    with load_runner(path, max_cache_tokens=512, block_size=4, speculative_tokens=3, decode=decode,
                     device=device, backend=backend) as r:
        last = {}
        for s, p in prompts.items():
            r.add_sequence(s)
            last[s] = int(r.step([(s, p)])[0].argmax())
        for rnd in range(2):
            if sampled:
                draws = {s: None if s == 1 else Draw([0.8, 0, 1.3][s], [0, 0, 40][s], [0.9, 1.0, 1.0][s],
                                                     sampling.make_generator(10 * rnd + s, device=device))
                         for s in prompts}
            reqs = [(s, last[s], ks[s], draws[s] if sampled else None if greedy else fixed(s, rnd)) for s in prompts]
            res = r.draft_many(reqs) if together else [r.draft(*q) for q in reqs]
            got.append([(d, [q.float().cpu() for q in qs]) for d, qs in res])
            target = r.verify([(s, [last[s]] + d) for s, (d, _) in zip(prompts, res, strict=True)])
            row = 0
            for s, (d, _) in zip(prompts, res, strict=True):
                a = 1 if rnd == 0 and s == 1 else 0          # accept a draft once: rollback of 2, not 3
                r.accept(s, a + 1)
                last[s] = int(target[row + a].argmax())       # the token after the kept ones
                row += len(d) + 1
        assert r.cache_tokens_used() == sum(len(p) for p in prompts.values()) + 4 + 3   # a + 1 kept a round
    return got, ks


def _same_rows(xs, ys, ks, tol: float = 1e-4):
    for rnd, (a_, b_) in enumerate(zip(xs, ys, strict=True)):
        for s, ((d0, q0), (d1, q1)) in enumerate(zip(a_, b_, strict=True)):
            assert d0 == d1 and len(q1) == list(ks.values())[s], (rnd, s)
            for a, b in zip(q0, q1, strict=True):
                rel = ((a - b).abs().max() / a.abs().max()).item()
                assert rel < tol, (rnd, s, rel)


def test_drafts_of_several_sequences_in_one_pass_equal_one_at_a_time():
    """Runner.draft_many (what the engine calls: one head forward per depth for every drafting
    row) gives each sequence the head's rows that drafting it alone gives, for different prompt
    lengths and draft counts, over two rounds of verify/accept (the head's cache rolled back
    exactly in between)."""
    path = fixture_dir(NAME) / "model"
    (alone, ks), (many, _) = _draft_rounds(path, False), _draft_rounds(path, True)
    _same_rows(alone, many, ks)


@pytest.mark.parametrize("decode", ["eager", "static"])
@pytest.mark.parametrize("name", MTP_MODELS)
def test_the_heads_cache_in_blocks_drafts_as_its_own_cache(name, decode, request, monkeypatch):
    """mtp_paged (the default): the head's cache in the sequences' blocks (PagedState.head_pool),
    drafting through the decoder's fixed-shape draft step ("static": rows up to --max-num-seqs x
    (1 + k), here the three prompts' pairs at once) or the eager head over paged views (decode
    "eager", where each prompt's pairs went through the head right after its step), deeper drafts
    in slots reserved past the cache: the same rows as the head's own cache gives."""
    from exl3tools.runtime.paged_decode import PagedDecoder

    path = model_dir(name, request)
    monkeypatch.setenv("EXL3TOOLS_MTP_PAGED", "0")
    want, ks = _draft_rounds(path, True)
    monkeypatch.setenv("EXL3TOOLS_MTP_PAGED", "1")
    steps, draft = [], PagedDecoder.draft
    monkeypatch.setattr(PagedDecoder, "draft", lambda self, *a: steps.append(len(a[0])) or draft(self, *a))
    got, _ = _draft_rounds(path, True, decode)
    _same_rows(want, got, ks)
    # static: the prompts' pairs, the deeper drafts and the second round's pairs through the fixed-shape step
    first = len(PROMPT) + 12 + 30                                 # every prompt's pairs (_draft_rounds)
    assert steps == ([] if decode == "eager" else [first, 2, 1, 4, 2, 1]), steps   # depths 2, 3; 4 pairs, depths 2, 3


@pytest.mark.parametrize("draws", ["greedy", "sampled"])
@pytest.mark.parametrize("name", MTP_MODELS)
def test_drafts_chain_on_the_device(name, draws, request, monkeypatch):
    """Drafts through the fixed-shape draft step (EXL3TOOLS_CHAINED_DRAFTS, the default): each
    deeper depth takes the depth before's tokens on the device (argmaxes, or seeded ``Draw``
    settings, what the engine passes for temperature > 0 rows, drawn by sample_batch_device
    beside a greedy row) and the host reads every depth's drafts once; the same drafts and rows as
    reading each depth back (=0: the argmax, or sampling.sample row by row with the same generator
    use), with three sequences' different draft counts (some stop drafting early)."""
    from exl3tools.runtime.paged_decode import PagedDecoder

    path = model_dir(name, request)
    kw = {draws: True}
    monkeypatch.setenv("EXL3TOOLS_CHAINED_DRAFTS", "0")
    want, ks = _draft_rounds(path, True, "static", **kw)
    monkeypatch.setenv("EXL3TOOLS_CHAINED_DRAFTS", "1")
    device, draft = [], PagedDecoder.draft
    monkeypatch.setattr(PagedDecoder, "draft", lambda self, *a: device.append(a[5] is not None) or draft(self, *a))
    got, _ = _draft_rounds(path, True, "static", **kw)
    _same_rows(want, got, ks)
    assert device == [False, True, True, False, True, True], device     # a round: the pairs, then depths 2, 3
    if draws == "sampled":
        greedy, _ = _draft_rounds(path, True, "static", greedy=True)
        assert [d for d, _ in got[0]] != [d for d, _ in greedy[0]]    # the draws did sample


def test_the_head_computes_logits_only_for_the_rows_it_drafts_from(monkeypatch):
    """A prompt's eager step feeds the head every known pair of it at once (Runner._catch_up), so
    a long prompt goes through the head chunk by chunk during its prefill, not at its first draft;
    only each sequence's newest row reaches the lm_head (a 32k prompt's rows would be 20 GB of
    GLM-5 logits); the drafts are those of the full computation. (The eager head's own cache:
    EXL3TOOLS_MTP_PAGED=0; the paged head: test_the_heads_cache_in_blocks_drafts_as_its_own_cache.)"""
    monkeypatch.setenv("EXL3TOOLS_MTP_PAGED", "0")
    path = fixture_dir(NAME) / "model"
    with load_runner(path, max_cache_tokens=512, block_size=4, speculative_tokens=2, decode="eager") as r:
        rows, logits = [], r.model.logits
        r.model.logits = lambda h: rows.append(h.shape[0]) or logits(h)
        try:
            last = {}
            for s, p in {0: PROMPT, 1: PROMPT[:23]}.items():
                r.add_sequence(s)
                last[s] = int(r.step([(s, p)])[0].argmax())
            assert rows == [1, 1, 1, 1]                     # per prompt: the target's last row, the head's newest
            sp = r._seq(0).spec
            assert sp.cache.length == len(PROMPT) - 1 >= 39 # every known pair went into the head's cache
            assert sum(len(x) for x in sp.states) == 1 and not sp.tokens   # the newest state waits
            rows.clear()
            greedy = lambda row: int(row.argmax())   # noqa: E731
            (d0, q0), (d1, _) = r.draft_many([(0, last[0], 2, greedy), (1, last[1], 2, greedy)])
        finally:
            r.model.logits = logits
        assert rows == [2, 2]                               # depth 1 and depth 2: one row per sequence
        assert len(d0) == len(d1) == 2 and all(torch.isfinite(q).all() for q in q0)


def test_greedy_drafts_without_a_draw_are_the_argmax_rows():
    """draw None (what the engine passes for greedy rows): every such row of a depth takes its
    argmax in one batch, the same drafts as drawing each row's argmax; a sampled row beside them
    keeps its own draw; accept_drafts with the batch's argmaxes (preds) gives the same verdict."""
    path = fixture_dir(NAME) / "model"
    greedy = lambda row: int(row.float().argmax())   # noqa: E731
    got = {}
    for mode in ("draw", "none"):
        with load_runner(path, max_cache_tokens=512, block_size=4, speculative_tokens=3) as r:
            last = {}
            for s, p in {0: PROMPT, 1: PROMPT[:23], 2: PROMPT[3:30]}.items():
                r.add_sequence(s)
                last[s] = int(r.step([(s, p)])[0].argmax())
            fixed = lambda row: 7                    # noqa: E731 - a "sampled" row: its own draw
            d = None if mode == "none" else greedy
            res = r.draft_many([(0, last[0], 3, d), (1, last[1], 2, fixed), (2, last[2], 1, d)])
            logits = r.verify([(s, [last[s]] + dr) for s, (dr, _) in zip((0, 1, 2), res, strict=True)])
            preds = logits.argmax(-1).tolist()
            verdicts = []
            for i, (dr, q) in enumerate(res):
                lo = sum(len(x) + 1 for x, _ in res[:i])
                target = logits[lo:lo + len(dr) + 1]
                v = sampling.accept_drafts(target, q, dr, 0.0, 0, 1.0, None)
                assert v == sampling.accept_drafts(target, q, dr, 0.0, 0, 1.0, None, preds=preds[lo:lo + len(dr) + 1])
                verdicts.append(v)
            got[mode] = ([dr for dr, _ in res], verdicts)
    assert got["none"] == got["draw"]
    assert got["none"][0][1] == [7, 7]

"""Logits processing in serve (runtime/sampling.py Adjust): logit_bias, min_tokens, repetition /
frequency / presence penalties and min_p, through a real server and the official openai client,
against the same rules written out here on the plain runtime's logits (greedy decoding)."""

from __future__ import annotations

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from exl3tools.runtime.runner import load_runner  # noqa: E402
from exl3tools.server.app import ServeConfig, create_app  # noqa: E402
from exl3tools.server.testing import LiveServer  # noqa: E402
from tests.conftest import DEMO  # noqa: E402

PROMPT = [1, 306, 497, 263, 931, 292, 727, 471]
N = 10


@pytest.fixture(scope="module")
def client():
    app = create_app(ServeConfig(model_path=str(DEMO / "model"), served_model_name="demo", max_context=128))
    with LiveServer(app) as s:
        yield openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def runner():
    with load_runner(str(DEMO / "model"), max_cache_tokens=512) as r:
        yield r


def served(client, **kw):
    extra = {"return_token_ids": True, "ignore_eos": kw.pop("ignore_eos", True), **kw.pop("extra", {})}
    r = client.completions.create(model="demo", prompt=PROMPT, max_tokens=kw.pop("max_tokens", N),
                                  temperature=kw.pop("temperature", 0), extra_body=extra, **kw)
    c = r.choices[0]
    return c.model_dump()["token_ids"], c.finish_reason


def reference(runner, process, n=N):
    """Greedy decoding where ``process(logits list, output so far)`` edits each step's logits."""
    runner.add_sequence("ref")
    try:
        out, new = [], PROMPT
        for _ in range(n):
            row = runner.step([("ref", new)])[0].tolist()
            process(row, out)
            out.append(max(range(len(row)), key=lambda i: (row[i], -i)))
            new = [out[-1]]
        return out
    finally:
        runner.free_sequence("ref")


def test_penalties_follow_the_documented_rules(client, runner):
    plain = reference(runner, lambda row, out: None)
    assert served(client)[0] == plain

    def rep(row, out, pen=1.8):
        for t in set(PROMPT) | set(out):
            row[t] = row[t] / pen if row[t] > 0 else row[t] * pen

    def freq(row, out, f=1.5, p=0.7):
        for t in set(out):
            row[t] -= f * out.count(t) + p

    got_rep = served(client, extra={"repetition_penalty": 1.8})[0]
    got_freq = served(client, frequency_penalty=1.5, presence_penalty=0.7)[0]
    assert got_rep == reference(runner, rep)
    assert got_freq == reference(runner, freq)
    assert got_rep != plain or got_freq != plain           # the penalties changed something


def test_logit_bias_and_min_tokens(client, runner):
    forced = 1234 % runner.vocab_size
    toks, _ = served(client, logit_bias={str(forced): 100})
    assert toks == [forced] * N
    banned = plain_first = reference(runner, lambda row, out: None, n=1)[0]
    toks, _ = served(client, logit_bias={str(banned): -100}, max_tokens=1)
    assert toks[0] != plain_first
    eos = sorted(runner.eos_token_ids)[0]
    # EOS pushed to the top: min_tokens holds it back for 4 tokens, then it ends the completion
    toks, reason = served(client, ignore_eos=False, logit_bias={str(eos): 100}, extra={"min_tokens": 4})
    assert len(toks) == 5 and eos not in toks[:4] and toks[4] == eos and reason == "stop"


def test_min_p_one_keeps_only_the_top_token(client):
    greedy = served(client)[0]
    assert served(client, temperature=1.5, seed=3, extra={"min_p": 1.0})[0] == greedy
    hot = [served(client, temperature=1.5, seed=s)[0] for s in (3, 4)]
    assert any(h != greedy for h in hot)                    # without min_p the draw wanders


def test_min_p_threshold_on_raw_logits():
    """min_p at temperature T: p_i < min_p * p_max  <=>  l_i < l_max + T ln(min_p)."""
    import torch

    from exl3tools.runtime.sampling import Adjust
    from exl3tools.server.protocol import SamplingParams

    logits = torch.tensor([2.0, 1.0, 0.0, -3.0])
    for T, mp in ((1.0, 0.3), (0.5, 0.1), (2.0, 0.5)):
        a = Adjust(SamplingParams(max_tokens=1, temperature=T, min_p=mp), [], [], 4, "cpu")
        kept = torch.isfinite(a.apply(logits)).tolist()
        p = torch.softmax(logits / T, -1)
        assert kept == (p >= mp * p.max()).tolist(), (T, mp)

"""Chained decode steps (server/engine.py ``_chain``, Runner.step_chained): the next decode step is
launched on the previous step's sampled tokens while they are still on the device. With the
fixed-shape decode step forced on the CPU, a real server answers the official openai client with
exactly the tokens, text and logprobs of the unchained engine (at TP 1 and TP 2): greedy and seeded sampling,
concurrent requests that end at different lengths, stop strings and EOS-free streams, a
preempting-free mix of logprobs and plain requests, and a cancelled stream."""

from __future__ import annotations

import concurrent.futures as cf

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from exl3tools.server.app import ServeConfig, create_app  # noqa: E402
from exl3tools.server.testing import LiveServer  # noqa: E402
from tests.conftest import DEMO  # noqa: E402

PROMPTS = ["The capital of France is", "Once upon a time, in a land far", "1, 2, 3,", "Hello"]


def _requests(client):
    ids = lambda r: [c.model_dump()["choices"][0]["token_ids"] for c in [r]][0]  # noqa: E731
    kw = dict(model="demo", extra_body={"ignore_eos": True, "return_token_ids": True})
    jobs = [dict(prompt=PROMPTS[0], max_tokens=9, temperature=0),
            dict(prompt=PROMPTS[1], max_tokens=4, temperature=0.8, seed=7),
            dict(prompt=PROMPTS[2], max_tokens=12, temperature=1.0, top_p=0.9, seed=3),
            dict(prompt=PROMPTS[3], max_tokens=7, temperature=0.7, seed=11, n=2)]
    with cf.ThreadPoolExecutor(len(jobs)) as pool:      # concurrent: rows finish at different steps
        many = list(pool.map(lambda j: client.completions.create(**kw, **j), jobs))
    out = [[c.model_dump()["token_ids"] for c in r.choices] for r in many]
    out.append([c.text for r in many for c in r.choices])
    stop = client.completions.create(**kw, prompt=PROMPTS[0], max_tokens=12, temperature=0.9, seed=5,
                                     stop=[" the", "e"])
    out.append([stop.choices[0].text, stop.choices[0].finish_reason])
    lp = client.completions.create(**kw, prompt=PROMPTS[1], max_tokens=5, temperature=0, logprobs=3)
    out.append([ids(lp), lp.choices[0].logprobs.token_logprobs])
    pieces = []
    for chunk in client.completions.create(**kw, prompt=PROMPTS[2], max_tokens=10, temperature=0.5, seed=2,
                                           stream=True):
        pieces.extend(c.text for c in chunk.choices)
    out.append("".join(pieces))
    stream = client.completions.create(**kw, prompt=PROMPTS[3], max_tokens=40, temperature=0, stream=True)
    next(iter(stream))
    stream.close()                                      # cancelled mid-stream
    return out


def _run(chains: tuple[bool, ...], tp: int = 1, prefix_caching: bool = True):
    """One server: ``_requests`` (and one more) with ``engine.chain`` set to each of ``chains`` in
    turn: each run's answers and the row counts of its chained steps."""
    cfg = ServeConfig(model_path=str(DEMO / "model"), served_model_name="demo", max_batch=6, max_context=96,
                      cuda_graphs="force", block_size=8, tp=tp, moe="ep", prefix_caching=prefix_caching)
    app = create_app(cfg)
    runs = []
    with LiveServer(app) as s:
        engine = app.state.server.engine
        runner = engine.runner
        chained = []
        real = runner.step_chained
        runner.step_chained = lambda ids, tok: chained.append(len(ids)) or real(ids, tok)
        client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0, timeout=60)
        for chain in chains:
            engine.chain = chain
            chained.clear()
            out = _requests(client)
            after = client.completions.create(model="demo", prompt=PROMPTS[0], max_tokens=3, temperature=0)
            out.append(after.choices[0].text)
            assert runner.cache_tokens_used() == 0 and engine.running == 0
            runs.append((out, list(chained)))
    return runs


def test_chained_steps_give_the_unchained_engines_answers():
    ((plain, none),), ((chained, steps),) = _run((False,)), _run((True,))
    assert none == []
    assert len(steps) >= 10 and max(steps) >= 2, steps     # chaining ran, on batches too
    assert chained == plain


@pytest.mark.slow
def test_chained_steps_at_tp2_give_the_unchained_engines_answers():
    """At --tp 2 (gloo, a worker process) a chained step's tokens reach the worker by a broadcast
    of rank 0's tensor (on GPUs a stream-ordered NCCL broadcast): the same answers as the
    unchained TP 2 engine, which reads every step's tokens on the host first. One server (one
    worker spawned) runs both: unchained, then chained (engine.chain is read at each step), no
    prefix caching so that the chained run's prompts are computed as the unchained run's were
    (chaining beside prefix hits: the TP 1 test)."""
    (plain, none), (chained, steps) = _run((False, True), tp=2, prefix_caching=False)
    assert none == []
    assert len(steps) >= 10 and max(steps) >= 2, steps
    assert chained == plain


def test_chained_steps_under_preemption_give_the_same_answers():
    """A cache that holds about two sequences while four decode at once: sequences are preempted
    and re-admitted between chained runs; greedy and seeded answers equal the unchained engine's."""
    jobs = [dict(prompt=p, max_tokens=20, temperature=t, seed=i)
            for i, (p, t) in enumerate(zip(PROMPTS, (0, 0.8, 0, 1.1), strict=True))]

    def run(chain: bool):
        cfg = ServeConfig(model_path=str(DEMO / "model"), served_model_name="demo", max_batch=4, max_context=64,
                          cuda_graphs="force", block_size=4, max_cache_tokens=56)
        app = create_app(cfg)
        with LiveServer(app) as s:
            engine = app.state.server.engine
            engine.chain = chain
            client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0, timeout=60)
            kw = dict(model="demo", extra_body={"ignore_eos": True, "return_token_ids": True})
            with cf.ThreadPoolExecutor(len(jobs)) as pool:
                rs = list(pool.map(lambda j: client.completions.create(**kw, **j), jobs))
            assert engine.runner.cache_tokens_used() == 0
            return [r.model_dump()["choices"][0]["token_ids"] for r in rs], engine.preempted_total

    (plain, pre_plain), (chained, pre_chained) = run(False), run(True)
    assert pre_plain > 0 and pre_chained > 0            # the cache really ran out
    assert chained == plain and all(len(t) == 20 for t in chained)

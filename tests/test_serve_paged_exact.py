"""Served logprobs on the paged engine equal the plain CPU runtime's (teacher-forced over the served
tokens), on a cold prompt, on a prefix-cache hit of the same prompt, and for requests that were
preempted under a tiny KV cache and recomputed: a real server on 127.0.0.1, the openai client."""

from __future__ import annotations

import concurrent.futures as cf
import time

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

import torch  # noqa: E402

from exl3tools.server.app import ServeConfig, create_app  # noqa: E402
from exl3tools.server.testing import LiveServer  # noqa: E402
from tests.conftest import DEMO  # noqa: E402

TOL = 1e-4
N = 6
PROMPTS = [[1] + list(range(100 + 37 * i, 100 + 37 * i + 30)) for i in range(4)]


def _reference_logprobs(model, prompt: list[int], out: list[int]) -> list[float]:
    cache = model.new_cache()
    logits = model.forward([(cache, prompt)])
    lps = []
    for t in out:
        lps.append(torch.log_softmax(logits[0].double(), -1)[t].item())
        logits = model.forward([(cache, [t])])
    return lps


def _ask(client, prompt, n=N):
    r = client.completions.create(model="demo", prompt=prompt, max_tokens=n, temperature=0, logprobs=1,
                                  extra_body={"ignore_eos": True, "return_token_ids": True})
    c = r.choices[0]
    return c.model_dump()["token_ids"], c.logprobs.token_logprobs, r.usage


@pytest.mark.parametrize("cuda_graphs", [False, "force"])
def test_served_logprobs_equal_the_reference(cuda_graphs):
    cfg = ServeConfig(model_path=str(DEMO / "model"), served_model_name="demo", max_batch=4, max_context=96,
                      block_size=4, cuda_graphs=cuda_graphs)
    app = create_app(cfg)
    with LiveServer(app) as s:
        model = app.state.server.engine.runner.model
        client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0, timeout=60)
        ids, lps, usage = _ask(client, PROMPTS[0])
        assert usage.prompt_tokens_details.cached_tokens == 0
        ref = _reference_logprobs(model, PROMPTS[0], ids)
        assert max(abs(a - b) for a, b in zip(lps, ref, strict=True)) < TOL
        ids2, lps2, usage2 = _ask(client, PROMPTS[0])            # whole blocks from the prefix cache
        assert usage2.prompt_tokens_details.cached_tokens == 28
        assert ids2 == ids and max(abs(a - b) for a, b in zip(lps2, ref, strict=True)) < TOL


def test_preempted_requests_keep_the_reference_logprobs():
    # 12 blocks of 4 tokens; four 7-token prompts are admitted, then their 24-token outputs outgrow the
    # cache: the newest give their blocks back, are re-admitted (their own blocks from the prefix cache
    # where still there) and recompute the rest
    cfg = ServeConfig(model_path=str(DEMO / "model"), served_model_name="demo", max_batch=4, max_context=48,
                      max_cache_tokens=48, block_size=4)
    app = create_app(cfg)
    prompts = [p[:7] for p in PROMPTS]
    with LiveServer(app) as s:
        engine = app.state.server.engine
        model = engine.runner.model
        client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0, timeout=120)
        with cf.ThreadPoolExecutor(4) as pool:
            got = list(pool.map(lambda p: _ask(client, p, 24), prompts))
        assert engine.preempted_total > 0
        for p, (ids, lps, _) in zip(prompts, got, strict=True):
            ref = _reference_logprobs(model, p, ids)
            assert len(ids) == 24 and max(abs(a - b) for a, b in zip(lps, ref, strict=True)) < TOL
        assert engine.runner.cache_tokens_used() == 0


def test_a_long_prompt_is_chunked_beside_running_decodes():
    """--max-prefill-tokens 16: a 200-token prompt enters in chunks of at most 16 tokens, and every
    step that carries one of its chunks also decodes the stream already running."""
    cfg = ServeConfig(model_path=str(DEMO / "model"), served_model_name="demo", max_batch=4, max_context=256,
                      block_size=4, max_prefill_tokens=16)
    app = create_app(cfg)
    with LiveServer(app) as s:
        runner = app.state.server.engine.runner
        steps, step = [], runner.step
        runner.step = lambda batch, **kw: steps.append([len(t) for _, t in batch]) or step(batch, **kw)
        client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0, timeout=120)
        kw = dict(model="demo", temperature=0, extra_body={"ignore_eos": True})
        with cf.ThreadPoolExecutor(2) as pool:
            first = pool.submit(lambda: list(client.completions.create(prompt=[1, 2, 3], max_tokens=60, stream=True,
                                                                       **kw)))
            deadline = time.monotonic() + 60
            while not any(len(b) == 1 and b[0] == 1 for b in steps):   # the first stream is decoding
                assert time.monotonic() < deadline
                time.sleep(0.001)
            long = pool.submit(client.completions.create, prompt=list(range(5, 205)), max_tokens=2, **kw)
            long.result()
            first.result()
        runner.step = step
        chunked = [b for b in steps if any(n > 1 for n in b)][1:]        # after the first prompt's prefill
        assert len(chunked) >= 200 // 16 and all(max(b) <= 16 for b in chunked)
        assert all(1 in b for b in chunked[:-1])                          # decoding went on meanwhile


@pytest.mark.parametrize("fit", ["0", "1"])
def test_a_burst_of_prompts_keeps_to_the_prompt_graphs(fit, monkeypatch):
    """prompt_fit (the default; runtime/preview.py, server/planner.py plan_step): four 31-token prompts
    gathered into one burst, a budget of 64 prompt tokens a step, prompt graphs of at most 40 rows.
    Opted out ("0"), the first step takes 64 prompt rows through the eager forward; on, no step leaves the
    graphs (one prompt a step beside the decoding ones). The served logprobs equal the reference
    either way."""
    import exl3tools.runtime.runner as R

    monkeypatch.setattr(R, "PROMPT_GRAPH_ROWS", 40)
    monkeypatch.setenv("EXL3TOOLS_PROMPT_GRAPHS", "1")       # (on the CPU only when asked for)
    monkeypatch.setenv("EXL3TOOLS_PROMPT_FIT", fit)
    cfg = ServeConfig(model_path=str(DEMO / "model"), served_model_name="demo", max_batch=4, max_context=96,
                      block_size=4, cuda_graphs="force", max_prefill_tokens=64, prefill_wait_s=2.0)
    app = create_app(cfg)
    with LiveServer(app) as s:
        engine = app.state.server.engine
        assert engine.runner.prompt_graph_limits() == (40, R.PROMPT_GRAPH_READS)
        client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0, timeout=120)
        t0 = time.monotonic()
        with cf.ThreadPoolExecutor(4) as pool:
            got = list(pool.map(lambda p: _ask(client, p, 4), PROMPTS))
        steps = [x for x in list(engine.trace) if x["t"] >= t0]
        model = engine.runner.model
        for p, (ids, lps, _) in zip(PROMPTS, got, strict=True):
            ref = _reference_logprobs(model, p, ids)
            assert len(ids) == 4 and max(abs(a - b) for a, b in zip(lps, ref, strict=True)) < TOL
    paths = [(x["path"], x["rows"]) for x in steps]
    if fit == "1":
        assert all(path != "eager" and rows <= 40 for path, rows in paths), paths
        assert [rows for path, rows in paths if path == "prompt"] == [31, 32, 33, 34], paths
    else:
        assert paths[0] == ("eager", 64), paths

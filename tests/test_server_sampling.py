"""The server's sampling: one batched sampler call per step (same tokens as per-row sampling),
and generation_config.json defaults for fields a request leaves out."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import torch

pytest.importorskip("fastapi")

from exl3tools.runtime import sampling  # noqa: E402
from exl3tools.server.app import ServeConfig, create_app, runtime_hooks  # noqa: E402
from exl3tools.server.testing import LiveServer  # noqa: E402
from tests.conftest import DEMO  # noqa: E402

MODEL = "demo"


def _clone(g):
    if g is None:
        return None
    c = torch.Generator(device=g.device)
    c.set_state(g.get_state())
    return c


def test_engine_samples_a_step_in_one_batched_call():
    """16 concurrent sampled sequences with mixed settings: the engine calls sample_batch once
    per step with every ready row (never per-row sample), and each call's tokens equal per-row
    `sample` on the same rows with copies of the same generators."""
    calls: list[int] = []
    per_row: list[int] = []
    mismatches: list = []

    def sample_batch(logits, temps, ks, ps, gens):
        copies = [_clone(g) for g in gens]
        got = sampling.sample_batch(logits, temps, ks, ps, gens)
        want = [sampling.sample(logits[i], temps[i], ks[i], ps[i], copies[i]) for i in range(len(got))]
        calls.append(len(got))
        if got != want:
            mismatches.append((got, want))
        return got

    def sample(*a):
        per_row.append(1)
        return sampling.sample(*a)

    hooks = {**runtime_hooks(), "sample_batch": sample_batch, "sample": sample}
    app = create_app(ServeConfig(model_path=str(DEMO / "model"), served_model_name=MODEL), hooks=hooks)
    settings = [{"temperature": 0.9, "seed": 3}, {"temperature": 0}, {"temperature": 1.2, "top_k": 20, "seed": 4},
                {"temperature": 0.7, "top_p": 0.8, "seed": 5}]
    with LiveServer(app) as s:
        def body(i):
            return {"model": MODEL, "prompt": [1, 30 + i, 40], "max_tokens": 12, "ignore_eos": True,
                    "return_token_ids": True, **settings[i % 4]}

        async def main():
            async with httpx.AsyncClient(base_url=s.url, timeout=120) as c:
                return await asyncio.gather(*(c.post("/v1/completions", json=body(i)) for i in range(16)))

        rs = asyncio.run(main())
        assert all(r.status_code == 200 for r in rs)
        assert all(len(r.json()["choices"][0]["token_ids"]) == 12 for r in rs)
        again = httpx.post(f"{s.url}/v1/completions", json={**body(2), "n": 3}, timeout=60).json()
        twice = httpx.post(f"{s.url}/v1/completions", json={**body(2), "n": 3}, timeout=60).json()
    assert [c["token_ids"] for c in again["choices"]] == [c["token_ids"] for c in twice["choices"]]
    assert not mismatches
    assert max(calls) >= 8  # many rows in one call
    assert sum(calls) >= 16 * 11
    assert not per_row  # every step went through the batch


def test_a_nan_row_fails_only_its_own_sequence():
    """The batched sampler refuses a step with a NaN row; the engine then samples row by row, so
    the poisoned request gets a 500 and its neighbour, decoding in the same steps, carries on."""
    from exl3tools.server.app import runtime_loader

    cfg = ServeConfig(model_path=str(DEMO / "model"), served_model_name=MODEL)
    base = runtime_loader(cfg)

    def load():
        runner = base()
        step = runner.step

        def poisoned(batch, **kw):
            out = step(batch, **kw).clone()
            for i, (_, toks) in enumerate(batch):
                if 999 in toks:
                    out[i] = float("nan")
            return out

        runner.step = poisoned
        return runner

    raised: list[int] = []

    def sample_batch(logits, *a):
        try:
            return sampling.sample_batch(logits, *a)
        except ValueError:
            raised.append(len(logits))
            raise

    hooks = {**runtime_hooks(), "sample_batch": sample_batch}
    with LiveServer(create_app(cfg, load=load, hooks=hooks)) as s:
        async def main():
            async with httpx.AsyncClient(base_url=s.url, timeout=120) as c:
                healthy = asyncio.create_task(c.post("/v1/completions", json={
                    "model": MODEL, "prompt": [1, 50], "max_tokens": 60, "temperature": 0.8, "seed": 1,
                    "ignore_eos": True}))
                while httpx.get(f"{s.url}/v1/engine/stats").json()["running"] == 0:
                    await asyncio.sleep(0.005)
                bad = await c.post("/v1/completions", json={"model": MODEL, "prompt": [1, 999],
                                                            "max_tokens": 5, "temperature": 0.8})
                return await healthy, bad

        ok, bad = asyncio.run(main())
    assert bad.status_code == 500 and bad.json()["error"]["code"] == "engine_error"
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 60
    assert raised and max(raised) >= 2  # the refused step held both rows

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
    """16 concurrent sampled sequences with mixed settings: the engine calls its device sampler
    once per step with every ready row (never per-row sample), and each call's tokens equal
    per-row `sample` on the same rows with copies of the same generators."""
    calls: list[int] = []
    per_row: list[int] = []
    mismatches: list = []

    def sample_device(logits, temps, ks, ps, gens):   # the engine's sampler: tokens stay on the device
        copies = [_clone(g) for g in gens]
        out = sampling.sample_device(logits, temps, ks, ps, gens)
        got = out.tolist()
        want = [sampling.sample(logits[i], temps[i], ks[i], ps[i], copies[i]) for i in range(len(got))]
        calls.append(len(got))
        if got != want:
            mismatches.append((got, want))
        return out

    def sample(*a):
        per_row.append(1)
        return sampling.sample(*a)

    hooks = {**runtime_hooks(), "sample_device": sample_device, "sample": sample}
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
    """The batched sampler marks a NaN row (-1); the engine then samples that row alone, so the
    poisoned request gets a 500 and its neighbour, decoding in the same steps, carries on."""
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

    def sample_device(logits, *a):     # a row that cannot be sampled comes back as -1
        out = sampling.sample_device(logits, *a)
        if min(out.tolist()) < 0:
            raised.append(len(logits))
        return out

    hooks = {**runtime_hooks(), "sample_device": sample_device}
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


# ------------------------------------------------------------------ generation_config.json defaults

PROMPT = [1, 50, 60]


def _greedy(model, n=4):
    from exl3tools.runtime.runner import load_runner

    with load_runner(str(model)) as r:
        r.add_sequence(0)
        out, new = [], PROMPT
        for _ in range(n):
            out.append(sampling.sample(r.step([(0, new)])[0], 0.0))
            new = [out[-1]]
    return out


@pytest.fixture(scope="module")
def greedy():
    return _greedy(DEMO / "model")


def _copy_with(tmp_path, gen: dict):
    import json
    import shutil

    dst = tmp_path / "model"
    shutil.copytree(DEMO / "model", dst)
    (dst / "generation_config.json").write_text(json.dumps(gen))
    return dst


def test_runner_reads_generation_defaults(tmp_path):
    from exl3tools.runtime.runner import load_runner
    from exl3tools.runtime.text_meta import generation_defaults

    model = _copy_with(tmp_path, {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "do_sample": True,
                                  "eos_token_id": [2, 7]})
    with load_runner(str(model)) as r:
        assert r.generation_defaults == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
        assert r.eos_token_ids == {2, 7}
    assert generation_defaults({"temperature": -1, "top_p": 0, "top_k": True}) == {}
    assert generation_defaults({"temperature": "0.7", "top_p": 1.5, "top_k": -1}) == {"top_k": 0}
    with load_runner(str(DEMO / "model")) as r:
        assert r.generation_defaults == {"max_tokens": 64}  # the demo's max_new_tokens (do_sample false)


def test_server_applies_generation_config_defaults(tmp_path, greedy):
    """Fields a request leaves out come from generation_config.json; fields it sets win; its
    eos_token_id list ends generation."""
    model = _copy_with(tmp_path, {"temperature": 1.7, "top_k": 1, "top_p": 0.5,
                                  "eos_token_id": [2, greedy[1]]})
    seen: list[tuple] = []

    def sample_device(logits, temps, ks, ps, gens):
        seen.extend(zip(temps, ks, ps, strict=True))
        return sampling.sample_device(logits, temps, ks, ps, gens)

    app = create_app(ServeConfig(model_path=str(model), served_model_name=MODEL),
                     hooks={**runtime_hooks(), "sample_device": sample_device})
    with LiveServer(app) as s:
        def post(**kw):
            r = httpx.post(f"{s.url}/v1/completions", json={"model": MODEL, "prompt": PROMPT,
                                                            "return_token_ids": True, **kw}, timeout=60)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]

        plain = post(max_tokens=4)  # top_k 1 from the file: greedy; stops at the file's 2nd EOS
        assert plain["token_ids"] == greedy[:2] and plain["finish_reason"] == "stop"
        assert seen == [(1.7, 1, 0.5)] * 2
        seen.clear()
        own = post(max_tokens=4, temperature=0.3, top_k=-1, top_p=1.0, seed=3, ignore_eos=True)
        assert len(own["token_ids"]) == 4 and seen == [(0.3, 0, 1.0)] * 4
        seen.clear()
        chat = httpx.post(f"{s.url}/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
            "top_k": 5}, timeout=60)
        assert chat.status_code == 200 and seen == [(1.7, 5, 0.5)]


def test_generate_cli_applies_generation_config_defaults(tmp_path, greedy):
    import json

    from click.testing import CliRunner
    from exl3tools.cli import main

    def run(model, *args):
        res = CliRunner().invoke(main, ["generate", str(model), "--token-ids", "1,50,60", "--json",
                                        *map(str, args)])
        assert res.exit_code == 0, res.output
        return json.loads(res.stdout)["completion_ids"]

    stop = _copy_with(tmp_path / "a", {"eos_token_id": [2, greedy[1]]})
    assert run(stop, "--max-tokens", 4) == greedy[:2]  # greedy by default; the file's EOS list stops it
    hot = _copy_with(tmp_path / "b", {"temperature": 5.0})
    sampled = run(hot, "--max-tokens", 8, "--seed", 1, "--ignore-eos")
    assert sampled != _greedy(hot, 8) and sampled == run(hot, "--max-tokens", 8, "--seed", 1, "--ignore-eos")
    assert run(hot, "--max-tokens", 8, "--seed", 1, "--ignore-eos", "--temperature", 0) == _greedy(hot, 8)

"""The Runner's graph-decode mode on the GPU (backend "cuda", CUDA graphs on) against the CPU eager
reference over the interleaved continuous-batching schedule of tests/test_runner_graph.py, and
`serve` on CUDA taking the graph path by default. Skipped without CUDA."""

from __future__ import annotations

import pytest

from tests.conftest import cuda_available

pytestmark = pytest.mark.skipif(not cuda_available(), reason="needs CUDA")

NAMES = ["glm4_moe-3.0bpw-mcg", "llama-4.0bpw-mul1"]
REL = 1e-2          # fp16 kernels vs the fp32 reference, as tests/gpu/test_graph_decode_gpu.py
MAX_LEN = 48


def _cuda_backend() -> str:
    from exl3tools.kernels import dispatch

    try:
        dispatch.get_backend("cuda")
    except Exception as exc:  # noqa: BLE001 - not built here
        pytest.skip(f"cuda backend unavailable: {exc}")
    return "cuda"


def _rel(a, b) -> float:
    return ((a.float().cpu() - b.float().cpu()).abs().max() / b.float().cpu().abs().max()).item()


@pytest.mark.parametrize("name", NAMES)
def test_graph_runner_on_cuda_matches_cpu_reference(name):
    import torch

    from exl3tools.runtime.runner import load_runner
    from tests.conftest import fixture_dir
    from tests.test_runner_graph import schedule

    path = fixture_dir(name) / "model"
    backend = _cuda_backend()
    ref = schedule(load_runner(path, max_context=MAX_LEN))
    runner = load_runner(path, device="cuda", backend=backend, max_context=MAX_LEN, graph_decode=True,
                         graph_slots=3)
    assert runner.graph is not None and runner.graph.graphs
    got = schedule(runner)
    assert runner.graph._graph is not None          # decode steps replayed a captured graph
    for s, (g, r) in enumerate(zip(got, ref, strict=True)):
        assert g.shape == r.shape and g.dtype == torch.float32 and g.device.type == "cpu", s
        assert _rel(g, r) < REL, (name, s, _rel(g, r))


def test_serve_on_cuda_uses_graphs_by_default():
    pytest.importorskip("fastapi")
    openai = pytest.importorskip("openai")
    from exl3tools.server.app import ServeConfig, create_app
    from exl3tools.server.testing import LiveServer
    from tests.conftest import DEMO

    backend = _cuda_backend()
    app = create_app(ServeConfig(model_path=str(DEMO / "model"), served_model_name="demo", device="cuda",
                                 backend=backend, max_batch=4, max_context=256))
    with LiveServer(app) as s:
        runner = app.state.server.engine.runner
        assert runner.graph is not None and runner.graph.graphs and runner.graph._graph is not None
        client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0, timeout=60)
        text = "".join(c.choices[0].text for c in client.completions.create(
            model="demo", prompt="The capital of France is", max_tokens=8, temperature=0, stream=True,
            extra_body={"ignore_eos": True}) if c.choices)
        r = client.completions.create(model="demo", prompt="The capital of France is", max_tokens=8,
                                      temperature=0, extra_body={"ignore_eos": True})
        # not compared token for token: split-K atomics may flip a near-tie between two runs
        assert r.usage.completion_tokens == 8 and text and r.choices[0].text
        assert runner.cache_tokens_used() == 0

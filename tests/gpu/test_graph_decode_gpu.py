"""GraphDecoder on the GPU (CUDA graphs, GPU backends) against the CPU reference, per-step logits.

Teacher-forced: both sides decode the same fixed tokens, so a near-tie never makes them diverge.
The grouped-experts check also runs on the Triton interpreter (TRITON_INTERPRET=1, no CUDA).
"""

from __future__ import annotations

import pytest

GQA = ["llama-4.0bpw-mul1", "qwen3_moe-2.5bpw-mul1", "glm4_moe-3.0bpw-mcg"]
PROMPTS = [[1, 17, 300, 42, 1999, 7, 512, 88], [5, 6, 7], [9, 8, 7, 6, 5, 4, 3, 2, 1, 100, 1024, 11, 77]]
FEED = [[3, 900, 11], [42, 42, 1], [7, 1500, 2000], [0, 64, 128], [1999, 5, 6]]   # step -> row tokens
REL = 1e-2          # fp16 kernels vs fp32 reference, as tests/gpu/test_gpu_runtime.py
GRAPH_REL = 2e-3    # replay vs the same step run eagerly: fp32 split-K atomics reorder (1.3e-4 seen)


def _rel(a, b) -> float:
    return ((a.float().cpu() - b.float().cpu()).abs().max() / b.float().cpu().abs().max()).item()


def _gpu_backends() -> list[str]:
    from exl3tools.kernels import dispatch

    out = ["triton"]
    if "cuda" in dispatch.backend_names():
        try:
            dispatch.get_backend("cuda")
            out.append("cuda")
        except Exception:  # noqa: BLE001 - not built/importable here: only triton is checked
            pass
    return out


def _run(model, graphs: bool, device: str):
    import torch

    from exl3tools.runtime.graph_decode import GraphDecoder

    gd = GraphDecoder(model, len(PROMPTS), 32, graphs=graphs)
    rows = [gd.prefill(PROMPTS).float().cpu()]
    for toks in FEED:
        rows.append(gd.step(torch.tensor(toks, device=device)).float().cpu())
    assert (gd._graph is not None) == graphs
    return rows


@pytest.mark.parametrize("name", GQA)
def test_graph_decode_matches_cpu_reference(dev, name):
    from exl3tools.runtime.runner import load_runner
    from tests.conftest import fixture_dir

    if dev == "cpu":
        pytest.skip("CUDA graphs need CUDA")
    path = fixture_dir(name) / "model"
    ref = _run(load_runner(path).model, False, "cpu")
    for backend in _gpu_backends():
        model = load_runner(path, device="cuda", backend=backend).model
        got = _run(model, True, "cuda")
        eager = _run(model, False, "cuda")      # same kernels without the graph: agree to split-K noise
        for s, (g, e, r) in enumerate(zip(got, eager, ref, strict=True)):
            assert g.shape == r.shape
            assert _rel(g, r) < REL, (backend, name, s, _rel(g, r))
            assert _rel(g, e) < GRAPH_REL, (backend, name, s, _rel(g, e))


def test_experts_slots_match_reference(dev):
    """make_experts on every GPU backend: slots equal the reference DenseExperts (fixture experts)."""
    import torch
    from exl3tools.kernels import dispatch

    from exl3tools.checkpoint.reader import Checkpoint
    from exl3tools.runtime.weights import WeightSource
    from tests.conftest import fixture_dir

    ws = WeightSource(Checkpoint.open(fixture_dir("glm4_moe-3.0bpw-mcg") / "model"))
    fields = [ws.linear(f"model.layers.1.mlp.experts.{e}.down_proj") for e in range(3)]
    cb, kb = fields[0].codebook, fields[0].k_bits
    ref = dispatch.make_experts([f.tensors for f in fields], cb, kb, "cpu", backend="reference")
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, fields[0].in_features, generator=g)
    tok = torch.tensor([0, 0, 1, 2, 2, 1])
    exp = torch.tensor([2, 0, 0, 1, 2, 2])
    want = ref.slots(x, tok, exp)
    backends = _gpu_backends() if dev != "cpu" else ["triton"]
    for backend in backends:
        ex = dispatch.make_experts([f.tensors for f in fields], cb, kb, dev, backend=backend)
        for n in (1, len(tok)):                 # a single slot takes the bm=1 path
            y = ex.slots(x.to(dev), tok[:n].to(dev), exp[:n].to(dev))
            assert y.shape == want[:n].shape and y.dtype == x.dtype
            assert _rel(y, want[:n]) < 2e-3, (backend, n)


def test_cuda_grouped_experts_share_device_tensors(dev):
    """Backend cuda: the grouped experts point at the eager expert linears' device tensors (no
    second copy of the experts in GPU memory)."""
    from exl3tools.runtime.layers import MoE
    from exl3tools.runtime.runner import load_runner
    from tests.conftest import fixture_dir

    if dev == "cpu" or "cuda" not in _gpu_backends():
        pytest.skip("needs the cuda backend")
    model = load_runner(fixture_dir("glm4_moe-3.0bpw-mcg") / "model", device="cuda", backend="cuda").model
    moe = next(layer.mlp for layer in model.layers if isinstance(layer.mlp, MoE))
    g = moe.grouped()
    held = sorted(moe.experts)
    eager = [moe.experts[e].gate.fn.trellis.data_ptr() for e in held]
    eager += [moe.experts[e].up.fn.trellis.data_ptr() for e in held]
    assert [t.data_ptr() for t in g["gate_up"].trellis] == eager
    assert [t.data_ptr() for t in g["down_proj"].trellis] == [moe.experts[e].down.fn.trellis.data_ptr()
                                                               for e in held]

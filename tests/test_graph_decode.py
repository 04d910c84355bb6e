"""GraphDecoder (static KV cache, sync-free step) and MoE.forward_static against the eager runtime.

CPU, reference kernels, fp32: the static path must give the eager logits to ~1e-4 relative; the
CUDA-graph capture itself is covered by tests/gpu/test_graph_decode.py.
"""

from __future__ import annotations

from functools import lru_cache

import pytest
import torch
from exl3tools.kernels import dispatch

from exl3tools.errors import UnsupportedArchitectureError, UsageError
from exl3tools.runtime.graph_decode import GraphDecoder
from exl3tools.runtime.layers import MoE
from exl3tools.runtime.loader import resolve
from exl3tools.runtime.runner import build_local_model, load_runner
from tests.conftest import fixture_dir

GQA = ["llama-4.0bpw-mul1", "qwen3_moe-2.5bpw-mul1", "glm4_moe-3.0bpw-mcg"]
PROMPTS = [[1, 17, 300, 42, 1999, 7, 512], [5, 6, 7], [9, 8, 7, 6, 5, 4, 3, 2, 1, 100, 88]]
REL = 1e-4
STEPS = 4


@lru_cache(maxsize=None)
def _model(name: str):
    return load_runner(fixture_dir(name) / "model").model


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item() / b.float().abs().max().item()


@pytest.mark.parametrize("name", GQA)
def test_graph_decoder_matches_eager(name):
    """Prefill + greedy decode (eager's argmax fed to both), batch 1 and batch 3 of unequal lengths."""
    model = _model(name)
    for batch in (1, 3):
        prompts = PROMPTS[:batch] if batch > 1 else PROMPTS[1:2]
        gd = GraphDecoder(model, batch, 24, graphs=False)
        caches = [model.new_cache() for _ in prompts]
        ref = model.forward(list(zip(caches, prompts, strict=True)))
        got = gd.prefill(prompts)
        assert got.shape == (batch, model.info.vocab_size) and got.dtype == torch.float32
        assert _rel(got, ref) < REL, (name, batch, "prefill")
        for s in range(STEPS):
            tok = ref.argmax(-1)
            got = gd.step(tok)
            ref = model.forward([(c, [int(t)]) for c, t in zip(caches, tok, strict=True)])
            assert _rel(got, ref) < REL, (name, batch, s)
        assert gd.pos.tolist() == [len(p) + STEPS for p in prompts]


def test_graph_decoder_prefill_again_and_limits():
    model = _model("llama-4.0bpw-mul1")
    gd = GraphDecoder(model, 2, 6, graphs=False)
    with pytest.raises(UsageError, match="prefill"):
        gd.step(torch.tensor([1, 2]))
    gd.prefill([[1, 2, 3, 4], [5]])
    gd.step(torch.tensor([1, 2]))
    with pytest.raises(UsageError, match="2 tokens"):
        gd.step(torch.tensor([1, 2, 3]))
    # a second prefill replaces the rows: same logits as a fresh decoder
    a = gd.prefill([[7, 8], [9, 10, 11]])
    b = gd.step(torch.tensor([3, 4]))
    fresh = GraphDecoder(model, 2, 6, graphs=False)
    assert torch.equal(fresh.prefill([[7, 8], [9, 10, 11]]), a)
    assert torch.equal(fresh.step(torch.tensor([3, 4])), b)
    gd.step(torch.tensor([3, 4]))
    gd.step(torch.tensor([3, 4]))        # row 1 writes the last slot (5)
    with pytest.raises(UsageError, match="max_len"):
        gd.step(torch.tensor([3, 4]))
    with pytest.raises(UsageError, match="1..5 tokens"):
        gd.prefill([[1] * 6, [2]])
    with pytest.raises(UsageError, match="CUDA"):
        GraphDecoder(model, 1, 8, graphs=True)


def test_graph_decoder_rejects_mla():
    model = load_runner(fixture_dir("deepseek_v3-3.0bpw-3inst") / "model").model
    with pytest.raises(UnsupportedArchitectureError, match="GQA"):
        GraphDecoder(model, 1, 8, graphs=False)


def _moes(model) -> list[MoE]:
    return [layer.mlp for layer in model.layers if isinstance(layer.mlp, MoE)]


@pytest.mark.parametrize("name", ["qwen3_moe-2.5bpw-mul1", "glm4_moe-3.0bpw-mcg"])
def test_moe_forward_static_equals_call(name):
    moes = _moes(_model(name))
    assert moes
    x = torch.randn(9, _model(name).info.hidden_size, generator=torch.Generator().manual_seed(0))
    for moe in moes:
        assert _rel(moe.forward_static(x), moe(x)) < 1e-5


def test_grouped_experts_share_the_eager_linears_tensors():
    """Grouped experts are built from the tensors the eager linears already hold: the checkpoint is
    not read again and no second copy of the experts is made (GPU memory)."""
    moe = _moes(_model("glm4_moe-3.0bpw-mcg"))[0]
    moe._grouped = None

    def no_reread(proj):
        raise AssertionError(f"expert fields of {proj} re-read from the checkpoint")
    moe.expert_fields = no_reread
    g = moe.grouped()
    assert g["gate_up"] is not None and "gate_proj" not in g
    x = torch.randn(5, _model("glm4_moe-3.0bpw-mcg").info.hidden_size, generator=torch.Generator().manual_seed(1))
    assert _rel(moe.forward_static(x), moe(x)) < 1e-5


@pytest.mark.parametrize("mode,world", [("ep", 2), ("tp", 4)])
def test_moe_forward_static_per_rank(mode, world):
    """Under TP each rank's static partial equals its eager partial (EP: experts on other ranks add
    zero; TP: intermediate slices, down bias on rank 0), and the partials sum to the TP=1 output."""
    name = "glm4_moe-tp-2.0bpw-mul1"
    full = _moes(_model(name))[0]
    layout = resolve(fixture_dir(name) / "model", world)
    x = torch.randn(6, _model(name).info.hidden_size, generator=torch.Generator().manual_seed(1))
    total = 0
    for rank in range(world):
        moe = _moes(build_local_model(layout, rank, world, moe=mode))[0]
        moe.reduce = lambda t: t                      # the partial before the all-reduce
        if mode == "ep":
            assert 0 < len(moe.experts) < full.router.shape[0]
        got, ref = moe.forward_static(x), moe(x)
        assert _rel(got, ref) < 1e-5, (mode, rank)
        total = total + got - moe.shared.partial(x)  # a cut shared expert's partials sum to it too
    assert _rel(total, full(x) - full.shared.partial(x)) < 1e-5, mode


def _expert_fields(name: str, proj: str, n: int):
    from exl3tools.checkpoint.reader import Checkpoint
    from exl3tools.runtime.weights import WeightSource

    ws = WeightSource(Checkpoint.open(fixture_dir(name) / "model"))
    return [ws.linear(f"model.layers.1.mlp.experts.{e}.{proj}") for e in range(n)]


def test_make_experts_reference_and_fallback_equal_linears(monkeypatch):
    fields = _expert_fields("glm4_moe-3.0bpw-mcg", "gate_proj", 5)
    cb, kb = fields[0].codebook, fields[0].k_bits
    lins = [dispatch.make_linear(f.tensors, cb, kb, "cpu") for f in fields]
    g = torch.Generator().manual_seed(2)
    x = torch.randn(4, fields[0].in_features, generator=g)
    tok = torch.tensor([0, 0, 1, 2, 3, 3, 1, 2, 0, 3])
    exp = torch.tensor([4, 1, 1, 0, 2, 4, 3, 3, 0, 1])
    want = torch.stack([lins[e](x[t:t + 1])[0] for t, e in zip(tok.tolist(), exp.tolist(), strict=True)])

    dispatch.register_backend("test-no-experts", dispatch.get_backend("reference"))
    try:
        loop = dispatch.make_experts([f.tensors for f in fields], cb, kb, "cpu", backend="test-no-experts")
    finally:
        dispatch._BACKENDS.pop("test-no-experts", None)
    assert isinstance(loop, dispatch.LoopExperts)
    dense = dispatch.make_experts([f.tensors for f in fields], cb, kb, "cpu", backend="reference")
    assert isinstance(dense, dispatch.DenseExperts)
    for ex in (loop, dense):
        y = ex.slots(x, tok, exp)
        assert y.shape == want.shape and y.dtype == x.dtype
        assert _rel(y, want) < 1e-6
    monkeypatch.setattr(dispatch.DenseExperts, "CHUNK_ELEMS", 3 * x.shape[1] * want.shape[1])  # 3 slots a chunk
    assert _rel(dense.slots(x, tok, exp), want) < 1e-6


def test_auto_backend_resolution():
    """"auto" is the reference decoder on the CPU; explicit names pass through untouched."""
    from exl3tools.kernels.dispatch import resolve_backend

    assert resolve_backend("auto", "cpu") == "reference"
    assert resolve_backend("reference-otf", "cuda") == "reference-otf"
    assert resolve_backend("auto", "cuda") in ("cuda", "triton", "reference")


def test_cache_bytes_is_what_the_decoder_allocates():
    from exl3tools.runtime.graph_decode import GraphDecoder

    model = _model("llama-4.0bpw-mul1")
    assert GraphDecoder.cache_bytes(model, 3, 40) == GraphDecoder(model, 3, 40, graphs=False).kv_bytes()

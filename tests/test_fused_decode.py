"""The fixed-shape decode step with the fused glue kernels (runtime/fused_step.py,
kernels/fused_decode.py) run by Triton's interpreter on the CPU: the continuous-batching schedule of
tests/test_paged_runner.py gives the plain cache's logits, every routing call picks MoE.route's
experts, and the switch (PagedDecoder(fused=...), EXL3TOOLS_FUSED) does what it says."""

from __future__ import annotations

import pytest
import torch

from exl3tools.errors import UsageError
from tests.test_paged_runner import REL, A, B, Lockstep, Reference, _model, _paged, _rel, schedule

NAMES = ["glm4_moe-3.0bpw-mcg", "qwen3_moe-2.5bpw-mul1", "llama-4.0bpw-mul1"]


def _interpret():
    pytest.importorskip("triton")
    from exl3tools.kernels import fused_decode

    if not fused_decode.INTERPRET:
        pytest.skip("needs TRITON_INTERPRET=1 (make test sets it) to run Triton on the CPU")
    return fused_decode


def _matches_plain_cache(name: str, r, *ctx) -> None:
    """``r``'s logits over ``schedule`` equal the plain cache's, step by step (``ctx``: for the message)."""
    ref, got = schedule(Reference(_model(name))), schedule(r)
    for s, (x, y) in enumerate(zip(got, ref, strict=True)):
        assert _rel(x, y) < REL, (*ctx, s, _rel(x, y))


@pytest.mark.parametrize("name", NAMES)
def test_fused_static_decode_matches_plain_cache(name, monkeypatch):
    fk = _interpret()
    real = fk.route
    calls = []

    def checked(logits, top_k, routing, norm, scaling=1.0, bias=None, lut=None, n_held=None, shared=False,
                choice_logits=None):
        assert choice_logits is None                 # (the MLA models' Fp16ChoiceMoE alone picks apart)
        out = real(logits, top_k, routing, norm, scaling, bias, lut, n_held, shared)
        ref = fk.route_reference(logits, top_k, routing, norm, scaling, bias, lut, n_held, shared)
        T = logits.shape[0]
        assert torch.equal(out["loc"].view(T, -1).sort(1).values, ref["loc"].view(T, -1).sort(1).values)
        assert torch.equal(out["gate_exp"], ref["gate_exp"]) or not torch.equal(out["loc"], ref["loc"])
        calls.append(shared)
        return out
    monkeypatch.setattr(fk, "route", checked)
    from exl3tools.kernels import expert_groups as eg

    groups, real_groups = [], eg.group_pairs
    monkeypatch.setattr(eg, "group_pairs", lambda exp, P, *a: groups.append((exp.shape[0], P)) or real_groups(exp, P, *a))
    monkeypatch.setenv("EXL3TOOLS_FUSED", "1")
    monkeypatch.delenv("EXL3TOOLS_EXPERT_GROUPS", raising=False)     # the default: on
    r = _paged(name, "static")
    assert r.paged.decoder._fused is not None and r.paged.decoder._fused.expert_groups
    _matches_plain_cache(name, r, name)
    # the MoE layers routed through the kernel; glm4_moe's shared expert inside the grouped calls
    assert set(calls) == {"llama-4.0bpw-mul1": set(), "qwen3_moe-2.5bpw-mul1": {False}}.get(name, {True})
    # steps of 2+ tokens run their MoE pairs in one tile per expert (kernels/expert_groups.py): top_k
    # pairs a token, glm4_moe's shared expert one more among them (the opt-out: test_expert_groups_opt_out)
    if name == "llama-4.0bpw-mul1":
        assert not groups
    else:
        assert groups and all(S > P for S, P in groups)
        assert {P for _, P in groups} == {_model(name).layers[-1].mlp.top_k + name.startswith("glm4_moe")}


@pytest.mark.parametrize("variant", ["shared-apart", "tiles"])
def test_fused_moe_variants_match_plain_cache(variant, monkeypatch):
    """glm4_moe's MoE layers the other two ways: the shared expert as its own linears
    (EXL3TOOLS_FUSED_SHARED=0's path), and expert-sorted tiles (the wide-batch path, forced)."""
    _interpret()
    from exl3tools.runtime import fused_step

    name = "glm4_moe-3.0bpw-mcg"
    if variant == "shared-apart":
        monkeypatch.setenv("EXL3TOOLS_FUSED_SHARED", "0")
    else:
        monkeypatch.setattr(fused_step, "MOE_TILES_MIN_SLOTS", 1)
    monkeypatch.setenv("EXL3TOOLS_EXPERT_GROUPS", "0")       # (the 2+ token default: test below)
    calls = []
    real = fused_step.FusedGqaStep._with_shared
    monkeypatch.setattr(fused_step.FusedGqaStep, "_with_shared", lambda self, m: calls.append(1) or real(self, m))
    tiles = []
    from exl3tools.runtime.layers import MoE

    real_tiles = MoE._tiles_sum
    monkeypatch.setattr(MoE, "_tiles_sum", lambda self, *a: tiles.append(1) or real_tiles(self, *a))
    monkeypatch.setenv("EXL3TOOLS_FUSED", "1")
    r = _paged(name, "static")
    _matches_plain_cache(name, r, name, variant)
    assert bool(tiles) == (variant == "tiles") and bool(calls) == (variant != "tiles")
    assert all(v is None for v in r.paged.decoder._fused._shared.values())


@pytest.mark.parametrize("name", ["glm4_moe-3.0bpw-mcg", "qwen3_moe-2.5bpw-mul1"])
def test_expert_groups_opt_out(name, monkeypatch):
    """EXL3TOOLS_EXPERT_GROUPS=0: steps of 2+ tokens run one row per MoE pair, never the expert
    groups (the default: test_fused_static_decode_matches_plain_cache, glm4_moe's shared expert among
    the pairs, qwen3_moe without one); the plain cache's logits."""
    _interpret()
    from exl3tools.kernels import expert_groups as eg

    calls = []
    real = eg.group_pairs
    monkeypatch.setattr(eg, "group_pairs", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setenv("EXL3TOOLS_FUSED", "1")
    monkeypatch.setenv("EXL3TOOLS_EXPERT_GROUPS", "0")
    r = _paged(name, "static")
    assert not r.paged.decoder._fused.expert_groups
    _matches_plain_cache(name, r, name)
    assert not calls


@pytest.mark.parametrize("wide", ["1", "0"])
def test_steps_past_the_pair_cap(wide, monkeypatch):
    """A step of more pairs than expert_groups.MAX_PAIRS (patched to 9 here: every step of 2+
    tokens) leaves the expert groups (for one row per pair, or _tiles_sum from MOE_TILES_MIN_SLOTS),
    unless the wide_groups preview raises the cap to WIDE_MAX_PAIRS; the plain cache's logits either way."""
    _interpret()
    from exl3tools.kernels import expert_groups as eg

    calls = []
    real = eg.group_pairs
    monkeypatch.setattr(eg, "group_pairs", lambda exp, *a: calls.append(exp.shape[0]) or real(exp, *a))
    monkeypatch.setattr(eg, "MAX_PAIRS", 9)
    monkeypatch.setenv("EXL3TOOLS_FUSED", "1")
    monkeypatch.setenv("EXL3TOOLS_WIDE_GROUPS", wide)
    name = "glm4_moe-3.0bpw-mcg"
    r = _paged(name, "static")
    assert r.paged.decoder._fused.max_pairs == (eg.WIDE_MAX_PAIRS if wide == "1" else 9)
    # the cap is decided at each step of 2+ tokens: B's 3-token prompt (15 pairs) and a decode step
    # of two rows (10 pairs) through the fixed-shape step; the whole schedule through the paths on
    # either side of it: test_fused_static_decode_matches_plain_cache[glm4_moe-3.0bpw-mcg] (the
    # expert groups) and test_expert_groups_opt_out[glm4_moe-3.0bpw-mcg] (one row per pair)
    ls = Lockstep(r, Reference(_model(name)))
    ls.add("A", "B")
    assert [ls.step([("A", A)]), ls.step([("B", B)]), ls.step([("A", [3]), ("B", [4])])] == ["eager", "decode",
                                                                                            "decode"]
    if wide == "1":
        assert calls and min(calls) > 9
    else:
        assert not calls


@pytest.mark.parametrize("name", ["glm4_moe-3.0bpw-mcg", "qwen3_moe-2.5bpw-mul1"])
def test_batch_invariant_moe_tiles_in_pair_order(name, monkeypatch):
    """The pair-order tiles (batch-invariant runs; EXL3TOOLS_PAIR_TILES), forced from 1 pair here:
    expert-sorted tiles whose rows go back to pair order (fused_step._pairs_by_tiles), summed by
    residual_rmsnorm as the slots path's are; the plain cache's logits. (Bit-equality with the
    slots path needs the CUDA kernels: tests/gpu/test_batch_invariance_gpu.py.)"""
    _interpret()
    from exl3tools.runtime import fused_step

    monkeypatch.setattr(fused_step, "PAIR_TILES_MIN_SLOTS", 1)
    monkeypatch.setenv("EXL3TOOLS_EXPERT_GROUPS", "0")   # pair_tiles is set after the step is built
    calls = []
    real = fused_step._pairs_by_tiles
    monkeypatch.setattr(fused_step, "_pairs_by_tiles", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setenv("EXL3TOOLS_FUSED", "1")
    r = _paged(name, "static")
    r.paged.decoder._fused.pair_tiles = True
    _matches_plain_cache(name, r, name)
    assert calls


def test_switch(monkeypatch):
    from exl3tools.runtime import fused_step

    cpu = torch.device("cpu")
    monkeypatch.delenv("EXL3TOOLS_FUSED", raising=False)
    assert fused_step.resolve(None, cpu) is False                 # the CPU keeps the torch reference
    assert fused_step.resolve(False, cpu) is False
    monkeypatch.setenv("EXL3TOOLS_FUSED", "0")
    assert fused_step.resolve(None, torch.device("cuda")) is False
    from exl3tools.kernels import fused_decode

    if not fused_decode.available(cpu):
        with pytest.raises(UsageError, match="fused"):
            fused_step.resolve(True, cpu)
    else:
        assert fused_step.resolve(True, cpu) is True
        monkeypatch.setenv("EXL3TOOLS_FUSED", "1")
        assert fused_step.resolve(None, cpu) is True
    monkeypatch.setenv("EXL3TOOLS_FUSED", "0")
    assert _paged("llama-4.0bpw-mul1", "static").paged.decoder._fused is None
    # GQA layers only: an MLA model keeps the torch loop wherever it gets a static step
    assert fused_step.supports(_model("glm4_moe-3.0bpw-mcg"))
    assert not fused_step.supports(_model("deepseek_v3-3.0bpw-3inst"))


def test_e2e_bench_takes_the_unfused_impl():
    import argparse
    import sys

    from tests.conftest import REPO

    sys.path.insert(0, str(REPO / "bench"))
    import gpu_e2e_model as g

    assert g.parse_impls("ours:cuda,ours:cuda:unfused,exllamav3,ours:cuda:shared-apart") == [
        "ours:cuda", "ours:cuda:unfused", "exllamav3", "ours:cuda:shared-apart"]
    with pytest.raises(argparse.ArgumentTypeError):
        g.parse_impls("ours:cuda:maybe")


# glm4_moe only: its first layer is dense, so its steps group a dense MLP's gate/up beside every
# layer's q/k/v, all the llama case grouped (q/k/v and dense gate/up in each layer)
@pytest.mark.parametrize("name", ["glm4_moe-3.0bpw-mcg"])
def test_grouped_projections_match_plain_cache(name, monkeypatch):
    """EXL3TOOLS_GROUPED_PROJ: q/k/v, and a dense MLP's gate/up, through LinearGroup (one grouped
    backend call where the backend has one; the CPU reference calls each): the same logits as
    the plain cache, every layer's q/k/v grouped, and the dense MLPs' gate/up."""
    _interpret()
    from exl3tools.runtime.layers import GatedMLP, LinearGroup

    groups = []
    real = LinearGroup.__call__
    monkeypatch.setattr(LinearGroup, "__call__", lambda self, x: groups.append(len(self.linears)) or real(self, x))
    monkeypatch.setenv("EXL3TOOLS_FUSED", "1")
    monkeypatch.setenv("EXL3TOOLS_GROUPED_PROJ", "1")
    r = _paged(name, "static")
    _matches_plain_cache(name, r, name)
    layers = r.model.layers
    dense = sum(isinstance(layer.mlp, GatedMLP) for layer in layers)
    assert len(r.paged.decoder._fused._groups) == len(layers) + dense
    assert set(groups) == ({3, 2} if dense else {3})


def test_e2e_bench_chains_steps_as_serve_does(monkeypatch):
    """``ours:<backend>:chained`` (bench/gpu_e2e_model.py) steps the runner as the server does (step
    N + 1 launched on step N's device tokens, then those tokens committed): on the demo checkpoint
    with the fixed-shape step forced on the CPU, every chained step goes through step_chained and
    the greedy tokens equal the unchained loop's after the same number of steps."""
    import argparse
    import sys

    from exl3tools.runtime.runner import load_runner
    from tests.conftest import DEMO, REPO

    sys.path.insert(0, str(REPO / "bench"))
    import gpu_e2e_model as g

    monkeypatch.setattr(g, "_time_cuda", lambda step, n: [step() for _ in range(n)] and 1.0)
    a = argparse.Namespace(warmup=2, steps=5, profile=0)
    prompts = g.make_prompts(3, 6, 200)
    rows = {}
    for impl in ("ours:reference", "ours:reference:chained"):
        runner = load_runner(str(DEMO / "model"), decode="static", max_num_seqs=4, max_context=64, block_size=8)
        calls = []
        real = runner.step_chained
        monkeypatch.setattr(runner, "step_chained",
                            lambda ids, tok, calls=calls, real=real: calls.append(len(ids)) or real(ids, tok))
        rows[impl] = row = {"impl": impl}
        g._ours_runner(runner, prompts, a, row)
        assert calls == ([3] * 7 if impl.endswith("chained") else []), impl
        runner.close()
    assert rows["ours:reference:chained"]["mode"].endswith("+chained")
    assert rows["ours:reference"]["last_tokens"] == rows["ours:reference:chained"]["last_tokens"]

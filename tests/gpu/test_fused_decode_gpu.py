"""The fused decode-step kernels (kernels/fused_decode.py) against their torch references, at small
and real (GLM-4.5-Air, Qwen3-MoE) shapes, on CUDA or on the Triton interpreter (TRITON_INTERPRET=1);
on CUDA also the captured decode step with the fused kernels on vs off on the GQA fixtures.

Expert choices must be identical (indices), weights within fp32 rounding; K/V written to a 16-bit
cache within one ulp of the reference's rounding on the interpreter (its bf16 cast truncates),
exactly on CUDA."""

from __future__ import annotations

import functools

import pytest

from tests.conftest import cuda_available

# (T, H): small, GLM-4.5-Air hidden at batch 1 and 8
NORM_CASES = [(1, 256), (3, 300), (1, 4096), (8, 4096)]
# (T, nq, nkv, hd, rdim, qk_norm, cache dtype)
ROPE_CASES = [(3, 4, 2, 64, 32, False, "float32"), (2, 8, 2, 64, 64, True, "bfloat16"),
              (1, 96, 8, 128, 64, False, "bfloat16"), (8, 96, 8, 128, 64, False, "float32"),
              (4, 32, 4, 128, 128, True, "bfloat16")]
# (T, E, k, routing, norm, bias, scaling)
ROUTE_CASES = [(3, 16, 4, "sigmoid", True, True, 2.5), (1, 128, 8, "sigmoid", True, True, 1.0),
               (8, 128, 8, "sigmoid", True, True, 2.5), (5, 160, 8, "sigmoid", False, False, 1.0),
               (8, 128, 8, "softmax", True, False, 1.0), (3, 256, 8, "softmax", False, False, 1.0),
               (2, 16, 4, "softmax", True, False, 1.0)]


def _close(a, b, tol):
    import torch

    a, b = a.float().cpu(), b.float().cpu()
    assert a.shape == b.shape and torch.isfinite(a).all()
    err = (a - b).abs().max().item() / max(b.abs().max().item(), 1e-30)
    assert err <= tol, err


@pytest.mark.parametrize("T,H", NORM_CASES)
@pytest.mark.parametrize("terms", ["none", "delta", "routed", "both", "rows"])
def test_residual_rmsnorm(dev, T, H, terms):
    import torch
    from exl3tools.kernels import fused_decode as fk

    g = torch.Generator().manual_seed(T * H)
    h = torch.randn(T, H, generator=g).to(dev)
    w = torch.randn(H, generator=g).to(dev)
    delta = torch.randn(T, H + 64, generator=g)[:, :H].to(dev) if terms in ("delta", "both") else None
    K = 8
    y = torch.randn(T * K, H + 128, generator=g).to(dev) if terms in ("routed", "both") else None
    rows = None
    if terms == "rows":     # y in another order (expert-grouped tiles), 5 rows more: y_rows says where
        y = torch.randn(T * K + 5, H + 128, generator=g).to(dev)
        rows = torch.randperm(T * K + 5, generator=g)[:T * K].to(torch.int32).to(dev)
    wk = torch.rand(T * K, generator=g).to(dev) if y is not None else None
    h1, h2 = h.clone(), h.clone()
    x1 = fk.residual_rmsnorm(h1, w, 1e-5, delta, y, wk, rows)
    x2 = fk.residual_rmsnorm_reference(h2, w, 1e-5, delta, y, wk, rows)
    _close(h1, h2, 1e-6)
    _close(x1, x2, 1e-5)
    if rows is not None:    # the pair-order rows without y_rows: the same sum
        h3 = h.clone()
        fk.residual_rmsnorm(h3, w, 1e-5, None, y.index_select(0, rows.long()), wk)
        _close(h1, h3, 1e-6)
    # with_fp16 (an MLA model's router input): x as before, then its fp16-rounded rows, exactly
    h4 = h.clone()
    x4, both = fk.residual_rmsnorm(h4, w, 1e-5, delta, y, wk, rows, with_fp16=True)
    assert both.shape == (2 * T, H) and x4.data_ptr() == both.data_ptr()
    assert torch.equal(x4, x1) and torch.equal(h4, h1)
    assert torch.equal(both[T:], x1.half().float()) and not torch.equal(both[T:], x1)


# (tokens, pairs a token, experts): GLM-4.5-Air's 8 routed + shared at batch 2, 8, 14, 32 and 56 (the
# most pairs, 504 <= MAX_PAIRS), Qwen3's 8 of 128, and few experts (one expert holding 3 tiles' pairs);
# past MAX_PAIRS (the wide_groups preview's narrower comparison blocks): batch 64 (576 pairs), Qwen3's
# 128 rows (1024), GLM-5's 256 routed + shared at 227 rows (2043 <= WIDE_MAX_PAIRS)
GROUP_CASES = [(2, 9, 129), (8, 9, 129), (14, 9, 129), (32, 9, 129), (56, 9, 129), (8, 8, 128), (7, 4, 3),
               (1, 9, 129), (64, 9, 129), (128, 8, 128), (227, 9, 257)]


@pytest.mark.parametrize("T,P,NE", GROUP_CASES)
def test_group_pairs(dev, T, P, NE):
    """kernels/expert_groups.group_pairs against its torch reference, value for value, and the
    layout itself: every pair its own row, in a tile of its expert holding its token; each tile's
    real rows counted; no tile past the static bound; one tile per expert while it has <= 8 pairs."""
    import torch
    from exl3tools.kernels import expert_groups as eg

    g = torch.Generator().manual_seed(T * P + NE)
    S = T * P
    e = torch.stack([torch.randperm(NE - 1, generator=g)[:P] if P < NE - 1 else
                     torch.randint(0, NE - 1, (P,), generator=g) for _ in range(T)])
    if P == 9:
        e[:, -1] = NE - 1                 # the shared expert: one pair per token
    e = e.reshape(-1).to(torch.int32)
    got = eg.group_pairs(e.to(dev), P, NE)
    want = eg.group_pairs_reference(e, P, NE)
    for k in ("pair_row", "tile_exp", "tile_n", "row_src", "row_exp"):
        assert torch.equal(got[k].cpu(), want[k]), k
    NT, R = got["tiles"], got["rows"]
    assert NT == eg.n_tiles(S, NE) and R == eg.TILE_ROWS
    row = want["pair_row"].long()
    assert len(set(row.tolist())) == S and int(row.max()) < NT * R
    tile = row // R
    assert torch.equal(want["tile_exp"][tile].long(), e.long())
    assert torch.equal(want["tile_exp"][NT + tile].long(), e.long() + NE)
    assert torch.equal(want["row_src"][row].long(), torch.arange(S) // P)
    assert torch.equal(want["row_exp"][NT * R + row].long(), e.long() + NE)
    assert torch.equal(torch.bincount(tile, minlength=NT)[:NT], want["tile_n"][:NT].long())
    counts = torch.bincount(e.long(), minlength=NE)
    assert int((want["tile_exp"][:NT] >= 0).sum()) == int(((counts + R - 1) // R).sum())


def test_group_pairs_refuses_too_many_pairs():
    import torch
    from exl3tools.kernels import expert_groups as eg

    with pytest.raises(ValueError, match="1-2048 pairs"):
        eg.group_pairs(torch.zeros(eg.WIDE_MAX_PAIRS + 1, dtype=torch.int32), 9, 129)


@pytest.mark.parametrize("H,dtype", [(256, "bfloat16"), (4096, "bfloat16"), (300, "float32")])
def test_embed_rmsnorm(dev, H, dtype):
    import torch
    from exl3tools.kernels import fused_decode as fk

    g = torch.Generator().manual_seed(H)
    embed = torch.randn(1000, H, generator=g).to(dev, getattr(torch, dtype))
    tokens = torch.tensor([999, 0, 5, 5, 17, 123, 1, 998]).to(dev)
    w = torch.randn(H, generator=g).to(dev)
    h1, x1 = fk.embed_rmsnorm(embed, tokens, w, 1e-5)
    h2, x2 = fk.embed_rmsnorm_reference(embed, tokens, w, 1e-5)
    assert h1.dtype == torch.float32 and torch.equal(h1.cpu(), h2.cpu())
    _close(x1, x2, 1e-5)


@pytest.mark.parametrize("case", ROPE_CASES)
def test_qk_rope_store(dev, case):
    import torch
    from exl3tools.kernels import fused_decode as fk

    T, nq, nkv, hd, rdim, qk_norm, dt = case
    g = torch.Generator().manual_seed(nq * hd + T)
    q = torch.randn(T, nq * hd + 128, generator=g)[:, :nq * hd].to(dev)     # a padded projection's view
    k, v = (torch.randn(T, nkv * hd, generator=g).to(dev) for _ in range(2))
    pos = torch.tensor([0, 1, 17, 4095, 31999, 5, 77, 1000][:T]).to(dev)
    slots = torch.randperm(64, generator=g)[:T].to(dev)
    inv = (1.0 / (1e6 ** (torch.arange(0, rdim, 2, dtype=torch.float64) / rdim))).float().to(dev)
    qn, kn = ((torch.rand(hd, generator=g) + 0.5).to(dev) for _ in range(2)) if qk_norm else (None, None)
    dtype = getattr(torch, dt)
    planes = [torch.full((64, nkv, hd), float("nan"), dtype=dtype, device=dev) for _ in range(4)]
    cos, sin = fk.rope_tables(pos, inv)
    q1 = fk.qk_rope_store(q, k, v, cos, sin, slots, rdim, planes[0], planes[1], qn, kn, 1e-6)
    q2 = fk.qk_rope_store_reference(q, k, v, cos, sin, slots, rdim, planes[2], planes[3], qn, kn, 1e-6)
    _close(q1, q2, 1e-6)
    if qn is None:      # the runtime's own RoPE (Attention.qkv's ops)
        from exl3tools.runtime.layers import apply_rope_neox

        _close(q1, apply_rope_neox(q.reshape(T, nq, hd), cos, sin, rdim), 1e-6)
    untouched = torch.ones(64, dtype=torch.bool)
    untouched[slots.cpu()] = False
    for got, ref in ((planes[0], planes[2]), (planes[1], planes[3])):
        assert torch.isnan(got.cpu()[untouched]).all()           # nothing written elsewhere
        tol = 2e-5 if dt == "float32" else (2 ** -7 if dev == "cpu" else 2 ** -8)
        _close(got[slots], ref[slots], tol)


@pytest.mark.parametrize("case", ROUTE_CASES)
def test_route_selects_the_reference_experts(dev, case):
    import torch
    from exl3tools.kernels import fused_decode as fk

    T, E, k, routing, norm, with_bias, scaling = case
    g = torch.Generator().manual_seed(E * T + k)
    logits = torch.randn(T, E, generator=g).to(dev)
    logits[0, 3] = logits[0, 5] = logits[0].max() + 1.0        # an exact tie: the lower index first
    bias = (torch.rand(E, generator=g) * 0.2).to(dev) if with_bias else None
    got = fk.route(logits, k, routing, norm, scaling, bias)
    ref = fk.route_reference(logits, k, routing, norm, scaling, bias)
    # the picks as sets per row (torch.topk's order among equals is not specified), then per pick
    gl, rl = got["loc"].view(T, k).cpu(), ref["loc"].view(T, k).cpu()
    assert torch.equal(gl.sort(1).values, rl.sort(1).values)
    og, orf = gl.argsort(1), rl.argsort(1)
    _close(got["w"].cpu().gather(1, og), ref["w"].cpu().gather(1, orf), 1e-6)
    assert fk.route(logits[:1], 1, "softmax", True)["loc"].tolist() == [3]    # a tie: the lower index
    # experts held elsewhere (-1 in the rank's table): weight 0, index 0, up rows at +held
    lut = torch.arange(E)
    lut[1::5] = -1
    held = int((lut >= 0).sum())
    lut[lut >= 0] = torch.arange(held)
    part = fk.route(logits, k, routing, norm, scaling, bias, lut.to(dev), held)
    want = lut[got["loc"].cpu()]
    assert torch.equal(part["loc"].cpu(), want)
    _close(part["wk"].cpu(), got["w"].reshape(-1).cpu() * (want >= 0), 1e-7)
    for key in ("gate_src", "gate_exp", "down_exp"):
        assert part[key].dtype == torch.int32
    S = T * k
    assert torch.equal(part["gate_src"].cpu(), torch.arange(T, dtype=torch.int32).repeat_interleave(k).repeat(2))
    assert torch.equal(part["down_exp"].cpu(), want.clamp(min=0).int())
    assert torch.equal(part["gate_exp"][S:].cpu(), part["down_exp"].cpu() + held)
    assert torch.equal(part["gate_exp"][:S].cpu(), part["down_exp"].cpu())
    # a shared expert as pair k of every token: index held, weight 1, up rows at +held + 1
    sh = fk.route(logits, k, routing, norm, scaling, bias, lut.to(dev), held, shared=True)
    P = k + 1
    assert torch.equal(sh["loc"].cpu(), part["loc"].cpu())
    assert torch.equal(sh["gate_src"].cpu(), torch.arange(T, dtype=torch.int32).repeat_interleave(P).repeat(2))
    dexp, wk = sh["down_exp"].view(T, P).cpu(), sh["wk"].view(T, P).cpu()
    assert torch.equal(dexp[:, :k], part["down_exp"].view(T, k).cpu()) and (dexp[:, k] == held).all()
    assert torch.equal(wk[:, :k], part["wk"].view(T, k).cpu()) and (wk[:, k] == 1).all()
    assert torch.equal(sh["gate_exp"].cpu(), torch.cat([dexp.reshape(-1), dexp.reshape(-1) + held + 1]))
    shr = fk.route_reference(logits, k, routing, norm, scaling, bias, lut.to(dev), held, shared=True)
    assert torch.equal(shr["gate_exp"].view(2, T, P)[:, :, k].cpu(), sh["gate_exp"].view(2, T, P)[:, :, k].cpu())


@pytest.mark.parametrize("T,E,k", [(1, 16, 4), (5, 256, 8)])
def test_route_picks_by_the_choice_logits(dev, T, E, k):
    """choice_logits (arch.deepseek_v3.Fp16ChoiceMoE's rule, the MLA models' fused step): the
    experts are the top-k of sigmoid(choice_logits) + bias, their weights sigmoid(logits),
    normalized and scaled; the pick differs from the logits' own where the two disagree, and
    equals Fp16ChoiceMoE.route's on its own inputs."""
    import torch
    from exl3tools.kernels import fused_decode as fk

    from exl3tools.runtime.arch.deepseek_v3 import Fp16ChoiceMoE

    g = torch.Generator().manual_seed(T * E + k)
    H = 64
    x, router = torch.randn(T, H, generator=g), torch.randn(E, H, generator=g) * 0.3
    bias = torch.rand(E, generator=g) * 0.2
    moe = Fp16ChoiceMoE.__new__(Fp16ChoiceMoE)
    moe.__dict__.update(router=router, bias=bias, top_k=k, norm=True, scaling=2.5)
    sel, w = moe.route(x)
    logits, choice = (x @ router.t()).to(dev), (x.half().float() @ router.t()).to(dev)
    got = fk.route(logits, k, "sigmoid", True, 2.5, moe.choice_bias().to(dev), choice_logits=choice)
    gl = got["loc"].view(T, k).cpu()
    assert torch.equal(gl.sort(1).values, sel.sort(1).values)
    _close(got["w"].cpu().gather(1, gl.argsort(1)), w.gather(1, sel.argsort(1)), 1e-6)
    # a choice that disagrees with the logits (reversed): the pick follows the choice, the weights the logits
    other = fk.route(logits, k, "sigmoid", False, 1.0, None, choice_logits=-logits)
    ref = fk.route_reference(logits, k, "sigmoid", False, 1.0, None, choice_logits=-logits)
    assert torch.equal(other["loc"].view(T, k).sort(1).values.cpu(), (-logits).topk(k, 1).indices.sort(1).values.cpu())
    assert torch.equal(other["loc"].cpu().sort().values, ref["loc"].cpu().sort().values)
    _close(other["w"].cpu().reshape(-1), torch.sigmoid(logits).cpu().gather(1, other["loc"].view(T, k).cpu()).reshape(-1), 1e-6)
    with pytest.raises(ValueError, match="choice_logits"):
        fk.route(logits, k, "softmax", True, choice_logits=choice)


def test_route_keeps_expert_ids_in_range_on_a_nan_row(dev):
    """An all-NaN row of router logits matches no maximum; its picks must still be experts that
    exist (else the grouped calls read past the expert tables: a sticky CUDA error)."""
    import torch
    from exl3tools.kernels import fused_decode as fk

    E = 16
    logits = torch.randn(3, E, generator=torch.Generator().manual_seed(1))
    logits[1] = float("nan")
    for routing, norm in (("softmax", True), ("softmax", False), ("sigmoid", True)):
        out = fk.route(logits.to(dev), 4, routing, norm, 1.0, None, torch.arange(E).to(dev), E)
        for key in ("loc", "down_exp"):
            assert 0 <= int(out[key].min()) and int(out[key].max()) < E, (routing, norm, key)


@pytest.mark.parametrize("R,N", [(3, 300), (8, 1408), (16, 10944)])
def test_silu_mul(dev, R, N):
    import torch
    from exl3tools.kernels import fused_decode as fk

    g = torch.Generator().manual_seed(N)
    gu = torch.randn(2 * R, N + 64, generator=g).to(dev) * 4
    a, b = gu[:R, :N], gu[R:, :N]
    _close(fk.silu_mul(a, b), fk.silu_mul_reference(a, b), 1e-6)


# ------------------------------------------------------------------ the whole step, CUDA
GQA = ["glm4_moe-3.0bpw-mcg", "qwen3_moe-2.5bpw-mul1", "llama-4.0bpw-mul1"]


@functools.lru_cache(maxsize=None)
def _cpu_schedule(name: str):
    from exl3tools.runtime.runner import load_runner
    from tests.conftest import fixture_dir
    from tests.test_paged_runner import Reference, schedule

    return schedule(Reference(load_runner(fixture_dir(name) / "model", max_context=48).model))


@pytest.mark.skipif(not cuda_available(), reason="needs CUDA")
@pytest.mark.parametrize("kv", ["fp32", "bf16"])
@pytest.mark.parametrize("name", GQA)
def test_graph_decode_fused_matches_unfused(name, kv, monkeypatch):
    """The captured decode step with the fused kernels vs the torch loop and vs the CPU reference,
    same checkpoint, same schedule (tests/test_paged_runner.py: prefills, batches of 1-2, block
    boundaries), at tests/gpu/test_serve_paged_gpu.py's tolerances."""
    from exl3tools.runtime.runner import load_runner
    from tests.conftest import fixture_dir
    from tests.gpu.conftest import cuda_backend
    from tests.gpu.test_serve_paged_gpu import REL, _rel
    from tests.test_paged_runner import schedule

    path = fixture_dir(name) / "model"
    ref = _cpu_schedule(name)
    outs = {}
    for fused in ("0", "1"):
        monkeypatch.setenv("EXL3TOOLS_FUSED", fused)
        r = load_runner(path, device="cuda", backend=cuda_backend(), max_context=48, max_num_seqs=3,
                        block_size=4, kv_dtype=kv, max_cache_tokens=4096)
        assert r.decode_mode == "graphs"
        assert (r.paged.decoder._fused is not None) == (fused == "1")
        outs[fused] = schedule(r)
        assert r.paged.decoder._graphs
        r.close()
    for s, (a, b, c) in enumerate(zip(outs["1"], outs["0"], ref, strict=True)):
        assert _rel(a, c) < REL[kv], (name, kv, s, _rel(a, c), _rel(b, c))
        assert _rel(a, b) < REL[kv], (name, kv, s, _rel(a, b))


@pytest.mark.skipif(not cuda_available(), reason="needs CUDA")
def test_graph_decode_fused_mla_matches_the_torch_loop(monkeypatch):
    """EXL3TOOLS_FUSED_MLA on CUDA: the captured DeepSeek-V3 decode step with FusedMlaStep (fused
    norms, MoE, and kernels/fused_mla.py inside the attention) against the same step's torch loop
    and the CPU reference, over the paged-runner schedule; fp16 latent planes (MLA's auto)."""
    from exl3tools.runtime.runner import load_runner
    from tests.conftest import fixture_dir
    from tests.gpu.conftest import cuda_backend
    from tests.gpu.test_serve_paged_gpu import REL, _rel
    from tests.test_paged_runner import schedule

    name = "deepseek_v3-3.0bpw-3inst"
    ref = _cpu_schedule(name)
    outs = {}
    monkeypatch.setenv("EXL3TOOLS_FUSED", "1")
    for on in ("0", "1"):
        monkeypatch.setenv("EXL3TOOLS_FUSED_MLA", on)
        r = load_runner(fixture_dir(name) / "model", device="cuda", backend=cuda_backend(), max_context=48,
                        max_num_seqs=3, block_size=4, max_cache_tokens=4096)
        assert r.decode_mode == "graphs"
        assert (type(r.paged.decoder._fused).__name__ == "FusedMlaStep") == (on == "1")
        outs[on] = schedule(r)
        r.close()
    for s, (a, b, c) in enumerate(zip(outs["1"], outs["0"], ref, strict=True)):
        assert _rel(a, c) < REL["fp32"], (s, _rel(a, c), _rel(b, c))
        assert _rel(a, b) < REL["fp32"], (s, _rel(a, b))


@pytest.mark.skipif(not cuda_available(), reason="needs CUDA")
@pytest.mark.parametrize("batch,groups", [(1, False), (8, False), (32, False), (2, True), (8, True), (32, True)])
def test_fused_moe_layer_matches_forward_static(batch, groups):
    """One MoE layer of the glm4_moe fixture on CUDA: the fused MLP (routing kernel, grouped
    gate+up, silu_mul, down, routed sum in the residual norm) against MoE.forward_static,
    for the slot path (1, 8 rows), the tiled path (32 rows x 4 = 128 pairs) and one tile per
    expert (EXL3TOOLS_EXPERT_GROUPS: kernels/expert_groups.py, the gemv kernel's tile_n, y_rows)."""
    import torch
    from exl3tools.kernels import fused_decode as fk

    from exl3tools.runtime.fused_step import FusedGqaStep
    from exl3tools.runtime.layers import MoE
    from exl3tools.runtime.runner import load_runner
    from tests.conftest import fixture_dir
    from tests.gpu.conftest import cuda_backend

    # a fixed cache: sized from free memory, two of its cases on two test workers raced for the GPU
    # (H200, 2026-12-02: one took 119 GiB, the other's 29.65 GiB pool did not fit)
    r = load_runner(fixture_dir("glm4_moe-3.0bpw-mcg") / "model", device="cuda", backend=cuda_backend(),
                    max_context=48, decode="static", max_cache_tokens=4096)
    model = r.model
    step = FusedGqaStep(model, r.paged.pool)
    step.expert_groups = groups
    if groups:   # the pair-order tiles (EXL3TOOLS_PAIR_TILES, on in tests/gpu's preview runs) take precedence
        step.pair_tiles = False
    moe = next(layer.mlp for layer in model.layers if isinstance(layer.mlp, MoE))
    x = torch.randn(batch, model.info.hidden_size, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    with torch.inference_mode():
        want = moe.forward_static(x)
        d, y, wk, y_rows = step.mlp(moe, x)
        assert (y_rows is not None) == groups
        h = torch.zeros_like(x)
        fk.residual_rmsnorm(h, torch.ones(x.shape[1], device="cuda"), 1e-5, d, y, wk, y_rows)
        sel, _ = moe.route(x)
        r2 = fk.route(x @ moe.router.t(), moe.top_k, moe.routing, moe.norm, moe.scaling, moe.bias)
    assert torch.equal(sel.sort(1).values.cpu(), r2["loc"].view(batch, -1).sort(1).values.cpu())
    _close(h, want, 2e-3)
    r.close()


@pytest.mark.parametrize("T,K,H", [(2048, 8, 6144), (37, 8, 4096), (5, 4, 300)])
def test_moe_combine(dev, T, K, H):
    """kernels/moe_combine.combine (the tiled MoE's fixed-order weighted sum, runtime.layers._tiles_sum)
    against its torch reference at the GLM-5 shape of a 2048-token chunk and smaller: rows of
    another chunk (-1) skipped, padding rows' NaN never read, one wider y (its stride)."""
    import torch
    from exl3tools.kernels import moe_combine

    if dev == "cpu" and T * H > 10**6:
        pytest.skip("the real shape on CUDA only (minutes in the interpreter)")
    g = torch.Generator().manual_seed(T + K)
    rows = T * K // 2 + 64
    y = torch.randn(rows, H + 16, generator=g)
    y[-64:] = float("nan")                                              # padding rows
    inv = torch.randint(-1, rows - 64, (T, K), generator=g, dtype=torch.int32)
    w = torch.rand(T, K, generator=g)
    base = torch.randn(T, H, generator=g)
    want = moe_combine.combine_reference(base.clone(), y, inv, w)
    got = moe_combine.combine(base.clone().to(dev), y.to(dev), inv.to(dev), w.to(dev))
    _close(got, want, 1e-6)


# (T, H, nope, C, R, cache dtype): the fixtures' MLA widths, GLM-5 (64 heads, nope 192) and
# DeepSeek-V3 (128 heads, nope 128) at batch 1 and 8
MLA_GLUE_CASES = [(3, 2, 128, 512, 64, "float32"), (1, 64, 192, 512, 64, "float16"),
                  (8, 128, 128, 512, 64, "float16"), (2, 4, 192, 512, 64, "bfloat16")]


@pytest.mark.parametrize("case", MLA_GLUE_CASES)
def test_mla_latent_store_and_query_rope(dev, case):
    """kernels/fused_mla.py: the latent's kv_a norm + RoPE + both cache writes at their slots (rows
    of a wider projection output, nothing else written), and every head's query RoPE, against
    their torch references with attention-scaled tables from fused_decode.rope_tables."""
    import torch
    from exl3tools.kernels import fused_decode as fk
    from exl3tools.kernels import fused_mla as fm

    T, H, nope, C, R, dt = case
    g = torch.Generator().manual_seed(T * H + C)
    lat = torch.randn(T, C + R + 8, generator=g)[:, :C + R + 4]         # strided rows, padded
    w, eps = torch.rand(C, generator=g) + 0.5, 1e-6
    pos = torch.randint(0, 30000, (T,), generator=g)
    inv = 1.0 / (10000 ** (torch.arange(0, R, 2, dtype=torch.float32) / R))
    cos, sin = fk.rope_tables(pos, inv)
    cos, sin = (cos * 1.3).contiguous(), (sin * 1.3).contiguous()
    slots = torch.randperm(32, generator=g)[:T]
    dtype = getattr(torch, dt)
    planes = [torch.full((32, n), float("nan"), dtype=dtype) for n in (C, R, C, R)]
    lat, w, cos, sin, slots = (t.to(dev) for t in (lat, w, cos, sin, slots))
    planes = [p.to(dev) for p in planes]
    fm.latent_store(lat, C, R, w, eps, cos, sin, slots, planes[0], planes[1])
    fm.latent_store_reference(lat, C, R, w, eps, cos, sin, slots, planes[2], planes[3])
    untouched = torch.ones(32, dtype=torch.bool)
    untouched[slots.cpu()] = False
    tol = 1e-6 if dt == "float32" else 2 ** -7
    for got, ref in ((planes[0], planes[2]), (planes[1], planes[3])):
        assert torch.isnan(got.float().cpu()[untouched]).all()
        _close(got[slots], ref[slots], tol)
    q = torch.randn(T, H, nope + R, generator=g).to(dev)
    _close(fm.rope_heads(q, nope, R, cos, sin), fm.rope_heads_reference(q, nope, R, cos, sin), 1e-6)
    from exl3tools.runtime.mla_rope import rope_gptj  # the reference is the runtime's RoPE

    # bit-equal on the CPU; on CUDA rope_gptj's cos/sin and fused_decode.rope_tables' come from
    # different kernels, an fp32 ulp apart (H200 2026-12-03: torch.equal failed on all four cases)
    _close(fm.rope_heads_reference(q, nope, R, cos, sin),
           rope_gptj(q[..., nope:], pos.to(dev), inv.to(dev), 1.3).contiguous(), 1e-6)
    with pytest.raises(ValueError, match="cos/sin"):
        fm.rope_heads(q, nope, R, cos[:, :8], sin[:, :8])
    with pytest.raises(ValueError, match="planes"):
        fm.latent_store(lat, C, R, w, eps, cos, sin, slots, planes[1], planes[0])


@pytest.mark.parametrize("T,D,R,dt", [(3, 128, 64, "float16"), (8, 128, 64, "float16"), (2, 128, 64, "float32")])
def test_mla_index_key_store(dev, T, D, R, dt):
    """kernels/fused_mla.index_key_store: the DSA indexer's keys (fp16 roundings, LayerNorm, RoPE
    on the first R channels) written at their slots equal Indexer.keys's, and its reference."""
    import torch
    from exl3tools.kernels import fused_decode as fk
    from exl3tools.kernels import fused_mla as fm

    from exl3tools.runtime.dsa import Indexer

    g = torch.Generator().manual_seed(T * D + R)
    Hd = 96
    ind = Indexer(wq_b=None, wk=torch.randn(D, Hd, generator=g) * 0.2, k_norm_w=torch.rand(D, generator=g) + 0.5,
                  k_norm_b=torch.randn(D, generator=g) * 0.1, weights_proj=torch.zeros(4, Hd), n_heads=4, head_dim=D,
                  rope_dim=R, topk=32, rope_params=(1.0 / (10000 ** (torch.arange(0, R, 2) / R)), 1.2))
    x = torch.randn(T, Hd, generator=g)
    pos = torch.randint(0, 30000, (T,), generator=g)
    cos, sin = fk.rope_tables(pos, ind.inv_freq)
    cos, sin = (cos * 1.2).contiguous(), (sin * 1.2).contiguous()
    slots = torch.randperm(16, generator=g)[:T]
    dtype = getattr(torch, dt)
    planes = [torch.full((16, D), float("nan"), dtype=dtype, device=dev) for _ in range(3)]
    x, cos, sin, slots = (t.to(dev) for t in (x, cos, sin, slots))
    ind._to(x.device)
    kraw = x @ ind.wk.t()
    fm.index_key_store(kraw, ind.kn_w, ind.kn_b, ind.eps, R, cos, sin, slots, planes[0])
    fm.index_key_store_reference(kraw, ind.kn_w, ind.kn_b, ind.eps, R, cos, sin, slots, planes[1])
    planes[2].index_copy_(0, slots, ind.keys(x, pos.to(dev)).to(dtype))
    untouched = torch.ones(16, dtype=torch.bool)
    untouched[slots.cpu()] = False
    assert torch.isnan(planes[0].float().cpu()[untouched]).all()
    assert torch.equal(planes[1][slots].cpu(), planes[2][slots].cpu())      # the reference is Indexer.keys
    # the kernel: fp16 values, equal but for a rare one-ulp rounding of the norm's sum
    diff = (planes[0][slots].float() - planes[2][slots].float()).abs().cpu()
    assert (diff > 0).float().mean() < 0.02 and diff.max() <= 2 ** -9 * planes[2][slots].float().abs().max().cpu()


@pytest.mark.parametrize("T,H,D,R", [(3, 4, 128, 64), (8, 32, 128, 64)])
def test_mla_index_queries(dev, T, H, D, R):
    """kernels/fused_mla.index_queries: the DSA indexer's roped fp16-rounded queries from their
    projection equal its reference, and the reference equals Indexer.queries's ops."""
    import torch
    from exl3tools.kernels import fused_decode as fk
    from exl3tools.kernels import fused_mla as fm

    from exl3tools.runtime.dsa import Indexer

    g = torch.Generator().manual_seed(T * H + D)
    inv = 1.0 / (10000 ** (torch.arange(0, R, 2) / R))
    ind = Indexer(wq_b=lambda r: r, wk=torch.zeros(D, 8), k_norm_w=torch.ones(D), k_norm_b=torch.zeros(D),
                  weights_proj=torch.zeros(H, 8), n_heads=H, head_dim=D, rope_dim=R, topk=32, rope_params=(inv, 1.2))
    qraw = torch.randn(T, H * D, generator=g) * 3
    pos = torch.randint(0, 30000, (T,), generator=g)
    cos, sin = fk.rope_tables(pos, inv)
    cos, sin = (cos * 1.2).contiguous(), (sin * 1.2).contiguous()
    want, _ = ind.queries(torch.zeros(T, 8), qraw, pos)             # wq_b = identity: q from qraw
    ref = fm.index_queries_reference(qraw, H, D, R, cos, sin)
    assert torch.equal(ref, want)
    got = fm.index_queries(qraw.to(dev), H, D, R, cos.to(dev), sin.to(dev)).cpu()
    diff = (got - ref).abs()
    assert (diff > 0).float().mean() < 0.02 and diff.max() <= 2 ** -9 * ref.abs().max()

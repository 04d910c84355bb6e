"""MUL1's AFF kernels (EXL3TOOLS_GEMV_AFFINE, the default; kernels/csrc/exl3_gemv.cu AFF) against
kernels/reference.py and against the pair kernels they replace. CUDA only."""

from __future__ import annotations

import numpy as np
import pytest
from exl3tools.kernels import reference as ref

from tests.gpu.kernel_cases import as_tensors as _tensors
from tests.gpu.kernel_cases import cuda_experts as _experts
from tests.gpu.kernel_cases import graph_replays, tile_rows_reference
from tests.gpu.kernel_cases import random_linear as _lin
from tests.gpu.kernel_cases import rel_err as _rel


@pytest.mark.parametrize("width", [16, 24, 48, 128])
def test_mul1_affine_gemv(cx, width, monkeypatch):
    """EXL3TOOLS_GEMV_AFFINE (the default; "0" opts out): a MUL1 module built with HALVES takes its AFF kernels at up
    to AFF_ROWS real rows a slot (each state's (h, 1.0) in the A fragment, kappa and beta applied
    once a split) and the pair kernels past them. Linears of 1-8 rows, with and without gemv_pro,
    expert slots of one row (a skipped tile: bias alone) and their silu(gate) * up input pass,
    8-row expert tiles with real-row counts, and a graph replay: each against the reference and
    the module built without them."""
    import torch

    rng = np.random.default_rng(width + 101)
    k, n = 4096, 384
    arrays = _lin(rng, k, n, width, bias=True)
    w = ref.decode_linear(*arrays[:3], "mul1").astype(np.float64)
    E = 3
    el = [_lin(rng, 512, 256, width, bias=True) for _ in range(E)]
    ys = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("EXL3TOOLS_GEMV_AFFINE", flag)
        for pro in ("0", "1"):
            monkeypatch.setenv("EXL3TOOLS_GEMV_PROLOGUE", pro)
            lin = cx.CudaLinear(_tensors(torch, *arrays), "mul1", "cuda")
            assert lin.mod.aff_rows == (cx.AFF_ROWS if flag == "1" else 0)
            for rows in (1, 2, 3, 4, 5, 8):
                x = np.random.default_rng(rows).normal(0, 1, (rows, k)).astype(np.float16)
                for rep in range(2):      # the workspace re-zeroed by the output pass
                    y = lin(torch.from_numpy(x).cuda()).float().cpu().numpy()
                    assert _rel(y, x.astype(np.float64) @ w + arrays[3]) < 2e-3, (flag, pro, rows, rep)
                ys[flag, pro, rows] = y
        ex = _experts([_tensors(torch, *p) for p in el], "mul1", "cuda")
        x = rng.normal(0, 1, (4, 512)).astype(np.float16)
        row_exp = torch.tensor([2, 0, 1, 2], device="cuda")
        tile_exp = torch.tensor([2, 0, -1, 2], device="cuda")
        for pro in ("0", "1"):
            monkeypatch.setenv("EXL3TOOLS_GEMV_PROLOGUE", pro)
            ex.gemv_in = pro == "1"
            y = ex.tiles(torch.from_numpy(x).cuda(), None, row_exp, tile_exp, 1).float().cpu().numpy()
            for s_, (e, te) in enumerate(zip(row_exp.tolist(), tile_exp.tolist(), strict=True)):
                tr, suh, svh, b = el[e]
                want = b.astype(np.float64) if te < 0 else x[s_].astype(np.float64) @ ref.decode_linear(
                    tr, suh, svh, "mul1") + b
                assert _rel(y[s_], want) < 2e-3, (flag, pro, s_)
            # the down projection's input pass: silu(gate) * up from a gate+up output of 2S rows
            from exl3tools.kernels.fused_decode import silu_mul_reference

            gu = torch.from_numpy(rng.normal(0, 2, (8, 512)).astype(np.float16)).cuda()
            want = ex.tiles(silu_mul_reference(gu[:4], gu[4:]), None, row_exp, tile_exp, 1).float().cpu().numpy()
            got = ex.tiles(gu, None, row_exp, tile_exp, 1, act_rows=4).float().cpu().numpy()
            assert _rel(got, want) < 1e-3, (flag, pro)
        # expert_groups' 8-row tiles with their real-row counts: AFF per slot of at most AFF_ROWS,
        # the pair past them; padding rows point at a NaN row (never read)
        from exl3tools.runtime.layers import expert_tiles

        T, top = 40, 2
        xt = rng.normal(0, 1, (T, 512)).astype(np.float16)
        exp = np.stack([rng.choice(E, top, replace=False) for _ in range(T)]).reshape(-1)
        tile_exp, row_exp, slot, valid = expert_tiles(torch.from_numpy(exp).cuda(), E, 8)
        counts = valid.view(-1, 8).sum(1)
        assert (counts <= cx.AFF_ROWS).any() and (counts > cx.AFF_ROWS).any()
        xn = torch.cat([torch.from_numpy(xt).cuda(), torch.full((1, 512), float("nan"), device="cuda").half()])
        src = torch.where(valid, slot // top, T)
        w_e = [ref.decode_linear(tr, suh, svh, "mul1").astype(np.float64) for tr, suh, svh, _ in el]
        got = ex.tiles(xn, src, row_exp, tile_exp, 8, counts=counts).float().cpu().numpy()
        v = valid.cpu().numpy()
        assert _rel(got[v], tile_rows_reference(xt, el, w_e, slot, row_exp, valid, top)) < 2e-3, flag
        if flag == "1":
            graph_replays(cx, arrays, 1, torch.float16)
    for key in [k_ for k_ in ys if k_[0] == "1"]:     # exact weights against fp16-rounded ones
        assert _rel(ys[key], ys[("0",) + key[1:]]) < 1e-3, key

"""The Hadamard passes (kernels/cuda_gemv.had_in / had_out: every linear's input and output
rotation) on their two grids, the _grid kernels (the default) and the 1-D one (EXL3TOOLS_HAD_GRID=0),
against each other bit for bit and against fp64 H·x. CUDA only."""

from __future__ import annotations

import numpy as np
import pytest
from exl3tools.kernels import reference as ref

from tests.gpu.kernel_cases import as_tensors as _tensors
from tests.gpu.kernel_cases import cuda_experts as _experts
from tests.gpu.kernel_cases import random_linear as _lin
from tests.gpu.kernel_cases import rel_err as _rel


def _flat_then_grid(monkeypatch, call, rows=None):
    """call() with the 1-D Hadamard kernels, then with the _grid ones (EXL3TOOLS_HAD_GRID); both on
    the CPU, equal in ``rows`` (all rows where None); the first returned."""
    import torch

    outs = []
    for flag in ("0", "1"):
        monkeypatch.setenv("EXL3TOOLS_HAD_GRID", flag)
        outs.append(call().cpu())
    flat, grid = (o if rows is None else o[rows] for o in outs)
    assert torch.equal(flat, grid), call
    return flat


def _had_out_fresh(cx, ex, a, dt, rows, total, n, kept, **kw):
    """had_out of a fresh copy of accumulator ``a`` (kept["acc"]: it, after the call)."""
    import torch

    kept["acc"] = torch.from_numpy(a.copy()).cuda()
    y = torch.empty(a.shape[0], n, dtype=dt, device="cuda")
    return cx.had_out(ex.mod, kept["acc"], y, ex.svh_tab, ex.bias_tab, rows, total, n, **kw)


@pytest.mark.parametrize("xdt", ["float16", "float32"])
def test_hadamard_passes_on_a_2d_grid(cx, xdt, monkeypatch):
    """The _grid Hadamard passes (the default; a (row, 8-block group) grid, butterflies as
    fma(v, ±1, o)) give the 1-D kernels' bits: had_in on raw x and on silu(gate) * up, with source
    rows, experts and skipped padding rows; had_out from fp32 (re-zeroed), fp16 and fixed-point
    accumulators with bias; rows of fewer blocks than a block's warps (k = 128, 384) and of a
    partial last group. Both against fp64 H·x."""
    from functools import partial

    import torch

    dt = getattr(torch, xdt)
    rng = np.random.default_rng(31)
    E, N, T = 3, 77, 8                  # experts, rows, rows a tile
    h = ref.hadamard128("float64")
    for k in (128, 384, 1664, 4096):   # 1664: 13 blocks, a partial last group
        el = [_lin(rng, k, k, 16, bias=True) for _ in range(E)]
        ex = _experts([_tensors(torch, *p) for p in el], "mul1", "cuda")
        x = torch.from_numpy(rng.normal(0, 1, (2 * N, k)).astype(np.float16)).cuda().to(dt)
        src = torch.from_numpy(rng.integers(0, N, N).astype(np.int32)).cuda()
        exp = torch.from_numpy(rng.integers(0, E, N).astype(np.int32)).cuda()
        tile_n = torch.from_numpy(rng.integers(0, T + 1, -(-N // T)).astype(np.int32)).cuda()
        live = (torch.arange(N) % T < tile_n.cpu().repeat_interleave(T)[:N]).numpy()
        both = partial(_flat_then_grid, monkeypatch)
        got = both(partial(cx.had_in, ex.mod, x[:N], ex.suh_tab, N, N, k)).double().numpy()
        want = (x[:N].double().cpu().numpy() * el[0][1].astype(np.float64)).reshape(N, -1, 128) @ h
        assert _rel(got, want.reshape(N, k)) < 1e-3, k
        both(partial(cx.had_in, ex.mod, x[:N], ex.suh_tab, 1, N, k, src=src, exp=exp, tile_n=tile_n, tile_rows=T), live)
        both(partial(cx.had_in, ex.mod, x, ex.suh_tab, 1, N, k, exp=exp, act_rows=N))
        acc32 = rng.normal(0, 1, (N, k)).astype(np.float32)
        accs = {"float32": acc32, "float16": acc32.astype(np.float16),
                "int64": np.round(acc32.astype(np.float64) * 2.0**32).astype(np.int64)}
        for adt, a in accs.items():
            for kw in ({}, {"exp": exp, "tile_n": tile_n, "tile_rows": T}):
                kept = {}
                rows = live if kw else slice(None)
                y = both(partial(_had_out_fresh, cx, ex, a, dt, *((1, N) if kw else (N, N)), k, kept, **kw),
                         live if kw else None)
                if adt != "float16":        # the workspaces are re-zeroed as they are read
                    assert not kept["acc"].cpu()[rows].any(), (k, adt)
                if not kw:
                    a64 = a.astype(np.float64) * (2.0**-32 if adt == "int64" else 1.0)
                    want = (a64.reshape(N, -1, 128) @ h).reshape(N, k) * el[0][2] + el[0][3]
                    assert _rel(y.double().numpy(), want) < 1e-3, (k, adt)

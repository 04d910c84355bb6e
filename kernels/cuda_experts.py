"""One projection of many MoE experts in one call on our CUDA kernels (backend ``cuda``; the
modules and routing constants are kernels/cuda_exl3.py's, the launch wrappers kernels/cuda_gemv.py's).

``CudaExperts.slots`` runs one projection of many experts at once, one row per (token, expert)
slot, experts addressed through device pointer tables: no host sync, no sorting.
``CudaExperts.tiles`` runs rows grouped by expert in tiles of up to 64 rows: one weight decode per
tile instead of per row (MoE prefill and wide decode batches); 64-row tiles on the shared-memory
tile kernel (unless EXL3TOOLS_PREFILL_TILES=0), skipping the tiles' padding rows.
"""

from __future__ import annotations

import os

import torch
from exl3tools.kernels.cuda_exl3 import (
    PREFILL_TILE_ROWS,
    SMALL_ROWS,
    TILE_KERNELS,
    WGR_RG_OUT_M128_KERNELS,
    _check_dims,
    _ptrs,
    cuda_device,
    module,
)
from exl3tools.kernels.cuda_gemv import (
    _SUFFIX,
    PDL,
    TILE_UNIT_KTILES,
    _act,
    _wgr_out,
    gemv,
    gemv_pro,
    gemv_pro_fits,
    had_in,
    had_out,
)
from exl3tools.kernels.cuda_launch import wave_split
from exl3tools.kernels.cuda_workspace import fixed_workspace, workspace

from exl3tools.errors import UsageError


class CudaExperts:
    """One projection (gate, up or down) of many experts with the same shape, K and codebook."""

    def __init__(self, tensors_per_expert: list[dict], codebook: str, device):
        self.device = cuda_device(device)
        dev = self.device
        self.trellis = [t["trellis"].to(dev, torch.int16).contiguous() for t in tensors_per_expert]
        shapes = {tuple(t.shape) for t in self.trellis}
        if len(shapes) != 1:
            raise UsageError(f"backend 'cuda': experts differ in trellis shape {sorted(shapes)}")
        self.kt, self.nt, self.width = self.trellis[0].shape
        self.k, self.n = self.kt * 16, self.nt * 16
        _check_dims(self.k, self.n)
        self.suh = [t["suh"].to(dev, torch.float16).contiguous() for t in tensors_per_expert]
        self.svh = [t["svh"].to(dev, torch.float16).contiguous() for t in tensors_per_expert]
        bs = [t.get("bias") for t in tensors_per_expert]
        self.bias = None if bs[0] is None else [b.to(dev, torch.float16).contiguous() for b in bs]
        self.mod = module(self.width, codebook, dev)
        self.tr_tab, self.suh_tab, self.svh_tab = (_ptrs(t, dev) for t in (self.trellis, self.suh, self.svh))
        self.bias_tab = _ptrs(self.bias, dev)
        from exl3tools.runtime import invariance, preview

        # batch-invariant runs: fixed splits, fixed-point sums, no fused output pass
        self.invariant = invariance.on()
        self.smem_tiles = preview.switched_on("prefill_tiles")
        # the default since 2026-12-02
        self.fused_out = preview.switched_on("tiles_epilogue") and not self.invariant
        self.gemv_in = preview.switched_on("gemv_prologue") and not self.invariant   # (GEMV_PRO_MAX_ROWS)
        # tiles(act_rows=...): silu(gate) * up inside the input pass (the fused step asks where on)
        self.fused_act = preview.switched_on("act_input") and not self.invariant
        # (EXL3TOOLS_TILE_UNIT_KTILES: other unit lengths, for measurements)
        self.unit_ktiles = int(os.environ.get("EXL3TOOLS_TILE_UNIT_KTILES", TILE_UNIT_KTILES))

    def _fused_out(self, kernel: str | None, out_dtype, slots: int) -> tuple[str, int, int] | None:
        """(kernel, k-tiles, column groups) of the tile kernel with its output pass fused, where
        it is on (the default; EXL3TOOLS_TILES_EPILOGUE=0 opts out), ``kernel`` is the 64-row tile kernel, y is fp16
        or fp32, and the launch takes one split (else None: tile kernel + had_out)."""
        if not self.fused_out or kernel != TILE_KERNELS[64] or out_dtype not in _SUFFIX:
            return None
        name = f"exl3_tiles_out_m64_t2_{_SUFFIX[out_dtype]}"
        kps, groups, units = wave_split(self.mod, name, self.device, self.kt, self.nt // 2, slots)
        return (name, kps, groups) if units == groups else None

    def _tile_kernel(self, rows: int) -> str | None:
        if not self.smem_tiles or rows < min(PREFILL_TILE_ROWS):
            return None
        return TILE_KERNELS[min(r for r in TILE_KERNELS if r >= rows)]

    def slots(self, x: torch.Tensor, tok: torch.Tensor, exp: torch.Tensor) -> torch.Tensor:
        """y[s] = x[tok[s]] @ W_{exp[s]} + bias_{exp[s]}, (S, n) in x.dtype; no host sync: the
        tiled call with one row per tile (the same three launches)."""
        return self.tiles(x, tok, exp, exp, 1)

    @property
    def moe_wgr(self) -> bool:
        """EXL3TOOLS_MOE_WGR (the default): 128-row tiles on the wgmma kernel (whole 128-column
        blocks and 64-k chunks: _check_dims has k and n in 128s). Read per call, so that one
        process can time it both ways (bench/gpu_prefill.py --ab)."""
        from exl3tools.runtime import preview

        return not self.invariant and preview.switched_on("moe_wgr")

    @property
    def max_tile_rows(self) -> int:
        """Tiles of up to this many rows (runtime.layers.tile_rows)."""
        return 128 if self.moe_wgr else max(PREFILL_TILE_ROWS) if self.smem_tiles else SMALL_ROWS

    def tiles(self, x: torch.Tensor, src: torch.Tensor | None, row_exp: torch.Tensor, tile_exp: torch.Tensor,
              rows: int, out_dtype: torch.dtype | None = None, kernel: str | None = None,
              counts: torch.Tensor | None = None, act_rows: int | None = None) -> torch.Tensor:
        """Rows grouped by expert (dispatch module doc): y[o] = x[src[o]] @ W_{row_exp[o]} + bias;
        tile t = rows [t * rows, (t + 1) * rows) all of expert tile_exp[t] (-1: skipped, its rows
        come out as bias). Each tile decodes its expert's weights once for all its rows.
        ``out_dtype``: fp16 or fp32 straight from the output pass (default x's). ``kernel``: a
        TILE_KERNELS entry or a wgr kernel with the output pass (cuda_exl3.WGR_RG_OUT_M128_KERNELS:
        benches, tests), else the shared-memory one for PREFILL_TILE_ROWS (unless
        EXL3TOOLS_PREFILL_TILES=0), else gemv.
        ``counts`` (NT,): the rows of each tile that are real; the rest are skipped by all three
        launches (either kernel) and come out undefined (their src/row_exp are never read).
        ``act_rows`` (``fused_act``): x is a gate+up call's output and row r's input is
        silu(x[r]) * x[r + act_rows], computed by the input pass (no silu_mul launch); src None."""
        N = row_exp.shape[0]
        if act_rows is not None and src is not None:
            raise UsageError("CudaExperts.tiles: act_rows reads rows in order (src None)")
        out_dtype = out_dtype or x.dtype
        if N == 0:
            return x.new_empty(0, self.n, dtype=out_dtype)
        x2 = _act(x, self.k)
        src32 = None if src is None else src.to(torch.int32).contiguous()
        rexp32 = row_exp.to(torch.int32).contiguous()
        texp32 = rexp32 if tile_exp is row_exp else tile_exp.to(torch.int32).contiguous()   # slots: one cast
        if kernel is None and self.moe_wgr and rows == 128 and out_dtype in _SUFFIX:
            kernel = WGR_RG_OUT_M128_KERNELS[out_dtype]
        kernel = kernel or self._tile_kernel(rows)
        tn = None if counts is None else counts.to(torch.int32).contiguous()
        if self.gemv_in and kernel is None and tn is None and gemv_pro_fits(rows, x2.dtype):   # had_in inside the gemv
            acc = workspace(self.device, N * self.n)
            gemv_pro(self.mod, x2, self.suh_tab, self.tr_tab, self.kt, self.nt, rows, tile_exp.shape[0], acc,
                     slot_exp=texp32, row_src=src32, row_exp=rexp32, act_rows=act_rows)
        else:
            xrot = had_in(self.mod, x2, self.suh_tab, 1, N, self.k, src=src32, exp=rexp32, tile_n=tn, tile_rows=rows,
                          act_rows=act_rows)
            if _wgr_out(kernel):      # a wgr kernel with the output pass (EXL3TOOLS_MOE_WGR, benches): y from it
                y = torch.empty(N, self.n, dtype=out_dtype, device=self.device)
                gemv(self.mod, xrot, self.tr_tab, self.kt, self.nt, rows, tile_exp.shape[0], None, slot_exp=texp32,
                     kernel=kernel, tile_n=tn, out=(y, self.svh_tab, self.bias_tab))
                return y
            fused = self._fused_out(kernel, out_dtype, tile_exp.shape[0])
            if fused is not None:     # the output pass inside the tile kernel: no workspace, no had_out
                name, kps, groups = fused
                y = torch.empty(N, self.n, dtype=out_dtype, device=self.device)
                self.mod.launch(name, (groups // 4, tile_exp.shape[0]), 128, xrot, self.tr_tab, texp32, None, rows,
                                self.kt, self.nt, kps, groups, groups, tn, y, self.svh_tab, self.bias_tab, pdl=PDL)
                return y
            acc = (fixed_workspace if self.invariant else workspace)(self.device, N * self.n)
            short = tn is not None and kernel is None    # live slots unknown at capture: short units
            gemv(self.mod, xrot, self.tr_tab, self.kt, self.nt, rows, tile_exp.shape[0], acc, slot_exp=texp32,
                 kernel=kernel, tile_n=tn, unit_ktiles=self.unit_ktiles if short else None)
            del xrot
        y = torch.empty(N, self.n, dtype=out_dtype if out_dtype in _SUFFIX else x2.dtype, device=self.device)
        had_out(self.mod, acc, y, self.svh_tab, self.bias_tab, 1, N, self.n, exp=rexp32, tile_n=tn, tile_rows=rows)
        return y.to(out_dtype)

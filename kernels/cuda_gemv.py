"""The launch wrappers of our CUDA kernels' passes over a linear's rows (kernels/csrc/exl3_gemv.cu),
shared by ``CudaLinear`` (kernels/cuda_exl3.py, which picks the kernels), ``CudaExperts`` and
``CudaGroup``:

- ``had_in``: the input pass (x ⊙ suh) · H_k to fp16 (``_act``: x as the kernels read it, fp16 or fp32);
- ``gemv``: xrot · Ŵ, Ŵ decoded inside the kernel (the register-fed gemv kernel, rows <= 64 a slot,
  or a tile or wgmma kernel by name), split-K partials added into the fp32 workspace
  (kernels/cuda_workspace.py), or as fixed-point int64 in batch-invariant runs; the wgr kernels
  with the output pass fused write y themselves;
- ``gemv_pro``: ``had_in`` and ``gemv`` in one launch (rows <= 8 a slot);
- ``had_out``: the output pass · H_n ⊙ svh + bias, re-zeroing an fp32 or fixed-point workspace as
  it reads it.

Grids and K splits come from kernels/cuda_launch.py. Every launch goes on torch's current stream
with no host sync (graph-capturable); gemv, gemv_pro and had_out with programmatic dependent launch
(``PDL``).
"""

from __future__ import annotations

import os

import torch
from exl3tools.kernels.cuda_driver import Module, TensorMap, tensor_map_2d
from exl3tools.kernels.cuda_launch import (
    PIPE,
    kernel_block,
    kernel_smem,
    resident,
    slot_rows,
    split_k,
    wave_split,
)
from exl3tools.kernels.cuda_workspace import wgr_buffers

from exl3tools.errors import UsageError

PDL = os.environ.get("EXL3TOOLS_CUDA_PDL", "1") == "1"   # programmatic dependent launch (Hopper)
HAD_WARPS = 8                # warps per block in the Hadamard passes (one warp per 128 values)
# batch-invariant calls: K split every >= this many k-tiles (512 k), a multiple of PIPE; the one-row
# one-wave split count otherwise, which at many slots (tiles of a prompt's MoE) would add 32 int64
# atomics per output
FIXED_MIN_KTILES = 32
# a stream-K launch's least share a block (exl3_wgr_sk_*: cuda_exl3.WGR_SK_KERNEL), in chunks of 4 k-tiles
WGR_SK_MIN_CHUNKS = 8


_SUFFIX = {torch.float16: "f16", torch.float32: "f32"}
_ACC = {**_SUFFIX, torch.int64: "i64"}     # had_out's accumulators: int64 = fixed point (invariant runs)


def _act(x: torch.Tensor, k: int) -> torch.Tensor:
    """(rows, k) contiguous fp16 or fp32: the kernels read either, no conversion launch."""
    x2 = x.reshape(-1, k)
    if x2.dtype not in _SUFFIX:
        x2 = x2.to(torch.float32)
    return x2.contiguous()


def _had_grid(total: int, width: int) -> tuple[int | tuple[int, int], str]:
    """A Hadamard pass's grid and kernel suffix over ``total`` rows of ``width`` columns: one warp
    per (row, 128-column block), HAD_WARPS a block; the _grid kernels' (row, group of HAD_WARPS
    blocks) 2-D grid, or with EXL3TOOLS_HAD_GRID=0 (read per call) the flat 1-D grid."""
    from exl3tools.runtime import preview  # torch-free

    blocks = width // 128
    if preview.switched_on("had_grid"):
        return (total, -(-blocks // HAD_WARPS)), "_grid"
    return -(-(total * blocks) // HAD_WARPS), ""


def had_in(mod: Module, x: torch.Tensor, suh_tab, rows: int, total: int, k: int, src=None, exp=None,
           tile_n=None, tile_rows: int = 1, act_rows: int | None = None) -> torch.Tensor:
    """``tile_n`` (int32 per tile of ``tile_rows`` rows, or None): rows at and past a tile's count
    are skipped (left undefined); only for the tile kernels, which zero-fill them. ``act_rows``:
    the input is silu(x[r]) * x[r + act_rows] (a gate+up output), not x[r]."""
    xrot = torch.empty(total, k, dtype=torch.float16, device=x.device)
    act = () if act_rows is None else (act_rows,)
    grid, tag = _had_grid(total, k)
    mod.launch(f"exl3_had_in_{'act_' if act else ''}{_SUFFIX[x.dtype]}{tag}", grid, 32 * HAD_WARPS, x,
               xrot, suh_tab, src, exp, rows, total, k, tile_n, tile_rows, *act)
    return xrot


def had_out(mod: Module, acc: torch.Tensor, y: torch.Tensor, svh_tab, bias_tab, rows: int, total: int, n: int,
            exp=None, tile_n=None, tile_rows: int = 1) -> torch.Tensor:
    """``tile_n``: as in had_in (the tile kernels never add to a skipped row: it stays zero)."""
    grid, tag = _had_grid(total, n)
    mod.launch(f"exl3_had_out_{_ACC[acc.dtype]}_{_SUFFIX[y.dtype]}{tag}", grid, 32 * HAD_WARPS, acc, y, svh_tab,
               bias_tab, exp, rows, total, n, tile_n, tile_rows, pdl=PDL)
    return y


# k-tiles a unit of the gemv kernel takes at most when a tile call's live slots are unknown at capture
# (CudaExperts.tiles with counts: expert_groups' one tile per expert, _tiles_sum's tiles). The
# one-wave split sizes units for every slot, but most are skipped (batch 8 on GLM-4.5-Air: 81 tiles,
# ~52 used), so the live units of a gate+up call (~104 x 44 of 256 k-tiles) took two waves of 256
# steps, as one row per pair did; units of 32 k-tiles fill the waves to within one short unit.
TILE_UNIT_KTILES = 32


def _wgr_out(name: str | None) -> bool:
    """Whether ``name`` is a wgr kernel with the output pass fused (it takes gemv's ``out``)."""
    return name is not None and name.startswith("exl3_wgr_") and "_out_" in name


def gemv(mod: Module, xrot: torch.Tensor, tr_tab, kt: int, nt: int, rows: int, slots: int, acc: torch.Tensor,
         slot_exp=None, kernel: str | None = None, tile_n=None, ld_tab=None, unit_ktiles: int | None = None,
         out: tuple | None = None, splits: int | None = None) -> None:
    """acc[z * rows + m] += xrot[z * rows + m] @ Ŵ of slot z's expert; ``kernel``: a TILE_KERNELS
    entry with at least ``rows`` rows (default: the register-fed gemv kernel, rows <= 64);
    ``tile_n`` (int32 valid rows per slot, or None: all; not with ``ld_tab``): the rest are
    neither read nor added. ``unit_ktiles``: units of at most that many k-tiles (more splits than
    one wave needs). An int64 ``acc`` (``fixed_workspace``, either kernel): batch-invariant sums, K
    split by the weight's shape alone. ``ld_tab`` (int32 per expert, gemv kernel only): the n-tiles
    of each expert's whole trellis, whose first ``nt`` columns (from its table pointer) the slot
    multiplies (CudaGroup's column chunks); None: nt. ``out`` (y, svh table, bias table; the wgr
    kernels with the output pass only, ``_wgr_out``; acc None): y = the output pass of the sums,
    written by the kernel itself; K split as for the others (one wave), each tile's splits added inside
    the kernel in split order (``wgr_buffers``); ``splits`` (with ``out``): K split that many ways
    instead (benches, tests; past one wave too: no split waits for another)."""
    if (out is not None) != _wgr_out(kernel):
        raise UsageError(f"{kernel}: the fused output pass takes out=(y, svh, bias), and only it does")
    if out is not None and not kernel.endswith("_" + _SUFFIX.get(out[0].dtype, "?")):
        raise UsageError(f"{kernel}: y in {out[0].dtype}")
    fixed = acc is not None and acc.dtype == torch.int64
    if kernel is None:
        mrows = 8 if rows <= 8 else 16 if rows <= 16 else 32 if rows <= 32 else 64
        nt_per = 2 if nt % 2 == 0 else 1      # 1 and 4 per warp measured no faster (more warps / more ILP)
        name = f"exl3_gemv_m{mrows}_t{nt_per}"
        if ld_tab is not None:                # (t2 only: CudaGroup's chunks are whole 128-column blocks)
            name = f"exl3_gemv_ld_m{mrows}_t2"
    elif ld_tab is not None:
        raise UsageError(f"{kernel}: no per-expert trellis width (ld_tab)")
    else:
        name, nt_per = kernel, int(kernel.split("_t")[-1].split("_")[0])   # (..._t2, ..._t2_f16)
        if rows > slot_rows(kernel) or nt % (kernel_block(kernel)[0] * nt_per):
            raise UsageError(f"{kernel}: {rows} rows or {nt} n-tiles do not fit it")
    if fixed:      # K split as for one row alone on the 8-row kernel, whatever kernel, rows and
        # slots come, every split at least FIXED_MIN_KTILES k-tiles (a many-slot call adds each
        # split with atomics); both kernels sum a split's k-tiles in order, so a row's result is
        # the same on either (tests/gpu/test_batch_invariance_gpu.py)
        if nt % 2:
            raise UsageError(f"batch-invariant gemv needs an even number of n-tiles, got {nt}")
        kps, _, _ = wave_split(mod, "exl3_gemv_m8_t2", xrot.device, kt, nt // 2, 1)
        kps = max(kps, FIXED_MIN_KTILES)
        groups = nt // nt_per
        units = groups * -(-kt // kps)
    else:
        kps, groups, units = wave_split(mod, name, xrot.device, kt, nt // nt_per, slots)
        if splits is not None and out is not None:   # (more or fewer than the rule's)
            kps, units = split_k(kt, groups, splits)
        if unit_ktiles and kps > unit_ktiles:
            kps = -(-unit_ktiles // PIPE) * PIPE
            units = groups * -(-kt // kps)
    accs = (None, acc) if fixed else (acc, None)
    if ld_tab is not None and tile_n is not None:
        raise UsageError("gemv: tile_n and ld_tab do not come together")
    extra = (tile_n,) if ld_tab is None else (ld_tab,)
    if name.startswith(("exl3_wga_", "exl3_wgr_")):   # the activations through TMA: boxes of the kernel's rows x 64 k
        extra += (_x_map(xrot, kt * 16, slot_rows(name)),)
    w, threads = kernel_block(name)
    grid = (-(-units // w), slots)
    if name.startswith("exl3_wgr_"):
        if kt % 4:                            # (chunks of 4 k-tiles)
            raise UsageError(f"{kernel}: {kt} k-tiles, not a multiple of 4")
        extra += (slots,)
        if out is not None:                   # K split as above (wave_split, or splits), the splits added in the kernel
            splits = -(-kt // kps)
            tiles = slots * (groups // w)
            extra += tuple(out) + (wgr_buffers(xrot.device, tiles, splits, slot_rows(name)) if splits > 1
                                   else (None, None))
        elif name.startswith("exl3_wgr_sk_"):   # stream-K: every tile's whole k-range; all slots' chunks
            # (4 k-tiles) in equal shares, one block an SM (WGR_SK_MIN_CHUNKS at the least)
            kps, units = kt, groups
            work = slots * (groups // w) * (kt // 4)
            grid = (max(1, min(resident(mod, name, xrot.device) // w, work // WGR_SK_MIN_CHUNKS)), 1)
    args = (xrot, tr_tab, slot_exp, *accs, rows, kt, nt, kps, groups, units) + extra
    mod.launch(name, grid, threads, *args, pdl=PDL, smem=kernel_smem(name))


_x_maps: dict[tuple, TensorMap] = {}


def _x_map(xrot: torch.Tensor, k: int, box_rows: int) -> TensorMap:
    """The tensor map of the rotated activations (fp16 rows of k) for exl3_wga_* / exl3_wgr_*, boxes of
    ``box_rows`` (the kernel's slot: its transaction count; rows past a smaller slot are read, never
    added) x 64; kept per buffer (a launch copies the map's bytes, so dropping one is safe)."""
    key = (xrot.data_ptr(), xrot.numel(), k, box_rows)
    m = _x_maps.get(key)
    if m is None:
        if len(_x_maps) >= 256:           # (a long-running process's old buffers)
            _x_maps.clear()
        m = _x_maps[key] = tensor_map_2d(xrot.data_ptr(), xrot.numel() // k, k, k * 2, 64, box_rows)
    return m


PRO_SMEM = 4096     # uint32 of rotated activations a gemv_pro block holds (PRO_SMEM in the source)
# rows a slot up to which gemv_pro is taken (EXL3TOOLS_GEMV_PROLOGUE, the default since 2026-12-03; its kernel takes 8).
# H200, 2026-12-03 (K 3, µs, had_in + gemv vs gemv_pro): one row 30.6 -> 29.8 at 4096 -> 14336,
# 31.3 -> 30.7 at 14336 -> 4096, 13.8 -> 13.6, 14.1 -> 13.8, 33.5 -> 34.0 at 8192 -> 8192; eight
# rows 32.6 -> 36.7, 32.1 -> 36.2, 34.4 -> 40.3 (each block rotates 8 rows, shorter splits)
GEMV_PRO_MAX_ROWS = 1


def gemv_pro_fits(rows: int, x_dtype: torch.dtype) -> bool:
    """Whether the preview takes ``gemv_pro`` for a call of ``rows`` rows a slot."""
    return rows <= min(GEMV_PRO_MAX_ROWS, 8) and x_dtype in _SUFFIX


def gemv_pro(mod: Module, x: torch.Tensor, suh_tab, tr_tab, kt: int, nt: int, rows: int, slots: int,
             acc: torch.Tensor, slot_exp=None, row_src=None, row_exp=None, ld_tab=None,
             act_rows: int | None = None) -> None:
    """``had_in`` and ``gemv`` in one launch (``exl3_gemv_pro_m8_t2_*``, rows <= 8 a slot): each
    block rotates its split's columns of raw x (row o: x[row_src[o]] and sign vector row_exp[o],
    had_in's rounding) into shared memory. K splits are multiples of 8 k-tiles (whole 128-column
    Hadamard blocks), small enough that rows x the split fit PRO_SMEM; the fp32 acc and ``ld_tab``
    as gemv's; ``act_rows`` as had_in's (not with ``ld_tab``)."""
    if act_rows is not None and ld_tab is not None:
        raise UsageError("gemv_pro: act_rows and ld_tab do not come together")
    kind = "ld_" if ld_tab is not None else "act_" if act_rows is not None else ""
    aff = "aff_" if rows <= mod.aff_rows else ""
    name = f"exl3_gemv_pro_{kind}{aff}m8_t2_{_SUFFIX[x.dtype]}"
    groups = nt // 2
    kps, _, _ = wave_split(mod, name, x.device, kt, groups, slots)
    kps = -(-kps // 8) * 8
    # xs holds rows x (kps x 8 + 4) uint32, or with XDUP_SMEM rows x (kps x xdup_words + 16) (MUL1:
    # its AFF kernels alone; a module without AFF rows is 3INST / MCG)
    xw = mod.xdup_words if aff or not mod.aff_rows else 0
    per, pad = (xw, 16) if xw else (8, 4)
    cap = (PRO_SMEM // rows - pad) // per // 8 * 8
    kps = max(8, min(kps, cap))
    units = groups * -(-kt // kps)
    last = ld_tab if act_rows is None else act_rows
    mod.launch(name, (-(-units // 4), slots), 128, x, suh_tab, row_src, row_exp, tr_tab, slot_exp, acc, rows, kt,
               nt, kps, groups, units, last, pdl=PDL)

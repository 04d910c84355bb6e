"""EXL3 linears on the GPU with our CUDA kernels (kernels/csrc/exl3_gemv.cu); backend ``cuda``.

    y = ((x ⊙ suh) · H_k) · Ŵ · H_n ⊙ svh + bias          (exl3-format.md §5.7, runtime form)

Paths by rows (x is (rows, k) at padded dims, k and n multiples of 128):
- rows ≤ 64: ``had_in`` -> ``gemv`` (decode tiles in registers straight into MMA fragments,
  split-K partials added into a self-cleaning fp32 workspace) -> ``had_out`` (output Hadamard,
  svh, bias, fp16; re-zeroes the workspace). Three launches, no host sync, graph-capturable.
- 65-128 rows, k >= DENSE_TILE_MIN_K, with the EXL3TOOLS_DENSE_TILES preview: one 128-row slot of
  the shared-memory tile kernel (``exl3_tiles_m128_t2``), the weight decoded once, never written.
- 65-1024 rows with the EXL3TOOLS_WGMMA preview: slots of 128 / 256 rows on the wgmma kernel
  (``exl3_wg2_m*``), the weight decoded once a slot into the warpgroup MMA's register operand.
- more rows (kernels/cuda_dense.py): from FOLD2_MIN_ROWS rows with fp16 activations (the default
  since 2026-12-06; EXL3TOOLS_DENSE_FOLD_IN=0 opts out), ``decode_fold2`` the whole weight W (both
  passes folded in) and one GEMM on x itself; else ``decode_t`` Ŵᵀ to fp16 once per call, one
  cuBLAS GEMM, ``had_out`` in place; or, with the EXL3TOOLS_DENSE_FOLD preview, ``decode_fold`` W' =
  Ŵ·H_n ⊙ svh (the output pass folded into the decoded weights) and one cuBLAS GEMM with the bias:
  no output pass, whose cost grows with rows (where rows x n >= FOLD_MIN_OUT).
Many experts' projections in one call: ``CudaExperts`` (kernels/cuda_experts.py).

Batch-invariant runs (runtime/invariance.py): K splits fixed by the weight's shape and the partials
added as fixed-point int64 (``had_out_i64``), on the gemv kernel or (64-row slots and tiles) the
shared-memory tile kernel, never the fused output pass: each row's result is then the same
whatever else the launch holds, and the same on either kernel.

The modules are compiled with nvcc per (trellis width, codebook) on first use and cached as
cubins (``EXL3TOOLS_CUDA_CACHE``, default ~/.cache/exl3tools/cuda); a cached cubin loads without
nvcc. They are loaded and launched through the CUDA driver API (ctypes; kernels/cuda_driver.py): no
build step, no torch extension, and launches go on torch's current stream, so CUDA graphs capture
them.
"""

from __future__ import annotations

import os
import threading

import torch
import torch.nn.functional as F
from exl3tools.kernels.cuda_build import CODEBOOKS, build, extra_define, halves
from exl3tools.kernels.cuda_dense import decode_t, dense_mm
from exl3tools.kernels.cuda_driver import Module, TensorMap, driver, tensor_map_2d
from exl3tools.kernels.cuda_launch import (
    PIPE,
    kernel_block,
    kernel_smem,
    resident,
    slot_rows,
    split_k,
    wave_split,
)

from exl3tools.errors import UsageError

SMALL_ROWS = 64              # above this: the wgr route, or a decoded weight + cuBLAS (module doc)
# the folded decode (EXL3TOOLS_DENSE_FOLD) only where the output pass it saves outweighs its extra
# decode cost (~12 µs at 4096 x 14336 on the H200): rows x n at least this (2048 x 6144 ≈ 12.6M)
FOLD_MIN_OUT = 12_000_000
# both passes folded (EXL3TOOLS_DENSE_FOLD_IN, the default) from this many rows (the weights of
# WGR_MIN_WEIGHTS or more take the wgr route up to WGR_MAX_ROWS first): the decode takes ~27 µs longer
# a 4096 x 14336 weight (98 against 71 on the H100), which the input and output passes it saves repay
# at 2048 rows at every bench shape (1-30 % under decode + GEMM + had_out) and at 1024 rows under
# WGR_MIN_WEIGHTS (15-22 %), but not at 1024 rows of the large shapes (2-5 % over: the wgr route takes
# those; between 1024 and 2048 rows they cross over, not measured) nor at 256 (0-12 % over)
FOLD2_MIN_ROWS = 1024
# batch-invariant calls: K split every >= this many k-tiles (512 k), a multiple of PIPE; the one-row
# one-wave split count otherwise, which at many slots (tiles of a prompt's MoE) would add 32 int64
# atomics per output
FIXED_MIN_KTILES = 32
# prefill tiles with the activations staged in shared memory (tiles_body in the source), by the
# most rows a tile has; MoE tiles of PREFILL_TILE_ROWS go to them unless EXL3TOOLS_PREFILL_TILES=0
# (runtime/preview.py; bench/gpu_moe_prefill.py times every entry beside the gemv kernel)
TILE_KERNELS = {32: "exl3_tiles_m32_t2", 64: "exl3_tiles_m64_t2", 128: "exl3_tiles_m128_t1"}
# H200, one GLM-5 expert projection at 2048 tokens (16k pairs, 256 experts): gemv tiles 6.98 ms,
# these on 32 / 64 / 128-row tiles 4.15 / 3.97 / 5.31 (the 128-row kernel decodes each expert once
# but reads its fragments from shared memory for one n-tile, not two); at 256 tokens (16-row
# tiles) the gemv kernel wins. So 64-row tiles only.
PREFILL_TILE_ROWS = (64,)
# dense linears of SMALL_ROWS < rows <= 128 with k >= DENSE_TILE_MIN_K (the EXL3TOOLS_DENSE_TILES
# preview): one slot of the 128-row tile kernel with two n-tiles a warp, the weight decoded once
# into the MMAs and never written, instead of decode + cuBLAS. H200 2026-12-03 (bench/gpu_bench.py
# --rows 128, K 3, µs, had_in + tiles + had_out vs decode + cuBLAS + had_out): 4096->14336 78.7
# vs 105.1, 14336->4096 69.2 vs 107.9, 8192->8192 75.3 vs 114.8, 6144->2048 30.3 vs 34.9, but
# 2048->6144 33.0 vs 30.4 (fewer k-splits to fill the GPU); at 256 rows (two slots, two decodes)
# it loses everywhere (139.9 vs 119.2 at 4096->14336)
DENSE_TILE_KERNEL = "exl3_tiles_m128_t2"
DENSE_TILE_MIN_K = 4096
# dense linears of SMALL_ROWS < rows <= WG_MAX_ROWS on Hopper's warpgroup MMA (the EXL3TOOLS_WGMMA
# preview; kernels/csrc/exl3_wgmma.cuh): slots of 128 rows (up to 128) or 256, each slot decoding the
# weight once for all its rows into wgmma's register operand while the MMA reads the activations
# from shared memory; x padded to whole slots. Slower than the default on the H200 (2026-12-03: 4096
# -> 14336 at 128 / 256 / 1024 rows 82.8 / 162.9 / 669.8 µs against 105.2 / 119.6 / 268.6); kept
# as the tested base of a decode spread over more warps (docs/gpu.md, "What is left" 2).
WG_KERNELS = {128: "exl3_wg2_m128_t2", 256: "exl3_wg2_m256_t1"}
WG_MAX_ROWS = 1024
# dense linears of SMALL_ROWS < rows <= WGA_MAX_ROWS under the EXL3TOOLS_DENSE_WGA preview: one
# 256-row slot (x padded) of exl3_wga_m256_t2, the weight decoded inside the GEMM, never written,
# instead of decode + cuBLAS. H100 2026-12-06 (bench/gpu_gemm_ab.py, CUDA-graph replays, K 3, µs,
# had_in + kernel + had_out against decode + cuBLAS + had_out): 256 rows 4096 -> 14336 108 vs 133,
# 14336 -> 4096 88 vs 142, 8192 -> 8192 101 vs 149; 128 rows 111 / 92 / 105 vs 127 / 130 / 142; at
# 512 rows (two slots, two decodes) 257 / 160 / 184 vs 180 / 168 / 188, hence the bound
WGA_KERNEL = "exl3_wga_m256_t2"
WGA_MAX_ROWS = 256
# exl3_wgr_m256_t2 (the 2026-12-06 08:39 session): exl3_wg2_m256_t1's register A operand (each
# warp's decoded tile straight into the MMA) over wga's TMA-staged, swizzled x and mbarrier stages,
# no block barrier in its loop, partial sums by atomics (had_out after); benches and tests (the
# EXL3TOOLS_DENSE_WGR route takes exl3_wgr_rg_out_*, below). H100, 2026-12-06 09:49 (bench/gpu_gemm_ab.py,
# graph replays, K 3, 256 rows, with had_in and had_out): 95.4 / 76.4 / 87.9 µs at 4096 -> 14336 /
# 14336 -> 4096 / 8192 -> 8192, 1.60 / 1.14 / 1.36x fp16 cuBLAS
WGR_KERNEL = "exl3_wgr_m256_t2"
WGR_ROWS = 256
# exl3_wgr_sk_m256_t2: the same loop, stream-K: a 1-D grid of one block an SM shares all slots' tiles
# x chunks equally, a block's share crossing tiles (each tile's partial sums added by atomics), so
# no SM idles when the tiles are not a multiple of the SMs (4096 -> 14336 at 256 rows: 112 tiles on
# 132 SMs); a share is at least WGR_SK_MIN_CHUNKS chunks of 4 k-tiles. Measured no faster than the
# split kernel (H100: 91.1 / 78.9 / 90.4 µs, the same three shapes): its atomics and had_out cost
# what the idle SMs did; on no route
WGR_SK_KERNEL = "exl3_wgr_sk_m256_t2"
WGR_SK_MIN_CHUNKS = 8
# exl3_wgr_out_m256_t2_{f16,f32}: exl3_wgr_m256_t2 with the output pass fused (H128, svh and bias on
# the block's sums in shared memory, y written directly: no workspace, no atomics, no had_out), for
# any launch: where its tiles fill under half the SMs, K is split as for the others (wave_split: one
# wave) and the splits meet in the kernel (wgr_fixup: each stores its sums in a scratch, and the
# last to arrive adds all splits' sums in split order and finishes the tile; none waits). H100, one
# split: 69.9 µs at 4096 -> 14336 and 256 rows (1.20x fp16 cuBLAS), 478 at 2048 rows (1.32x)
WGR_OUT_KERNELS = {torch.float16: "exl3_wgr_out_m256_t2_f16", torch.float32: "exl3_wgr_out_m256_t2_f32"}
# exl3_wgr_rg_out_m256_t2_{f16,f32}: the same with the producer warp in a warpgroup of its own that
# gives its registers to the consumers (setmaxnreg 40 / 232, 384 threads), so four A operands stay
# in registers and a chunk's decode runs with three MMAs queued ahead instead of one: 4-8 % faster
# than exl3_wgr_out at every shape and row count measured (H100, 2026-12-06 11:03: 65.1 µs at 4096 ->
# 14336 and 256 rows, 1.12x fp16 cuBLAS; 74.3 at 14336 -> 4096, 1.12x; 74.8 at 8192 -> 8192,
# 1.19x); the EXL3TOOLS_DENSE_WGR route
WGR_RG_OUT_KERNELS = {torch.float16: "exl3_wgr_rg_out_m256_t2_f16", torch.float32: "exl3_wgr_rg_out_m256_t2_f32"}
# exl3_wgr_rg_out_m128_t2_{f16,f32}: the same loop on 128-row slots (wgmma.m64n128k16): MoE prefill
# tiles of 128 rows (CudaExperts.moe_wgr; air6 has ~128 pairs an expert at 2048 tokens) and dense
# linears of 65-WGR_M128_ROWS rows on the EXL3TOOLS_DENSE_WGR route, where a 256-row slot is half
# padding. H100, 2026-12-06 16:56 (bench/gpu_gemm_ab.py, graph replays, K 3): 8192 -> 8192 at 128
# rows 57.2 µs (0.96x fp16 cuBLAS) against the 256-row slot's 80.7 (1.35x); at 256 rows two slots
# 89.7 against one 256-row slot's 78.8
WGR_RG_OUT_M128_KERNELS = {torch.float16: "exl3_wgr_rg_out_m128_t2_f16", torch.float32: "exl3_wgr_rg_out_m128_t2_f32"}
WGR_M128_ROWS = 128
# the EXL3TOOLS_DENSE_WGR route's most rows (past it: decode + cuBLAS, the weight decoded once)
WGR_MAX_ROWS = 1024
# and its fewest weights (k x n): a smaller linear fills the SMs only by splitting K into a few
# chunks a block, and decode + cuBLAS won (H100, 2026-12-06 11:03, 256-1024 rows: 4096 -> 1024,
# 4096 -> 1408 and 1408 -> 4096 (air6's k / v and shared expert) 1-11 % slower on wgr_rg; every
# linear of 45 M weights or more 4-50 % faster)
WGR_MIN_WEIGHTS = 1 << 24
PDL = os.environ.get("EXL3TOOLS_CUDA_PDL", "1") == "1"   # programmatic dependent launch (Hopper)
HAD_WARPS = 8                # warps per block in the Hadamard passes (one warp per 128 values)

_lock = threading.Lock()


_modules: dict[tuple, Module] = {}


def cuda_device(device) -> torch.device:
    """``device`` with its index ("cuda" -> the current CUDA device): modules and workspaces are
    kept per device index."""
    device = torch.device(device)
    return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())


def module(width: int, codebook: str, device) -> Module:
    device = cuda_device(device)
    if width % 8 or not 16 <= width <= 128:
        raise UsageError(f"illegal trellis width {width}")
    if codebook not in CODEBOOKS:
        raise UsageError(f"unknown codebook {codebook!r}")
    # the build-time preview is part of the key: a batch-invariant run never gets a HALVES module
    # that a run without the mode loaded earlier in the process (cuda_build.halves)
    key = (width // 8, CODEBOOKS[codebook], device.index, halves(CODEBOOKS[codebook]))
    m = _modules.get(key)
    if m is None:
        with _lock:
            m = _modules.get(key)
            if m is None:
                m = Module(build(key[0], key[1]), device)
                m.aff_rows = AFF_ROWS if key[3] and codebook == "mul1" else 0
                # XDUP_SMEM (a tuning A/B's build define): the halves PRO kernels keep each activation
                # as its B words in shared memory, 16 uint32 a row's k-tile (3INST / MCG: (x, x)) or 32
                # (MUL1's AFF kernels: (x, 0) and (0, x)); gemv_pro sizes its split for them
                if key[3] and extra_define("XDUP_SMEM"):
                    m.xdup_words = 32 if codebook == "mul1" else 16
                _modules[key] = m
    return m


# ------------------------------------------------------------------ workspace
_workspace: dict[int, torch.Tensor] = {}
_retired: list[torch.Tensor] = []      # outgrown workspaces: captured graphs may still point at them


WORKSPACE_KEEP = 1 << 24     # floats (64 MiB): larger requests outside graph capture get a buffer of their own


def _kept(kept: dict[int, torch.Tensor], device: torch.device, numel: int, dtype: torch.dtype, least: int,
          zero: bool) -> torch.Tensor | None:
    """``kept``'s buffer for ``device`` if it holds ≥ numel, else a new one of max(numel, least)
    (zeroed where ``zero``) in its place, the outgrown one kept, never freed, because a CUDA graph
    captured earlier replays into it; None where it would have to grow under graph capture."""
    buf = kept.get(device.index)
    if buf is None or buf.numel() < numel:
        if torch.cuda.is_current_stream_capturing():
            return None
        if buf is not None:
            _retired.append(buf)
        buf = kept[device.index] = (torch.zeros if zero else torch.empty)(max(numel, least), dtype=dtype,
                                                                            device=device)
    return buf


def workspace(device: torch.device, numel: int) -> torch.Tensor:
    """A zero fp32 buffer of ≥ numel shared by all small-row calls on ``device``.

    Every gemv adds into it and the output pass that follows re-zeroes what it read, so it is
    zero between calls (stream order; one stream per device). Grown only outside graph capture
    (``_kept``). A request above WORKSPACE_KEEP floats (a long prefill's MoE tiles) gets a fresh
    zeroed buffer, freed after the call: the shared one, and what it retires, stay small. Under
    capture (a prompt-step graph of hundreds of rows) that buffer comes from the graph's pool and
    its zeroing is part of the graph, since its warm-up never grew the shared one.
    """
    if numel > WORKSPACE_KEEP:
        return torch.zeros(numel, dtype=torch.float32, device=device)
    ws = _kept(_workspace, device, numel, torch.float32, 1 << 22, zero=True)
    if ws is None:
        raise RuntimeError("cuda backend: workspace must grow during CUDA-graph capture; warm up first")
    return ws


_wgr_flags: dict[int, torch.Tensor] = {}
_wgr_scratch: dict[int, torch.Tensor] = {}


def wgr_buffers(device: torch.device, tiles: int, splits: int, rows: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """(flags, scratch) of a wgr launch with the output pass that splits K: an int32 count a tile
    (zero between launches: the last split to arrive re-zeroes it) and ``splits`` partial sums of
    ``rows`` (the kernel's slot) x 128 fp32 a tile. Each kept per device (``_kept``, as
    ``workspace``); under capture one too small is replaced by the graph's own (from its pool, the
    counts' zeroing part of the graph)."""
    need = tiles * splits * rows * 128
    flags = _kept(_wgr_flags, device, tiles, torch.int32, 1024, zero=True)
    scratch = _kept(_wgr_scratch, device, need, torch.float32, 1 << 22, zero=False)
    return (torch.zeros(tiles, dtype=torch.int32, device=device) if flags is None else flags,
            torch.empty(need, dtype=torch.float32, device=device) if scratch is None else scratch)


def fixed_workspace(device: torch.device, numel: int) -> torch.Tensor:
    """``workspace`` as ``numel`` int64 (the fixed-point sums of batch-invariant gemv calls; zero
    bits are zero either way, and had_out_i64 re-zeroes what it reads)."""
    return workspace(device, 2 * numel)[:2 * numel].view(torch.int64)


def _ptrs(tensors, device) -> torch.Tensor | None:
    if tensors is None:
        return None
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64, device=device)


# ------------------------------------------------------------------ launches
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
# rows a slot the AFF kernels of a MUL1 halves module take (the EXL3TOOLS_GEMV_AFFINE preview;
# AFF_ROWS in the source): gemv_pro picks its exl3_gemv_pro_*aff_* entry points up to these, the
# gemv kernels choose inside
AFF_ROWS = 4
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


def decode_rotated(trellis: torch.Tensor, codebook: str) -> torch.Tensor:
    """Ŵ (k, n) fp16 from an int16 trellis on a CUDA device (bit-exact; for tests and tools)."""
    tr = trellis.to(torch.int16).contiguous()
    return decode_t(module(tr.shape[-1], codebook, tr.device), tr).t().contiguous()


# ------------------------------------------------------------------ linears
def _check_dims(k: int, n: int) -> None:
    if k % 128 or n % 128:
        raise UsageError(f"backend 'cuda' needs in/out features that are multiples of 128, got {k} x {n}")


class CudaLinear:
    """One EXL3 linear on the GPU; ``__call__(x) -> x @ W + bias`` at padded dims."""

    def __init__(self, tensors: dict, codebook: str, device):
        self.device = cuda_device(device)
        self.trellis = tensors["trellis"].to(self.device, torch.int16).contiguous()
        self.kt, self.nt, self.width = self.trellis.shape
        self.k, self.n = self.kt * 16, self.nt * 16
        _check_dims(self.k, self.n)
        self.suh = tensors["suh"].to(self.device, torch.float16).contiguous()
        self.svh = tensors["svh"].to(self.device, torch.float16).contiguous()
        b = tensors.get("bias")
        self.bias = None if b is None else b.to(self.device, torch.float16).contiguous()
        self.codebook = codebook
        self.mod = module(self.width, codebook, self.device)
        self.tr_tab, self.suh_tab, self.svh_tab = (_ptrs([t], self.device) for t in (self.trellis, self.suh, self.svh))
        self.bias_tab = _ptrs(None if self.bias is None else [self.bias], self.device)
        from exl3tools.runtime import invariance, preview

        # rows > SMALL_ROWS: the output pass folded into Ŵ (fold), both passes (fold_in; fp16 x, the default);
        # None: their switches, read per call (a prefill A/B switches them in one process)
        self.fold: bool | None = None
        self.fold_in: bool | None = None
        self.invariant = invariance.on()
        self.gemv_in = preview.switched_on("gemv_prologue")   # rows <= GEMV_PRO_MAX_ROWS: no had_in launch
        self.smem_tiles = preview.switched_on("prefill_tiles")   # invariant runs past 64 rows
        self.dense_tiles = preview.switched_on("dense_tiles") and self.k >= DENSE_TILE_MIN_K and self.nt % 8 == 0
        self.wgmma = preview.switched_on("wgmma") and self.nt % 16 == 0     # (256 columns a block)
        self.wga: bool | None = None        # rows 65-256 on WGA_KERNEL; None: its switch, read per call
        # rows 65-WGR_MAX_ROWS on the wgr kernels; None: its switch, read per call (WGR_MIN_WEIGHTS at least)
        self.wgr: bool | None = None

    @property
    def device_tensors(self) -> dict:
        """The stored fields as held on the device (grouped experts share them, no copy)."""
        t = dict(trellis=self.trellis, suh=self.suh, svh=self.svh)
        if self.bias is not None:
            t["bias"] = self.bias
        return t

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """y in x's dtype (fp16 or fp32 straight from the kernels; others via fp32)."""
        shape = x.shape
        x2 = _act(x, self.k)
        rows = x2.shape[0]
        if rows == 0:                      # a grid of 0 blocks is a launch error
            return x.new_empty(*shape[:-1], self.n)
        if self.invariant:
            return self._invariant(x2)[:rows].to(x.dtype).reshape(*shape[:-1], self.n)
        if self.wgmma and SMALL_ROWS < rows <= WG_MAX_ROWS:
            return self._wgmma(x2)[:rows].to(x.dtype).reshape(*shape[:-1], self.n)
        fold = fold_in = False
        if rows > SMALL_ROWS:
            from exl3tools.runtime import preview

            if rows <= WGR_MAX_ROWS and (
                    preview.switched_on("dense_wgr") and self.k * self.n >= WGR_MIN_WEIGHTS
                    if self.wgr is None else self.wgr):
                slot = WGR_M128_ROWS if rows <= WGR_M128_ROWS else WGR_ROWS
                return self._in_slots(x2, slot, self._wgr_kernel(x2.dtype, slot))[:rows].to(x.dtype).reshape(
                    *shape[:-1], self.n)
            if rows <= WGA_MAX_ROWS and not (rows <= 128 and self.dense_tiles) and (
                    preview.switched_on("dense_wga") if self.wga is None else self.wga):
                return self._in_slots(x2, WGA_MAX_ROWS, WGA_KERNEL)[:rows].to(x.dtype).reshape(*shape[:-1], self.n)
            fold = preview.switched_on("dense_fold") if self.fold is None else self.fold
            fold_in = preview.switched_on("dense_fold_in") if self.fold_in is None else self.fold_in
        if fold_in and rows >= FOLD2_MIN_ROWS and x2.dtype == torch.float16:
            # the whole weight: x itself into cuBLAS
            y = dense_mm(self.mod, x2, self.trellis, self.svh, self.bias, suh=self.suh)
            return y.to(x.dtype).reshape(*shape[:-1], self.n)
        if self.gemv_in and gemv_pro_fits(rows, x2.dtype):     # had_in inside the gemv
            acc = workspace(self.device, rows * self.n)
            gemv_pro(self.mod, x2, self.suh_tab, self.tr_tab, self.kt, self.nt, rows, 1, acc)
        else:
            xrot = had_in(self.mod, x2, self.suh_tab, rows, rows, self.k)
            if fold and rows * self.n >= FOLD_MIN_OUT:
                y = dense_mm(self.mod, xrot, self.trellis, self.svh, self.bias)
                return y.to(x.dtype).reshape(*shape[:-1], self.n)
            if rows <= SMALL_ROWS:
                acc = workspace(self.device, rows * self.n)
                gemv(self.mod, xrot, self.tr_tab, self.kt, self.nt, rows, 1, acc)
            elif rows <= 128 and self.dense_tiles:     # one 128-row slot: the weight decoded once
                acc = workspace(self.device, rows * self.n)
                gemv(self.mod, xrot, self.tr_tab, self.kt, self.nt, rows, 1, acc, kernel=DENSE_TILE_KERNEL)
            else:
                acc = dense_mm(self.mod, xrot, self.trellis)
        y = torch.empty(rows, self.n, dtype=x2.dtype, device=self.device)
        had_out(self.mod, acc, y, self.svh_tab, self.bias_tab, rows, rows, self.n)
        return y.to(x.dtype).reshape(*shape[:-1], self.n)

    def _wgmma(self, x2: torch.Tensor) -> torch.Tensor:
        """y (rows padded to whole slots) through the wgmma kernel: slots of 128 or 256 rows."""
        r = 128 if x2.shape[0] <= 128 else 256
        return self._in_slots(x2, r, WG_KERNELS[r])

    @staticmethod
    def _wgr_kernel(dtype: torch.dtype, slot: int = WGR_ROWS) -> str:
        """EXL3TOOLS_DENSE_WGR's kernel for slots of ``slot`` rows (256, or WGR_M128_ROWS): the fused
        output pass with the register-donating producer (WGR_RG_OUT_KERNELS, WGR_RG_OUT_M128_KERNELS;
        a launch of too few tiles for the SMs splits K and adds the splits inside); WGR_KERNEL
        (atomics, had_out; 256-row slots hold smaller ones) for a y that is neither fp16 nor fp32
        (``_act`` gives one or the other)."""
        return (WGR_RG_OUT_M128_KERNELS if slot == WGR_M128_ROWS else WGR_RG_OUT_KERNELS).get(dtype, WGR_KERNEL)

    def _in_slots(self, x2: torch.Tensor, r: int, kernel: str | None, fixed: bool = False,
                  splits: int | None = None) -> torch.Tensor:
        """y of x2's rows padded to whole slots of ``r`` rows, every slot a slot of one gemv launch
        (``kernel``) over this weight; ``fixed``: the fixed-point workspace (batch-invariant runs).
        A wgr kernel with the output pass (WGR_OUT_KERNELS, WGR_RG_OUT_KERNELS, WGR_RG_OUT_M128_KERNELS)
        writes y itself (in x2's dtype, fp16 or fp32), K split ``splits`` ways if given (``gemv``)."""
        rows = x2.shape[0]
        slots = -(-rows // r)
        total = r * slots
        if total > rows:
            x2 = F.pad(x2, (0, 0, 0, total - rows))
        xrot = had_in(self.mod, x2, self.suh_tab, total, total, self.k)
        if _wgr_out(kernel):
            y = torch.empty(total, self.n, dtype=x2.dtype, device=self.device)
            gemv(self.mod, xrot, self.tr_tab, self.kt, self.nt, r, slots, None, kernel=kernel,
                 out=(y, self.svh_tab, self.bias_tab), splits=splits)
            return y
        acc = (fixed_workspace if fixed else workspace)(self.device, total * self.n)
        gemv(self.mod, xrot, self.tr_tab, self.kt, self.nt, r, slots, acc, kernel=kernel)
        y = torch.empty(total, self.n, dtype=x2.dtype, device=self.device)
        return had_out(self.mod, acc, y, self.svh_tab, self.bias_tab, total, total, self.n)

    @staticmethod
    def grouped(fns: list):
        """``fns`` (linears that read the same x) as one ``cuda_group.CudaGroup``, or None where
        they cannot be (dispatch.make_group then calls each)."""
        from exl3tools.kernels.cuda_group import CudaGroup

        c = CudaGroup.plan(fns)
        return None if c is None else CudaGroup(fns, c)

    def _invariant(self, x2: torch.Tensor) -> torch.Tensor:
        """y of a batch-invariant run: fixed splits and fixed-point sums, so no row depends on the
        others; past 64 rows, 64-row slots (rows padded) on the shared-memory tile kernel (unless
        EXL3TOOLS_PREFILL_TILES=0: the gemv kernel), which give each row what the gemv kernel does."""
        r = min(x2.shape[0], SMALL_ROWS)
        slots = -(-x2.shape[0] // r)
        return self._in_slots(x2, r, TILE_KERNELS[SMALL_ROWS] if slots > 1 and self.smem_tiles else None, fixed=True)


def _cuda_factory(tensors: dict, codebook: str, k_bits: float, device):
    return CudaLinear(tensors, codebook, device)


def _experts_factory(tensors_per_expert: list[dict], codebook: str, k_bits: float, device):
    from exl3tools.kernels.cuda_experts import CudaExperts  # (it imports this module)

    return CudaExperts(tensors_per_expert, codebook, device)


def _register() -> None:
    from exl3tools.kernels import dispatch

    dispatch.register_backend("cuda", _cuda_factory)
    if hasattr(dispatch, "register_experts"):
        dispatch.register_experts("cuda", _experts_factory)


def available() -> bool:
    """True where a CUDA device is visible and the driver library loads."""
    if not torch.cuda.is_available():
        return False
    try:
        driver()
    except OSError:
        return False
    return True


if not available():
    raise ImportError("backend 'cuda' needs a CUDA device and the CUDA driver library")
_register()

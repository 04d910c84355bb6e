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
The launch wrappers (``had_in``, ``gemv``, ``gemv_pro``, ``had_out``) are kernels/cuda_gemv.py's,
the workspace they add into kernels/cuda_workspace.py's.

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

import threading

import torch
import torch.nn.functional as F
from exl3tools.kernels.cuda_build import CODEBOOKS, build, extra_define, halves
from exl3tools.kernels.cuda_dense import decode_t, dense_mm
from exl3tools.kernels.cuda_driver import Module, driver
from exl3tools.kernels.cuda_gemv import _act, _wgr_out, gemv, gemv_pro, gemv_pro_fits, had_in, had_out
from exl3tools.kernels.cuda_workspace import fixed_workspace, workspace

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
# 132 SMs); a share is at least cuda_gemv.WGR_SK_MIN_CHUNKS chunks of 4 k-tiles. Measured no faster than the
# split kernel (H100: 91.1 / 78.9 / 90.4 µs, the same three shapes): its atomics and had_out cost
# what the idle SMs did; on no route
WGR_SK_KERNEL = "exl3_wgr_sk_m256_t2"
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
# rows a slot the AFF kernels of a MUL1 halves module take (the EXL3TOOLS_GEMV_AFFINE preview;
# AFF_ROWS in the source; ``module`` sets Module.aff_rows): cuda_gemv.gemv_pro picks its
# exl3_gemv_pro_*aff_* entry points up to these, the gemv kernels choose inside
AFF_ROWS = 4

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


def _ptrs(tensors, device) -> torch.Tensor | None:
    if tensors is None:
        return None
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64, device=device)


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

"""The launch table of the GEMM kernels in kernels/csrc/exl3_gemv.cu: a block's rows, units, threads
and shared memory by kernel name, and how K is split so that a launch's units are resident at once
(one wave). kernels/cuda_gemv.py and kernels/cuda_experts.py size every launch with it; tests/gpu
patch ``sm_count`` here to force split counts."""

from __future__ import annotations

from exl3tools.kernels.cuda_dense import sm_count
from exl3tools.kernels.cuda_driver import Module

PIPE = 4                     # k-tiles per pipeline stage in the gemv kernel (P in the source)


def slot_rows(name: str) -> int:
    """The most rows a slot of GEMM kernel ``name`` takes (its _m field: exl3_wga_m256_t2 -> 256)."""
    return int(name.split("_m")[1].split("_")[0])


def kernel_block(name: str) -> tuple[int, int]:
    """(units, threads) a block of GEMM kernel ``name``: a unit is a warp's n-tiles, 4 a block of
    128 threads, 8 / 16 for the wgmma kernels of two / four warpgroups (exl3_wg2_*, exl3_wg4_*);
    the warp-specialized exl3_ws3_* / exl3_ws4_* have 4 units of MMA work in 1024 threads (16 warps decode),
    exl3_wga_* 4 units in 512 threads (every warp decodes, every warpgroup multiplies), exl3_wgr_* 4
    units in 288 (8 warps decode and multiply, one copies), exl3_wgr_rg_* in 384 (the copying warp's
    warpgroup gives its registers away)."""
    if name.startswith(("exl3_wg2_", "exl3_wg4_")):
        w = 4 * int(name[len("exl3_wg")])
        return w, 32 * w
    if name.startswith(("exl3_ws3_", "exl3_ws4_")):
        return 4, 1024
    if name.startswith("exl3_wga_"):
        return 4, 512
    if name.startswith("exl3_wgr_rg_"):
        return 4, 384
    if name.startswith("exl3_wgr_"):
        return 4, 288
    return 4, 128


WS3_SMEM = 4 * 4 * (2 * 64 + 128) * 16 * 2   # exl3_ws3_*: 4 stages of 4 k-tiles of A (128 columns) and x (128 rows)
# exl3_ws4_*: and each of 16 producer warps a ring of 3 chunks of 4 tiles' words (64 at most: K 8)
WS4_SMEM = WS3_SMEM + 16 * 3 * 4 * 64 * 4
# exl3_wga_*: 3 stages (4 with -DWGA_S=4) of 64 k of A (128 columns) and x (256 rows), a ring of 4
# chunks' trellis words (4 k-tiles x 8 tiles of 64 words at most: K 8) and 8 mbarriers (the ring's, x's)
WGA_SMEM = 4 * (128 + 256) * 64 * 2 + 4 * 4 * 8 * 64 * 4 + 8 * 8
# exl3_wgr_*: 5 stages (WGR_S) of x (256 rows x 64 k) and 4 k-tiles x 8 tiles of trellis words (64 at
# most: K 8), a full and an empty mbarrier a stage
WGR_SMEM = 5 * (256 * 64 * 2 + 4 * 8 * 64 * 4) + 2 * 5 * 8


def kernel_smem(name: str) -> int:
    """Bytes of dynamic shared memory a block of GEMM kernel ``name`` takes (the rest: static)."""
    for prefix, smem in (("exl3_ws3_", WS3_SMEM), ("exl3_ws4_", WS4_SMEM), ("exl3_wga_", WGA_SMEM),
                         ("exl3_wgr_", WGR_SMEM)):
        if name.startswith(prefix):
            return smem
    return 0


def resident(mod: Module, name: str, device) -> int:
    """Units of a GEMM kernel launch resident at once on the device (one wave)."""
    w, threads = kernel_block(name)
    return sm_count(device) * mod.blocks_per_sm(name, threads, kernel_smem(name)) * w


def wave_split(mod: Module, name: str, device, kt: int, groups: int, slots: int) -> tuple[int, int, int]:
    """(k-tiles per split, column groups, units) of a GEMM kernel launch: K split so that all units
    are resident at once (one wave: no tail of half-empty SMs); units == groups: one split. (More
    splits to fill a part-empty last wave timed slower on the H100: docs/gpu-sessions.md, 2026-12-06 14:28.)"""
    kps, units = split_k(kt, groups, max(1, min(-(-kt // 8), resident(mod, name, device) // (groups * slots))))
    return kps, groups, units


def split_k(kt: int, groups: int, splits: int) -> tuple[int, int]:
    """(k-tiles per split, units) of K split at most ``splits`` ways in whole pipeline stages."""
    kps = -(-kt // splits)
    kps = -(-kps // PIPE) * PIPE
    return kps, groups * -(-kt // kps)

"""Paged MLA decode on Hopper, TMA copies and warpgroup MMAs (kernels/csrc/mla_decode.cu): the
split kernel of kernels/mla_attention.mla_decode for dense rows on fp16 planes with latent 512 and
rope 64 and heads in 64s (DeepSeek-V3's 128, GLM-5's 64; other counts, a tensor-parallel rank's,
padded to 64 unless EXL3TOOLS_MLA_PAD_HEADS=0), launched through the CUDA driver on
torch's current stream, so CUDA graphs capture it (with the planes' tensor maps as parameters). It
writes the Triton kernel's partials (o, base-2 lse) and mla_decode merges them with the same
kernel. mla_decode takes it for rows without a DSA selection where ``fits`` and the ``mla_cuda``
switch (runtime/preview.py) allow; a selection stays on Triton (a cp.async version of this kernel
over selected rows measured 0.78-0.90x Triton's time on the H200)."""

from __future__ import annotations

import threading
import warnings

import torch
from exl3tools.kernels import cuda_build
from exl3tools.kernels.cuda_driver import Module, TensorMap, tensor_map_2d

from exl3tools.errors import UsageError

HEADS = 64            # heads a block (one wgmma M)
KEYS = 64             # keys a staged tile
LATENT, ROPE = 512, 64
THREADS = 256         # two warpgroups
SMEM = 3 * KEYS * (LATENT + ROPE) * 2 + 1024 + 16   # queries, two key stages, alignment, barriers
# the ping-pong kernel: the same, its rows' softmax state (5 x 64 floats) and a barrier a buffer chunk
SMEM_PP = 3 * KEYS * (LATENT + ROPE) * 2 + 1024 + 5 * HEADS * 4 + 2 * (LATENT + ROPE) // 64 * 8

_lock = threading.Lock()
_modules: dict[int, Module] = {}
_maps: dict[tuple, TensorMap] = {}      # a pool's planes keep theirs (graphs captured them by value)
_can_build: bool | None = None


def fits(q_lat: torch.Tensor, ckv: torch.Tensor, kpe: torch.Tensor, pad: bool = False) -> bool:
    """The shapes, dtypes and device this kernel serves (sm_90 only: the cubin is sm_90a), with
    planes a tensor map can address (16-byte aligned rows, the blocks one run of slots). Heads in
    64s, or any count with ``pad`` (the ping-pong kernel's padded variant: split's ``pad``)."""
    if not (q_lat.is_cuda and ckv.dtype == torch.float16 and kpe.dtype == torch.float16):
        return False
    if (q_lat.shape[1] % HEADS and not pad) or q_lat.shape[2] != LATENT or kpe.shape[2] != ROPE:
        return False
    if any(s % 8 for s in (ckv.stride(1), kpe.stride(1))) or ckv.data_ptr() % 16 or kpe.data_ptr() % 16:
        return False            # TMA: 16-byte aligned rows
    if not (_blocks_contiguous(ckv) and _blocks_contiguous(kpe)):
        return False            # one tensor map a plane: its blocks one run of slots
    bs = ckv.shape[1]
    if bs < 2 or bs & (bs - 1):
        return False            # a power of two (the table's shift), at most 32 boxes (a warp's lanes) a tile
    return torch.cuda.get_device_capability(q_lat.device) == (9, 0) and _buildable()


def _buildable() -> bool:
    """Whether the kernel's cubin is there or builds, asked once a process (mla_decode asks every
    call): a toolchain that cannot compile it (an old nvcc) leaves the Triton kernel serving, with
    one warning, instead of failing the first decode step."""
    global _can_build
    if _can_build is None:
        _can_build = cuda_build.can_build_mla()
        if _can_build:
            try:
                cuda_build.build_mla()
            except (RuntimeError, UsageError, OSError) as exc:
                warnings.warn(f"the CUDA MLA kernel did not build ({str(exc).splitlines()[0]}): Triton's serves",
                              RuntimeWarning, stacklevel=2)
                _can_build = False
    return _can_build


def _module(device: torch.device) -> Module:
    index = device.index if device.index is not None else torch.cuda.current_device()
    m = _modules.get(index)
    if m is None:
        with _lock:
            m = _modules.get(index)
            if m is None:
                m = _modules[index] = Module(cuda_build.build_mla(), torch.device("cuda", index))
    return m


def _blocks_contiguous(plane: torch.Tensor) -> bool:
    """The plane's blocks follow each other (one row of slots a tensor map can address)."""
    return plane.stride(0) == plane.shape[1] * plane.stride(1)


def _plane_map(plane: torch.Tensor, box_rows: int) -> TensorMap:
    key = (plane.data_ptr(), tuple(plane.shape), tuple(plane.stride()), box_rows)
    m = _maps.get(key)
    if m is None:
        m = _maps[key] = tensor_map_2d(plane.data_ptr(), plane.shape[0] * plane.shape[1], plane.shape[2],
                                       plane.stride(1) * 2, 64, box_rows)
    return m


def split(q_lat: torch.Tensor, q_pe: torch.Tensor, ckv: torch.Tensor, kpe: torch.Tensor,
          block_tables: torch.Tensor, context_lens: torch.Tensor, out: torch.Tensor, po: torch.Tensor,
          plse: torch.Tensor, qk_scale: float, num_splits: int, min_split_tiles: int,
          pingpong: bool = False, scaled_p: bool = False) -> None:
    """One launch of the split kernel over dense rows: fp16 contiguous queries (B, H, 512) / (B, H,
    64), the caller's checked planes (``fits``) and tables (mla_attention._check); with one split
    the normalised output goes to ``out``, else partials to ``po`` / ``plse`` (mla_decode's layout).
    ``pingpong``: the kernel that computes each tile's scores once (mla_decode.cu pp_body), same
    contract; ``scaled_p`` (with it): its variant that stores P_A scaled
    to B's maxima, so warpgroup 1's two latent products go out back to back (mla_decode_pp_ps).
    H not a multiple of 64 takes the ping-pong kernel's padded variant (mla_decode_pp_pad: the
    last head block's missing rows zero queries, never stored)."""
    B, H, _ = q_lat.shape
    hchunks = -(-H // HEADS)
    bs = ckv.shape[1]
    box = min(bs, KEYS)          # a copy: one table block's rows (a tile's at most)
    if scaled_p and not pingpong:
        raise ValueError("scaled_p is a variant of the ping-pong kernel")
    if H % HEADS and not pingpong:
        raise ValueError(f"{H} heads (not a multiple of {HEADS}) take the ping-pong kernel's padded variant")
    if pingpong:
        kernel, smem = "mla_decode_pp", SMEM_PP
        kernel += ("_ps" if scaled_p else "") + ("_pad" if H % HEADS else "")
    else:
        kernel, smem = "mla_decode_tma", SMEM
    _module(q_lat.device).launch(kernel, (hchunks * num_splits, B), THREADS, q_lat, q_pe, _plane_map(ckv, box),
                                 _plane_map(kpe, box), block_tables, context_lens, out, po, plse, float(qk_scale),
                                 num_splits, min_split_tiles, H, hchunks, bs.bit_length() - 1, box,
                                 block_tables.stride(0), int(num_splits == 1), smem=smem)

"""Linears of many rows on the GPU: the weight decoded to fp16 by our CUDA kernels
(kernels/csrc/exl3_gemv.cu), then one cuBLAS GEMM (``CudaLinear`` in kernels/cuda_exl3.py takes this
path above SMALL_ROWS rows).

- ``decode_t``: Ŵᵀ, bit-exact (the output pass ``had_out`` follows the GEMM);
- ``decode_fold``: W'ᵀ = (Ŵ · H_n ⊙ svh)ᵀ, the output pass folded in (the GEMM adds the bias);
- ``decode_fold2``: Wᵀ, the linear's whole weight (both Hadamard passes folded in: x itself goes in);
- ``dense_mm``: any of them in column chunks of at most DENSE_CHUNK_BYTES, each chunk's GEMM in place.

Modules (``cuda_exl3.module``) come in from the caller, so this module imports nothing of
cuda_exl3's and loads without a GPU.
"""

from __future__ import annotations

import functools

import torch
from exl3tools.kernels.cuda_driver import Module

from exl3tools.errors import UsageError

DENSE_CHUNK_BYTES = 256 * 2**20   # the most fp16 Ŵ decoded at once (dense_mm)
FOLD2_SMEM = 128 * 132 * 4   # decode_fold2's dynamic shared memory a block: 128 columns x F2_LD floats


@functools.cache
def sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def decode_t(mod: Module, trellis: torch.Tensor, j0: int = 0, j1: int | None = None,
             kernel: str | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Ŵᵀ (n, k) fp16, bit-exact; of n-tiles j0..j1 only (rows 16 j0 .. 16 j1 of the whole Ŵᵀ)
    where given. ``trellis``: (kt, nt, width) int16, contiguous. ``kernel`` (default exl3_decode_t,
    or exl3_decode_t_coop with the EXL3TOOLS_DECODE_COOP preview where nt % 4 == 0):
    exl3_decode_t_coop each quad of tiles loaded once a warp (bench/gpu_bench.py times both: its
    rows > 64 table). ``out``: a contiguous fp16 (16 (j1 - j0), 16 kt) buffer to decode into
    (dense_mm's reused chunk)."""
    kt, ld, _ = trellis.shape
    j1 = ld if j1 is None else j1
    nt = j1 - j0
    # the quad kernel's 16-byte loads: whole quads from a 16-byte aligned trellis (tile rows and
    # tiles are multiples of 16 bytes long; a view into a larger buffer need not start at one)
    quads_fit = nt % 4 == 0 and trellis.data_ptr() % 16 == 0
    if kernel is None:
        from exl3tools.runtime import preview  # torch-free; read per call so tests can switch it

        kernel = "exl3_decode_t_coop" if quads_fit and preview.switched_on("decode_coop") else "exl3_decode_t"
    elif kernel == "exl3_decode_t_coop" and not quads_fit:
        raise UsageError(f"exl3_decode_t_coop: {nt} n-tiles (a multiple of 4?) from address "
                         f"{trellis.data_ptr():#x} (16-byte aligned?)")
    wt = _decoded(out, nt, kt, trellis.device)
    quads = -(-(kt * nt) // 4)
    blocks = min(-(-quads // 8), sm_count(trellis.device) * 16)
    mod.launch(kernel, blocks, 256, trellis[:, j0], wt, kt, nt, ld)
    return wt


def decode_fold(mod: Module, trellis: torch.Tensor, svh: torch.Tensor, j0: int = 0, j1: int | None = None,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """W'ᵀ (n, k) fp16 with W' = Ŵ · H_n / sqrt(128) ⊙ svh (the output pass folded in; float32
    inside, rounded once), so that x @ W' + bias = had_out(x @ Ŵ); of n-tiles j0..j1 where given
    (multiples of 8: whole 128-column Hadamard blocks); ``out`` as in decode_t."""
    kt, ld, _ = trellis.shape
    j1 = ld if j1 is None else j1
    nt = j1 - j0
    if nt % 8 or j0 % 8:
        raise UsageError(f"decode_fold: n-tiles {j0}..{j1} are not whole 128-column blocks")
    wt = _decoded(out, nt, kt, trellis.device)
    items = kt * (nt // 8)
    blocks = min(-(-items // 8), sm_count(trellis.device) * 2)
    mod.launch("exl3_decode_fold", blocks, 256, trellis[:, j0], wt, svh[16 * j0:], kt, nt, ld)
    return wt


def decode_fold2(mod: Module, trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor, j0: int = 0,
                 j1: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Wᵀ (n, k) fp16 with W = diag(suh) · H_k · Ŵ · H_n · diag(svh) / 128, the linear's whole weight
    (both Hadamard passes folded in; float32 inside, rounded once), so that x @ W + bias is the
    linear of x itself; of n-tiles j0..j1 where given (whole 128-column blocks), ``out`` as in
    decode_t. ``suh``: all k entries."""
    kt, ld, _ = trellis.shape
    j1 = ld if j1 is None else j1
    nt = j1 - j0
    if nt % 8 or j0 % 8 or kt % 8:
        raise UsageError(f"decode_fold2: k-tiles {kt}, n-tiles {j0}..{j1} are not whole 128-wide blocks")
    wt = _decoded(out, nt, kt, trellis.device)
    mod.launch("exl3_decode_fold2", (kt // 8) * (nt // 8), 256, trellis[:, j0], wt, suh, svh[16 * j0:], kt, nt, ld,
               smem=FOLD2_SMEM)
    return wt


def _decoded(out: torch.Tensor | None, nt: int, kt: int, device) -> torch.Tensor:
    if out is None:
        return torch.empty(nt * 16, kt * 16, dtype=torch.float16, device=device)
    if out.shape != (nt * 16, kt * 16) or out.dtype != torch.float16 or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous fp16 {(nt * 16, kt * 16)} tensor, got {out.dtype} {tuple(out.shape)}")
    return out


def dense_mm(mod: Module, x: torch.Tensor, trellis: torch.Tensor, svh: torch.Tensor | None = None,
             bias: torch.Tensor | None = None, suh: torch.Tensor | None = None) -> torch.Tensor:
    """x (rows, k) fp16 @ Ŵ (k, n) through cuBLAS on the decoded Ŵ, decoded DENSE_CHUNK_BYTES of
    fp16 at a time (column chunks: a 154880 x 6144 head is 1.9 GB decoded whole, which an MTP
    verify step's graph held in its pool, docs/serve.md), every chunk into one buffer (on one
    stream each GEMM has read it before the next decode writes it). Chunks small enough to stay in
    L2 measured slower (H200, docs/gpu.md): the decode is not bound by its stores' HBM traffic.
    The chunks' GEMMs write their columns of the result in place. With ``svh``: x @ W' (+
    ``bias``) on decode_fold's W', the linear's whole output (no output pass to follow); with
    ``suh`` too, x is the raw input and W decode_fold2's whole weight (no input pass before)."""
    kt, nt, _ = trellis.shape
    step = max(1, DENSE_CHUNK_BYTES // (kt * 16 * 16 * 2))      # n-tiles a chunk
    if svh is not None:
        step = max(8, step - step % 8)
    step = min(step, nt)
    buf = torch.empty(step * 16, kt * 16, dtype=torch.float16, device=x.device)

    def mm(j0: int, j1: int, out=None):
        wt = buf[:16 * (j1 - j0)]
        if svh is None:
            return torch.mm(x, decode_t(mod, trellis, j0, j1, out=wt).t(), out=out)
        w = (decode_fold(mod, trellis, svh, j0, j1, out=wt) if suh is None
             else decode_fold2(mod, trellis, suh, svh, j0, j1, out=wt)).t()
        if bias is None:
            return torch.mm(x, w, out=out)
        return torch.addmm(bias[16 * j0:16 * j1], x, w, out=out)
    if step >= nt:
        return mm(0, nt)
    y = torch.empty(x.shape[0], nt * 16, dtype=x.dtype, device=x.device)
    for j0 in range(0, nt, step):
        j1 = min(nt, j0 + step)
        mm(j0, j1, out=y[:, 16 * j0:16 * j1])
    return y

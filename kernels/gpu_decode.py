"""EXL3 linears decoded on a CUDA device (dequantize, validate --deep): kernels/reference.py
``rotate_out_chain`` bit for bit, and so ``decode_linear`` bit for bit where the host BLAS sums in
that order (``reference.blas_is_fma_chain()``), within float32 rounding elsewhere.

    W = diag(suh) · H_k · Ŵ · H_n · diag(svh)          (exl3-format.md §5.7)

Ŵ comes from cuda_exl3 (bit-exact). ``_had_kernel`` computes every Hadamard output as one float32 FMA
chain over j = 0..127 in order, starting from 0 (``reference.hadamard_chain``; cuBLAS sums in another
order, and so do some CPU BLAS kernels: OpenBLAS's Haswell sgemm on an AMD EPYC), and the sign/scale
vectors are separate float32 multiplies in the reference's order. The work is done on Wᵀ (n, k),
which is the Hugging Face layout: H is symmetric, so every chain is the same element for element.
"""

from __future__ import annotations

import threading
from functools import lru_cache

import numpy as np
import torch
import triton
import triton.language as tl
from exl3tools.kernels.reference import hadamard128

BM, BN = 64, 64
TORCH_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


@triton.jit
def _had_kernel(a_ptr, b_ptr, c_ptr, M, N, s_az, s_am, s_aj, s_bz, s_bj, s_bn, s_cz, s_cm, s_cn,
                BM: tl.constexpr, BN: tl.constexpr):
    """C[z] = A[z] (M x 128) · B[z] (128 x N), float32: acc = fma(a_j, b_j, acc) for j = 0..127."""
    pid = tl.program_id(0)
    z = tl.program_id(1).to(tl.int64)
    nb = tl.cdiv(N, BN)
    rm = ((pid // nb) * BM + tl.arange(0, BM)).to(tl.int64)
    rn = ((pid % nb) * BN + tl.arange(0, BN)).to(tl.int64)
    mm = rm < M
    mn = rn < N
    pa = a_ptr + z * s_az + rm * s_am
    pb = b_ptr + z * s_bz + rn * s_bn
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for j in range(128):
        a = tl.load(pa + j * s_aj, mask=mm, other=0.0)
        b = tl.load(pb + j * s_bj, mask=mn, other=0.0)
        acc = tl.fma(a[:, None], b[None, :], acc)
    tl.store(c_ptr + z * s_cz + rm[:, None] * s_cm + rn[None, :] * s_cn, acc, mask=mm[:, None] & mn[None, :])


@lru_cache(maxsize=None)
def _h(device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.array(hadamard128())).to(device)  # the reference's float32 H / sqrt(128)


def had_k_t(x: torch.Tensor) -> torch.Tensor:
    """x (n, k) float32 -> out[:, 128b + a] = chain_j x[:, 128b + j] · H[j, a]: the reference's
    had_rows on Wᵀ."""
    n, k = x.shape
    a = x.contiguous().view(-1, 128)
    out = torch.empty((n, k), dtype=torch.float32, device=x.device)
    m = a.shape[0]
    grid = (triton.cdiv(m, BM) * triton.cdiv(128, BN), 1)
    _had_kernel[grid](a, _h(x.device), out, m, 128, 0, 128, 1, 0, 128, 1, 0, 128, 1, BM=BM, BN=BN)
    return out


def had_n_t(y: torch.Tensor) -> torch.Tensor:
    """y (n, k) float32 -> out[128b + a, :] = chain_j H[a, j] · y[128b + j, :]: the reference's
    had_cols on Wᵀ."""
    n, k = y.shape
    y = y.contiguous()
    out = torch.empty((n, k), dtype=torch.float32, device=y.device)
    grid = (triton.cdiv(128, BM) * triton.cdiv(k, BN), n // 128)
    _had_kernel[grid](_h(y.device), y, out, 128, k, 0, 128, 1, 128 * k, k, 1, 128 * k, k, 1, BM=BM, BN=BN)
    return out


def rotate_out_t(what_t: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor) -> torch.Tensor:
    """Wᵀ (n, k) float32 from Ŵᵀ (n, k) fp16: the reference's rotate_out, transposed, bit for bit."""
    n, k = what_t.shape
    if k % 128 or n % 128 or suh.shape != (k,) or svh.shape != (n,):
        raise ValueError(f"Ŵᵀ {tuple(what_t.shape)} does not fit suh {tuple(suh.shape)} / svh {tuple(svh.shape)}")
    y = had_k_t(what_t.to(torch.float32))
    y *= suh.to(y.device, torch.float32)[None, :]
    z = had_n_t(y)
    z *= svh.to(z.device, torch.float32)[:, None]
    return z


class GpuDecoder:
    """Decodes EXL3 linears from numpy fields on one CUDA device. Thread-safe (one lock: the device
    runs one decode at a time anyway; callers' CPU work on the results overlaps)."""

    def __init__(self, device: str = "cuda"):
        from exl3tools.kernels import cuda_dense, cuda_exl3  # cuda_exl3 raises ImportError without CUDA

        self.cx, self.dense = cuda_exl3, cuda_dense
        self.device = cuda_exl3.cuda_device(device)
        self.lock = threading.Lock()

    def weight_t(self, trellis: np.ndarray, suh: np.ndarray, svh: np.ndarray, codebook: str) -> torch.Tensor:
        """Wᵀ (n, k) float32 on the device."""
        def host(x, dtype):  # a writable contiguous copy only where needed (frombuffer views are read-only)
            return torch.from_numpy(np.require(x, dtype, ["C", "W"]))

        with torch.cuda.device(self.device):  # Triton launches on the thread's current device
            tr = host(trellis, np.int16).to(self.device)
            what_t = self.dense.decode_t(self.cx.module(tr.shape[-1], codebook, self.device), tr)
            return rotate_out_t(what_t, host(suh, np.float16), host(svh, np.float16))

    def decode_linear(self, trellis: np.ndarray, suh: np.ndarray, svh: np.ndarray, codebook: str) -> np.ndarray:
        """W (k, n) float32 in host memory: a drop-in for reference.decode_linear."""
        with self.lock:
            return self.weight_t(trellis, suh, svh, codebook).t().contiguous().cpu().numpy()

    def hf_rows_bytes(self, trellis: np.ndarray, suh: np.ndarray, svh: np.ndarray, codebook: str,
                      rows: int, cols: int, dtype: str) -> bytes:
        """Bytes of the HF weight rows ``Wᵀ[:rows, :cols]`` in safetensors ``dtype`` (F32/F16/BF16),
        rounded on the device (round-to-nearest-even, as dequantize.to_dtype_bytes)."""
        with self.lock:
            w = self.weight_t(trellis, suh, svh, codebook)[:rows, :cols]
            return w.to(TORCH_DTYPES[dtype]).contiguous().view(torch.uint8).cpu().numpy().tobytes()

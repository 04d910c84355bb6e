"""Random EXL3 linears and the (K, codebook) grid shared by the GPU kernel tests."""

from __future__ import annotations

import numpy as np

WIDTHS = [16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128]       # K = 1, 1.5, 2, 2.5, ... 8
CASES = [(w, cb) for w in WIDTHS for cb in ("3inst", "mcg", "mul1") if w % 16 == 0 or cb == "mul1"]


def random_linear(rng, k, n, width, bias=False):
    """(trellis, suh, svh, bias or None) as numpy; every bit pattern is a valid trellis."""
    tr = rng.integers(-32768, 32768, size=(k // 16, n // 16, width)).astype(np.int16)
    suh = (rng.choice([-1.0, 1.0], k) * rng.uniform(0.5, 1.5, k)).astype(np.float16)
    svh = (rng.choice([-1.0, 1.0], n) * rng.uniform(0.001, 0.01, n)).astype(np.float16)
    b = rng.normal(0, 0.01, n).astype(np.float16) if bias else None
    return tr, suh, svh, b


def as_tensors(torch, tr, suh, svh, b):
    """The stored-field dict a kernel backend takes."""
    t = dict(trellis=torch.from_numpy(tr), suh=torch.from_numpy(suh), svh=torch.from_numpy(svh))
    if b is not None:
        t["bias"] = torch.from_numpy(b)
    return t


def rel_err(y, yref):
    return float(np.linalg.norm(y - yref) / np.linalg.norm(yref))


def cuda_experts(tensors_per_expert, codebook, device):
    """kernels/cuda_experts.CudaExperts (imported on call: the module needs CUDA)."""
    from exl3tools.kernels.cuda_experts import CudaExperts

    return CudaExperts(tensors_per_expert, codebook, device)

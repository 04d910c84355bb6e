"""Random EXL3 linears and the (K, codebook) grid shared by the GPU kernel tests."""

from __future__ import annotations

import numpy as np
from exl3tools.kernels import reference as ref

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


def tile_rows_reference(x, lins, w, slot, row_exp, valid, top):
    """x[token] @ W_e + bias (float64) of each real row of expert_tiles' tiles, in row order
    (``w``: the experts' decoded weights, ``lins``: their (trellis, suh, svh, bias))."""
    v = valid.cpu().numpy()
    s_, re = slot.cpu().numpy()[v], row_exp.cpu().numpy()[v]
    return np.stack([x[s // top].astype(np.float64) @ w[e] + lins[e][3] for s, e in zip(s_, re, strict=True)])


def graph_replays(cx, lin_arrays, rows: int, dtype) -> None:
    """The linear of ``lin_arrays`` (trellis, suh, svh, bias) captured in a CUDA graph on a zero
    input of ``rows`` rows (after a warm-up on a side stream), replayed with three new inputs,
    each against the reference."""
    import torch

    tr, suh, svh, b = lin_arrays
    k = tr.shape[0] * 16
    lin = cx.CudaLinear(as_tensors(torch, tr, suh, svh, b), "mul1", "cuda")
    xs = torch.zeros(rows, k, dtype=dtype, device="cuda")
    g, ys = captured(lin, xs)
    w = ref.decode_linear(tr, suh, svh, "mul1").astype(np.float64)
    for seed in range(3):
        x = np.random.default_rng(seed).normal(0, 1, (rows, k)).astype(np.float16)
        xs.copy_(torch.from_numpy(x))
        g.replay()
        torch.cuda.synchronize()
        assert rel_err(ys.float().cpu().numpy(), x.astype(np.float64) @ w + b) < 2e-3, seed


def captured(fn, xs):
    """(graph, outputs) of ``fn(xs)`` captured in a CUDA graph after a warm-up on a side stream."""
    import torch

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn(xs)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        ys = fn(xs)
    return g, ys

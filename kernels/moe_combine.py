"""The routed experts' weighted sum of a tiled MoE call, added chunk by chunk into each token's row.

``combine(out, y, inv, w)``: ``out[t] += sum_k w[t, k] * y[inv[t, k]]`` over the k with
``inv[t, k] >= 0`` (the pair's row in this chunk of expert-sorted tiles, runtime.layers._tiles_sum),
k in ascending order: a fixed order, so the result does not depend on timing (index_add_'s atomics
would), and no (pairs, hidden) float32 staging of every pair before a sum over k (384 MiB of a
2048-token GLM-5 step's 1.19 GB activation peak on the H200). index_put_'s deterministic
accumulation (a sort, then the embedding-backward kernel) did the same in 2.8 ms a chunk there,
33 ms of a 145 ms prompt chunk. Rows never read (padding, pairs of another chunk or rank) may hold
anything, NaN included.

One program per (token, column block): reads the token's k rows of y once; graph-capturable (the
grid depends on shapes only). ``combine_reference``: the same contract in torch (the CPU path).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:   # runtime-only installs: the reference still works
    triton = tl = None

BLOCK = 1024      # columns a program


if triton is not None:
    @triton.jit
    def _combine_kernel(out_ptr, y_ptr, inv_ptr, w_ptr, H, so, sy, K: tl.constexpr, BLOCK: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        hm = h < H
        acc = tl.load(out_ptr + t * so + h, mask=hm, other=0.0).to(tl.float32)
        for k in tl.static_range(K):
            r = tl.load(inv_ptr + t * K + k).to(tl.int64)
            wk = tl.load(w_ptr + t * K + k).to(tl.float32)
            m = hm & ((h * 0 + r) >= 0)                  # a vector mask (r is a scalar)
            v = tl.load(y_ptr + r * sy + h, mask=m, other=0.0).to(tl.float32)
            acc += v * wk
        tl.store(out_ptr + t * so + h, acc.to(out_ptr.dtype.element_ty), mask=hm)


def _check(out: torch.Tensor, y: torch.Tensor, inv: torch.Tensor, w: torch.Tensor) -> None:
    T, H = out.shape
    if inv.dtype != torch.int32 or inv.dim() != 2 or inv.shape[0] != T or tuple(w.shape) != tuple(inv.shape) \
            or y.dim() != 2 or y.shape[1] < H or out.stride(1) != 1 or y.stride(1) != 1:
        raise ValueError(f"combine: out {tuple(out.shape)}, y {tuple(y.shape)}, inv {tuple(inv.shape)} {inv.dtype}, "
                         f"w {tuple(w.shape)}: need (T, H), (rows, >= H) with unit column stride, int32 (T, k), (T, k)")


def combine(out: torch.Tensor, y: torch.Tensor, inv: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """out (T, H) += the weighted rows (module doc), in place; returns out. y (rows, >= H)."""
    _check(out, y, inv, w)
    T, H = out.shape
    if T and H:
        w = w.contiguous()
        _combine_kernel[(T, triton.cdiv(H, BLOCK))](out, y, inv.contiguous(), w, H, out.stride(0), y.stride(0),
                                                    K=inv.shape[1], BLOCK=BLOCK, num_warps=4)
    return out


def combine_reference(out: torch.Tensor, y: torch.Tensor, inv: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """combine in torch: one gather and add per k, in ascending k."""
    _check(out, y, inv, w)
    H = out.shape[1]
    for k in range(inv.shape[1]):
        r = inv[:, k].long()
        rows = y.index_select(0, r.clamp(min=0))[:, :H].to(out.dtype)
        out += torch.where((r >= 0)[:, None], rows * w[:, k, None].to(out.dtype), 0.0)
    return out

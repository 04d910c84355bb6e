"""DSA lightning-indexer scores of one decode token per row over its paged keys, in Triton.

``score[b, t] = fp16(Σ_h w[b, h] · relu(q[b, h] · k_t) · scale)`` for ``t < context_lens[b]``
(key t at ``kidx[block_tables[b, t // bs], t % bs]``), ``-inf`` from ``context_lens[b]`` to the
table's width: (B, W * block_size) float32 holding fp16 values, what runtime/dsa.py's
``topk_positions`` selects from (``paged_scores_reference`` there is the same contract in torch).

Grid (B, W * bs / TN): one program scores TN keys against every indexer head (the heads padded to
>= 16 rows for the dot). Tiles past a row's length only write -inf, so cost follows the real
lengths; shapes and grid depend on the table width alone (graph-capturable). Unlike the torch
reference it never materialises the (B, T, D) gathered keys, which at a 32k-token table and
batch 32 would be half a gigabyte per layer inside a CUDA graph's pool.
"""

from __future__ import annotations

import torch
from exl3tools.kernels.mla_attention import PLANE_DTYPES  # the MLA pool's planes, kidx among them

try:
    import triton
    import triton.language as tl
except ImportError:   # runtime-only installs: runtime.dsa.paged_scores_reference still works
    triton = tl = None

TILE = 32          # 64 x 128 fp32 FMA dot at TN 64 spills ~7 KB a thread on sm_90; TN 32, 8 warps: ~0.2 KB


if triton is not None:
    @triton.jit
    def _scores_kernel(q_ptr, w_ptr, k_ptr, bt_ptr, len_ptr, out_ptr, scale, NH, D, T,
                       s_kb, s_kt, s_bt, HP: tl.constexpr, DP: tl.constexpr, BS: tl.constexpr,
                       TN: tl.constexpr):
        b = tl.program_id(0)
        t = tl.program_id(1) * TN + tl.arange(0, TN)
        L = tl.load(len_ptr + b)
        out = out_ptr + b.to(tl.int64) * T + t
        if tl.program_id(1) * TN >= L:
            tl.store(out, tl.full([TN], float("-inf"), tl.float32), mask=t < T)
        else:
            h = tl.arange(0, HP)
            hmask = h < NH
            d = tl.arange(0, DP)
            dmask = d < D
            q = tl.load(q_ptr + (b.to(tl.int64) * NH + h)[:, None] * D + d[None, :],
                        mask=hmask[:, None] & dmask[None, :], other=0.0)
            w = tl.load(w_ptr + b.to(tl.int64) * NH + h, mask=hmask, other=0.0)
            tmask = t < L
            blk = tl.load(bt_ptr + b.to(tl.int64) * s_bt + t // BS, mask=tmask, other=0).to(tl.int64)
            k = tl.load(k_ptr + (blk * s_kb + (t % BS).to(tl.int64) * s_kt)[:, None] + d[None, :],
                        mask=tmask[:, None] & dmask[None, :], other=0.0).to(tl.float32)
            logits = tl.dot(q, tl.trans(k), input_precision="ieee")             # (HP, TN)
            s = tl.sum(tl.maximum(logits, 0.0) * w[:, None], 0) * scale
            s = s.to(tl.float16).to(tl.float32)
            tl.store(out, tl.where(tmask, s, float("-inf")), mask=t < T)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def paged_scores(q: torch.Tensor, w: torch.Tensor, kidx: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q (B, H_i, D) and w (B, H_i) float32, kidx (num_blocks, block_size, D) in the pool's dtype
    (fp32, fp16 or bf16, read as fp32), tables (B, W) int32, context_lens (B,) int32: scores
    (B, W * block_size) float32 (module doc)."""
    if triton is None:
        raise RuntimeError("paged_scores needs triton (runtime.dsa.paged_scores_reference does not)")
    B, NH, D = q.shape
    if (q.dtype, w.dtype) != (torch.float32,) * 2 or kidx.dtype not in PLANE_DTYPES or tuple(w.shape) != (B, NH) \
            or kidx.dim() != 3 or kidx.shape[2] != D or kidx.stride(2) != 1:
        raise ValueError(f"q {tuple(q.shape)}, w {tuple(w.shape)}, kidx {tuple(kidx.shape)} {kidx.dtype}: need "
                         "float32 (B, H, D), (B, H) and (num_blocks, block_size, D) in fp32, fp16 or bf16")
    if block_tables.dtype != torch.int32 or block_tables.shape[0] != B or block_tables.stride(1) != 1 \
            or context_lens.dtype != torch.int32 or tuple(context_lens.shape) != (B,):
        raise ValueError("block_tables must be int32 (B, W) with contiguous rows, context_lens int32 (B,)")
    bs = kidx.shape[1]
    T = block_tables.shape[1] * bs
    q, w = q.contiguous(), w.contiguous()
    out = torch.empty(B, T, device=q.device, dtype=torch.float32)
    if B == 0 or T == 0:
        return out
    _scores_kernel[(B, triton.cdiv(T, TILE))](
        q, w, kidx, block_tables, context_lens, out, float(scale), NH, D, T,
        kidx.stride(0), kidx.stride(1), block_tables.stride(0),
        HP=max(16, _pow2(NH)), DP=max(16, _pow2(D)), BS=bs, TN=TILE, num_warps=8)
    return out

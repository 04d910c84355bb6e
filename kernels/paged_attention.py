"""PLACEHOLDER (replaced by the Triton kernel branch): paged decode attention, torch reference."""

from __future__ import annotations

import torch


def paged_decode_reference(q, k_cache, v_cache, block_tables, context_lens, scale, *, num_splits=None, out=None):
    B, nq, D = q.shape
    nb, bs, nkv, _ = k_cache.shape
    L = block_tables.shape[1] * bs
    slots = (block_tables.long()[:, :, None] * bs + torch.arange(bs, device=q.device)).reshape(B, L)
    k = k_cache.reshape(nb * bs, nkv, D)[slots].float()          # (B, L, nkv, D)
    v = v_cache.reshape(nb * bs, nkv, D)[slots].float()
    g = nq // nkv
    qg = q.float().view(B, nkv, g, D)
    s = torch.einsum("bhgd,blhd->bhgl", qg, k) * scale
    valid = torch.arange(L, device=q.device)[None, :] < context_lens[:, None]
    s = s.masked_fill(~valid[:, None, None, :], float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)
    o = torch.einsum("bhgl,blhd->bhgd", p, v.masked_fill(~valid[:, :, None, None], 0.0)).reshape(B, nq, D)
    if out is not None:
        out.copy_(o)
        return out
    return o


paged_decode = paged_decode_reference

"""DSA lightning indexer (GLM-5 / DeepSeek-V3.2 on MLA): per query, keep the index_topk best keys.

Semantics of exllamav3 1.6.5 (modules/mla_attn.py ``_indexer_keys``/``_indexer_topk``,
attention_fn/dsa_triton.py ``_dsa_indexer_kernel``, exllamav3_ext/dsa_topk.cu):

- keys  ``k = rope(LayerNorm(wk(x)))`` (LayerNorm with bias, eps 1e-6), one key per token, cached;
- queries ``q = rope(wq_b(q_resid))`` with ``q_resid = rmsnorm(q_a(x))`` of the MLA layer, H_i heads;
- rope: the same interleaved (GPT-J) table as the main attention, on the FIRST qk_rope_head_dim dims;
- ``score[r, s] = sum_h w[r, h] * relu(q[r, h] . k[s]) * D_i**-0.5 * H_i**-0.5``, ``w = weights_proj(x)``;
  ``-inf`` past the causal bound; scores are stored as fp16 before the selection;
- selection: the ``min(index_topk, visible)`` largest finite scores; ties at the threshold are taken
  in ascending key index (radix select + ordered compaction in dsa_topk.cu).

exllamav3 keeps q, k and w in fp16 too; we round them to fp16 as it does, so the discrete choice
lands on the same side of near-ties as often as possible (the selection is all that depends on it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from exl3tools.runtime.mla import rope_gptj


def _fp16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float16).to(torch.float32)


class Indexer:
    def __init__(self, *, wq_b, wk: torch.Tensor, k_norm_w: torch.Tensor, k_norm_b: torch.Tensor,
                 weights_proj: torch.Tensor, n_heads: int, head_dim: int, rope_dim: int, topk: int,
                 rope_params: tuple, eps: float = 1e-6):
        self.wq_b = wq_b
        self.wk, self.wproj = wk.float(), weights_proj.float()        # HF (out, in)
        self.kn_w, self.kn_b, self.eps = k_norm_w.float(), k_norm_b.float(), eps
        self.nh, self.hd, self.rd, self.topk = n_heads, head_dim, rope_dim, topk
        self.inv_freq, self.attn_factor = rope_params[0], rope_params[1]
        self.scale = head_dim ** -0.5 * n_heads ** -0.5
        self.last_selection: torch.Tensor | None = None   # (n, L) bool, for tests and diagnostics

    def _rope_front(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        r = rope_gptj(x[..., :self.rd], pos, self.inv_freq, self.attn_factor)
        return torch.cat([r, x[..., self.rd:]], dim=-1)

    def _to(self, dev: torch.device) -> None:
        if self.wk.device != dev:
            for name in ("wk", "wproj", "kn_w", "kn_b", "inv_freq"):
                setattr(self, name, getattr(self, name).to(dev))

    def keys(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Roped indexer keys of the new rows (T, D_i): what the cache stores (plane ``kidx``)."""
        self._to(x.device)
        k = _fp16(x @ self.wk.t())
        k = _fp16(F.layer_norm(k, (self.hd,), self.kn_w, self.kn_b, self.eps))
        return _fp16(self._rope_front(k, pos))

    def scores(self, x: torch.Tensor, q_resid: torch.Tensor, pos: torch.Tensor, keys: torch.Tensor,
               pos0: int) -> torch.Tensor:
        """fp16-rounded scores (n, L) of n query rows at positions pos0.. against every cached key."""
        n = x.shape[0]
        q = _fp16(self.wq_b(q_resid)).view(n, self.nh, self.hd)
        q = _fp16(self._rope_front(q, pos))
        w = _fp16(x @ self.wproj.t())                                            # (n, H_i)
        logits = torch.einsum("nhd,ld->nhl", q, keys)
        s = (F.relu(logits) * w[:, :, None]).sum(1) * self.scale
        L = keys.shape[0]
        dev = s.device
        visible = torch.arange(L, device=dev)[None, :] < (torch.arange(n, device=dev)[:, None] + pos0 + 1)
        s = s.masked_fill(~visible, float("-inf"))
        return _fp16(s)

    def select(self, x, q_resid, pos, keys, pos0) -> torch.Tensor:
        """Boolean keep mask (n, L): each row's top-k finite scores, ties by ascending index."""
        s = self.scores(x, q_resid, pos, keys, pos0)
        n, L = s.shape
        k = min(self.topk, L)
        order = torch.sort(s, dim=-1, descending=True, stable=True).indices[:, :k]
        keep = torch.zeros(n, L, dtype=torch.bool, device=s.device)
        keep.scatter_(1, order, True)
        keep &= torch.isfinite(s)
        self.last_selection = keep
        return keep

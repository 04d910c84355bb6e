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

from exl3tools.runtime.layers import causal_mask
from exl3tools.runtime.mla import as_blocks
from exl3tools.runtime.mla_rope import rope_gptj

# A prompt chunk's indexer logits are (rows, heads, L) float32, several copies: at a 30k history a
# 2048-row chunk took 7.9 GB a copy and ran the H200 out of memory inside serve's KV budget (the
# startup's activation measure sees no history). ``select`` takes its rows in groups of this size.
SCORE_BYTES = 128 * 2**20


def _fp16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float16).to(torch.float32)


class Indexer:
    def __init__(self, *, wq_b, wk: torch.Tensor, k_norm_w: torch.Tensor, k_norm_b: torch.Tensor,
                 weights_proj: torch.Tensor, n_heads: int, head_dim: int, rope_dim: int, topk: int,
                 rope_params: tuple, eps: float = 1e-6):
        self.wq_b = wq_b
        # HF (out, in); one tensor, so that the decode step projects keys and head weights in one
        # GEMM (write_keys), wk and wproj views into it
        self.kn_w, self.kn_b, self.eps = k_norm_w.float(), k_norm_b.float(), eps
        self.nh, self.hd, self.rd, self.topk = n_heads, head_dim, rope_dim, topk
        self.wkw = torch.cat([wk.float(), weights_proj.float()])
        self._views()
        self.inv_freq, self.attn_factor = rope_params[0], rope_params[1]
        self.scale = head_dim ** -0.5 * n_heads ** -0.5
        self.last_selection: torch.Tensor | None = None   # (n, L) bool, for tests and diagnostics

    def _rope_front(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        r = rope_gptj(x[..., :self.rd], pos, self.inv_freq, self.attn_factor)
        return torch.cat([r, x[..., self.rd:]], dim=-1)

    def _views(self) -> None:
        self.wk, self.wproj = self.wkw[:self.hd], self.wkw[self.hd:]

    def _to(self, dev: torch.device) -> None:
        if self.wkw.device != dev:
            for name in ("wkw", "kn_w", "kn_b", "inv_freq"):
                setattr(self, name, getattr(self, name).to(dev))
            self._views()

    def keys(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Roped indexer keys of the new rows (T, D_i): what the cache stores (plane ``kidx``)."""
        self._to(x.device)
        k = _fp16(x @ self.wk.t())
        k = _fp16(F.layer_norm(k, (self.hd,), self.kn_w, self.kn_b, self.eps))
        return _fp16(self._rope_front(k, pos))

    def write_keys(self, x: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor, plane: torch.Tensor,
                   rope_cs: tuple | None = None) -> torch.Tensor | None:
        """``keys`` of the new rows into the paged ``plane`` at ``slots``. ``rope_cs``: the step's
        RoPE table for this indexer's RoPE (runtime/fused_step.py FusedMlaStep): the roundings,
        norm, RoPE and write as one kernel (kernels/fused_mla.index_key_store), after one GEMM
        that projects the head weights too; those (n, H_i) weights, not yet rounded to fp16
        (the score kernels round them), are returned for ``select_paged``, else None."""
        if rope_cs is None:
            plane.index_copy_(0, slots, self.keys(x, pos).to(plane.dtype))
            return None
        from exl3tools.kernels import fused_mla
        from exl3tools.runtime import preview

        self._to(x.device)
        both = preview.switched_on("dsa_fused_select")        # "0": the weights' own GEMM (queries)
        proj = x @ (self.wkw if both else self.wk).t()
        fused_mla.index_key_store(proj[:, :self.hd], self.kn_w, self.kn_b, self.eps, self.rd, *rope_cs, slots, plane)
        return proj[:, self.hd:] if both else None

    def queries(self, x: torch.Tensor, q_resid: torch.Tensor, pos: torch.Tensor,
                rope_cs: tuple | None = None, w: torch.Tensor | None = None,
                qraw: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """fp16-rounded roped queries (n, H_i, D_i) and head weights (n, H_i) of n rows; with the
        step's RoPE table ``rope_cs`` the queries' roundings and RoPE as one kernel
        (kernels/fused_mla.index_queries). ``w``: the head weights ``write_keys`` projected,
        handed back unrounded (every score function rounds them); ``qraw``: wq_b(q_resid) made
        already (with rope_cs: the decode step groups it with the MLA layer's q_b)."""
        n = x.shape[0]
        if rope_cs is not None:
            from exl3tools.kernels import fused_mla

            q = fused_mla.index_queries(self.wq_b(q_resid) if qraw is None else qraw, self.nh, self.hd, self.rd,
                                        *rope_cs)
        else:
            q = _fp16(self.wq_b(q_resid)).view(n, self.nh, self.hd)
            q = _fp16(self._rope_front(q, pos))
        return q, (_fp16(x @ self.wproj.t()) if w is None else w)

    def scores(self, x: torch.Tensor, q_resid: torch.Tensor, pos: torch.Tensor, keys: torch.Tensor,
               pos0: int) -> torch.Tensor:
        """fp16-rounded scores (n, L) of n query rows at positions pos0.. against every cached key."""
        n = x.shape[0]
        q, w = self.queries(x, q_resid, pos)
        logits = torch.einsum("nhd,ld->nhl", q, keys)
        s = (F.relu(logits) * w[:, :, None]).sum(1) * self.scale
        s = s.masked_fill(~causal_mask(n, pos0, keys.shape[0], s.device), float("-inf"))
        return _fp16(s)

    def select(self, x, q_resid, pos, keys, pos0, *, positions: bool = False) -> torch.Tensor:
        """Boolean keep mask (n, L): each row's top-k finite scores, ties by ascending index.
        ``positions``: the same choice as (n, min(topk, L)) int32 key positions, -1 for an unused
        entry (kernels/mla_attention.py's ``sel``). Rows go in groups whose (rows, heads, L)
        float32 logits fit SCORE_BYTES."""
        n, L = x.shape[0], keys.shape[0]
        k = min(self.topk, L)
        keep = torch.zeros(n, L, dtype=torch.bool, device=x.device)
        sel = torch.empty(n, k, dtype=torch.int32, device=x.device) if positions else None
        step = max(1, SCORE_BYTES // (self.nh * L * 4))
        for r0 in range(0, n, step):
            r = slice(r0, min(n, r0 + step))
            s = self.scores(x[r], None if q_resid is None else q_resid[r], pos[r], keys, pos0 + r0)
            order = torch.sort(s, dim=-1, descending=True, stable=True).indices[:, :k]
            keep[r].scatter_(1, order, True)
            keep[r] &= torch.isfinite(s)
            if sel is not None:
                sel[r] = torch.where(torch.isfinite(s.gather(1, order)), order, -1).to(torch.int32)
        self.last_selection = keep
        return keep if sel is None else sel

    def select_kernels(self, x, q_resid, pos, keys, pos0, score_fn, topk_fn, block: int = 64, *,
                       positions: bool = False) -> torch.Tensor:
        """``select`` through the decode step's kernels (``score_fn``/``topk_fn`` as in
        ``select_paged``, None: their torch references): ``keys`` (L, D_i) padded into one table of ``block``-key blocks that
        every row shares, each row its own causal length. The same mask (``positions``: the same
        (n, min(topk, L)) positions, in another order within a row) as ``select`` up to the
        scores' summation order, without the (rows, heads, L) float32 logits or a sort: row groups
        of SCORE_BYTES of float32 scores, where ``select`` needs (rows, heads, L) of them (at a
        30k history 2 groups of a 2048-row chunk, not 60). ``block`` is fixed so that the kernels
        compile once, not once per history length."""
        self._to(x.device)
        n, L = x.shape[0], keys.shape[0]
        # the cache hands the history back in float32, which the score kernel reads on its FMA
        # path; the keys are fp16 values (``keys`` rounds them), so fp16 is exact and takes the
        # tensor-core dots
        plane = as_blocks(keys.half() if keys.is_cuda and keys.dtype == torch.float32 else keys, block)
        nb = plane.shape[0]
        table = torch.arange(nb, dtype=torch.int32, device=x.device)
        K = min(self.topk, L)
        if positions:
            out = torch.empty(n, K, dtype=torch.int32, device=x.device)
        else:
            out = torch.zeros(n, nb * block + 1, dtype=torch.bool, device=x.device)   # + a column for -1
        step = max(1, SCORE_BYTES // (nb * block * 4))
        for r0 in range(0, n, step):
            r = slice(r0, min(n, r0 + step))
            q, w = self.queries(x[r], None if q_resid is None else q_resid[r], pos[r])
            m = q.shape[0]
            ctx = torch.arange(pos0 + r0 + 1, pos0 + r0 + m + 1, dtype=torch.int32, device=x.device)
            sel = self._select(q, w, plane, table.expand(m, nb), ctx, score_fn, topk_fn)
            if positions:
                # (m, min(topk, padded width)): a row sees at most L keys, so its chosen positions
                # (and a short row's 0 .. ctx - 1) sit in the first K columns
                out[r] = sel[:, :K]
            else:
                out[r].scatter_(1, torch.where(sel >= 0, sel, nb * block).long(), True)
        if positions:
            return out
        keep = out[:, :L]
        self.last_selection = keep
        return keep

    def select_paged(self, x: torch.Tensor, q_resid: torch.Tensor, pos: torch.Tensor, kidx: torch.Tensor,
                     tables: torch.Tensor, ctx: torch.Tensor, score_fn=None, topk_fn=None,
                     rope_cs: tuple | None = None, w: torch.Tensor | None = None,
                     qraw: torch.Tensor | None = None) -> torch.Tensor:
        """``select`` for one decode token per row over the paged key plane (the fixed-shape step:
        device ops only). ``kidx`` (num_blocks, block_size, D_i); row b's keys are positions
        ``< ctx[b]`` through ``tables[b]``. Returns the attended positions (B, min(topk, width))
        int32, -1 for none (kernels/mla_attention.py's ``sel``). ``rope_cs``, ``w``, ``qraw``: as
        ``queries``."""
        self._to(x.device)
        q, w = self.queries(x, q_resid, pos, rope_cs, w, qraw)
        return self._select(q, w, kidx, tables, ctx, score_fn, topk_fn)

    def _select(self, q, w, kidx, tables, ctx, score_fn, topk_fn) -> torch.Tensor:
        """The top-k positions of the scores of queries ``q`` / head weights ``w`` over paged keys:
        the Triton pair through kernels/dsa_indexer.select (one pass of its top-k fused into the
        scores), else ``score_fn`` then ``topk_fn`` (None: their torch references)."""
        if score_fn is not None and topk_fn is not None:
            from exl3tools.kernels import dsa_indexer

            return dsa_indexer.select(q, w, kidx, tables, ctx, self.scale, self.topk, score_fn, topk_fn)
        s = (score_fn or paged_scores_reference)(q, w, kidx, tables, ctx, self.scale)
        return (topk_fn or topk_positions)(s, ctx, self.topk)


def paged_scores_reference(q: torch.Tensor, w: torch.Tensor, kidx: torch.Tensor, tables: torch.Tensor,
                           ctx: torch.Tensor, scale: float) -> torch.Tensor:
    """fp16-rounded indexer scores (B, W * block_size) of one query per row against its paged keys,
    -inf at and past ``ctx[b]`` (``Indexer.scores`` for a decode row); fixed shapes, no host sync.
    ``w`` is rounded to fp16 here, as the kernels round it (the decode step passes it raw)."""
    w = _fp16(w)
    B, W = tables.shape
    bs = kidx.shape[1]
    T = W * bs
    t = torch.arange(T, device=q.device)
    valid = t[None, :] < ctx.to(torch.int64)[:, None]                            # (B, T)
    blk = torch.where(valid, tables.to(torch.int64).repeat_interleave(bs, 1), 0)
    keys = kidx.reshape(-1, kidx.shape[2])[blk * bs + t % bs].float()              # (B, T, D_i)
    keys = torch.where(valid[..., None], keys, 0.0)
    logits = torch.einsum("bhd,btd->bht", q, keys)
    s = (F.relu(logits) * w[:, :, None]).sum(1) * scale
    return _fp16(s.masked_fill(~valid, float("-inf")))


def topk_positions(s: torch.Tensor, ctx: torch.Tensor, topk: int) -> torch.Tensor:
    """Indexer.select's choice as position lists, device ops only: rows with ``ctx > topk`` keep
    their ``topk`` best finite scores, ties in ascending position (one int64 key per entry: the
    fp16 score's order, then the position reversed, so topk has no ties to break); other rows
    keep positions ``0 .. ctx - 1``. (B, min(topk, T)) int32, -1 for an unused entry."""
    B, T = s.shape
    K = min(int(topk), T)
    idx = torch.arange(T, device=s.device)
    bits = s.to(torch.float16).view(torch.int16).to(torch.int64)
    mag = bits & 0x7FFF
    order = torch.where(bits < 0, -mag, mag)                    # monotone in the value; -0 == +0
    # unsorted: attention is order-free, and the sort after the selection cost as much as the
    # selection (radix sort ~30 us a layer at 4k contexts on the H200, bench/gpu_all.sh profile)
    top = torch.topk(order * (1 << 32) + (T - 1 - idx), K, dim=1, sorted=False).indices
    keep = torch.isfinite(s.gather(1, top))
    lens = ctx.to(torch.int64)[:, None]
    dense = torch.where(idx[None, :K] < lens, idx[None, :K], -1)
    return torch.where(lens > topk, torch.where(keep, top, -1), dense).to(torch.int32)

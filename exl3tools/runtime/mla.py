"""Multi-head latent attention (DeepSeek-V3, GLM-5) over a latent cache, float32 on CPU.

Semantics follow exllamav3 1.6.5 (modules/mla_attn.py):

- queries: ``q_b(rmsnorm(q_a(x)))`` (or ``q_proj(x)`` without q_lora), per head ``[nope | rope]``;
- latent: ``kv_a_proj_with_mqa(x)`` (576 real columns of 640 stored) = ``[c_kv (kv_lora) | k_pe (rope)]``;
  the cache keeps ``rmsnorm(c_kv)`` and the roped ``k_pe`` (one shared rope key, MQA style);
- RoPE is GPT-J style (interleaved pairs ``(2i, 2i+1)``) on the rope slice only, with YaRN
  frequencies and the DeepSeek ``mscale / mscale_all_dim`` factor on cos/sin when configured;
- ``kv_b_proj`` (fp16, HF ``(H*(nope+v), kv_lora)``) is absorbed: ``W_UK`` folds into the query
  and ``W_UV`` into the output, so per-head K/V are never materialised;
- softmax scale ``(nope + rope) ** -0.5``, times ``mscale(factor, mscale_all_dim) ** 2`` under YaRN.

Heads are local to this rank (q_b column-cut, kv_b rows and o_proj row-cut by whole heads); the
latent side (q_a, kv_a, norms, cache, DSA indexer) is replicated on every rank, because the latent
is shared by all heads. ``reduce`` (the TP all-reduce when heads are cut) sums the o_proj partials.
"""

from __future__ import annotations

import os

import torch

from exl3tools.errors import UnsupportedArchitectureError
from exl3tools.kernels import mla_absorb
from exl3tools.runtime import preview
from exl3tools.runtime.layers import causal_mask
from exl3tools.runtime.mla_rope import rope_gptj
from exl3tools.runtime.mla_spans import FreshPrompts, ShortRows, fresh_prompts, short_rows

CACHE_CKV, CACHE_KPE, CACHE_KIDX = "ckv", "kpe", "kidx"
# Prompts of at least SDPA_MIN_ROWS rows attend through decompressed K/V and torch's fused attention
# on CUDA (MLAttention.attend_decompressed), in PREFILL_DTYPE (fp16 as exllamav3 computes); shorter
# spans (decode, verify rows) keep the absorbed float32 einsums, cheaper when n is small. The CPU
# keeps the einsums (the exact reference) unless SDPA_ON_CPU (tests: then in float32).
SDPA_MIN_ROWS = 32
PREFILL_DTYPE = torch.float16
SDPA_ON_CPU = False
DECOMPRESS_BYTES = 256 * 2**20     # decompressed K/V per head group (attend_decompressed)
# The prompt attention's kernels on CUDA: not cuDNN's, which torch picked first and which builds a
# plan for every new shape (batch, prompt length) on first use: served 8-stream prompts waited
# 200 ms a step for it on the H200 (2026-12-02). Math only where both refuse (a test forbids it).
PREFILL_SDPA = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH")
PAD_V_ON_CPU = False   # tests: attend_decompressed's zero-padded V (the mla_flash_pad preview) on the CPU
SELECT_TILE = (32, 64, 8)   # attend_selected's MLA kernel tile on fp16 planes (heads, keys, warps)


def w16_absorb(dev) -> bool:
    """Whether MLA layers on ``dev`` hold W_UK / W_UV in fp16 for kernels/mla_absorb.py (mla_w16:
    the default on CUDA, EXL3TOOLS_MLA_W16=0 opts out; on the CPU under TRITON_INTERPRET=1 when
    "1")."""
    if not preview.on_cuda("mla_w16", dev):
        return False
    from exl3tools.kernels import fused_decode

    return fused_decode.available(dev)


def as_blocks(t: torch.Tensor, block: int) -> torch.Tensor:
    """Rows ``t`` (L, D) as a paged plane (ceil(L / block), block, D), zero-padded at the end: a
    history laid out for the decode step's kernels, with ``arange`` as its block table."""
    L, D = t.shape
    out = t.new_zeros(-(-L // block) * block, D)
    out[:L] = t
    return out.view(-1, block, D)


# ------------------------------------------------------------------ attention
class MLAttention:
    """``__call__(x, batch)`` like runtime.layers.Attention; cache names ``ckv``/``kpe`` (+ ``kidx``).

    ``indexer``: a runtime.dsa.Indexer ("full" layer), or None. ``dsa_shared``: this layer reuses
    the selection the nearest preceding full layer published in ``batch.extras`` ("shared").
    """

    def __init__(self, *, layer_idx: int, n_heads: int, nope: int, rope: int, v_dim: int, kv_lora: int,
                 q_a=None, q_a_norm=None, q_b=None, q_proj=None, kv_a, kv_a_norm, kv_b: torch.Tensor, o,
                 rope_params: tuple[torch.Tensor, float, float], indexer=None, dsa_shared: bool = False,
                 index_topk: int = 0, reduce=None):
        self.reduce = reduce or (lambda t: t)
        self.layer, self.nh, self.nope, self.rope, self.vd, self.kv_lora = layer_idx, n_heads, nope, rope, v_dim, kv_lora
        self.q_a, self.q_a_norm, self.q_b, self.q_proj = q_a, q_a_norm, q_b, q_proj
        self.kv_a, self.kv_a_norm, self.o = kv_a, kv_a_norm, o
        self.inv_freq, self.attn_factor, sm_fold = rope_params
        self.scale = (nope + rope) ** -0.5 * sm_fold
        w = kv_b.float().view(n_heads, nope + v_dim, kv_lora)
        self.w_uk = w[:, :nope, :].contiguous()                    # (H, nope, C)
        self.w_uv = w[:, nope:, :].contiguous()                    # (H, v, C)
        self.indexer, self.dsa_shared = indexer, dsa_shared
        self.index_topk = index_topk if (indexer is not None or dsa_shared) else 0
        self._w16 = None                  # (W_UK, W_UV, W_UV padded, W_K or None) for attend_decompressed

    def cache_spec(self) -> list:
        """Per token: the normed latent, the roped key and (a DSA "full" layer) the indexer key, in
        the pool's dtype: ``--kv-cache-dtype auto`` gives MLA models an fp16 pool on CUDA (kv_pool.kv_dtype_for;
        exllamav3 caches the latent in fp16 too), float32 on the CPU; a rounded key may flip a DSA
        top-k near-tie against the fp32 reference."""
        from exl3tools.runtime.kv_pool import PlaneSpec

        specs = [PlaneSpec(CACHE_CKV, (self.kv_lora,)), PlaneSpec(CACHE_KPE, (self.rope,))]
        if self.indexer is not None:
            specs.append(PlaneSpec(CACHE_KIDX, (self.indexer.hd,)))
        return specs

    def _queries(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.q_proj is not None:
            return self.q_proj(x), None
        q_resid = self.q_a_norm(self.q_a(x))
        return self.q_b(q_resid), q_resid

    def _to(self, dev: torch.device) -> None:
        """Follow the activations' device once (weights are built on CPU by the loader). With
        mla_w16 (the default on CUDA) W_UK and W_UV are held in fp16 there (kv_b's own values; mla_absorb.absorbed)."""
        dt = torch.float16 if w16_absorb(dev) else torch.float32
        if self.w_uk.device != dev or self.w_uk.dtype != dt:
            self.w_uk, self.w_uv, self.inv_freq = self.w_uk.to(dev, dt), self.w_uv.to(dev, dt), self.inv_freq.to(dev)
            if dt == PREFILL_DTYPE:
                # fp16 weights, as CUDA's prompts decompress: the decompression's copies made now and
                # W_UK / W_UV made views of them, held once. Now, not at the first decompression:
                # the decode graphs captured before it read W_UK / W_UV by address, and rebinding
                # them then freed what the graphs read (NaN logits on the H100, 2026-12-07 13:23)
                self._w16 = self._decompress_weights(dev, dt, preview.on_cuda("mla_w16_vt", dev))
                self.w_uk, self.w_uv = self._w16[0], self._w16[1]

    def _decompress_weights(self, dev: torch.device, dt: torch.dtype, v_rows: bool = False) -> tuple:
        """(W_UK, W_UV, W_UV padded to q's head size, W_K or None) in ``dt`` on ``dev`` for
        _sdpa_decompressed; W_UK and W_UV views of the others. With EXL3TOOLS_MLA_K_GEMM (the
        default on CUDA) K comes from one GEMM of [c | r]: W_K (H, nope + rope, C + rope) holds
        W_UK and an identity block from the rope key to K's rope columns, so no cat copies K.
        ``v_rows`` (mla_w16_vt, the default on CUDA): W_UV (padded) stored (H, C, v) and returned as its
        transposed views, v contiguous (the absorbed product's rows as W_UK's)."""
        qk = self.nope + self.rope
        w_uv = self.w_uv.to(dev, dt)
        w_uk, w_k = self.w_uk.to(dev, dt), None
        if preview.on_cuda("mla_k_gemm", dev):
            C = self.kv_lora
            w_k = w_uk.new_zeros(self.nh, qk, C + self.rope)
            w_k[:, :self.nope, :C] = w_uk
            w_k[:, self.nope:, C:] = torch.eye(self.rope, dtype=dt, device=dev)
            w_uk = w_k[:, :self.nope, :C]          # a view: W_UK is not held twice
        w_uv_pad = w_uv
        if v_rows:         # (H, C, qk or v) storage, its transpose the (H, v, C) W_UV as before
            st = w_uv.new_zeros(w_uv.shape[0], w_uv.shape[2], max(qk, self.vd))
            st[:, :, :self.vd] = w_uv.transpose(1, 2)
            w_uv_pad = st.transpose(1, 2)
            w_uv = w_uv_pad[:, :self.vd]
        elif self.vd < qk:   # W_UV a view of the padded one: not held twice (DeepSeek-V3: 17 MB a layer)
            w_uv_pad = torch.cat((w_uv, w_uv.new_zeros(w_uv.shape[0], qk - self.vd, w_uv.shape[2])), 1)
            w_uv = w_uv_pad[:, :self.vd]
        return w_uk, w_uv, w_uv_pad, w_k

    def __call__(self, x: torch.Tensor, batch) -> torch.Tensor:
        T = x.shape[0]
        dev = x.device
        self._to(dev)
        pos = batch.positions.to(dev)
        q, q_resid = self._queries(x)
        q = q.view(T, self.nh, self.nope + self.rope)
        q_nope = q[..., :self.nope]
        q_pe = rope_gptj(q[..., self.nope:], pos, self.inv_freq, self.attn_factor)
        lat = self.kv_a(x)
        ckv = self.kv_a_norm(lat[:, :self.kv_lora])
        kpe = rope_gptj(lat[:, self.kv_lora:self.kv_lora + self.rope], pos, self.inv_freq, self.attn_factor)
        q_lat = None

        def absorbed() -> torch.Tensor:
            """The absorbed queries (T, H, C), made once where a path reads them: a prompt through
            attend_decompressed / attend_fresh does not (a 2048-token chunk's are 256 MiB of
            float32, GLM-5 shape, and ~26 GFLOP a layer)."""
            nonlocal q_lat
            if q_lat is None:
                q_lat = mla_absorb.absorbed(q_nope, self.w_uk)
            return q_lat
        kidx = self.indexer.keys(x, pos) if self.indexer is not None else None

        shared = batch.extras.setdefault("dsa_keep", {})
        out = torch.empty(T, self.nh, self.vd, dtype=torch.float32, device=dev)
        new = {CACHE_CKV: ckv, CACHE_KPE: kpe} | ({} if kidx is None else {CACHE_KIDX: kidx})   # every row, per plane
        decompress = dev.type == "cuda" or SDPA_ON_CPU       # prompts through attend_decompressed / attend_fresh
        # DSA prompt rows over their selected keys only (on CUDA unless "0": runtime/preview.py)
        sparse_rows = decompress and self.index_topk and preview.on_cuda("dsa_sparse_prefill", dev)
        fresh = fresh_prompts(batch, self.index_topk, dev, SDPA_MIN_ROWS) if decompress and batch.spans else None
        if fresh is not None:
            self.attend_fresh(fresh, q_nope, q_pe, new, out)
        # decode and verify rows beside a prompt chunk: one pass of the decode step's kernels (a
        # preview: runtime/preview.py), not a gather of each one's history and four einsums each
        rows = short_rows(batch, dev, fresh, SDPA_MIN_ROWS) if decompress and preview.switched_on("mla_eager_rows") else None
        if rows is not None:
            self.attend_rows(rows, x, q_resid, absorbed(), q_pe, new, out, shared)
        for si, sp in enumerate(batch.spans):
            if (fresh is not None and si in fresh.spans) or (rows is not None and si in rows.spans):
                continue
            r = slice(sp.row, sp.row + sp.n)
            full = sp.cache.extend(self.layer, {name: t[r] for name, t in new.items()})
            cc, kp = full[CACHE_CKV], full[CACHE_KPE]                          # (L, C), (L, rope)
            L = cc.shape[0]
            keep = None
            if self.index_topk and L > self.index_topk:                        # exllamav3: sparse iff
                # the selection as a mask, or as positions for attend_selected (sparse_rows); a
                # "shared" layer finds what the full layer before it published, in the same form
                as_positions = bool(sparse_rows) and sp.n >= SDPA_MIN_ROWS
                if self.indexer is not None:                                   # visible > index_topk
                    keep = self._select(x[r], q_resid[r], pos[r], full[CACHE_KIDX], sp.pos, as_positions)
                    shared[si] = keep
                elif self.dsa_shared:
                    keep = self._shared_selection(shared, si)
                if as_positions:
                    # the history as the pool stores it (fp16 on CUDA: the kernel's tensor-core
                    # dots; extend reads it back in float32, which took its FMA path: 3.2x slower
                    # than the dense path on the H200)
                    dt = sp.cache.pool.planes[self.layer][CACHE_CKV].dtype if hasattr(sp.cache, "pool") else cc.dtype
                    out[r] = self.attend_selected(absorbed()[r], q_pe[r], cc.to(dt), kp.to(dt), keep, sp.pos)
                    continue
            # the (n, L) mask only where it is read: without a selection the fused kernels take the
            # causal bottom-right alignment (the queries are the last n of the L keys) as a bias
            allowed = None if keep is None and decompress and sp.n >= SDPA_MIN_ROWS else causal_mask(sp.n, sp.pos, L, dev)
            if keep is not None:
                allowed &= keep
            if decompress and sp.n >= SDPA_MIN_ROWS:
                # straight into out's rows: no (n, H, v) float32 result beside it (128 MiB at 2048 rows)
                self.attend_decompressed(q_nope[r], q_pe[r], cc, kp, allowed, out=out[r])
                continue
            s = (torch.einsum("thc,lc->htl", absorbed()[r], cc) + torch.einsum("thr,lr->htl", q_pe[r], kp)) * self.scale
            s = s.masked_fill(~allowed[None], float("-inf"))
            p = torch.softmax(s, dim=-1)
            o_lat = torch.einsum("htl,lc->thc", p, cc)
            out[r] = mla_absorb.absorbed(o_lat, self.w_uv, transpose=True)
        return self.reduce(self.o(out.reshape(T, self.nh * self.vd)))

    def attend_decompressed(self, q_nope: torch.Tensor, q_pe: torch.Tensor, cc: torch.Tensor, kp: torch.Tensor,
                            allowed: torch.Tensor | None, out: torch.Tensor | None = None) -> torch.Tensor:
        """The same attention as the absorbed einsums, for many query rows (a prompt): per-head K/V
        decompressed from the latent (``W_UK``, ``W_UV``) and one fused ``scaled_dot_product_attention``
        in 16 bits (flash / memory-efficient kernels; PREFILL_DTYPE). The absorbed form costs
        n * L * H * (C + rope) multiply-adds and an (H, n, L) float32 score tensor (16 GB for a
        2048-token chunk at a 32k context); this one L * H * C * (nope + v) for the decompression
        and 16-bit attention. ``allowed`` (n, L) bool, or None: causal, the n queries being the last
        n keys (bottom-right aligned: a chunk after a cached history, through ``causal_lower_right``
        rather than an (n, L) mask that the memory-efficient kernel reads per head and tile).
        Returns (n, H, v) float32: ``out`` where given (written in place, e.g. rows of the layer's output)."""
        from torch.nn.attention.bias import causal_lower_right

        dt = PREFILL_DTYPE if cc.is_cuda else torch.float32
        # cast before the cat: a float32 copy of every query (128 MiB at 2048 rows, GLM-5) never made
        q = torch.cat((q_nope.to(dt), q_pe.to(dt)), -1).transpose(0, 1)[None]    # (1, H, n, nope + rope)
        n, L = q.shape[2], cc.shape[0]
        mask = allowed[None, None] if allowed is not None else None if n == L else causal_lower_right(n, L)
        if out is None:
            out = torch.empty(n, self.nh, self.vd, dtype=torch.float32, device=q.device)

        def write(h: slice, o: torch.Tensor) -> None:
            out[:, h] = o[0]
        self._sdpa_decompressed(q, cc.to(dt)[None], kp.to(dt)[None], mask, write)
        return out

    def _select(self, x, q_resid, pos, keys, pos0, positions: bool = False) -> torch.Tensor:
        """A prompt span's DSA mask (``positions``: its key positions, ``Indexer.select``): on
        CUDA (unless EXL3TOOLS_DSA_PREFILL_KERNELS=0; on the CPU when "1", through the kernels'
        torch references) through the decode step's score and top-k kernels
        (``Indexer.select_kernels``), else ``Indexer.select`` (float32 logits of every row, head
        and key, then a sort)."""
        if preview.on_cuda("dsa_prefill_kernels", x.device):
            from exl3tools.runtime.paged_decode import mla_attention_fn

            _, score_fn, topk_fn = mla_attention_fn(x.device)
            return self.indexer.select_kernels(x, q_resid, pos, keys, pos0, score_fn, topk_fn, positions=positions)
        return self.indexer.select(x, q_resid, pos, keys, pos0, positions=positions)

    def attend_selected(self, q_lat: torch.Tensor, q_pe: torch.Tensor, cc: torch.Tensor, kp: torch.Tensor,
                        sel: torch.Tensor, pos0: int, block: int = 64) -> torch.Tensor:
        """DSA prompt rows over their selected keys only: each row is one query of the decode
        step's MLA kernel (``mla_attention_fn``: Triton on CUDA, its torch reference elsewhere),
        absorbed ``q_lat`` (n, H, C) and ``q_pe`` (n, H, rope) over the history's latent ``cc``
        (L, C) and rope keys ``kp`` (L, rope), laid out as one table of ``block``-row blocks that
        every row shares (a stride-0 table), row i seeing ``pos0 + i + 1`` keys; ``sel`` (n, K)
        int32 positions, -1 unused (``Indexer.select(positions=True)``). n * K * H * (C + rope)
        multiply-adds whatever the history, where attend_decompressed costs n * L * H * (nope +
        rope + v) plus the decompression. Returns (n, H, v) float32."""
        from exl3tools.runtime.paged_decode import mla_attention_fn

        attend = mla_attention_fn(q_lat.device)[0]
        n = q_lat.shape[0]
        ckv, kpe = as_blocks(cc, block), as_blocks(kp, block)      # the pool's dtype, as the decode step reads it
        table = torch.arange(ckv.shape[0], dtype=torch.int32, device=q_lat.device)[None].expand(n, -1)
        ctx = torch.arange(pos0 + 1, pos0 + n + 1, dtype=torch.int32, device=q_lat.device)
        # fp16 planes: 32 heads x 64 keys a program, 8 warps (the decode step's wide tile): 3.5 ms
        # a GLM-5 layer for a 2048-row chunk on the H200 where 32 x 32 x 8 took 5.4 (a 30000-token
        # prompt 1.95 -> 1.74 s). EXL3TOOLS_MLA_SELECT_TILE="HB,TN,WARPS" tries others (read per
        # call: bench/gpu_prefill.py --long-variants times them in one process)
        from exl3tools.kernels.mla_attention import tile_override

        tile = tile_override(os.environ.get("EXL3TOOLS_MLA_SELECT_TILE"), "EXL3TOOLS_MLA_SELECT_TILE")
        kw = dict(zip(("head_block", "tile_n", "num_warps"), tile or SELECT_TILE, strict=True)) \
            if ckv.dtype == torch.float16 and self.nh >= 32 else {}
        o_lat = attend(q_lat.float().contiguous(), q_pe.float().contiguous(), ckv, kpe, table, ctx,
                       self.scale, sel=sel.contiguous(), **kw)
        return mla_absorb.absorbed(o_lat, self.w_uv, transpose=True)

    def attend_rows(self, rows: ShortRows, x: torch.Tensor, q_resid: torch.Tensor, q_lat: torch.Tensor,
                    q_pe: torch.Tensor, new: dict[str, torch.Tensor], out: torch.Tensor, shared: dict) -> None:
        """Short spans (decode and verify rows) of an eager step as rows of the decode step's
        attention (``decode_static``'s, through ``paged_decode.mla_attention_fn``): their latent
        written at their slots, DSA's selection by the paged scores and top-k where a row sees more
        than index_topk keys (a "shared" layer reuses the full layer's), absorbed queries over the
        blocks. The per-span loop gathers each row's whole history per layer and runs four einsums
        and a mask: ~48 torch calls per sequence and layer (counted on the CPU fixtures), so ~120k
        for a step beside 32 decoding sequences on a 78-layer GLM-5. Writes the rows of
        ``rows.rows`` of ``out``."""
        from exl3tools.runtime.paged_decode import mla_attention_fn

        planes = rows.pool.planes[self.layer]
        for name, t in new.items():
            planes[name].index_copy_(0, rows.slots, t.index_select(0, rows.rows).to(planes[name].dtype))
        for cache, n in rows.lengths:
            cache.lengths[self.layer] += n
        r = rows.rows
        out.index_copy_(0, r, self._attend_paged(
            x.index_select(0, r), q_resid.index_select(0, r), q_lat.index_select(0, r).contiguous(),
            q_pe.index_select(0, r).contiguous(), rows.positions, rows.pool, rows.tables, rows.ctx,
            rows.longest > self.index_topk, shared, "rows", mla_attention_fn(x.device)))

    def _attend_paged(self, x, q_resid, q_lat, q_pe, pos, pool, tables, ctx, sparse: bool, shared: dict, key,
                      fns, rope_cs: tuple | None = None, index_w: torch.Tensor | None = None,
                      index_q: torch.Tensor | None = None) -> torch.Tensor:
        """Rows (their latent already in ``pool``) through the decode step's kernels ``fns`` =
        (MLA attention, DSA scores, DSA top-k): a DSA full layer selects when ``sparse`` (some row
        sees more than index_topk keys) and publishes its selection in ``shared[key]`` for the
        shared layers after it. (rows, H, v) float32 (decode_static, attend_rows). ``rope_cs``: the
        fused step's RoPE table (decode_static), for the indexer's queries; ``index_w``: the head
        weights the indexer's ``write_keys`` projected with its keys, ``index_q`` its query projection
        made beside q_b's (Indexer.queries)."""
        attend, score_fn, topk_fn = fns
        sel = None
        if self.index_topk and sparse:                # else every row keeps all its keys
            if self.indexer is not None:
                sel = self.indexer.select_paged(x, q_resid, pos, pool.blocks(self.layer, CACHE_KIDX), tables, ctx,
                                                score_fn, topk_fn, rope_cs=self._index_rope(rope_cs), w=index_w,
                                                qraw=index_q)
                shared[key] = sel
            elif self.dsa_shared:
                sel = self._shared_selection(shared, key)
        o_lat = attend(q_lat, q_pe, pool.blocks(self.layer, CACHE_CKV), pool.blocks(self.layer, CACHE_KPE),
                       tables, ctx, self.scale, sel=sel)
        return mla_absorb.absorbed(o_lat, self.w_uv, transpose=True)

    def _shared_selection(self, shared: dict, key):
        """A "shared" DSA layer's selection: what the full layer before it published under ``key``."""
        sel = shared.get(key)
        if sel is None:
            raise UnsupportedArchitectureError(f"layer {self.layer}: shared DSA layer found no selection from a full layer")
        return sel

    def attend_fresh(self, fresh: FreshPrompts, q_nope: torch.Tensor, q_pe: torch.Tensor,
                     new: dict[str, torch.Tensor], out: torch.Tensor) -> None:
        """Several new prompts (no history) in one pass instead of one ``extend`` + one
        ``attend_decompressed`` per sequence (an eager step of 8 x 32 tokens on the GLM-5 shape:
        66 -> 45 ms on the H200, 1766 -> 843 launches): their rows go into their cache slots in one
        write per plane, and attend as a (prompts, longest) batch padded at the end under
        ``is_causal``, where a real query never sees a padded key. Writes the rows of
        ``fresh.dst`` of ``out``; ``new``: this step's planes for every row of the batch."""
        planes = fresh.pool.planes[self.layer]
        for name, t in new.items():
            planes[name].index_copy_(0, fresh.slots, t.index_select(0, fresh.dst).to(planes[name].dtype))
        for cache, n in fresh.lengths:
            cache.lengths[self.layer] = n
        dt = PREFILL_DTYPE if q_nope.is_cuda else torch.float32
        B, m = fresh.gather.shape
        g = fresh.gather.reshape(-1)

        def rows(t: torch.Tensor, stored: torch.dtype | None = None) -> torch.Tensor:
            # rounded before the gather: no float32 copy of the padded rows (the queries: 2 x 128 MiB
            # at 2048 rows, GLM-5 shape)
            t = (t if stored is None else t.to(stored)).to(dt).index_select(0, g)
            return t.view(B, m, *t.shape[1:])
        # K/V from the latent as stored (rounded to the pool's dtype), as the per-sequence path reads it
        c, r = rows(new[CACHE_CKV], planes[CACHE_CKV].dtype), rows(new[CACHE_KPE], planes[CACHE_KPE].dtype)
        q = torch.cat((rows(q_nope), rows(q_pe)), -1).transpose(1, 2)           # (B, H, m, nope + rope)

        def write(h: slice, o: torch.Tensor) -> None:
            """A head group's (B, m, heads, v) 16-bit result into out's rows, prompt by prompt (each
            one's rows are adjacent in the batch): no (rows, H, v) float32 copy of the whole."""
            for b, (row, n) in enumerate(fresh.rows):
                out[row:row + n, h].copy_(o[b, :n])
        self._sdpa_decompressed(q, c, r, None, write)

    def _sdpa_decompressed(self, q: torch.Tensor, c: torch.Tensor, r: torch.Tensor,
                           mask: torch.Tensor | None, write) -> None:
        """(B, H, n, nope + rope) queries over (B, L, C) latents and (B, L, rope) keys, all in one
        16-bit (or float32) dtype; ``mask`` broadcast to (B, H, n, L), a ``CausalBias``, or None:
        causal with the queries at the start (n == L). ``write(heads, o)`` takes each head group's
        (B, n, heads, v) 16-bit result as it comes (the callers put it into their float32 rows)."""
        from torch.nn.attention.bias import CausalBias

        dt = q.dtype
        qk = self.nope + self.rope
        # flash attention takes one head size for q, k and v (DeepSeek-V3: 192 and 128, so it got
        # the memory-efficient kernel): V decompressed with zero columns up to q's size, where no
        # (n, L) mask rules flash out anyway (EXL3TOOLS_MLA_FLASH_PAD=0 opts out, runtime/preview.py)
        pad = (self.vd < qk <= 256 and (mask is None or isinstance(mask, CausalBias))
               and (q.is_cuda or PAD_V_ON_CPU) and preview.switched_on("mla_flash_pad"))
        kgemm = preview.on_cuda("mla_k_gemm", q.device)     # K from one GEMM (_decompress_weights)
        if (self._w16 is None or self._w16[0].device != q.device or self._w16[0].dtype != dt
                or (kgemm and self._w16[3] is None)):
            # copies of their own: W_UK / W_UV are never rebound here (a captured graph reads them)
            self._w16 = self._decompress_weights(q.device, dt)
        w_uk, w_uv, w_k = self._w16[0], self._w16[2 if pad else 1], self._w16[3] if kgemm else None
        vd = w_uv.shape[1]
        B, L = c.shape[0], c.shape[1]
        # heads in groups whose decompressed K/V fit DECOMPRESS_BYTES (a 128k history is 128 MB a
        # GLM-5 head): the transient stays bounded whatever the context, which the startup's
        # activation measure (a prompt without history) cannot see
        per_head = B * L * (qk + vd) * c.element_size()
        g = max(1, min(self.nh, DECOMPRESS_BYTES // max(per_head, 1)))
        cr = torch.cat((c, r), -1) if w_k is not None else None      # (B, L, C + rope), once
        for h0 in range(0, self.nh, g):
            h = slice(h0, min(h0 + g, self.nh))
            if w_k is not None:
                k = torch.einsum("blc,hnc->bhln", cr, w_k[h])
            else:
                k = torch.cat((torch.einsum("blc,hnc->bhln", c, w_uk[h]),
                               r[:, None].expand(B, h.stop - h0, L, self.rope)), -1)
            v = torch.einsum("blc,hvc->bhlv", c, w_uv[h])
            # 4-D: the flash and memory-efficient kernels take nothing else; 3-D inputs fall back
            # to the math path, which widens to fp32 and materialises the scores (H200 profile of a
            # 2048-token GLM-5 prompt: 56 of 164 ms)
            with _prefill_kernels(q.device):
                o = torch.nn.functional.scaled_dot_product_attention(
                    q[:, h], k, v, attn_mask=mask, is_causal=mask is None, scale=self.scale)
            write(h, o[..., :self.vd].transpose(1, 2))

    # ------------------------------------------------------------------ fixed-shape decode step
    def decode_static(self, x: torch.Tensor, st, rope_cs: tuple | None = None, project=None) -> torch.Tensor:
        """One decode token per row of ``x`` (B, hidden; already normed) with device ops only and
        shapes fixed by B and the table width (runtime/paged_decode.py's CUDA-graph step). ``st``:
        positions, slots, tables, ctx (int32, this token included), pool, mla_attend (kernels/
        mla_attention.py's contract) and a per-step ``extras`` dict (a full DSA layer publishes its
        selection there for the "shared" layers after it). The same result as ``__call__``.
        ``rope_cs``: the step's (cos, sin) scaled by attn_factor (runtime/fused_step.py FusedMlaStep):
        the q_a norm, the queries' RoPE, the latent's norm, RoPE and cache writes and a DSA layer's
        key store and queries then run as kernels/fused_mla.py's kernels instead of ~36-66 torch ops;
        ``project(owner, linears, x)`` (FusedGqaStep._project): the two projections that read x
        (q_a or q_proj, and kv_a) as one grouped call."""
        B = x.shape[0]
        self._to(x.device)
        pos = st.positions
        planes = st.pool.planes[self.layer]
        index_q = None
        if rope_cs is not None:
            # a DSA full layer that selects this step: its indexer's query projection (wq_b reads
            # q_resid too) rides in q_b's grouped call
            selects = bool(self.index_topk and st.sparse and self.indexer is not None)
            q, q_resid, q_pe, index_q = self._fused_queries_and_latent(x, st.slots, planes, rope_cs, project,
                                                                       self.indexer if selects else None)
        else:
            q, q_resid = self._queries(x)
            q = q.view(B, self.nh, self.nope + self.rope)
            q_pe = rope_gptj(q[..., self.nope:], pos, self.inv_freq, self.attn_factor).contiguous()
            lat = self.kv_a(x)
            kpe = rope_gptj(lat[:, self.kv_lora:self.kv_lora + self.rope], pos, self.inv_freq, self.attn_factor)
            planes[CACHE_CKV].index_copy_(0, st.slots,
                                          self.kv_a_norm(lat[:, :self.kv_lora]).to(planes[CACHE_CKV].dtype))
            planes[CACHE_KPE].index_copy_(0, st.slots, kpe.to(planes[CACHE_KPE].dtype))
        q_lat = mla_absorb.absorbed(q[..., :self.nope], self.w_uk).contiguous()
        index_w = None
        if self.indexer is not None:
            index_w = self.indexer.write_keys(x, pos, st.slots, planes[CACHE_KIDX], self._index_rope(rope_cs))
        out = self._attend_paged(x, q_resid, q_lat, q_pe, pos, st.pool, st.tables, st.ctx, st.sparse, st.extras,
                                 "dsa_sel", (st.mla_attend, st.dsa_scores, st.dsa_topk), rope_cs, index_w, index_q)
        return self.reduce(self.o(out.reshape(B, self.nh * self.vd)))

    def _fused_queries_and_latent(self, x, slots, planes, rope_cs, project, indexer=None):
        """decode_static's queries (q, q_resid, q_pe, index_q) and latent cache writes through
        kernels/fused_mla.py, with the step's RoPE table ``rope_cs``. ``indexer`` (a DSA layer
        that selects this step): its wq_b projection of q_resid as ``index_q``, in one grouped
        call with q_b where ``project`` groups (else None: Indexer.queries projects it)."""
        from exl3tools.kernels import fused_decode, fused_mla

        pair = (self.q_proj if self.q_proj is not None else self.q_a, self.kv_a)
        qa, lat = project(self, pair, x) if project is not None else (pair[0](x), pair[1](x))
        index_q = None
        if self.q_proj is not None:
            q, q_resid = qa, None
        else:
            q_resid = fused_decode.residual_rmsnorm(qa.float(), self.q_a_norm.weight, self.q_a_norm.eps)
            if indexer is not None and project is not None:
                q, index_q = project(indexer, (self.q_b, indexer.wq_b), q_resid)
            else:
                q = self.q_b(q_resid)
        q = q.reshape(x.shape[0], self.nh, self.nope + self.rope)
        q_pe = fused_mla.rope_heads(q, self.nope, self.rope, *rope_cs)
        fused_mla.latent_store(lat, self.kv_lora, self.rope, self.kv_a_norm.weight, self.kv_a_norm.eps,
                               *rope_cs, slots, planes[CACHE_CKV], planes[CACHE_KPE])
        return q, q_resid, q_pe, index_q

    def _index_rope(self, rope_cs: tuple | None) -> tuple | None:
        """The step's RoPE table where it fits the indexer's RoPE too (FusedMlaStep shares the
        inv_freq), else None (the indexer's own torch RoPE)."""
        ind = self.indexer
        fits = rope_cs is not None and ind.rd == self.rope and ind.inv_freq is self.inv_freq \
            and ind.attn_factor == self.attn_factor
        return rope_cs if fits else None


def _prefill_kernels(dev: torch.device):
    """sdpa_kernel(PREFILL_SDPA) on CUDA; the CPU keeps torch's choice."""
    import contextlib

    if dev.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([getattr(SDPBackend, b) for b in PREFILL_SDPA])


def has_mla(model) -> bool:
    """Whether any layer of ``model`` is an MLAttention (its KV pool defaults to fp16 on CUDA)."""
    return any(isinstance(layer.attn, MLAttention) for layer in model.layers)

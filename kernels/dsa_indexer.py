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

``topk_select`` then makes ``dsa.topk_positions``' choice (the same set of positions; the order
within a row differs, attention does not depend on it) in one program per row and three passes
over its scores, instead of torch.topk over int64 keys (a radix select of 2-bit digits, ~40 us a
layer at a 4k context on the H200) plus ~10 elementwise kernels to build the keys. Each fp16
score maps to a 16-bit key, monotone in its value (-0 = +0; non-finite scores to 0, never chosen);
pass 1 histograms the keys' high bytes, pass 2 the low bytes within the boundary bin, which fixes
the threshold key and how many of its ties to take; pass 3 writes every position above the
threshold and the first ties in ascending position (Indexer.select's stable order).
``topk_select_chunked`` runs the passes over 2048-score chunks of a row in parallel: pass 2 keeps
each chunk's low-byte histogram, from which pass 3 derives where the chunk's positions go. ``select``
(the decode step's) has the tensor-core scores kernel make pass 1 on the scores it holds.

``paged_scores(tensor_cores=True)`` on an fp16 key plane (the CUDA default for MLA) runs
``_scores_tc_kernel`` instead of the scores kernel above: each program loads the fp16 queries once
and scores TC_TILES tiles of TC_TN keys with fp16 tensor-core dots (fp32 accumulation; the
products of fp16 values are exact in fp32, so only the query's rounding and the summation order
differ from the fp32 FMA dot). The FMA kernel reloads the float32 queries (16-32 KB, four times
the keys' bytes) for every 32 keys. On the H200 (2026-12-02, 64 heads): 82 -> 12 us at batch 1 and
a 32k table, 2361 -> 82 us at batch 32, where reading the keys takes 60 us; the decode step takes
it (``paged_scores_tc``) unless EXL3TOOLS_DSA_SCORES_TC=0.
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
TOPK_TILE = 2048   # scores per step of topk_select's passes
TC_TN, TC_TILES = 64, 4   # _scores_tc_kernel: keys per dot, dots per program (256 keys a program)
# From this table width topk_for_width picks topk_select_chunked: one H200 run (bench/gpu_mla_attention.py,
# 64 heads, with the FMA scores, 2026-12-02) timed one program a row 31.6 us at 4k and 188.9 at 32k,
# the chunked kernels 35.3 and 101.1; the top-k alone (bench/gpu_topk.py, later that day) 19.0 and
# 112.6 against 21.9 and 23.1
CHUNKED_MIN_WIDTH = 8192
CHUNK_GROUP = 16   # topk_select_chunked's last pass: the chunks' low histograms read 16 at a time
# topk_select_chunked's chunk and warps a program; 4 warps where the grid has CHUNK_WIDE_PROGRAMS
# programs or more. H200, 2026-12-02 (bench/gpu_topk.py, top-k alone): batch 1 at 4k-202k scores
# 22-25 us with 8 warps (4: 23-28); batch 32 at 32k 41.3 -> 36.8 us with 4 warps, at 131k 114.8 ->
# 88.9, at 202k 166.9 -> 126.1; batch 8 at 131k 40.8 -> 36.4. (Chunks of 512-4096 scores measured
# no better than 2048.) One program a row: 19.0 us at 4k, 112.6 at 32k (hence CHUNKED_MIN_WIDTH).
CHUNK_TILE, CHUNK_WARPS, CHUNK_WIDE_PROGRAMS = TOPK_TILE, 8, 256


if triton is not None:
    @triton.jit
    def _row_queries(q_ptr, w_ptr, b, NH, D, s_w, HP: tl.constexpr, DP: tl.constexpr):
        """Row b's indexer queries (HP, DP) and fp16-rounded head weights (HP,), zero-padded; the
        key columns. (The rounding is Indexer.queries'; the decode step passes the weights raw.)"""
        h = tl.arange(0, HP)
        hmask = h < NH
        d = tl.arange(0, DP)
        dmask = d < D
        q = tl.load(q_ptr + (b.to(tl.int64) * NH + h)[:, None] * D + d[None, :],
                    mask=hmask[:, None] & dmask[None, :], other=0.0)
        w = tl.load(w_ptr + b.to(tl.int64) * s_w + h, mask=hmask, other=0.0)
        return q, w.to(tl.float16).to(tl.float32), d, dmask

    @triton.jit
    def _key_tile(k_ptr, bt_ptr, b, t, tmask, d, dmask, s_kb, s_kt, s_bt, BS: tl.constexpr):
        """Keys at positions t of row b through its block table, in the plane's dtype (0 where masked)."""
        blk = tl.load(bt_ptr + b.to(tl.int64) * s_bt + t // BS, mask=tmask, other=0).to(tl.int64)
        return tl.load(k_ptr + (blk * s_kb + (t % BS).to(tl.int64) * s_kt)[:, None] + d[None, :],
                       mask=tmask[:, None] & dmask[None, :], other=0.0)

    @triton.jit
    def _scores_kernel(q_ptr, w_ptr, k_ptr, bt_ptr, len_ptr, out_ptr, hist_ptr, scale, NH, D, T,
                       s_kb, s_kt, s_bt, s_w, HP: tl.constexpr, DP: tl.constexpr, BS: tl.constexpr,
                       TN: tl.constexpr, HIST: tl.constexpr):
        b = tl.program_id(0)
        t = tl.program_id(1) * TN + tl.arange(0, TN)
        L = tl.load(len_ptr + b)
        out = out_ptr + b.to(tl.int64) * T + t
        if tl.program_id(1) * TN >= L:
            tl.store(out, tl.full([TN], float("-inf"), tl.float32), mask=t < T)
        else:
            q, w, d, dmask = _row_queries(q_ptr, w_ptr, b, NH, D, s_w, HP, DP)
            tmask = t < L
            k = _key_tile(k_ptr, bt_ptr, b, t, tmask, d, dmask, s_kb, s_kt, s_bt, BS).to(tl.float32)
            logits = tl.dot(q, tl.trans(k), input_precision="ieee")             # (HP, TN)
            s = tl.sum(tl.maximum(logits, 0.0) * w[:, None], 0) * scale
            s = tl.where(tmask, s.to(tl.float16).to(tl.float32), float("-inf"))
            tl.store(out, s, mask=t < T)
            if HIST:
                _add_high_hist(hist_ptr + b.to(tl.int64) * 256, tl.histogram(_key_of(s, tmask) >> 8, 256))


    @triton.jit
    def _scores_tc_kernel(q_ptr, w_ptr, k_ptr, bt_ptr, len_ptr, out_ptr, hist_ptr, scale, NH, D, T,
                          s_kb, s_kt, s_bt, s_w, HP: tl.constexpr, DP: tl.constexpr, BS: tl.constexpr,
                          TN: tl.constexpr, TILES: tl.constexpr, HIST: tl.constexpr):
        b = tl.program_id(0)
        t0 = tl.program_id(1) * (TN * TILES)
        L = tl.load(len_ptr + b)
        row = out_ptr + b.to(tl.int64) * T
        if t0 >= L:
            for i in tl.static_range(TILES):
                t = t0 + i * TN + tl.arange(0, TN)
                tl.store(row + t, tl.full([TN], float("-inf"), tl.float32), mask=t < T)
        else:
            q, w, d, dmask = _row_queries(q_ptr, w_ptr, b, NH, D, s_w, HP, DP)
            q = q.to(tl.float16)                                                 # fp16-exact values
            hist = tl.zeros([256], tl.int32)
            for i in tl.static_range(TILES):
                t = t0 + i * TN + tl.arange(0, TN)
                tmask = t < L
                k = _key_tile(k_ptr, bt_ptr, b, t, tmask, d, dmask, s_kb, s_kt, s_bt, BS)
                logits = tl.dot(k, tl.trans(q))                                  # (TN, HP) fp32
                s = tl.sum(tl.maximum(logits, 0.0) * w[None, :], 1) * scale
                s = tl.where(tmask, s.to(tl.float16).to(tl.float32), float("-inf"))
                tl.store(row + t, s, mask=t < T)
                if HIST:
                    hist += tl.histogram(_key_of(s, tmask) >> 8, 256)
            if HIST:
                _add_high_hist(hist_ptr + b.to(tl.int64) * 256, hist)

    @triton.jit
    def _key_of(v, visible):
        """16-bit order keys of fp16-valued float32 scores ``v``: 0 for non-finite or invisible ones."""
        bits = v.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32)
        mag = bits & 0x7FFF
        key = tl.where(bits < 0, -mag, mag) + 32768                        # -0 and +0: 32768
        return tl.where((mag < 0x7C00) & visible, key, 0)

    @triton.jit
    def _keys(s_row, t, T, L):
        """``_key_of`` the scores at positions t of a row of length L (t >= L: key 0)."""
        return _key_of(tl.load(s_row + t, mask=t < T, other=float("-inf")), t < L)

    @triton.jit
    def _add_high_hist(hist_row, h):
        """A chunk's histogram of key high bytes into its row's (topk_select_chunked's pass 1);
        bin 0 (unselectable keys) is never read, so it is left out."""
        b = tl.arange(0, 256)
        tl.atomic_add(hist_row + b, h, mask=(b > 0) & (h > 0))

    @triton.jit
    def _boundary(hist, want, NB: tl.constexpr):
        """The highest bin b whose count of keys at or above b reaches ``want``, and the count above b."""
        bins = tl.arange(0, NB)
        above_or_at = tl.sum(hist, 0) - tl.cumsum(hist, 0) + hist
        b = tl.max(tl.where(above_or_at >= want, bins, -1), 0)
        return b, tl.sum(tl.where(bins > b, hist, 0), 0)

    @triton.jit
    def _high_bin(h1, K):
        """(boundary high byte, keys above it, entries to fill: min(selectable keys, K)) from a row's
        high-byte histogram; bin 0 holds the unselectable keys (key 0) and is ignored."""
        h1 = tl.where(tl.arange(0, 256) == 0, 0, h1)
        want = tl.minimum(tl.sum(h1, 0), K)
        hi, above_hi = _boundary(h1, want, 256)
        return hi, above_hi, want

    @triton.jit
    def _cut(hi, lo, above_hi, above_lo, want):
        """(threshold key, count above it, ties at it to take) from the two boundary bins."""
        thr = tl.where(want > 0, hi * 256 + lo, 0)
        above = tl.where(want > 0, above_hi + above_lo, 0)
        return thr, above, want - above

    @triton.jit
    def _write_chosen(o_row, t, key, thr, above, ties, n_gt, n_eq):
        """Positions ``t`` whose key is above the threshold go after the ``n_gt`` written before
        them, ties after ``above + n_eq`` while fewer than ``ties`` are taken; the new counts."""
        gt = (key > thr).to(tl.int32)
        eq = ((key == thr) & (key > 0)).to(tl.int32)
        at_gt = n_gt + tl.cumsum(gt, 0) - 1
        at_eq = n_eq + tl.cumsum(eq, 0) - 1
        tl.store(o_row + at_gt, t, mask=gt > 0)
        tl.store(o_row + above + at_eq, t, mask=(eq > 0) & (at_eq < ties))
        return n_gt + tl.sum(gt, 0), n_eq + tl.sum(eq, 0)

    @triton.jit
    def _topk_kernel(s_ptr, len_ptr, out_ptr, T, K, topk, TB: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        L = tl.load(len_ptr + row)
        s_row = s_ptr + row * T
        o_row = out_ptr + row * K
        j = tl.arange(0, TB)
        if L <= topk:                        # every visible position (exllamav3's rule)
            for j0 in range(0, K, TB):
                tl.store(o_row + j0 + j, tl.where(j0 + j < L, j0 + j, -1), mask=j0 + j < K)
        else:
            hist = tl.zeros([256], tl.int32)
            for t0 in range(0, T, TB):
                key = _keys(s_row, t0 + j, T, L)
                hist += tl.histogram(key >> 8, 256)
            hi, above_hi, want = _high_bin(hist, K)
            hist2 = tl.zeros([512], tl.int32)
            for t0 in range(0, T, TB):
                key = _keys(s_row, t0 + j, T, L)
                hist2 += tl.histogram(tl.where((key >> 8) == hi, key & 255, 256), 512)
            hist2 = tl.where(tl.arange(0, 512) < 256, hist2, 0)
            lo, above_lo = _boundary(hist2, want - above_hi, 512)
            thr, above, ties = _cut(hi, lo, above_hi, above_lo, want)
            n_gt = 0
            n_eq = 0
            for t0 in range(0, T, TB):
                t = t0 + j
                n_gt, n_eq = _write_chosen(o_row, t, _keys(s_row, t, T, L), thr, above, ties, n_gt, n_eq)
            for j0 in range(0, K, TB):       # fewer finite scores than K: the rest unused
                tl.store(o_row + j0 + j, -1, mask=(j0 + j >= want) & (j0 + j < K))


    @triton.jit
    def _chunk_high_kernel(s_ptr, len_ptr, hist_ptr, T, topk, TB: tl.constexpr):
        """Pass 1: one chunk's histogram of key high bytes, added into its row's (B, 256) int32."""
        row = tl.program_id(0).to(tl.int64)
        L = tl.load(len_ptr + row)
        if L > topk:
            key = _keys(s_ptr + row * T, tl.program_id(1) * TB + tl.arange(0, TB), T, L)
            _add_high_hist(hist_ptr + row * 256, tl.histogram(key >> 8, 256))

    @triton.jit(do_not_specialize=["NC"])    # one compile for every table width
    def _chunk_low_kernel(s_ptr, len_ptr, hist_ptr, low_ptr, T, K, topk, NC, TB: tl.constexpr):
        """Pass 2: one chunk's histogram of the low bytes of its keys in the boundary high bin,
        and its count of keys above that bin, at ``low[row, chunk]`` ((B, NC, 257) int32: bins
        [0, 256), the count at 256). Stored per chunk, not summed, so that pass 3 derives each
        chunk's counts above and at the threshold from them (no counting pass)."""
        row = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1)
        L = tl.load(len_ptr + row)
        if L > topk:
            key = _keys(s_ptr + row * T, c * TB + tl.arange(0, TB), T, L)
            hi, _, _ = _high_bin(tl.load(hist_ptr + row * 256 + tl.arange(0, 256)), K)
            b = tl.arange(0, 512)
            h = tl.histogram(tl.where((key >> 8) == hi, key & 255, 256), 512)
            out = low_ptr + (row * NC + c) * 257
            tl.store(out + b, h, mask=b < 256)
            tl.store(out + 256, tl.sum(((key >> 8) > hi).to(tl.int32), 0))

    @triton.jit
    def _low_tiles(low_row, c0, n, CG: tl.constexpr):
        """Chunks c0..c0 + CG - 1 (those below n) of a row's pass-2 output: their low-byte
        histograms (CG, 256) and counts above the boundary bin (CG,), zeros past n."""
        cs = c0 + tl.arange(0, CG)
        ok = cs < n
        tile = tl.load(low_row + cs[:, None] * 257 + tl.arange(0, 256)[None, :], mask=ok[:, None], other=0)
        return tile, tl.load(low_row + cs * 257 + 256, mask=ok, other=0)

    @triton.jit(do_not_specialize=["NC"])    # one compile for every table width
    def _chunk_write_kernel(s_ptr, len_ptr, hist_ptr, low_ptr, out_ptr, T, K, topk, NC, TB: tl.constexpr,
                            CG: tl.constexpr):
        """Pass 3: the threshold from the high histogram and the chunks' low ones, the keys above it
        and at it in the chunks before this one (CG chunks a step), then this chunk's chosen
        positions at offsets after theirs; output entries [c * TB, (c + 1) * TB) past the chosen ones
        (or a dense row's) filled here too."""
        row = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1)
        L = tl.load(len_ptr + row)
        o_row = out_ptr + row * K
        j = c * TB + tl.arange(0, TB)
        if L <= topk:
            tl.store(o_row + j, tl.where(j < L, j, -1), mask=j < K)
        else:
            hi, above_hi, want = _high_bin(tl.load(hist_ptr + row * 256 + tl.arange(0, 256)), K)
            bins = tl.arange(0, 256)
            low_row = low_ptr + row * NC * 257
            total = tl.zeros([256], tl.int32)
            for c0 in range(0, NC, CG):
                tile, _ = _low_tiles(low_row, c0, NC, CG)
                total += tl.sum(tile, 0)
            lo, above_lo = _boundary(total, want - above_hi, 256)
            thr, above, ties = _cut(hi, lo, above_hi, above_lo, want)
            n_gt = 0
            n_eq = 0
            for c0 in range(0, c, CG):                  # the chunks before this one
                tile, gt = _low_tiles(low_row, c0, c, CG)
                n_gt += tl.sum(gt, 0) + tl.sum(tl.sum(tl.where(bins[None, :] > lo, tile, 0), 1), 0)
                n_eq += tl.sum(tl.sum(tl.where(bins[None, :] == lo, tile, 0), 1), 0)
            _write_chosen(o_row, j, _keys(s_ptr + row * T, j, T, L), thr, above, ties, n_gt, n_eq)
            tl.store(o_row + j, -1, mask=(j >= want) & (j < K))


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def paged_scores(q: torch.Tensor, w: torch.Tensor, kidx: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, scale: float, *, tensor_cores: bool = False,
                 hist: torch.Tensor | None = None) -> torch.Tensor:
    """q (B, H_i, D) and w (B, H_i) float32 (w's rows may be strided: the decode step's are columns
    of the indexer's key projection; rounded to fp16 here, as Indexer.queries rounds them), kidx
    (num_blocks, block_size, D) in the pool's dtype (fp32, fp16 or bf16, read as fp32), tables
    (B, W) int32, context_lens (B,) int32: scores (B, W * block_size) float32 (module doc).
    ``tensor_cores``: fp16 tensor-core dots where kidx is fp16 (q's values fp16-exact, as
    Indexer.queries rounds them); other planes ignore it. ``hist``: a zeroed (B, 256) int32
    tensor that gets the scores' key high-byte histogram (topk_select_chunked's first pass)."""
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
    if hist is not None and (hist.dtype != torch.int32 or tuple(hist.shape) != (B, 256) or not hist.is_contiguous()):
        raise ValueError(f"hist must be a contiguous int32 ({B}, 256), got {hist.dtype} {tuple(hist.shape)}")
    bs = kidx.shape[1]
    T = block_tables.shape[1] * bs
    q = q.contiguous()
    if w.stride(1) != 1:
        w = w.contiguous()
    out = torch.empty(B, T, device=q.device, dtype=torch.float32)
    if B == 0 or T == 0:
        return out
    args = (q, w, kidx, block_tables, context_lens, out, out if hist is None else hist, float(scale), NH, D, T,
            kidx.stride(0), kidx.stride(1), block_tables.stride(0), w.stride(0))
    HP, DP = max(16, _pow2(NH)), max(16, _pow2(D))
    if tensor_cores and kidx.dtype == torch.float16:
        _scores_tc_kernel[(B, triton.cdiv(T, TC_TN * TC_TILES))](
            *args, HP=HP, DP=DP, BS=bs, TN=TC_TN, TILES=TC_TILES, HIST=hist is not None, num_warps=4)
    else:
        _scores_kernel[(B, triton.cdiv(T, TILE))](*args, HP=HP, DP=DP, BS=bs, TN=TILE, HIST=hist is not None,
                                                  num_warps=8)
    return out


def paged_scores_tc(q: torch.Tensor, w: torch.Tensor, kidx: torch.Tensor, block_tables: torch.Tensor,
                    context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """paged_scores with tensor_cores=True: the decode step's score function unless EXL3TOOLS_DSA_SCORES_TC=0."""
    return paged_scores(q, w, kidx, block_tables, context_lens, scale, tensor_cores=True)


def _topk_out(name: str, s: torch.Tensor, context_lens: torch.Tensor, topk: int) -> tuple[int, torch.Tensor]:
    """Checked arguments of the top-k kernels: (K, the (B, K) int32 output to fill)."""
    if triton is None:
        raise RuntimeError(f"{name} needs triton (runtime.dsa.topk_positions does not)")
    if s.dtype != torch.float32 or s.dim() != 2 or context_lens.dtype != torch.int32 \
            or tuple(context_lens.shape) != (s.shape[0],):
        raise ValueError(f"scores must be float32 (B, T) and context_lens int32 (B,), got {s.dtype} "
                         f"{tuple(s.shape)} and {context_lens.dtype} {tuple(context_lens.shape)}")
    K = min(int(topk), s.shape[1])
    return K, torch.empty(s.shape[0], K, device=s.device, dtype=torch.int32)


def topk_select(s: torch.Tensor, context_lens: torch.Tensor, topk: int) -> torch.Tensor:
    """dsa.topk_positions' selection (module doc) from ``paged_scores``' (B, T) float32 scores:
    (B, min(topk, T)) int32 positions, -1 for an unused entry. No host sync (graph-capturable)."""
    K, out = _topk_out("topk_select", s, context_lens, topk)
    B, T = s.shape
    if B and K:
        _topk_kernel[(B,)](s.contiguous(), context_lens, out, T, K, int(topk), TB=TOPK_TILE, num_warps=8)
    return out


def topk_select_chunked(s: torch.Tensor, context_lens: torch.Tensor, topk: int, *, tb: int | None = None,
                        warps: int | None = None, hist: torch.Tensor | None = None) -> torch.Tensor:
    """topk_select over chunks of ``tb`` (CHUNK_TILE) scores in parallel (grid rows x chunks, three
    passes: the key high bytes' histogram summed with atomics, each chunk's low bytes in the
    boundary bin, then each chunk's writes at offsets derived from the chunks before it), for wide
    tables where one program per row walks every chunk three times. The same contract and result
    set. ``tb`` / ``warps``: the chunk size and warps a program (bench/gpu_topk.py sweeps them).
    ``hist``: the first pass's histogram, already made (``paged_scores(hist=)``; ``select``)."""
    K, out = _topk_out("topk_select_chunked", s, context_lens, topk)
    B, T = s.shape
    if not (B and K):
        return out
    tb = tb or CHUNK_TILE
    s = s.contiguous()
    chunks = triton.cdiv(T, tb)
    warps = warps or (4 if B * chunks >= CHUNK_WIDE_PROGRAMS else CHUNK_WARPS)
    grid = (B, chunks)
    if hist is None:
        hist = torch.zeros(B, 256, device=s.device, dtype=torch.int32)
        _chunk_high_kernel[grid](s, context_lens, hist, T, int(topk), TB=tb, num_warps=warps)
    low = torch.empty(B, chunks, 257, device=s.device, dtype=torch.int32)
    _chunk_low_kernel[grid](s, context_lens, hist, low, T, K, int(topk), chunks, TB=tb, num_warps=warps)
    _chunk_write_kernel[grid](s, context_lens, hist, low, out, T, K, int(topk), chunks, TB=tb, CG=CHUNK_GROUP,
                              num_warps=warps)
    return out


def topk_for_width(width: int):
    """The top-k kernel for a (B, width) score table: ``topk_select_chunked`` from CHUNKED_MIN_WIDTH
    scores, else ``topk_select``. The width is fixed per captured graph (runtime/paged_decode.py's
    widths), so each graph makes the choice once, at capture."""
    return topk_select_chunked if width >= CHUNKED_MIN_WIDTH else topk_select


def topk_auto(s: torch.Tensor, context_lens: torch.Tensor, topk: int) -> torch.Tensor:
    """topk_select or topk_select_chunked by the table's width (topk_for_width)."""
    return topk_for_width(s.shape[1])(s, context_lens, topk)


def _chunked_at(topk_fn, width: int) -> bool:
    return topk_fn is topk_select_chunked or (topk_fn is topk_auto and topk_for_width(width) is topk_select_chunked)


def select(q: torch.Tensor, w: torch.Tensor, kidx: torch.Tensor, block_tables: torch.Tensor,
           context_lens: torch.Tensor, scale: float, topk: int, score_fn, topk_fn) -> torch.Tensor:
    """``topk_fn(score_fn(q, w, ...), context_lens, topk)``: the DSA selection of the decode step
    (runtime.dsa.Indexer.select_paged). Where the pair is the tensor-core scores and the chunked
    top-k, the scores kernel makes the top-k's first pass (the key high bytes' histogram) on the
    scores it holds: one launch and one read of the scores fewer."""
    from exl3tools.runtime import preview  # torch-free; read per call so tests can flip it

    width = block_tables.shape[1] * kidx.shape[1]
    if score_fn is paged_scores_tc and kidx.dtype == torch.float16 and _chunked_at(topk_fn, width) \
            and preview.switched_on("dsa_fused_select"):
        hist = torch.zeros(q.shape[0], 256, device=q.device, dtype=torch.int32)
        s = paged_scores(q, w, kidx, block_tables, context_lens, scale, tensor_cores=True, hist=hist)
        return topk_select_chunked(s, context_lens, topk, hist=hist)
    return topk_fn(score_fn(q, w, kidx, block_tables, context_lens, scale), context_lens, topk)

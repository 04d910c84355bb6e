"""Decode attention over a paged KV cache: flash-decoding (split-K) in Triton, plus a torch reference.

Row b of the batch attends over tokens t < context_lens[b]; token t lives at
``cache[block_tables[b, t // block_size], t % block_size]``. Query head h reads kv head h // (nq // nkv).

Kernel 1, grid (B, nkv * head_chunks, num_splits): one program = one kv head, all the query heads that
share it (up to HB of them), one contiguous range of TN-token tiles. Each K/V tile is gathered once
through the block table and used by every head of the group with tensor-core dots (the head group is
padded to >= 16 rows, the smallest MMA M). Online softmax in fp32 (base 2). With one split it writes
the output directly; else it writes a normalised partial (o, lse) per split and kernel 2 merges them.

Graph safety: both launch grids depend only on shapes and num_splits; each program derives its tile
range from context_lens[b] on the device, so cost follows the real lengths, never the table width,
and block-table entries at or past ceil(len / block_size) are never read. Callers keep
context_lens[b] <= max_blocks * block_size.

Known limit: every row gets the same number of splits. With one long row among many short ones
(B * nkv already fills the GPU, so the default is one split) the long row runs on only nkv programs;
a larger num_splits plus ``_paged_decode(min_split_tiles=...)`` (short rows keep to few splits)
spreads it: bench/gpu_paged_attention.py --mixed measures that case.
"""

from __future__ import annotations

import math
import os
from functools import lru_cache

import torch

try:
    import triton
    import triton.language as tl
except ImportError:   # runtime-only installs have no triton: paged_decode_reference still works
    triton = tl = None

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
LOG2E = 1.4426950408889634
MAX_HEAD_DIM = 256
MAX_SPLITS = 128         # default rule's cap: B 1 x 1 kv head at 128k = 16 tiles of 64 per split
INTERPRET_PROGRAMS = 4   # CPU interpreter: few programs, each costs Python time
MERGE_CHUNK = 32         # splits per merge step: a 32 x 256 fp32 tile is 64 registers a thread

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


if triton is not None:
    @triton.jit
    def _q_parts(q, KV_DT: tl.constexpr, DOT_DT: tl.constexpr, Q_SPLIT: tl.constexpr, IS_FP32: tl.constexpr):
        """q as the dot operands: fp32 as is; with Q_SPLIT (q fp32, or the other 16-bit type) as
        hi + lo in the cache dtype: two MMAs give ~16 mantissa bits of q instead of 8 (bf16), with
        exact products and fp32 accumulation."""
        if IS_FP32:
            q_hi = q.to(tl.float32)
            q_lo = q_hi
        elif Q_SPLIT:
            qf = q.to(tl.float32)
            q_hi = qf.to(KV_DT)
            q_lo = (qf - q_hi.to(tl.float32)).to(KV_DT).to(DOT_DT)
            q_hi = q_hi.to(DOT_DT)
        else:
            q_hi = q.to(DOT_DT)
            q_lo = q_hi
        return q_hi, q_lo

    @triton.jit
    def _scores(q_hi, q_lo, k, DOT_DT: tl.constexpr, Q_SPLIT: tl.constexpr, IS_FP32: tl.constexpr):
        """q · kᵀ in fp32 (unscaled)."""
        if IS_FP32:
            s = tl.dot(q_hi, tl.trans(k), input_precision="ieee")
        else:
            kt = tl.trans(k.to(DOT_DT))
            s = tl.dot(q_hi, kt)
            if Q_SPLIT:
                s = tl.dot(q_lo, kt, s)
        return s

    @triton.jit
    def _online_softmax(s, v, m_i, l_i, acc, KV_DT: tl.constexpr, DOT_DT: tl.constexpr, IS_FP32: tl.constexpr):
        """One tile of online softmax (base 2; s scaled, -inf where masked, finite row maxima):
        the updated (m_i, l_i, acc)."""
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if IS_FP32:
            acc = tl.dot(p, v, acc, input_precision="ieee")
        else:
            # p in [0, 1] as hi + lo of the cache dtype: a bare bf16 p costs ~2^-9 relative per weight
            vd = v.to(DOT_DT)
            p_hi = p.to(KV_DT)
            p_lo = (p - p_hi.to(tl.float32)).to(KV_DT)
            acc = tl.dot(p_hi.to(DOT_DT), vd, acc)
            acc = tl.dot(p_lo.to(DOT_DT), vd, acc)
        return m_new, l_i, acc

    @triton.jit
    def _split_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, len_ptr, out_ptr, po_ptr, plse_ptr,
                      qk_scale, num_splits, min_tiles, NQ, G, D, HCHUNKS,
                      skb, skt, skh, svb, svt, svh, sbt,
                      DP: tl.constexpr, HB: tl.constexpr, BS: tl.constexpr, TN: tl.constexpr,
                      KV_DT: tl.constexpr, DOT_DT: tl.constexpr, Q_SPLIT: tl.constexpr,
                      IS_FP32: tl.constexpr, DIRECT: tl.constexpr):
        b = tl.program_id(0)
        kvh = tl.program_id(1) // HCHUNKS
        hc = tl.program_id(1) % HCHUNKS
        sp = tl.program_id(2)

        L = tl.load(len_ptr + b)
        ntiles = tl.cdiv(L, TN)
        tps = tl.maximum(tl.cdiv(ntiles, num_splits), min_tiles)   # tiles per split (>= 1)
        t0 = sp * tps
        t1 = tl.minimum(t0 + tps, ntiles)

        hq = hc * HB + tl.arange(0, HB)          # head index inside the group
        rmask = hq < G
        head = kvh * G + hq
        d = tl.arange(0, DP)
        dmask = d < D
        qmask = rmask[:, None] & dmask[None, :]
        q = tl.load(q_ptr + b.to(tl.int64) * NQ * D + head[:, None] * D + d[None, :], mask=qmask, other=0.0)
        q_hi, q_lo = _q_parts(q, KV_DT, DOT_DT, Q_SPLIT, IS_FP32)

        m_i = tl.full([HB], float("-inf"), tl.float32)
        l_i = tl.zeros([HB], tl.float32)
        acc = tl.zeros([HB, DP], tl.float32)
        j = tl.arange(0, TN)
        k_base = k_ptr + kvh.to(tl.int64) * skh
        v_base = v_ptr + kvh.to(tl.int64) * svh
        bt_row = bt_ptr + b.to(tl.int64) * sbt
        for it in range(t0, t1):
            t = it * TN + j
            tmask = t < L
            # one table entry per token (broadcast within a block); past-the-end entries stay unread
            blk = tl.load(bt_row + t // BS, mask=tmask, other=0).to(tl.int64)
            slot = (t % BS).to(tl.int64)
            kvmask = tmask[:, None] & dmask[None, :]
            k = tl.load(k_base + (blk * skb + slot * skt)[:, None] + d[None, :], mask=kvmask, other=0.0)
            s = _scores(q_hi, q_lo, k, DOT_DT, Q_SPLIT, IS_FP32)
            s = tl.where(tmask[None, :], s * qk_scale, float("-inf"))   # row max finite: a token < L
            v = tl.load(v_base + (blk * svb + slot * svt)[:, None] + d[None, :], mask=kvmask, other=0.0)
            m_i, l_i, acc = _online_softmax(s, v, m_i, l_i, acc, KV_DT, DOT_DT, IS_FP32)

        l_safe = tl.where(l_i > 0, l_i, 1.0)
        o = acc / l_safe[:, None]                 # zeros for an empty range (context_lens[b] == 0)
        if DIRECT:
            tl.store(out_ptr + b.to(tl.int64) * NQ * D + head[:, None] * D + d[None, :], o, mask=qmask)
        else:
            # only splits with tiles write; the merge recomputes which ones those are
            wmask = hq < G * (t0 < t1).to(tl.int32)
            row = (b.to(tl.int64) * NQ + head) * num_splits + sp
            tl.store(po_ptr + row[:, None] * D + d[None, :], o, mask=wmask[:, None] & dmask[None, :])
            tl.store(plse_ptr + row, m_i + tl.log2(l_safe), mask=wmask)


    @triton.jit
    def _merge_kernel(po_ptr, plse_ptr, len_ptr, out_ptr, num_splits, min_tiles, NQ, D,
                      DP: tl.constexpr, TN: tl.constexpr, SC: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)
        L = tl.load(len_ptr + b)
        ntiles = tl.cdiv(L, TN)
        tps = tl.maximum(tl.cdiv(ntiles, num_splits), min_tiles)
        n_act = tl.cdiv(ntiles, tps)              # the splits kernel 1 wrote (0 when L == 0)
        d = tl.arange(0, DP)
        dmask = d < D
        row0 = (b.to(tl.int64) * NQ + h) * num_splits
        m = tl.full([1], float("-inf"), tl.float32)
        den = tl.zeros([1], tl.float32)
        acc = tl.zeros([DP], tl.float32)
        for c in range(0, n_act, SC):
            s = c + tl.arange(0, SC)
            smask = s < n_act
            lse = tl.load(plse_ptr + row0 + s, mask=smask, other=float("-inf"))
            m_new = tl.maximum(m, tl.max(lse, 0))  # finite: the chunk holds at least one written split
            alpha = tl.exp2(m - m_new)
            w = tl.exp2(lse - m_new)
            o = tl.load(po_ptr + (row0 + s)[:, None] * D + d[None, :], mask=smask[:, None] & dmask[None, :],
                        other=0.0)
            acc = acc * alpha + tl.sum(w[:, None] * o, 0)
            den = den * alpha + tl.sum(w, 0)
            m = m_new
        res = acc / tl.where(den > 0, den, 1.0)
        tl.store(out_ptr + (b.to(tl.int64) * NQ + h) * D + d, res, mask=dmask)


@lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def default_config(head_dim: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """(TN tokens per tile, num_warps, num_stages).

    16-bit: a 64 x 128 K+V tile pair is 32 KB. K/V addresses come from a block-table load in the same
    iteration; Triton's pipeliner (3.6 and 3.9, read off the TTGIR) spreads num_stages over that
    two-load chain and only double-buffers K/V from num_stages 5 (76 KB smem, ~180 registers at
    D 128: two programs per SM, each with the next tile in flight while it computes); 2..4 give one
    buffer, so a program waits for every tile. fp32 (tests, CPU parity) runs its dots on FMAs:
    16-token tiles keep it at ~64 registers without spills."""
    dp = max(16, _pow2(head_dim))
    if dtype == torch.float32:
        return 16, 4, 2
    return (64 if dp <= 128 else 32), 4, 5


def _check(q, k_cache, v_cache, block_tables, context_lens):
    if q.dim() != 3 or not q.is_contiguous():
        raise ValueError(f"q must be a contiguous (B, nq, D) tensor, got {tuple(q.shape)}")
    if q.dtype not in _DTYPES:
        raise ValueError(f"q dtype {q.dtype} not supported")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"k/v caches must both be (num_blocks, block_size, nkv, D), got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if k_cache.dtype != v_cache.dtype or k_cache.dtype not in _DTYPES:
        raise ValueError(f"k/v cache dtypes {k_cache.dtype}/{v_cache.dtype}: need one of bf16, fp16, fp32")
    B, nq, D = q.shape
    _, bs, nkv, dk = k_cache.shape
    if dk != D or nq % nkv:
        raise ValueError(f"q (nq={nq}, D={D}) does not fit the cache (nkv={nkv}, D={dk})")
    if bs & (bs - 1) or D > MAX_HEAD_DIM:
        raise ValueError(f"block_size {bs} must be a power of two, D {D} <= {MAX_HEAD_DIM}")
    if block_tables.dtype != torch.int32 or block_tables.dim() != 2 or block_tables.shape[0] != B:
        raise ValueError(f"block_tables must be int32 (B, max_blocks), got {block_tables.dtype} "
                         f"{tuple(block_tables.shape)}")
    if context_lens.dtype != torch.int32 or tuple(context_lens.shape) != (B,):
        raise ValueError(f"context_lens must be int32 (B,), got {context_lens.dtype} {tuple(context_lens.shape)}")
    if (block_tables.stride(1) != 1 or not context_lens.is_contiguous() or k_cache.stride(3) != 1
            or v_cache.stride(3) != 1):
        raise ValueError("block_tables rows, context_lens and the cache head dim must be contiguous")


def _new_out(q: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return torch.empty(q.shape, device=q.device, dtype=torch.float32)
    if out.shape != q.shape or out.dtype != torch.float32 or not out.is_contiguous() or out.device != q.device:
        raise ValueError(f"out must be a contiguous float32 {tuple(q.shape)} tensor on {q.device}")
    return out


def _programs_per_sm(head_dim: int, dtype: torch.dtype) -> int:
    """Resident programs per SM at default_config (sm_90, from the compiled smem/register use):
    16-bit D <= 64 and fp32 ~25-41 KB / <= 96 registers; 16-bit D 128-256 76-84 KB / 184-230."""
    return 4 if dtype == torch.float32 or _pow2(head_dim) <= 64 else 2


def _choose_splits(programs: int, slots: int, limit: int) -> int:
    """Fewest splits whose wave cost is within 5% of the best over 1..limit. Wave cost:
    ceil(programs * s / slots) / s (time in units of one unsplit program, each wave as long as one
    program). A last, partial wave runs on the bandwidth of its few programs: 8 x 40 = 320 programs
    on 264 slots cost 2 at 1 split, 1.25 at 4 splits."""
    cost = {s: math.ceil(programs * s / slots) / s for s in range(1, max(1, limit) + 1)}
    best = min(cost.values())
    return min(s for s, c in cost.items() if c <= 1.05 * best)


def default_num_splits(q: torch.Tensor, k_cache: torch.Tensor, block_tables: torch.Tensor,
                       tile_n: int | None = None) -> int:
    """Splits per (row, kv head) from shapes only (a replayed graph keeps it while the lengths
    change): enough programs to fill every resident slot without a thin last wave, at most
    MAX_SPLITS and never more than tiles in the table. B * nkv that already fills the GPU evenly
    gets 1 (no merge kernel). On the interpreter: at most INTERPRET_PROGRAMS programs."""
    B, nq, D = q.shape
    bs, nkv = k_cache.shape[1], k_cache.shape[2]
    tn = tile_n or default_config(D, k_cache.dtype)[0]
    programs = B * nkv * math.ceil((nq // nkv) / _head_block(nq // nkv, D))
    max_tiles = max(1, math.ceil(block_tables.shape[1] * bs / tn))
    if not q.is_cuda:
        return max(1, min(INTERPRET_PROGRAMS // programs, max_tiles))
    index = q.device.index if q.device.index is not None else torch.cuda.current_device()
    slots = _programs_per_sm(D, k_cache.dtype) * _sm_count(index)
    return _choose_splits(programs, slots, min(max_tiles, MAX_SPLITS))


def _head_block(g: int, D: int) -> int:
    """Query heads per program: the group padded to a power of two >= 16 (MMA M), capped so the fp32
    accumulator stays at <= 4096 elements (32 registers a thread at 4 warps; 64 heads at D 128 took
    220 registers and 128 KB smem)."""
    dp = max(16, _pow2(D))
    return min(max(16, _pow2(g)), max(16, 4096 // dp))


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, scale: float, *, num_splits: int | None = None,
                 out: torch.Tensor | None = None, min_split_tiles: int = 1) -> torch.Tensor:
    """Attention of one query token per row over its paged K/V; (B, nq, D) float32 (into ``out``).

    Rows with context_lens 0 give zeros. No host synchronization: capturable in a CUDA graph and
    replayable with new block_tables / context_lens contents. ``scale`` is a Python float.
    ``num_splits`` / ``min_split_tiles``: see ``_paged_decode``; ``invariant_splits`` gives the
    pair under which a row's result does not depend on the batch.
    """
    return _paged_decode(q, k_cache, v_cache, block_tables, context_lens, scale, num_splits=num_splits,
                         out=out, min_split_tiles=min_split_tiles)


INVARIANT_MIN_TILES = 8      # key tiles per split at least, in batch-invariant runs
INVARIANT_MAX_SPLITS = 16    # splits at most: the partials of a 256-row step stay ~200 MB at 96 heads


def invariant_splits(table_tokens: int, head_dim: int, dtype: torch.dtype) -> tuple[int, int]:
    """(num_splits, min_split_tiles) for batch-invariant runs (runtime/invariance.py) over block
    tables of ``table_tokens`` tokens: every row then splits its keys every T tiles (T =
    min_split_tiles) whatever the batch, since tiles per split = max(ceil(tiles / splits), T) = T
    when splits * T covers the whole table, and the merge takes the same chunks (its chunk size
    depends on num_splits alone). Fewer, longer splits than the default for short batches."""
    tiles = max(1, math.ceil(table_tokens / default_config(head_dim, dtype)[0]))
    t = max(INVARIANT_MIN_TILES, math.ceil(tiles / INVARIANT_MAX_SPLITS))
    return math.ceil(tiles / t), t


def _paged_decode(q, k_cache, v_cache, block_tables, context_lens, scale, *, num_splits=None, out=None,
                  tile_n=None, num_warps=None, num_stages=None, min_split_tiles=1):
    """paged_decode with the tile configuration exposed (bench/gpu_paged_attention.py --sweep).

    ``min_split_tiles``: a row uses at most ceil(tiles / min_split_tiles) of the splits. With many
    splits (mixed lengths: one long row among short ones) short rows then stay in one or two
    programs while the long row spreads over all of them."""
    if triton is None:
        raise RuntimeError("paged_decode needs triton (paged_decode_reference does not)")
    _check(q, k_cache, v_cache, block_tables, context_lens)
    B, nq, D = q.shape
    bs, nkv = k_cache.shape[1], k_cache.shape[2]
    g = nq // nkv
    dp = max(16, _pow2(D))
    tn, warps, stages = default_config(D, k_cache.dtype)
    tn, warps, stages = tile_n or tn, num_warps or warps, num_stages or stages
    hb = _head_block(g, D)
    hchunks = math.ceil(g / hb)
    splits = num_splits or default_num_splits(q, k_cache, block_tables, tn)
    out = _new_out(q, out)
    if B == 0:
        return out
    kv_dt = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}[k_cache.dtype]
    # the interpreter's tl.dot multiplies bf16 bit patterns as uint16 (triton 3.5-3.9): feed it the
    # same bf16-rounded operands as fp32, whose numpy matmul is exact for these products
    dot_dt = tl.float32 if INTERPRET and kv_dt == tl.bfloat16 else kv_dt
    direct = splits == 1
    if direct:
        po = plse = out
    else:
        po = torch.empty(B, nq, splits, D, device=q.device, dtype=torch.float32)
        plse = torch.empty(B, nq, splits, device=q.device, dtype=torch.float32)
    _split_kernel[(B, nkv * hchunks, splits)](
        q, k_cache, v_cache, block_tables, context_lens, out, po, plse,
        float(scale) * LOG2E, splits, max(1, int(min_split_tiles)), nq, g, D, hchunks,
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        DP=dp, HB=hb, BS=bs, TN=tn, KV_DT=kv_dt, DOT_DT=dot_dt,
        Q_SPLIT=q.dtype != k_cache.dtype, IS_FP32=kv_dt == tl.float32, DIRECT=direct,
        num_warps=warps, num_stages=stages)
    if not direct:
        sc = min(_pow2(splits), MERGE_CHUNK)
        _merge_kernel[(B, nq)](po, plse, context_lens, out, splits, max(1, int(min_split_tiles)), nq, D,
                               DP=dp, TN=tn, SC=sc, num_warps=4)
    return out


def paged_decode_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float, *,
                           num_splits: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """paged_decode in plain torch (fp32): the CPU runtime's path and the test oracle.

    Fixed shapes, no host sync: gathers all max_blocks * block_size slots (table entries past a row's
    length replaced by block 0, so garbage ids are never dereferenced) and masks by context_lens.
    ``num_splits`` is accepted for signature parity and ignored.
    """
    del num_splits
    _check(q, k_cache, v_cache, block_tables, context_lens)
    B, nq, D = q.shape
    bs, nkv = k_cache.shape[1], k_cache.shape[2]
    g = nq // nkv
    W = block_tables.shape[1]
    out = _new_out(q, out)
    lens = context_lens.to(torch.int64)
    used = torch.arange(W, device=q.device)[None, :] * bs < lens[:, None]             # (B, W)
    ids = torch.where(used, block_tables.to(torch.int64), torch.zeros_like(block_tables, dtype=torch.int64))
    valid = torch.arange(W * bs, device=q.device)[None, :] < lens[:, None]             # (B, T)
    k = k_cache[ids].reshape(B, W * bs, nkv, D).permute(0, 2, 1, 3).float()            # (B, nkv, T, D)
    v = v_cache[ids].reshape(B, W * bs, nkv, D).permute(0, 2, 1, 3).float()
    v = torch.where(valid[:, None, :, None], v, 0.0)      # unwritten slots may hold NaN: 0 * NaN = NaN
    qg = q.float().reshape(B, nkv, g, D)
    s = torch.matmul(qg, k.transpose(-1, -2)) * scale                                  # (B, nkv, g, T)
    s = torch.where(valid[:, None, None, :], s, float("-inf"))
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, 0.0)            # empty rows: exp(-inf) = 0, no NaN
    p = torch.exp(s - m)
    den = p.sum(-1, keepdim=True)
    o = torch.matmul(p, v) / torch.where(den > 0, den, 1.0)
    out.copy_(o.reshape(B, nq, D))
    return out


# ------------------------------------------------------------------ prefill (variable length, causal)
if triton is not None:
    @triton.jit
    def _prefill_kernel(q_ptr, k_ptr, v_ptr, st_ptr, qs_ptr, len_ptr, out_ptr, tile_ptr, qk_scale, NQ, G, D,
                        skt, skh, svt, svh, sst,
                        DP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, KV_DT: tl.constexpr,
                        DOT_DT: tl.constexpr, Q_SPLIT: tl.constexpr, IS_FP32: tl.constexpr,
                        TILES: tl.constexpr):
        if TILES:           # a fixed grid (a graph's): program i takes tile (b, mb) = tiles[i]
            b = tl.load(tile_ptr + 2 * tl.program_id(0))
            mb = tl.load(tile_ptr + 2 * tl.program_id(0) + 1)
            h = tl.program_id(1)
        else:
            b = tl.program_id(0)
            mb = tl.program_id(1)
            h = tl.program_id(2)
        r0 = tl.load(qs_ptr + b)
        n = tl.load(qs_ptr + b + 1) - r0
        if mb * BM < n:
            L = tl.load(len_ptr + b)
            pos0 = L - n                           # the new tokens are the last n of the context
            i = mb * BM + tl.arange(0, BM)
            imask = i < n
            qpos = pos0 + i
            d = tl.arange(0, DP)
            dmask = d < D
            qmask = imask[:, None] & dmask[None, :]
            q_off = (r0 + i).to(tl.int64)[:, None] * NQ * D + h * D + d[None, :]
            q = tl.load(q_ptr + q_off, mask=qmask, other=0.0)
            q_hi, q_lo = _q_parts(q, KV_DT, DOT_DT, Q_SPLIT, IS_FP32)
            kvh = h // G
            k_base = k_ptr + kvh.to(tl.int64) * skh
            v_base = v_ptr + kvh.to(tl.int64) * svh
            st_row = st_ptr + b.to(tl.int64) * sst
            m_i = tl.full([BM], float("-inf"), tl.float32)
            l_i = tl.zeros([BM], tl.float32)
            acc = tl.zeros([BM, DP], tl.float32)
            j = tl.arange(0, BN)
            kv_end = tl.minimum(L, pos0 + mb * BM + BM)   # causal: no key past this block's last query
            for start in range(0, kv_end, BN):
                t = start + j
                tmask = t < kv_end
                slot = tl.load(st_row + t, mask=tmask, other=0).to(tl.int64)
                kvmask = tmask[:, None] & dmask[None, :]
                k = tl.load(k_base + (slot * skt)[:, None] + d[None, :], mask=kvmask, other=0.0)
                s = _scores(q_hi, q_lo, k, DOT_DT, Q_SPLIT, IS_FP32)
                # every row sees key 0 in the first tile, so its running max is finite from then on
                s = tl.where((t[None, :] <= qpos[:, None]) & tmask[None, :], s * qk_scale, float("-inf"))
                v = tl.load(v_base + (slot * svt)[:, None] + d[None, :], mask=kvmask, other=0.0)
                m_i, l_i, acc = _online_softmax(s, v, m_i, l_i, acc, KV_DT, DOT_DT, IS_FP32)
            o = acc / l_i[:, None]
            tl.store(out_ptr + q_off, o, mask=qmask)


def _check_prefill(q, k_plane, v_plane, slot_table, q_start, ctx_lens):
    if q.dim() != 3 or not q.is_contiguous() or q.dtype not in _DTYPES:
        raise ValueError(f"q must be a contiguous (N, nq, D) float tensor, got {tuple(q.shape)} {q.dtype}")
    if k_plane.dim() != 3 or k_plane.shape != v_plane.shape or k_plane.dtype != v_plane.dtype:
        raise ValueError(f"k/v planes must both be (slots, nkv, D), got {tuple(k_plane.shape)} and "
                         f"{tuple(v_plane.shape)}")
    N, nq, D = q.shape
    if k_plane.shape[2] != D or nq % k_plane.shape[1] or D > MAX_HEAD_DIM:
        raise ValueError(f"q (nq={nq}, D={D}) does not fit the planes {tuple(k_plane.shape)}")
    B = ctx_lens.shape[0]
    for name, t, shape in (("q_start", q_start, (B + 1,)), ("ctx_lens", ctx_lens, (B,))):
        if t.dtype != torch.int32 or tuple(t.shape) != shape or not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous int32 {shape}, got {t.dtype} {tuple(t.shape)}")
    if slot_table.dtype != torch.int32 or slot_table.dim() != 2 or slot_table.shape[0] != B \
            or slot_table.stride(1) != 1:
        raise ValueError(f"slot_table must be int32 (B, max_len) with contiguous rows, got "
                         f"{slot_table.dtype} {tuple(slot_table.shape)}")
    if k_plane.stride(2) != 1 or v_plane.stride(2) != 1:
        raise ValueError("the k/v planes' head dim must be contiguous")


def prefill_block_rows(kv_dtype: torch.dtype) -> int:
    """The query rows a program of ``paged_prefill`` takes (its tiles' height, BM)."""
    return 16 if kv_dtype == torch.float32 else 64     # fp32 dots run on FMAs: small tiles keep registers in check


PAD_TILE = (0, 1 << 24)    # a tile past every sequence's rows: its program returns at once


def prefill_tiles(q_start: list[int], bm: int, count: int) -> list[int]:
    """``paged_prefill``'s ``tiles`` for a fixed grid of ``count`` programs a head: (b, mb) of each
    BM = ``bm`` row tile of sequence b's rows q_start[b]:q_start[b + 1], flattened, then PAD_TILE
    up to ``count`` (rows // bm + sequences tiles are always enough)."""
    tiles = [(b, mb) for b in range(len(q_start) - 1) for mb in range(-(-(q_start[b + 1] - q_start[b]) // bm))]
    if len(tiles) > count:
        raise ValueError(f"{len(tiles)} prefill tiles do not fit a grid of {count}")
    return [v for t in tiles + [PAD_TILE] * (count - len(tiles)) for v in t]


def paged_prefill(q: torch.Tensor, k_plane: torch.Tensor, v_plane: torch.Tensor, slot_table: torch.Tensor,
                  q_start: torch.Tensor, ctx_lens: torch.Tensor, scale: float, max_new: int, *,
                  out: torch.Tensor | None = None, tiles: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of a packed batch of new tokens over the paged cache (flash-attention style).

    Sequence b's new tokens are rows ``q_start[b]:q_start[b+1]`` of ``q`` (N, nq, D), at positions
    ``ctx_lens[b] - n_b .. ctx_lens[b] - 1``, and their K/V are already written. Token t of
    sequence b lives at ``plane[slot_table[b, t]]`` (planes (slots, nkv, D)); entries at or past
    ctx_lens[b] are never read. Query row i attends to keys 0 .. its own position, GQA head
    h -> kv head h // (nq // nkv). ``max_new``: the largest n_b (sizes the grid). (N, nq, D) fp32.
    ``tiles`` (int32 (2 T,), ``prefill_tiles``): a grid of T programs a head instead, each the
    (sequence, row tile) its entry names, whatever the rows (a CUDA graph's fixed launch).
    """
    if triton is None:
        raise RuntimeError("paged_prefill needs triton (paged_prefill_reference does not)")
    _check_prefill(q, k_plane, v_plane, slot_table, q_start, ctx_lens)
    N, nq, D = q.shape
    out = _new_out(q, out)
    B = ctx_lens.shape[0]
    if B == 0 or N == 0 or max_new <= 0:
        return out
    nkv = k_plane.shape[1]
    dp = max(16, _pow2(D))
    kv_dt = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}[k_plane.dtype]
    dot_dt = tl.float32 if INTERPRET and kv_dt == tl.bfloat16 else kv_dt
    is_fp32 = kv_dt == tl.float32
    bm = prefill_block_rows(k_plane.dtype)
    bn = 16 if is_fp32 else (64 if dp <= 128 else 32)
    if tiles is not None and (tiles.dtype != torch.int32 or tiles.dim() != 1 or tiles.numel() % 2):
        raise ValueError(f"tiles must be int32 (2 T,), got {tiles.dtype} {tuple(tiles.shape)}")
    grid = (B, triton.cdiv(max_new, bm), nq) if tiles is None else (tiles.numel() // 2, nq)
    _prefill_kernel[grid](
        q, k_plane, v_plane, slot_table, q_start, ctx_lens, out, q_start if tiles is None else tiles,
        float(scale) * LOG2E, nq, nq // nkv, D,
        k_plane.stride(0), k_plane.stride(1), v_plane.stride(0), v_plane.stride(1), slot_table.stride(0),
        DP=dp, BM=bm, BN=bn, KV_DT=kv_dt, DOT_DT=dot_dt, Q_SPLIT=q.dtype != k_plane.dtype, IS_FP32=is_fp32,
        TILES=tiles is not None, num_warps=4, num_stages=2)
    return out


def paged_prefill_reference(q: torch.Tensor, k_plane: torch.Tensor, v_plane: torch.Tensor,
                            slot_table: torch.Tensor, q_start: torch.Tensor, ctx_lens: torch.Tensor,
                            scale: float, max_new: int, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """paged_prefill in plain torch (fp32, one sequence at a time): the test oracle."""
    del max_new
    _check_prefill(q, k_plane, v_plane, slot_table, q_start, ctx_lens)
    N, nq, D = q.shape
    nkv = k_plane.shape[1]
    out = _new_out(q, out)
    starts, lens = q_start.tolist(), ctx_lens.tolist()
    for b, L in enumerate(lens):
        r0, r1 = starts[b], starts[b + 1]
        n = r1 - r0
        if n == 0:
            continue
        idx = slot_table[b, :L].to(torch.int64)
        k = k_plane[idx].float().transpose(0, 1).repeat_interleave(nq // nkv, 0)      # (nq, L, D)
        v = v_plane[idx].float().transpose(0, 1).repeat_interleave(nq // nkv, 0)
        s = torch.matmul(q[r0:r1].float().transpose(0, 1), k.transpose(1, 2)) * scale  # (nq, n, L)
        qpos = torch.arange(L - n, L, device=q.device)[:, None]
        s = s.masked_fill(torch.arange(L, device=q.device)[None, :] > qpos, float("-inf"))
        out[r0:r1] = torch.matmul(torch.softmax(s, -1), v).transpose(0, 1)
    return out

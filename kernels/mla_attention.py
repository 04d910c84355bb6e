"""Paged MLA decode attention (DeepSeek-V3, GLM-5): flash-decoding over the latent cache, in Triton,
plus a plain torch reference of the same contract. On an sm_90 GPU, rows without a selection on fp16
planes take a CUDA split kernel instead (kernels/mla_cuda.py: TMA copies, wgmma; the same partials
and merge; ``EXL3TOOLS_MLA_CUDA=0`` keeps Triton).

One query token per row b with H absorbed heads: ``q_lat`` (B, H, C) (``q_nope · W_UK``) and
``q_pe`` (B, H, R). Token t of row b has its latent ``ckv[blk, t % bs]`` (C) and rope key
``kpe[blk, t % bs]`` (R), ``blk = block_tables[b, t // bs]``; the score of head h is
``(q_lat[h] · ckv_t + q_pe[h] · kpe_t) * scale``, and the output ``o_lat[h] = Σ_t p[h, t] ckv_t``
(B, H, C) float32 (the caller applies W_UV). Every head reads the same latent rows, so one program
loads each latent tile once for a group of HB heads (the point of MLA decode).

Which tokens a row attends to:

- ``sel`` None: tokens ``0 .. context_lens[b] - 1``;
- ``sel`` (B, K) int32 (DSA): entries ``sel[b, j] >= 0`` are the positions to attend to (each at
  most once, ``< context_lens[b]``); ``-1`` entries are skipped. The kernel walks the K entries,
  so a sparse layer reads K latent rows whatever the context.

Kernel 1, grid (B, head_chunks, num_splits): one program = HB heads, one contiguous range of
TN-entry tiles; online softmax in fp32 (base 2). One split writes the output directly; else every
split writes a normalised partial (o, lse) (an empty range: zeros, lse -inf) and kernel 2 merges.
Both grids depend on shapes and num_splits only; tile ranges come from context_lens on the device
(graph-capturable; cost follows the real lengths without ``sel``, K with it).

Precision: the planes are the pool's dtype (MLAttention.cache_spec). fp16 planes take fp16 tensor-core
dots with fp32 accumulation (the query and the probabilities rounded to fp16); bf16 planes are
widened to fp32 as they load. On fp32 (and widened) planes ``precision`` "ieee" (default) runs the
dots as exact fp32 FMAs; "tf32x3" uses tensor cores with three TF32 products (~fp32 accuracy), set
by ``EXL3TOOLS_MLA_PRECISION`` or the argument (bench/gpu_mla_attention.py compares them).
"""

from __future__ import annotations

import math
import os

import torch
from exl3tools.kernels import mla_cuda

from exl3tools.errors import UsageError

try:
    import triton
    import triton.language as tl
except ImportError:   # runtime-only installs have no triton: mla_decode_reference still works
    triton = tl = None

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
PRECISION = os.environ.get("EXL3TOOLS_MLA_PRECISION", "ieee")
LOG2E = 1.4426950408889634
MAX_SPLITS = 64
INTERPRET_PROGRAMS = 4   # CPU interpreter: few programs, each costs Python time
MERGE_ELEMS = 4096       # fp32 partial elements a merge program loads a step (32 a thread at 4 warps)
MERGE_SLICE = 32         # latent channels a merge program takes where the rows are few (merge_config)
NUM_STAGES = 2           # the split kernel's pipeline depth (64 x 64 fp16 tiles: 72 KiB of keys a stage)
Q16_MIN_HB = 64          # fp16 planes from this head block: the queries go in as fp16 (mla_decode)
SPLIT_OVERHEAD_TILES = 2  # default_num_splits: a program's query load and partial store, in key tiles
WIDE_HEAD_PROGRAMS = 0.7  # default_config: 64-head blocks from this many programs per SM


def _min_split_tiles(value: str | None) -> int:
    """EXL3TOOLS_MLA_MIN_SPLIT_TILES: tiles a split takes at least (mla_decode's min_split_tiles)."""
    if not value:
        return 1
    if not value.isdigit() or int(value) < 1:
        raise UsageError(f"EXL3TOOLS_MLA_MIN_SPLIT_TILES={value!r}: expected a whole number >= 1")
    return int(value)


MIN_SPLIT_TILES = _min_split_tiles(os.environ.get("EXL3TOOLS_MLA_MIN_SPLIT_TILES"))
PLANE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)   # the pool's dtype (dsa_indexer's too)


def tile_override(value: str | None, name: str = "EXL3TOOLS_MLA_TILE") -> tuple[int, int, int] | None:
    """``name``="HB,TN,WARPS": the MLA kernel's tiles for every call that does not pass its own (a
    diagnostic: bench/gpu_all.sh serves EXL3TOOLS_MLA_TILE beside the default to time a sweep's
    winner end to end; EXL3TOOLS_MLA_SELECT_TILE: the DSA prompt rows', mla.MLAttention.attend_selected).
    Unset: default_config. A bad value is a UsageError naming the variable."""
    if not value:
        return None
    try:
        hb, tn, warps = (int(v) for v in value.split(","))
    except ValueError:
        raise UsageError(f"{name}={value!r}: expected HB,TN,WARPS, e.g. 32,32,8") from None
    if any(v <= 0 or v & (v - 1) for v in (hb, tn, warps)) or hb < 16 or tn < 16:
        raise UsageError(f"{name}={value!r}: HB and TN powers of two >= 16, WARPS a power of two")
    return hb, tn, warps


TILE = tile_override(os.environ.get("EXL3TOOLS_MLA_TILE"))


if triton is not None:
    @triton.jit
    def _mla_split_kernel(ql_ptr, qp_ptr, ckv_ptr, kpe_ptr, bt_ptr, len_ptr, sel_ptr, out_ptr, po_ptr, plse_ptr,
                          qk_scale, num_splits, min_tps, H, C, R, K,
                          s_cb, s_ct, s_pb, s_pt, s_bt, s_sel,
                          CP: tl.constexpr, RP: tl.constexpr, HB: tl.constexpr, BS: tl.constexpr,
                          TN: tl.constexpr, HAS_SEL: tl.constexpr, PREC: tl.constexpr, DIRECT: tl.constexpr,
                          SPLIT_DOTS: tl.constexpr = False):
        b = tl.program_id(0)
        hc = tl.program_id(1)
        sp = tl.program_id(2)
        L = tl.load(len_ptr + b)
        if HAS_SEL:
            n = K
        else:
            n = L
        ntiles = tl.cdiv(n, TN)
        tps = tl.maximum(tl.cdiv(ntiles, num_splits), min_tps)   # short contexts: fewer, longer splits
        t0 = sp * tps
        t1 = tl.minimum(t0 + tps, ntiles)

        h = hc * HB + tl.arange(0, HB)
        hmask = h < H
        c = tl.arange(0, CP)
        cmask = c < C
        r = tl.arange(0, RP)
        rmask = r < R
        row = b.to(tl.int64) * H + h
        ql = tl.load(ql_ptr + row[:, None] * C + c[None, :], mask=hmask[:, None] & cmask[None, :], other=0.0)
        qp = tl.load(qp_ptr + row[:, None] * R + r[None, :], mask=hmask[:, None] & rmask[None, :], other=0.0)

        m_i = tl.full([HB], float("-inf"), tl.float32)
        l_i = tl.zeros([HB], tl.float32)
        acc = tl.zeros([HB, CP], tl.float32)
        j = tl.arange(0, TN)
        bt_row = bt_ptr + b.to(tl.int64) * s_bt
        sel_row = sel_ptr + b.to(tl.int64) * s_sel
        for it in range(t0, t1):
            e = it * TN + j
            if HAS_SEL:
                t = tl.load(sel_row + e, mask=e < K, other=-1)
                tmask = (t >= 0) & (t < L)
                t = tl.where(tmask, t, 0)
            else:
                t = e
                tmask = t < L
            # past-the-end and skipped entries never dereference a table entry
            blk = tl.load(bt_row + t // BS, mask=tmask, other=0).to(tl.int64)
            slot = (t % BS).to(tl.int64)
            kc = tl.load(ckv_ptr + (blk * s_cb + slot * s_ct)[:, None] + c[None, :],
                         mask=tmask[:, None] & cmask[None, :], other=0.0)
            kp = tl.load(kpe_ptr + (blk * s_pb + slot * s_pt)[:, None] + r[None, :],
                         mask=tmask[:, None] & rmask[None, :], other=0.0)
            if kc.dtype == tl.float16:
                # fp16 planes: fp16 tensor-core dots, fp32 accumulation (q and p rounded to fp16, as
                # flash attention does); widening the tiles instead spills on sm_90 (32 registers,
                # ~5 KB a thread: bench/triton_sm90_check.py)
                s = tl.dot(ql.to(tl.float16), tl.trans(kc))
                if SPLIT_DOTS:   # the rope dot in an accumulator of its own (a miscompile probe)
                    s += tl.dot(qp.to(tl.float16), tl.trans(kp))
                else:
                    s = tl.dot(qp.to(tl.float16), tl.trans(kp), s)
            else:
                kc = kc.to(tl.float32)      # bf16 planes are widened (fp32 planes: a no-op)
                kp = kp.to(tl.float32)
                s = tl.dot(ql, tl.trans(kc), input_precision=PREC)
                s = tl.dot(qp, tl.trans(kp), s, input_precision=PREC)
            s = tl.where(tmask[None, :], s * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)   # a tile of skipped entries: no NaN
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            if kc.dtype == tl.float16:
                acc = tl.dot(p.to(tl.float16), kc, acc * alpha[:, None])
            else:
                acc = tl.dot(p, kc, acc * alpha[:, None], input_precision=PREC)
            m_i = m_new

        l_safe = tl.where(l_i > 0, l_i, 1.0)
        o = acc / l_safe[:, None]                 # zeros where nothing was attended to
        omask = hmask[:, None] & cmask[None, :]
        if DIRECT:
            tl.store(out_ptr + row[:, None] * C + c[None, :], o, mask=omask)
        else:
            prow = row * num_splits + sp
            if t1 > t0:   # an empty split writes its lse (-inf) alone: the merge never reads its o
                tl.store(po_ptr + prow[:, None] * C + c[None, :], o, mask=omask)
            lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
            tl.store(plse_ptr + prow, lse, mask=hmask)

    @triton.jit
    def _mla_merge_kernel(po_ptr, plse_ptr, out_ptr, num_splits, C, CP: tl.constexpr, SC: tl.constexpr):
        # one program per row and CP-wide slice of the latent (grid (B * H, cdiv(C, CP)), merge_config)
        row = tl.program_id(0).to(tl.int64)       # b * H + h
        c = tl.program_id(1) * CP + tl.arange(0, CP)
        cmask = c < C
        m = tl.full([1], float("-inf"), tl.float32)
        den = tl.zeros([1], tl.float32)
        acc = tl.zeros([CP], tl.float32)
        for c0 in range(0, num_splits, SC):
            s = c0 + tl.arange(0, SC)
            smask = s < num_splits
            lse = tl.load(plse_ptr + row * num_splits + s, mask=smask, other=float("-inf"))
            # the partials load beside their lse, not masked by it (one memory round trip a step,
            # not two); an empty split wrote no o, so what its slot holds is dropped, not weighted
            o = tl.load(po_ptr + (row * num_splits + s)[:, None] * C + c[None, :],
                        mask=smask[:, None] & cmask[None, :], other=0.0)
            o = tl.where((lse > float("-inf"))[:, None], o, 0.0)
            m_new = tl.maximum(m, tl.max(lse, 0))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m - m_safe)
            w = tl.exp2(lse - m_safe)
            acc = acc * alpha + tl.sum(w[:, None] * o, 0)
            den = den * alpha + tl.sum(w, 0)
            m = m_new
        tl.store(out_ptr + row * C + c, acc / tl.where(den > 0, den, 1.0), mask=cmask)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _check(q_lat, q_pe, ckv, kpe, block_tables, context_lens, sel):
    if q_lat.dim() != 3 or q_pe.dim() != 3 or q_lat.shape[:2] != q_pe.shape[:2]:
        raise ValueError(f"q_lat (B, H, C) and q_pe (B, H, R) disagree: {tuple(q_lat.shape)} {tuple(q_pe.shape)}")
    for name, t in (("q_lat", q_lat), ("q_pe", q_pe)):
        if t.dtype != torch.float32 and not (t.dtype == torch.float16 == ckv.dtype):
            raise ValueError(f"{name} must be float32 (or float16 with fp16 planes), got {t.dtype}")
    if ckv.dtype not in PLANE_DTYPES or kpe.dtype != ckv.dtype:
        raise ValueError(f"ckv and kpe must share one of float32, float16, bfloat16, got {ckv.dtype} and {kpe.dtype}")
    if not (q_lat.is_contiguous() and q_pe.is_contiguous()):
        raise ValueError("q_lat and q_pe must be contiguous")
    B, H, C = q_lat.shape
    R = q_pe.shape[2]
    if ckv.dim() != 3 or kpe.dim() != 3 or ckv.shape[:2] != kpe.shape[:2] or ckv.shape[2] != C or kpe.shape[2] != R:
        raise ValueError(f"planes must be (num_blocks, block_size, C={C}) and (.., R={R}), got "
                         f"{tuple(ckv.shape)} and {tuple(kpe.shape)}")
    bs = ckv.shape[1]
    if bs & (bs - 1) or ckv.stride(2) != 1 or kpe.stride(2) != 1:
        raise ValueError(f"block_size {bs} must be a power of two and the planes' last dim contiguous")
    if block_tables.dtype != torch.int32 or block_tables.dim() != 2 or block_tables.shape[0] != B \
            or block_tables.stride(1) != 1:
        raise ValueError(f"block_tables must be int32 (B, max_blocks) with contiguous rows, got "
                         f"{block_tables.dtype} {tuple(block_tables.shape)}")
    if context_lens.dtype != torch.int32 or tuple(context_lens.shape) != (B,) or not context_lens.is_contiguous():
        raise ValueError(f"context_lens must be contiguous int32 (B,), got {context_lens.dtype} "
                         f"{tuple(context_lens.shape)}")
    if sel is not None and (sel.dtype != torch.int32 or sel.dim() != 2 or sel.shape[0] != B or sel.stride(1) != 1):
        raise ValueError(f"sel must be int32 (B, K) with contiguous rows, got {sel.dtype} {tuple(sel.shape)}")


def _new_out(q_lat: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return torch.empty(q_lat.shape, device=q_lat.device, dtype=torch.float32)
    if out.shape != q_lat.shape or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous float32 {tuple(q_lat.shape)} tensor")
    return out


def default_config(H: int, precision: str, planes: torch.dtype = torch.float32, *, B: int | None = None,
                   entries: int | None = None, sms: int | None = None) -> tuple[int, int, int]:
    """(HB heads per program, TN entries per tile, num_warps). fp32 FMA dots: small tiles keep the
    (HB, C) accumulator, the query and the latent tile in registers. tf32x3 keeps 16 heads too:
    sm_90 builds of HB 64 x TN 32 need 488 KiB of shared memory (limit 227 KiB) and, with a
    selection and splits, fail ptxas register allocation; HB 16 x TN 32 needs 144 KiB.

    fp16 planes: 32 heads x 64 keys at 8 warps (16 heads below 32), whose (HB, TN) score tile
    gives each warp a tensor-core tile of its own (at 16 x 16 most of the 8 warps have none). H200,
    2026-12-02: the kernel at 128 heads 222 -> 100 us at batch 1 and a 32k context, 825 -> 315 us
    at batch 32 and 4k (bench/gpu_mla_attention.py --sweep); the DeepSeek-V3 shape served one
    stream at a 30000-token context at 298 tok/s against 251. EXL3TOOLS_MLA_WIDE_TILES=0 keeps
    16 x 16 x 8 (runtime/preview.py OPT_OUTS). fp32 planes (and bf16, widened to fp32 as they
    load) keep the small tiles: at 32 x 64 their tf32x3 dots need 288 KiB of shared memory (sm_90
    has 227; H200, 2026-12-02).

    64 heads x 64 keys (fp16 queries: wgmma, Q16_MIN_HB) where that still makes enough programs
    (B x head blocks x splits >= WIDE_HEAD_PROGRAMS x the SMs; B, entries and sms given). H200,
    2026-12-02 night, µs against 32 x 64 x 8: 128 heads batch 1 at 32k 75 vs 101, 4k 32 vs 34;
    batch 32 at 4k 267 vs 319 (a 2048-key selection 160 vs 208); 64 heads batch 32 at 4k 141 vs
    202 (selection 96 vs 130); but 64 heads at batch 1 (64 programs) 74 vs 59, a selection 27 vs 20."""
    if planes == torch.float16 and _switched_on("mla_wide_tiles"):
        if H >= 64 and B and entries and sms and \
                B * math.ceil(H / 64) * min(MAX_SPLITS, math.ceil(entries / 64)) >= WIDE_HEAD_PROGRAMS * sms:
            return 64, 64, 8
        return (32 if H > 16 else 16), 64, 8
    if precision == "ieee":
        return 16, 16, 8
    return 16, 32, 8


def _switched_on(name: str) -> bool:
    """runtime/preview.py's switch ``name`` (mla_wide_tiles, mla_wave_splits, mla_cuda,
    mla_pingpong, mla_pad_heads, mla_scaled_p), read per call so tests can flip it."""
    from exl3tools.runtime import preview  # torch-free

    return preview.switched_on(name)


def default_num_splits(B: int, hchunks: int, entries: int, tn: int, sms: int | None, *,
                       one_per_sm: bool = False) -> int:
    """Splits from shapes only (a replayed graph keeps them), never more tiles than the table (or
    the selection) has, at most MAX_SPLITS; ``sms`` the GPU's SM count (None: the interpreter, a
    few programs): about two programs per SM, or with ``one_per_sm`` (the
    fp16 planes' 32- and 64-head tiles: 115-221 KiB of shared memory and ~240 registers a thread
    hold one program an SM; H200 ncu, 2026-12-04) the count that minimises waves x (tiles a split +
    SPLIT_OVERHEAD_TILES), fewest splits on a tie. Two programs an SM there had left a third wave
    42 % full at batch 32 (5 splits, 320 programs) and written 2.5x the partials."""
    programs = max(1, B * hchunks)
    max_tiles = max(1, math.ceil(entries / tn))
    if sms is None:
        return max(1, min(INTERPRET_PROGRAMS // programs, max_tiles))
    cap = max(1, min(max_tiles, MAX_SPLITS))
    if not one_per_sm:
        return max(1, min(math.ceil(2 * sms / programs), cap))
    return min(range(1, cap + 1),
               key=lambda s: (math.ceil(programs * s / sms) * (math.ceil(max_tiles / s) + SPLIT_OVERHEAD_TILES), s))


def mla_decode(q_lat: torch.Tensor, q_pe: torch.Tensor, ckv: torch.Tensor, kpe: torch.Tensor,
               block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float, *,
               sel: torch.Tensor | None = None, num_splits: int | None = None, out: torch.Tensor | None = None,
               precision: str | None = None, head_block: int | None = None, tile_n: int | None = None,
               num_warps: int | None = None, split_dots: bool = False,
               min_split_tiles: int | None = None, num_stages: int | None = None) -> torch.Tensor:
    """Paged MLA decode (module doc): (B, H, C) float32 ``o_lat``, into ``out`` when given. No host
    sync: capturable in a CUDA graph, replayable with new tables / lengths / selections. On fp16
    planes the queries may be float16 (the kernel rounds float32 ones to fp16 alike).
    ``min_split_tiles``: a row's splits take at least this many tiles each (MIN_SPLIT_TILES), so a
    short context fills fewer splits and the merge reads fewer partials. ``num_stages``: Triton's
    software-pipeline depth of the key loop (NUM_STAGES; bench/gpu_mla_attention.py --sweep-tiles).
    ``split_dots``: on fp16 planes, the rope keys' dot into its own accumulator instead of chained
    through the latent's (Triton has miscompiled two dots chained through one accumulator on other
    targets, triton-lang/triton#10821; tests/gpu/test_mla_attention.py probes both)."""
    if triton is None:
        raise RuntimeError("mla_decode needs triton (mla_decode_reference does not)")
    _check(q_lat, q_pe, ckv, kpe, block_tables, context_lens, sel)
    B, H, C = q_lat.shape
    R = q_pe.shape[2]
    out = _new_out(q_lat, out)
    if B == 0:
        return out
    prec = precision or PRECISION
    if INTERPRET:
        prec = "ieee"
    entries = sel.shape[1] if sel is not None else block_tables.shape[1] * ckv.shape[1]
    index = q_lat.device.index if q_lat.device.index is not None else (
        torch.cuda.current_device() if q_lat.is_cuda else 0)
    sms = torch.cuda.get_device_properties(index).multi_processor_count if q_lat.is_cuda else None
    # dense rows on the TMA + wgmma kernel (kernels/mla_cuda.py) unless a Triton tile, dot or
    # pipeline was asked for
    pingpong = _switched_on("mla_pingpong")
    cuda = (sel is None and TILE is None and head_block is None and tile_n is None and num_warps is None
            and not split_dots and num_stages is None and not INTERPRET and _switched_on("mla_cuda")
            and mla_cuda.fits(q_lat, ckv, kpe, pad=pingpong and _switched_on("mla_pad_heads")))
    if cuda:
        hb, tn, warps = mla_cuda.HEADS, mla_cuda.KEYS, 0
    else:
        hb, tn, warps = TILE or default_config(H, prec, ckv.dtype, B=B, entries=entries, sms=sms)
        hb, tn, warps = head_block or hb, tile_n or tn, num_warps or warps
    if ckv.dtype == torch.float16 and (cuda or hb >= Q16_MIN_HB):
        # fp16 queries in memory: Triton keeps a loaded fp16 dot operand in shared memory, where a
        # converted fp32 one stays in registers beside the (HB, C) accumulator (at 64 heads both
        # held 128 registers a thread and spilled). The kernel rounds them so either way.
        q_lat, q_pe = q_lat.to(torch.float16), q_pe.to(torch.float16)
    hchunks = math.ceil(H / hb)
    cp = max(16, _pow2(C))
    splits = num_splits or default_num_splits(B, hchunks, entries, tn, sms,
                                              one_per_sm=cuda or (ckv.dtype == torch.float16 and hb >= 32
                                                                  and tn >= 64 and _switched_on("mla_wave_splits")))
    direct = splits == 1
    if direct:
        po = plse = out
    else:
        po = torch.empty(B, H, splits, C, device=q_lat.device, dtype=torch.float32)
        plse = torch.empty(B, H, splits, device=q_lat.device, dtype=torch.float32)
    s = sel if sel is not None else context_lens
    if cuda:
        mla_cuda.split(q_lat.contiguous(), q_pe.contiguous(), ckv, kpe, block_tables, context_lens, out, po, plse,
                       float(scale) * LOG2E, splits, max(1, int(min_split_tiles or MIN_SPLIT_TILES)),
                       pingpong=pingpong, scaled_p=pingpong and _switched_on("mla_scaled_p"))
    else:
        _mla_split_kernel[(B, hchunks, splits)](
            q_lat, q_pe, ckv, kpe, block_tables, context_lens, s, out, po, plse,
            float(scale) * LOG2E, splits, max(1, int(min_split_tiles or MIN_SPLIT_TILES)), H, C, R,
            sel.shape[1] if sel is not None else 0,
            ckv.stride(0), ckv.stride(1), kpe.stride(0), kpe.stride(1), block_tables.stride(0),
            sel.stride(0) if sel is not None else 0,
            CP=cp, RP=max(16, _pow2(R)), HB=hb, BS=ckv.shape[1], TN=tn, HAS_SEL=sel is not None,
            PREC=prec, DIRECT=direct, SPLIT_DOTS=split_dots, num_warps=warps, num_stages=num_stages or NUM_STAGES)
    if not direct:
        merge(po, plse, out, merge_config(B * H, splits, C, sms))
    return out


def merge_config(rows: int, parts: int, C: int, sms: int | None) -> tuple[int, int]:
    """(CP latent channels a merge program, SC partials it loads a step) for ``rows`` rows of
    ``parts`` partials: a step loads at most MERGE_ELEMS fp32. Where the rows are few (under two
    programs an SM; always on the interpreter, so the CPU tests cover the slices) the programs
    take slices of the latent and every partial in one step; else whole rows. Before the 2026-12-04
    late session one DeepSeek-V3 row at 32k (128 rows x 64 partials, 16.8 MB) merged in 12.5 µs
    (H200 ncu: 128-channel slices, 16 partials a step, the partials' loads waiting on the lse). That
    session's sweep (bench/gpu_mla_cuda.py --merge, each replay after an L2 flush): that row 11.7 µs
    in 32-channel slices with all 64 partials at once, 12.0 in 64-channel ones, 17.7 at 128 x 16;
    one GLM-5 DSA row (64 x 32) 7.5 / 9.3 (128-channel) / 10.0 (128 x 16); batch 8's whole rows
    (1024 x 8) 10.9."""
    cp = max(16, _pow2(C))
    sc = _pow2(parts)
    if sms is not None and rows >= 2 * sms:
        return cp, max(1, min(sc, MERGE_ELEMS // cp))
    sc = min(sc, MERGE_ELEMS // 16)
    return max(16, min(cp, MERGE_SLICE, MERGE_ELEMS // sc)), sc


def merge(po: torch.Tensor, plse: torch.Tensor, out: torch.Tensor, config: tuple[int, int],
          num_warps: int = 4) -> torch.Tensor:
    """``out`` (B, H, C) from the splits' partials ``po`` (B, H, parts, C) and ``plse`` (B, H, parts),
    base-2 lse, -inf for a split that attended to nothing (its ``po`` slot is never read as a
    number); ``config`` (CP, SC): merge_config."""
    B, H, parts, C = po.shape
    cp, sc = config
    _mla_merge_kernel[(B * H, triton.cdiv(C, cp))](po, plse, out, parts, C, CP=cp, SC=sc, num_warps=num_warps)
    return out


def mla_decode_reference(q_lat: torch.Tensor, q_pe: torch.Tensor, ckv: torch.Tensor, kpe: torch.Tensor,
                         block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float, *,
                         sel: torch.Tensor | None = None, num_splits: int | None = None,
                         out: torch.Tensor | None = None, **_) -> torch.Tensor:
    """mla_decode in plain torch (fp32): the CPU runtime's path and the test oracle. Fixed shapes,
    no host sync: gathers every table column (or the K selected positions) and masks."""
    del num_splits
    _check(q_lat, q_pe, ckv, kpe, block_tables, context_lens, sel)
    B, H, C = q_lat.shape
    bs = ckv.shape[1]
    W = block_tables.shape[1]
    out = _new_out(q_lat, out)
    lens = context_lens.to(torch.int64)[:, None]
    if sel is None:
        pos = torch.arange(W * bs, device=q_lat.device).expand(B, W * bs)
    else:
        pos = sel.to(torch.int64)
    valid = (pos >= 0) & (pos < lens)                                            # (B, T)
    pos = torch.where(valid, pos, 0)
    blk = block_tables.to(torch.int64).gather(1, pos // bs)
    blk = torch.where(valid, blk, 0)                   # unused table entries are never dereferenced
    flat = blk * bs + pos % bs
    cc = ckv.reshape(-1, C)[flat].float()                                        # (B, T, C)
    kp = kpe.reshape(-1, kpe.shape[2])[flat].float()
    cc = torch.where(valid[..., None], cc, 0.0)        # unwritten slots may hold NaN
    kp = torch.where(valid[..., None], kp, 0.0)
    s = (torch.einsum("bhc,btc->bht", q_lat, cc) + torch.einsum("bhr,btr->bht", q_pe, kp)) * scale
    s = torch.where(valid[:, None, :], s, float("-inf"))
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, 0.0)
    p = torch.exp(s - m)
    den = p.sum(-1, keepdim=True)
    out.copy_(torch.einsum("bht,btc->bhc", p, cc) / torch.where(den > 0, den, 1.0))
    return out

"""A decode step's (token, expert) pairs grouped into one tile per expert, in one launch.

At batch 8 a GLM-4.5-Air MoE layer has 72 pairs (8 routed + the shared expert per token) but only
~50 distinct experts: one row per pair decodes the shared expert's weights 8 times and every
doubly-picked expert twice, and the step is bound by that decode (docs/gpu.md: the batch-8 step
reads weights at the 1-row kernel's decode rate). ``group_pairs`` lays the pairs out as tiles of
``rows`` rows, each tile all of one expert (an expert with more pairs than ``rows`` gets several),
so the grouped expert calls (``obj.tiles``, kernels/dispatch.py) decode each expert once; the
8-row gemv kernel costs the same MMA work for 1 or 8 rows. One Triton program computes it with
S x S comparisons (S <= MAX_PAIRS, or WIDE_MAX_PAIRS), where runtime.layers.expert_tiles takes ~25 torch launches;
``residual_rmsnorm(y_rows=pair_row)`` then sums each token's rows straight from the tile layout.

Layout, for the gate+up call over 2 x NE experts (up at +NE, as ``fused_decode.route`` numbers
them) and then the down call over the first halves: NT = S // rows + min(NE, S) tiles (a bound
that depends on S alone: graph-capturable), tiles ordered by each expert's first pair.
"""

from __future__ import annotations

import torch
from exl3tools.kernels.fused_decode import _pow2, triton

if triton is not None:
    import triton.language as tl

MAX_PAIRS = 512      # the fused step's default cap (batch 56 at 9 pairs): checked on the H200
# the cap with the "wide_groups" preview (runtime/preview.py): batch 64 at 9 pairs (576), 64 sequences
# with one draft each (1152), GLM-5's 227 rows of 9; the comparison block BS x BJ stays at 16k
# elements (BJ 16 at 1024 pairs, 8 at 2048) and the program takes 16 warps above MAX_PAIRS
WIDE_MAX_PAIRS = 2048
TILE_ROWS = 8        # the 8-row gemv kernel: one MMA per tile for 1-8 rows


def n_tiles(S: int, NE: int, rows: int = TILE_ROWS) -> int:
    """The static tile count of S pairs over NE experts (each expert's last tile is its only partial one)."""
    return S // rows + min(NE, S)


if triton is not None:
    @triton.jit
    def _group_pairs_kernel(exp_ptr, row_ptr, texp_ptr, tn_ptr, src_ptr, rexp_ptr, S, P, NE, NT,
                            R: tl.constexpr, BS: tl.constexpr, BJ: tl.constexpr, BR: tl.constexpr):
        i = tl.arange(0, BS)
        mi = i < S
        ei = tl.load(exp_ptr + i, mask=mi, other=-1)
        rank = tl.zeros([BS], tl.int32)    # pairs of the same expert before pair i
        cnt = tl.zeros([BS], tl.int32)     # pairs of pair i's expert
        for j0 in range(0, S, BJ):
            j = j0 + tl.arange(0, BJ)
            ej = tl.load(exp_ptr + j, mask=j < S, other=-2)
            same = ei[:, None] == ej[None, :]
            cnt += tl.sum(same.to(tl.int32), 1)
            rank += tl.sum((same & (j[None, :] < i[:, None])).to(tl.int32), 1)
        first = (rank == 0) & mi
        ntile = tl.where(first, (cnt + R - 1) // R, 0)
        basef = tl.cumsum(ntile, 0) - ntile            # first tile of each expert, at its first pair
        tl.store(row_ptr + i, tl.where(first, basef, 0), mask=mi)     # (row_ptr as scratch)
        tl.debug_barrier()
        base = tl.zeros([BS], tl.int32)
        for j0 in range(0, S, BJ):                       # every pair takes its first pair's base
            j = j0 + tl.arange(0, BJ)
            ej = tl.load(exp_ptr + j, mask=j < S, other=-2)
            bj = tl.load(row_ptr + j, mask=j < S, other=0)
            base += tl.sum(tl.where(ei[:, None] == ej[None, :], bj[None, :], 0), 1)
        tl.debug_barrier()
        row = base * R + rank
        # defaults first: unused tiles (-1, 0 rows), padding rows (token 0, a valid expert)
        for t0 in range(0, NT, BR):
            t = t0 + tl.arange(0, BR)
            mt = t < NT
            tl.store(texp_ptr + t, tl.full([BR], -1, tl.int32), mask=mt)
            tl.store(texp_ptr + NT + t, tl.full([BR], -1, tl.int32), mask=mt)
            tl.store(tn_ptr + t, tl.zeros([BR], tl.int32), mask=mt)
            tl.store(tn_ptr + NT + t, tl.zeros([BR], tl.int32), mask=mt)
        for r0 in range(0, NT * R, BR):
            r = r0 + tl.arange(0, BR)
            mr = r < NT * R
            tl.store(src_ptr + r, tl.zeros([BR], tl.int32), mask=mr)
            tl.store(src_ptr + NT * R + r, tl.zeros([BR], tl.int32), mask=mr)
            tl.store(rexp_ptr + r, tl.zeros([BR], tl.int32), mask=mr)
            tl.store(rexp_ptr + NT * R + r, tl.zeros([BR], tl.int32) + NE, mask=mr)
        tl.debug_barrier()
        tile = row // R
        n_in = tl.minimum(cnt - (rank // R) * R, R)      # real rows of pair i's tile
        tl.store(row_ptr + i, row, mask=mi)
        tl.store(texp_ptr + tile, ei, mask=mi)            # (every pair of a tile stores the same values)
        tl.store(texp_ptr + NT + tile, ei + NE, mask=mi)
        tl.store(tn_ptr + tile, n_in, mask=mi)
        tl.store(tn_ptr + NT + tile, n_in, mask=mi)
        tok = i // P
        tl.store(src_ptr + row, tok, mask=mi)
        tl.store(src_ptr + NT * R + row, tok, mask=mi)
        tl.store(rexp_ptr + row, ei, mask=mi)
        tl.store(rexp_ptr + NT * R + row, ei + NE, mask=mi)


def _out(S: int, NT: int, R: int, dev) -> dict:
    i32 = dict(dtype=torch.int32, device=dev)
    return {"pair_row": torch.empty(S, **i32), "tile_exp": torch.empty(2 * NT, **i32),
            "tile_n": torch.empty(2 * NT, **i32), "row_src": torch.empty(2 * NT * R, **i32),
            "row_exp": torch.empty(2 * NT * R, **i32), "tiles": NT, "rows": R}


def group_pairs(exp: torch.Tensor, P: int, NE: int, rows: int = TILE_ROWS) -> dict:
    """Tiles of the S pairs whose experts are ``exp`` (S,) int32 in [0, NE) (pair s of token s // P).

    Returns int32 device tensors, each twice over (the gate half, then the up half at +NE; the
    down call takes the first halves): ``tile_exp`` (2NT,) the tile's expert (-1: unused),
    ``tile_n`` (2NT,) its real rows, ``row_src`` / ``row_exp`` (2NT*rows,) each row's token and
    expert (padding rows: token 0, expert 0 / NE), plus ``pair_row`` (S,) the row of each pair,
    and the ints ``tiles`` (NT) and ``rows``."""
    S = exp.shape[0]
    if not 0 < S <= WIDE_MAX_PAIRS:
        raise ValueError(f"group_pairs takes 1-{WIDE_MAX_PAIRS} pairs, got {S}")
    NT = n_tiles(S, NE, rows)
    out = _out(S, NT, rows, exp.device)
    BS = max(16, _pow2(S))
    _group_pairs_kernel[(1,)](exp.to(torch.int32).contiguous(), out["pair_row"], out["tile_exp"], out["tile_n"],
                              out["row_src"], out["row_exp"], S, int(P), int(NE), NT, R=int(rows),
                              BS=BS, BJ=min(32, 16384 // BS), BR=256,
                              num_warps=4 if S <= 128 else 8 if S <= MAX_PAIRS else 16)
    return out


def group_pairs_reference(exp: torch.Tensor, P: int, NE: int, rows: int = TILE_ROWS) -> dict:
    """``group_pairs`` in torch ops (the same layout, value for value)."""
    S, R, dev = exp.shape[0], rows, exp.device
    NT = n_tiles(S, NE, R)
    e = exp.long()
    idx = torch.arange(S, device=dev)
    same = e[:, None] == e[None, :]
    rank = (same & (idx[None, :] < idx[:, None])).sum(1)
    cnt = same.sum(1)
    first = rank == 0
    ntile = torch.where(first, (cnt + R - 1) // R, 0)
    basef = torch.where(first, torch.cumsum(ntile, 0) - ntile, 0)
    row = (same.long() * basef[None, :]).sum(1) * R + rank
    tile = row // R
    texp = torch.full((NT,), -1, dtype=torch.long, device=dev)
    texp[tile] = e
    tn = torch.zeros(NT, dtype=torch.long, device=dev)
    tn[tile] = torch.clamp(cnt - (rank // R) * R, max=R)
    src = torch.zeros(NT * R, dtype=torch.long, device=dev)
    src[row] = idx // P
    rexp = torch.zeros(NT * R, dtype=torch.long, device=dev)
    rexp[row] = e
    rexp_up = torch.full((NT * R,), NE, dtype=torch.long, device=dev)
    rexp_up[row] = e + NE
    i32 = torch.int32
    return {"pair_row": row.to(i32), "tile_exp": torch.cat([texp, torch.where(texp >= 0, texp + NE, -1)]).to(i32),
            "tile_n": torch.cat([tn, tn]).to(i32), "row_src": torch.cat([src, src]).to(i32),
            "row_exp": torch.cat([rexp, rexp_up]).to(i32), "tiles": NT, "rows": R}

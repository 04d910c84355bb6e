"""How an eager step's batch groups its spans for MLAttention (runtime/mla.py): the new prompts
that attend as one padded batch (``fresh_prompts``, MLAttention.attend_fresh) and the short spans
(decode and verify rows) that attend as rows of the decode step's kernels (``short_rows``,
MLAttention.attend_rows), each cached in ``batch.extras``. ``min_rows``: mla.SDPA_MIN_ROWS, the
rows from which a span is a prompt."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class FreshPrompts:
    """The spans of a batch that MLAttention.attend_fresh takes together (fresh_prompts)."""

    spans: frozenset[int]          # their indices in batch.spans
    pool: object                   # the KVPool of their caches
    slots: torch.Tensor            # (rows,) int64: each row's cache slot, spans in order
    dst: torch.Tensor              # (rows,) int64: the same rows' indices in the batch
    gather: torch.Tensor           # (prompts, longest) int64 batch rows, padded with the span's first
    lengths: tuple                 # ((PagedSeqView, n), ...): each cache's length after the write
    rows: tuple                    # ((first batch row, n), ...): each prompt's rows in the batch


@dataclass(frozen=True, slots=True)
class ShortRows:
    """The short spans of a batch that MLAttention.attend_rows takes together (short_rows)."""

    spans: frozenset[int]          # their indices in batch.spans
    pool: object                   # the KVPool of their caches
    rows: torch.Tensor             # (R,) int64: their rows in the batch, spans in order
    slots: torch.Tensor            # (R,) int64: each row's cache slot
    positions: torch.Tensor        # (R,) int64
    tables: torch.Tensor           # (R, width) int32: each row's sequence's block table
    ctx: torch.Tensor              # (R,) int32: keys each row sees, itself included
    lengths: tuple                 # ((PagedSeqView, n), ...): rows each cache gains per layer
    longest: int                   # the most keys a row sees (past index_topk, DSA selects)


def short_rows(batch, dev: torch.device, fresh: FreshPrompts | None, min_rows: int) -> ShortRows | None:
    """The spans of fewer than ``min_rows`` rows (decode and verify rows) in one paged pool, not
    among ``fresh``'s, as rows of the decode kernels (cached in ``batch.extras``); None: none."""
    if "mla_rows" in batch.extras:
        return batch.extras["mla_rows"]
    from exl3tools.runtime.kv_pool import PagedSeqView

    taken = fresh.spans if fresh is not None else frozenset()
    group = [si for si, sp in enumerate(batch.spans)
             if si not in taken and sp.n < min_rows and isinstance(sp.cache, PagedSeqView)]
    if group:
        pool = batch.spans[group[0]].cache.pool
        group = [si for si in group if batch.spans[si].cache.pool is pool]
    meta = None
    if group:
        spans = [batch.spans[si] for si in group]
        bs = pool.block_size
        width = max(-(-(sp.pos + sp.n) // bs) for sp in spans)
        tables = []
        for sp in spans:
            t = (sp.cache._slots[:sp.pos + sp.n:bs] // bs).to(torch.int32)
            tables.append(torch.nn.functional.pad(t, (0, width - t.shape[0])).expand(sp.n, -1))
        rows = torch.cat([torch.arange(sp.row, sp.row + sp.n) for sp in spans]).to(dev)
        positions = batch.positions.to(dev).index_select(0, rows)
        meta = ShortRows(frozenset(group), pool, rows,
                         torch.cat([sp.cache._slots[sp.pos:sp.pos + sp.n] for sp in spans]).to(dev),
                         positions, torch.cat(tables).to(dev), (positions + 1).to(torch.int32),
                         tuple((sp.cache, sp.n) for sp in spans), max(sp.pos + sp.n for sp in spans))
    batch.extras["mla_rows"] = meta
    return meta


def fresh_prompts(batch, index_topk: int, dev: torch.device, min_rows: int) -> FreshPrompts | None:
    """Which new prompts of ``batch`` attend as one padded batch (cached in ``batch.extras``): spans
    of at least ``min_rows`` rows with no history in a paged pool and, under DSA, no more rows than
    ``index_topk`` (so they select nothing). Padding at most doubles the rows: the longest
    prompts leave the group (and attend alone) until it does not. None: fewer than two."""
    key = ("mla_fresh", index_topk)
    if key in batch.extras:
        return batch.extras[key]
    from exl3tools.runtime.kv_pool import PagedSeqView

    cand = [(sp.n, si) for si, sp in enumerate(batch.spans)
            if sp.pos == 0 and sp.n >= min_rows and isinstance(sp.cache, PagedSeqView)
            and not (index_topk and sp.n > index_topk)]
    if cand:
        pool = batch.spans[cand[0][1]].cache.pool
        cand = sorted(c for c in cand if batch.spans[c[1]].cache.pool is pool)
    while len(cand) >= 2 and len(cand) * cand[-1][0] > 2 * sum(n for n, _ in cand):
        cand.pop()
    fresh = None
    if len(cand) >= 2:
        group = sorted(si for _, si in cand)
        m = max(batch.spans[si].n for si in group)
        gather, dst = [], []
        for si in group:
            sp = batch.spans[si]
            gather.extend([*range(sp.row, sp.row + sp.n), *[sp.row] * (m - sp.n)])
            dst.extend(range(sp.row, sp.row + sp.n))
        packed = torch.tensor(gather + dst, dtype=torch.int64).to(dev, non_blocking=True)
        G = len(gather)
        spans = [batch.spans[si] for si in group]
        fresh = FreshPrompts(frozenset(group), pool, torch.cat([sp.cache._slots[:sp.n] for sp in spans]),
                             packed[G:], packed[:G].view(len(group), m),
                             tuple((sp.cache, sp.n) for sp in spans), tuple((sp.row, sp.n) for sp in spans))
    batch.extras[key] = fresh
    return fresh

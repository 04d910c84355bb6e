"""Cut an EXL3 checkpoint into per-rank shards at 128-channel boundaries (docs/rank-slice.md).

``plan_rank_slices`` is pure (headers + config in, a RankPlan value out, no I/O beyond what
Checkpoint.open already read); ``write_rank_shards`` streams bytes from the source to the ranks:
each source shard is read once, sequentially, in bounded chunks, and every rank file is written
sequentially while it is hashed, so nothing is read back and peak memory stays at a few chunks.

This module is the public entry point; the code lives in small modules:
rank_cuts (SLICE_RULES, split arithmetic, cut decisions), rank_plan (plan values, fingerprints,
plan_rank_slices), rank_write (journal, copy paths, write_rank_shards) and vllm_hybrid
(--layout vllm-hybrid, dequantize_to_writer).
"""

from __future__ import annotations

from exl3tools.rank_cuts import SLICE_RULES, Cut, decide_cuts, split128
from exl3tools.rank_plan import (
    FORMAT,
    FORMAT_VERSION,
    OutTensor,
    RankPlan,
    ShardPlan,
    plan_rank_slices,
    source_info,
)
from exl3tools.rank_write import check_destination, write_rank_shards
from exl3tools.vllm_hybrid import dequantize_to_writer, plan_hybrid

__all__ = [
    "SLICE_RULES", "Cut", "decide_cuts", "split128",
    "FORMAT", "FORMAT_VERSION", "OutTensor", "RankPlan", "ShardPlan", "plan_rank_slices", "source_info",
    "check_destination", "write_rank_shards", "dequantize_to_writer", "plan_hybrid",
]

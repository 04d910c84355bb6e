"""rank-slice: cut an EXL3 checkpoint into per-rank shards at 128-channel boundaries (docs/rank-slice.md).

``plan_rank_slices`` is pure (headers + config in, a RankPlan value out, no I/O beyond what
Checkpoint.open already read); ``write_rank_shards`` streams bytes from the source to the ranks:
each source shard is read once, sequentially, in bounded chunks, and every rank file is written
sequentially while it is hashed, so nothing is read back and peak memory stays at a few chunks;
``verify_sliced`` proves an output reassembles to its source.

The package's floors, each importing only the ones below it:

    cuts (SLICE_RULES, split arithmetic, cut decisions) -> plan (plan values, fingerprints, layout
    "ranks") -> write (journal, copy paths, write_rank_shards) -> vllm_hybrid (layout "vllm-hybrid",
    dequantize_to_writer) -> verify -> plan_rank_slices() here, which picks the layout.
"""

from __future__ import annotations

from exl3tools.checkpoint.reader import Checkpoint
from exl3tools.errors import UsageError
from exl3tools.slicing.cuts import SLICE_RULES, Cut, decide_cuts, split128
from exl3tools.slicing.plan import (
    FORMAT,
    FORMAT_VERSION,
    OutTensor,
    RankPlan,
    ShardPlan,
    plan_ranks,
    source_info,
)
from exl3tools.slicing.verify import VerifyReport, verify_sliced
from exl3tools.slicing.vllm_hybrid import dequantize_to_writer, plan_hybrid
from exl3tools.slicing.write import check_destination, write_rank_shards

LAYOUTS = ("ranks", "vllm-hybrid")

__all__ = [
    "plan_rank_slices", "write_rank_shards", "check_destination", "verify_sliced", "VerifyReport",
    "dequantize_to_writer", "plan_hybrid", "source_info",
    "SLICE_RULES", "Cut", "decide_cuts", "split128", "FORMAT", "FORMAT_VERSION", "OutTensor", "RankPlan", "ShardPlan",
]


def plan_rank_slices(ck: Checkpoint, tp: int, moe: str = "tp", layout: str = "ranks") -> RankPlan:
    """The complete slicing plan (a value; nothing is written)."""
    if tp < 1:
        raise UsageError(f"--tp must be >= 1, got {tp}")
    if moe not in ("tp", "ep"):
        raise UsageError(f"--moe must be tp or ep, got {moe!r}")
    if layout not in LAYOUTS:
        raise UsageError(f"--layout must be ranks or vllm-hybrid, got {layout!r}")
    return plan_hybrid(ck, tp, moe) if layout == "vllm-hybrid" else plan_ranks(ck, tp, moe)

"""The paged KV cache's block manager (pure Python): allocation, prefix hits, reference counts,
LRU eviction, back-pressure."""

from __future__ import annotations

import pytest

from exl3tools.errors import UsageError
from exl3tools.runtime.block_manager import SCRATCH_BLOCK, BlockManager, OutOfBlocksError


def _run(bm: BlockManager, sid, tokens: list[int]) -> int:
    """open + reserve + commit, as the runner does for a prefill; returns the cached count."""
    cached = bm.open(sid, tokens)
    bm.reserve(sid, len(tokens) - cached)
    bm.commit(sid, tokens)
    return cached


def test_allocation_slots_and_scratch_block():
    bm = BlockManager(6, 4)
    assert bm.usable_blocks == 5 and bm.free_blocks() == 5
    bm.open("a")
    slots = bm.reserve("a", 6)
    table = bm.table("a")
    assert len(table) == 2 and SCRATCH_BLOCK not in table
    assert slots == [table[0] * 4 + i for i in range(4)] + [table[1] * 4, table[1] * 4 + 1]
    bm.commit("a", list(range(6)))
    assert bm.length("a") == 6 and bm.new_blocks_needed("a", 2) == 0 and bm.new_blocks_needed("a", 3) == 1
    assert bm.reserve("a", 2) == [table[1] * 4 + 2, table[1] * 4 + 3]
    bm.free("a")
    assert bm.free_blocks() == 5 and bm.sequences() == 0


def test_prefix_hit_shares_whole_blocks_and_leaves_the_last_token():
    bm = BlockManager(12, 4)
    prompt = list(range(100, 111))                     # 11 tokens: 2 full blocks + 3
    assert _run(bm, "a", prompt) == 0
    assert _run(bm, "b", prompt) == 8                  # 2 whole blocks; the rest is computed
    assert bm.table("b")[:2] == bm.table("a")[:2] and bm.table("b")[2] != bm.table("a")[2]
    exact = list(range(100, 108))                      # 8 tokens = 2 full blocks: the last is recomputed
    assert _run(bm, "c", exact) == 4
    other = [100, 101, 102, 103, 9, 9, 9, 9, 9]        # shares only the first block
    assert _run(bm, "d", other) == 4
    changed_head = [0] + prompt[1:]                    # same later blocks, other parent: no hit
    assert _run(bm, "e", changed_head) == 0
    st = bm.stats()
    assert st.hit_tokens == 16 and st.queried_tokens == 11 * 3 + 8 + 9


def test_refcounts_lru_eviction_and_back_pressure():
    bm = BlockManager(5, 2)                             # 4 usable blocks
    _run(bm, "a", [1, 2, 3, 4, 5])                     # 3 blocks, 2 full (hashed)
    _run(bm, "b", [1, 2, 3, 4, 9])                     # shares 2, needs 1 more
    assert bm.free_blocks() == 0
    bm.open("c")
    with pytest.raises(OutOfBlocksError, match="KV cache full"):
        bm.reserve("c", 1)
    assert bm.table("c") == []                         # nothing changed
    bm.free("a")                                        # shared blocks still held by b; a's tail is free
    assert bm.free_blocks() == 1
    bm.free("b")                                        # hashed blocks stay findable (cached, ref 0)
    assert bm.free_blocks() == 4
    assert _run(bm, "d", [1, 2, 3, 4, 7]) == 4          # found after everyone let go
    bm.free("d")
    bm.free("c")
    # fill the cache with other tokens: the cached chain is evicted, tail first, and forgotten
    _run(bm, "e", [50, 51, 52, 53, 54, 55, 56, 57])
    bm.free("e")
    assert _run(bm, "f", [1, 2, 3, 4, 7]) == 0


def test_errors():
    bm = BlockManager(8, 4)
    bm.open("a")
    bm.reserve("a", 10)
    bm.commit("a", list(range(7)))
    with pytest.raises(UsageError, match="already exists"):
        bm.open("a")
    with pytest.raises(UsageError, match="unknown"):
        bm.reserve("zz", 1)
    with pytest.raises(UsageError, match="beyond"):
        bm.commit("a", list(range(13)))              # 10 reserved: 3 blocks of 4
    with pytest.raises(UsageError):
        BlockManager(1, 4)


def test_no_prefix_caching():
    bm = BlockManager(10, 4, prefix_caching=False)
    _run(bm, "a", list(range(9)))
    assert _run(bm, "b", list(range(9))) == 0
    bm.free("a")
    bm.free("b")
    assert bm.free_blocks() == 9

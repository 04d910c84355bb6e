"""The paged KV cache's bookkeeping: fixed-size blocks, a block table per sequence, prefix caching.

Pure Python (no torch): the one owner of which cache block holds which tokens. The tensors live in
``runtime/kv_pool.py``; the runner asks this module where a sequence's next tokens go.

- Block 0 is reserved as scratch (padded rows of a CUDA-graph bucket write there); blocks
  1..num_blocks-1 are handed out.
- A *full* block that holds committed tokens gets a hash of (its parent block's hash, its token
  ids), so a block is found only under the same whole prefix. ``open`` hands a new sequence the
  longest chain of cached blocks that matches its tokens (a repeated system prompt or chat
  history is not recomputed); the tokens are compared too, so a hash collision cannot alias.
- Reference counts: a cached block shared by several sequences is freed when the last one goes.
  A freed block that carries a hash stays findable in an LRU list and is evicted (oldest first)
  only when a fresh block is needed and the free list is empty.
- Only a sequence's last, partial block is ever written after it was allocated, and a partial
  block is never shared, so no copy-on-write is needed.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from exl3tools.errors import RuntimeFailure, UsageError

SCRATCH_BLOCK = 0


class OutOfBlocksError(RuntimeFailure):
    """The paged KV cache has too few free blocks for the tokens asked for."""


@dataclass(slots=True)
class _Block:
    ref: int = 0
    hash: int | None = None
    tokens: tuple[int, ...] = ()


@dataclass(slots=True)
class _Seq:
    table: list[int] = field(default_factory=list)
    length: int = 0          # tokens written (committed) into the table's blocks
    hashed: int = 0          # leading blocks whose hash is registered
    last_hash: int | None = None


@dataclass(frozen=True, slots=True)
class PrefixStats:
    queried_tokens: int
    hit_tokens: int


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, *, prefix_caching: bool = True):
        if block_size < 1 or num_blocks < 2:
            raise UsageError(f"a paged cache needs block_size >= 1 and >= 2 blocks (got {block_size}, {num_blocks})")
        self.num_blocks, self.block_size, self.prefix_caching = int(num_blocks), int(block_size), prefix_caching
        self._blocks = [_Block() for _ in range(self.num_blocks)]
        self._free: list[int] = list(range(self.num_blocks - 1, SCRATCH_BLOCK, -1))   # pop() -> lowest id
        self._cached: OrderedDict[int, None] = OrderedDict()   # ref 0 blocks with a hash, LRU first
        self._by_hash: dict[int, int] = {}
        self._seqs: dict[Hashable, _Seq] = {}
        self.queried_tokens = 0
        self.hit_tokens = 0

    # ------------------------------------------------------------------ queries
    @property
    def usable_blocks(self) -> int:
        return self.num_blocks - 1

    def free_blocks(self) -> int:
        """Blocks a new allocation can take: free ones and cached ones nobody holds."""
        return len(self._free) + len(self._cached)

    def used_blocks(self) -> int:
        return self.usable_blocks - self.free_blocks()

    def blocks_for(self, tokens: int) -> int:
        return -(-int(tokens) // self.block_size)

    def length(self, seq_id: Hashable) -> int:
        return self._seq(seq_id).length

    def table(self, seq_id: Hashable) -> list[int]:
        return self._seq(seq_id).table

    def has(self, seq_id: Hashable) -> bool:
        return seq_id in self._seqs

    def sequences(self) -> int:
        return len(self._seqs)

    def new_blocks_needed(self, seq_id: Hashable | None, new_tokens: int) -> int:
        """Blocks that appending ``new_tokens`` to ``seq_id`` (None: a new empty sequence) takes."""
        s = self._seqs.get(seq_id) if seq_id is not None else None
        have, length = (len(s.table), s.length) if s is not None else (0, 0)
        return max(0, self.blocks_for(length + new_tokens) - have)

    def stats(self) -> PrefixStats:
        return PrefixStats(self.queried_tokens, self.hit_tokens)

    # ------------------------------------------------------------------ lifecycle
    def open(self, seq_id: Hashable, tokens: Sequence[int] = ()) -> int:
        """Start ``seq_id``; with prefix caching, claim the cached blocks that hold the longest
        whole-block prefix of ``tokens`` (at most len(tokens) - 1 tokens, so the last token is
        always computed and gives logits). Returns the number of tokens already cached."""
        if seq_id in self._seqs:
            raise UsageError(f"sequence {seq_id!r} already exists")
        s = self._seqs[seq_id] = _Seq()
        if not self.prefix_caching or len(tokens) < 2:
            return 0
        bs = self.block_size
        full = (len(tokens) - 1) // bs
        self.queried_tokens += len(tokens)
        parent = None
        for i in range(full):
            chunk = tuple(map(int, tokens[i * bs:(i + 1) * bs]))
            h = hash((parent, chunk))
            b = self._by_hash.get(h)
            if b is None or self._blocks[b].tokens != chunk:
                break
            self._take(b)
            s.table.append(b)
            parent = h
        s.length = s.hashed = len(s.table)
        s.length *= bs
        s.last_hash = parent
        self.hit_tokens += s.length
        return s.length

    def reserve(self, seq_id: Hashable, new_tokens: int) -> list[int]:
        """Grow ``seq_id``'s table to hold ``new_tokens`` more tokens; returns the slot (block *
        block_size + offset) of each new token. Raises OutOfBlocksError, changing nothing, when
        too few blocks are free."""
        s = self._seq(seq_id)
        need = self.new_blocks_needed(seq_id, new_tokens)
        if need > self.free_blocks():
            raise OutOfBlocksError(f"KV cache full: {need} more blocks needed, {self.free_blocks()} free "
                                   f"of {self.usable_blocks} ({self.block_size} tokens each)")
        for _ in range(need):
            s.table.append(self._fresh())
        return self.slots(seq_id, s.length, int(new_tokens))

    def slots(self, seq_id: Hashable, start: int, n: int) -> list[int]:
        """The slot (block * block_size + offset) of positions start .. start + n - 1 of ``seq_id``,
        whose table must already hold them."""
        table, bs = self._seq(seq_id).table, self.block_size
        return [table[p // bs] * bs + p % bs for p in range(start, start + n)]

    def advance(self, seq_id: Hashable, n: int) -> None:
        """``n`` reserved tokens are written but not known yet (a chained decode step reads its
        input token on the device): the length grows now; ``commit`` hashes their blocks later."""
        s = self._seq(seq_id)
        if s.length + n > len(s.table) * self.block_size:
            raise UsageError(f"sequence {seq_id!r}: advance of {n} tokens beyond its reserved blocks")
        s.length += n

    def commit(self, seq_id: Hashable, tokens: Sequence[int]) -> None:
        """``tokens`` (the sequence's whole history, prompt + output) are now written up to
        ``len(tokens)``: advance the length and register the hashes of blocks that became full."""
        s = self._seq(seq_id)
        n = len(tokens)
        if n > len(s.table) * self.block_size:
            raise UsageError(f"sequence {seq_id!r}: commit of {n} tokens beyond its reserved blocks")
        s.length = n
        if not self.prefix_caching:
            return
        bs = self.block_size
        while s.hashed < n // bs:
            i = s.hashed
            chunk = tuple(map(int, tokens[i * bs:(i + 1) * bs]))
            h = hash((s.last_hash, chunk))
            b = s.table[i]
            blk = self._blocks[b]
            if blk.hash is None and h not in self._by_hash:   # first writer of this prefix owns the hash
                blk.hash, blk.tokens = h, chunk
                self._by_hash[h] = b
            s.hashed, s.last_hash = i + 1, h

    def trim(self, seq_id: Hashable) -> None:
        """Give back the table's blocks past its committed length (slots reserved for drafts that
        speculative decoding rejected; such blocks were never full, so never hashed)."""
        s = self._seq(seq_id)
        keep = self.blocks_for(s.length)
        while len(s.table) > keep:
            self._release(s.table.pop())

    def free(self, seq_id: Hashable) -> None:
        s = self._seqs.pop(seq_id, None)
        if s is None:
            return
        for b in reversed(s.table):        # tail first: the LRU evicts a chain's tail before its head
            self._release(b)

    # ------------------------------------------------------------------ internals
    def _seq(self, seq_id: Hashable) -> _Seq:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise UsageError(f"unknown sequence {seq_id!r}") from None

    def _take(self, b: int) -> None:
        blk = self._blocks[b]
        if blk.ref == 0:
            self._cached.pop(b, None)
        blk.ref += 1

    def _fresh(self) -> int:
        if self._free:
            b = self._free.pop()
        else:
            b, _ = self._cached.popitem(last=False)      # evict the least recently freed
            blk = self._blocks[b]
            del self._by_hash[blk.hash]
            blk.hash, blk.tokens = None, ()
        self._blocks[b].ref = 1
        return b

    def _release(self, b: int) -> None:
        blk = self._blocks[b]
        blk.ref -= 1
        if blk.ref == 0:
            if blk.hash is not None:
                self._cached[b] = None
            else:
                self._free.append(b)

"""The paged KV cache's tensors: per layer, named planes of ``num_blocks * block_size`` token slots.

A layer says what it keeps per token through ``cache_spec()`` (GQA: ``k``/``v`` of shape
(kv_heads, head_dim); MLA: the latent ``ckv``, the rope key ``kpe`` and DSA's indexer keys
``kidx``), so one pool serves every attention kind. Slot ``s`` of a plane holds the token at
offset ``s % block_size`` of block ``s // block_size``; ``runtime/block_manager.py`` decides which
blocks a sequence owns.

``kv_dtype_for`` picks the planes' dtype (``--kv-cache-dtype``), ``bytes_per_token`` and
``mtp_budget`` size the KV budget.

``PagedSeqView`` gives the eager forward (``CausalLM.forward``) SeqCache's interface over one
sequence's blocks for the length of one step: ``extend`` writes the new rows into their slots and
returns the whole history gathered back (what the attention reads).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from exl3tools.errors import UsageError


@dataclass(frozen=True, slots=True)
class PlaneSpec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype | None = None     # None: the pool's KV dtype


def layer_specs(model) -> list[tuple[PlaneSpec, ...]]:
    """What each decoder layer caches per token, in cache-index order."""
    specs: dict[int, tuple[PlaneSpec, ...]] = {}
    for layer in model.layers:
        attn = layer.attn
        specs[attn.layer] = tuple(attn.cache_spec())
    if sorted(specs) != list(range(len(specs))):
        raise ValueError(f"layer cache indices are not 0..{len(specs) - 1}: {sorted(specs)}")
    return [specs[i] for i in range(len(specs))]


def bytes_per_token(specs: list[tuple[PlaneSpec, ...]], dtype: torch.dtype) -> int:
    total = 0
    for layer in specs:
        for p in layer:
            n = 1
            for d in p.shape:
                n *= d
            total += n * torch.empty((), dtype=p.dtype or dtype).element_size()
    return total


def mtp_cache_bytes_per_token(model, speculative_tokens: int) -> int:
    """Bytes per token of the MTP head's own cache (one layer per drafting sequence, a SeqCache
    outside the pool, grown by doubling from MIN_CAPACITY tokens); 0 without speculative decoding.
    Every token it holds the pool holds too, so the KV budget counts it: 2x per pool token, plus
    MIN_CAPACITY tokens per sequence."""
    if not speculative_tokens or getattr(model, "mtp", None) is None:
        return 0
    return bytes_per_token([tuple(model.mtp.block.attn.cache_spec())], torch.float32)


def mtp_budget(model, speculative_tokens: int, dtype: torch.dtype, *, paged: bool) -> tuple[int, int]:
    """What the MTP head's cache takes from the KV budget: (bytes per pool token, bytes per
    sequence). ``paged`` (the default, PagedState.head_pool): one layer's planes in the pool's
    dtype beside every pool slot, nothing per sequence. Else a SeqCache per drafting sequence in
    float32 (mtp_cache_bytes_per_token): 2x its bytes per pool token and MIN_CAPACITY tokens per
    sequence. Charging the eager head's float32 twice with the head paged left 44 of 136 GB unused
    on the H200 (GLM-5 shape, --speculative-tokens 1-3, 2026-12-02)."""
    from exl3tools.runtime.cache import MIN_CAPACITY

    if not speculative_tokens or getattr(model, "mtp", None) is None:
        return 0, 0
    if paged:
        return bytes_per_token([tuple(model.mtp.block.attn.cache_spec())], dtype), 0
    m = mtp_cache_bytes_per_token(model, speculative_tokens)
    return 2 * m, m * MIN_CAPACITY


def kv_dtype_for(name: str, device: torch.device, *, mla: bool = False) -> torch.dtype:
    """"auto": on CUDA bfloat16, and float16 for MLA models (their split kernel's fp16 tensor-core
    dots ran 4-11x faster than fp32 planes on the H200, bench/gpu_mla_attention.py; exllamav3
    caches the latent in fp16 too); float32 on the CPU (the reference path stays exact)."""
    table = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
             "fp32": torch.float32, "float32": torch.float32}
    if name == "auto":
        if device.type != "cuda":
            return torch.float32
        return torch.float16 if mla else torch.bfloat16
    if name not in table:
        raise UsageError(f"--kv-cache-dtype must be auto, bf16, fp16 or fp32, got {name!r}")
    return table[name]


class KVPool:
    def __init__(self, specs: list[tuple[PlaneSpec, ...]], num_blocks: int, block_size: int,
                 dtype: torch.dtype, device):
        self.specs, self.num_blocks, self.block_size = specs, int(num_blocks), int(block_size)
        self.dtype, self.device = dtype, torch.device(device)
        slots = self.num_blocks * self.block_size
        # zeroed: a padded graph row reads nothing, but a NaN left in memory must never reach a sum
        self.planes: list[dict[str, torch.Tensor]] = [
            {p.name: torch.zeros((slots, *p.shape), dtype=p.dtype or dtype, device=self.device) for p in layer}
            for layer in specs]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.planes for t in layer.values())

    def blocks(self, layer: int, name: str) -> torch.Tensor:
        """The plane as (num_blocks, block_size, *shape): what paged attention kernels take."""
        t = self.planes[layer][name]
        return t.view(self.num_blocks, self.block_size, *t.shape[1:])

    def slots(self, table: list[int], n: int) -> torch.Tensor:
        """Slot ids of token positions 0..n-1 of a sequence with block ``table`` (int64, device)."""
        bs = self.block_size
        t = torch.tensor(table[:-(-n // bs)], dtype=torch.int64)
        return (t[:, None] * bs + torch.arange(bs)).reshape(-1)[:n].to(self.device, non_blocking=True)


class PagedSeqView:
    """One sequence's cache for one forward: ``length`` tokens already in ``slots[:length]``; the
    step's new tokens go to the following slots (runtime.cache.SeqCache's interface)."""

    __slots__ = ("pool", "_slots", "lengths")

    def __init__(self, pool: KVPool, slots: torch.Tensor, length: int):
        self.pool, self._slots = pool, slots
        self.lengths = [int(length)] * len(pool.planes)

    @property
    def length(self) -> int:
        return self.lengths[0]

    def extend(self, layer: int, new: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        n0 = self.lengths[layer]
        n = next(iter(new.values())).shape[0]
        idx = self._slots[n0:n0 + n]
        planes = self.pool.planes[layer]
        for name, t in new.items():
            planes[name].index_copy_(0, idx, t.to(planes[name].dtype))
        self.lengths[layer] = n0 + n
        hist = self._slots[:n0 + n]
        # read back through the cache: the new rows as stored (rounded to the KV dtype), as decode sees them
        return {name: planes[name].index_select(0, hist).to(t.dtype) for name, t in new.items()}

"""Tensor-parallel context: who we are and the two collectives the model needs.

One process per rank. ``TPContext(1, 0)`` is the single-process case: every collective is a no-op,
so model code is written once. Column-parallel outputs stay local; row-parallel (and
expert-parallel) partial sums go through ``all_reduce``; vocab-split logits through ``all_gather``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class TPContext:
    world: int = 1
    rank: int = 0

    @property
    def active(self) -> bool:
        return self.world > 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            import torch.distributed as dist

            dist.all_reduce(x)
        return x

    def sizes(self, n: int) -> list[int]:
        """Every rank's ``n``, in rank order (an object collective: a host sync, never in a step)."""
        if self.world == 1:
            return [n]
        import torch.distributed as dist

        out: list = [None] * self.world
        dist.all_gather_object(out, int(n))
        return out

    def all_gather_cat(self, x: torch.Tensor, sizes: list[int], dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's ``x`` along ``dim``, where rank r's is ``sizes[r]`` long there
        (``sizes``, gathered once: tensor collectives only, so a CUDA graph can capture it)."""
        if self.world == 1:
            return x
        import torch.distributed as dist

        dev = x.device
        if x.is_cuda and dist.get_backend() == "gloo":   # gloo gathers no CUDA tensors (EXL3TOOLS_TP_ONE_GPU)
            x = x.cpu()
        pad = max(sizes) - x.shape[dim]
        if pad:
            shape = list(x.shape)
            shape[dim] = pad
            x = torch.cat([x, x.new_zeros(shape)], dim=dim)
        parts = [torch.empty_like(x) for _ in range(self.world)]
        dist.all_gather(parts, x.contiguous())
        parts = [p.narrow(dim, 0, s) for p, s in zip(parts, sizes, strict=True)]
        return torch.cat(parts, dim=dim).to(dev)


SINGLE = TPContext()


def even_split(total: int, world: int, unit: int) -> list[tuple[int, int]]:
    """Cut ``total`` (a multiple of ``unit``) into ``world`` contiguous ranges of whole units,
    as even as possible (earlier ranks take the remainder)."""
    units = total // unit
    base, extra = divmod(units, world)
    out, a = [], 0
    for r in range(world):
        b = a + (base + (1 if r < extra else 0)) * unit
        out.append((a, b))
        a = b
    return out

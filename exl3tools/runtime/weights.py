"""Tensors of one rank as torch: reads only this checkpoint's files, optionally cut in memory.

A ``Cut`` applies the slicing rules of exl3-format.md §8.2 while reading (byte ranges, never the
whole tensor), so an unsliced checkpoint can be run with TP > 1 exactly as a rank-slice output
would be: the model code only ever sees the local shapes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from exl3tools.checkpoint.reader import Checkpoint
from exl3tools.errors import CheckpointError, MissingTensorError
from exl3tools.exl3 import TILE, k_from_width, marker_ok, unpack_signs

# Load progress: progress_hook(bytes just read, bytes in this checkpoint) after every tensor read.
# The CLI sets it while it loads (exl3tools.cli._runtime.LoadProgress); None: silent.
progress_hook: Callable[[int, int], None] | None = None


@dataclass(frozen=True, slots=True)
class Cut:
    """Keep ``[first, last)`` of a linear's padded output (``col``) or input (``row``) dim."""

    kind: str          # "col" | "row"
    first: int
    last: int
    bias_here: bool = True  # row cuts: the bias lives on exactly one rank (first == 0)


@dataclass(slots=True)
class LinearFields:
    prefix: str
    tensors: dict[str, torch.Tensor]   # trellis/suh/svh/bias, or weight (dense fallback)
    codebook: str | None               # None for a dense (unquantized) linear
    k_bits: float | None
    in_features: int                   # padded, local
    out_features: int                  # padded, local


class WeightSource:
    """Reads tensors of one checkpoint directory (a whole model or one rank's slice)."""

    def __init__(self, ckpt: Checkpoint):
        self.ckpt = ckpt

    def has(self, name: str) -> bool:
        return name in self.ckpt.tensors

    def names(self) -> list[str]:
        return list(self.ckpt.tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.ckpt.ref(name).shape)

    def numpy(self, name: str, dim: int | None = None, first: int = 0, last: int = 0) -> np.ndarray:
        arr = self.ckpt.read_numpy(name) if dim is None else self.ckpt.read_numpy_slice(name, dim, first, last)
        if progress_hook is not None:
            progress_hook(arr.size * self.ckpt.ref(name).info.itemsize, self.total_bytes)  # bytes on disk
        return arr

    @cached_property
    def total_bytes(self) -> int:
        return sum(ref.info.nbytes for ref in self.ckpt.tensors.values())

    def tensor(self, name: str, dtype: torch.dtype | None = torch.float32, dim: int | None = None,
               first: int = 0, last: int = 0) -> torch.Tensor:
        arr = self.numpy(name, dim, first, last)
        t = torch.from_numpy(np.ascontiguousarray(arr))
        return t if dtype is None else t.to(dtype)

    def is_linear(self, prefix: str) -> bool:
        return self.has(f"{prefix}.trellis") or self.has(f"{prefix}.weight")

    def linear(self, prefix: str, cut: Cut | None = None) -> LinearFields:
        """The stored fields of linear ``prefix`` (EXL3, or a dense ``.weight`` fallback)."""
        if not self.has(f"{prefix}.trellis"):
            return self._dense(prefix, cut)
        tshape = self.shape(f"{prefix}.trellis")
        if len(tshape) != 3:
            raise CheckpointError(f"{prefix}.trellis has shape {tshape}, expected rank 3")
        k_bits = k_from_width(tshape[-1])
        if k_bits is None:
            raise CheckpointError(f"{prefix}.trellis: illegal width {tshape[-1]}")
        codebook = "3inst"
        for m in ("mcg", "mul1"):
            if self.has(f"{prefix}.{m}"):
                if codebook != "3inst":
                    raise CheckpointError(f"{prefix}: both mcg and mul1 markers")
                if not marker_ok(m, int(self.numpy(f"{prefix}.{m}").reshape(()))):
                    raise CheckpointError(f"{prefix}.{m}: wrong marker value")
                codebook = m
        k, n = tshape[0] * TILE, tshape[1] * TILE
        t: dict[str, torch.Tensor] = {}
        su = self._sign_vec(prefix, "suh", "su", k)
        sv = self._sign_vec(prefix, "svh", "sv", n)
        bias = self.has(f"{prefix}.bias")
        if cut is None:
            t["trellis"] = self.tensor(f"{prefix}.trellis", None)
            t["suh"], t["svh"] = su, sv
            if bias:
                t["bias"] = self.tensor(f"{prefix}.bias", torch.float16)
        elif cut.kind == "col":
            t["trellis"] = self.tensor(f"{prefix}.trellis", None, 1, cut.first // TILE, cut.last // TILE)
            t["suh"], t["svh"] = su, sv[cut.first:cut.last].clone()
            if bias:
                t["bias"] = self.tensor(f"{prefix}.bias", torch.float16, 0, cut.first, cut.last)
            n = cut.last - cut.first
        else:
            t["trellis"] = self.tensor(f"{prefix}.trellis", None, 0, cut.first // TILE, cut.last // TILE)
            t["suh"], t["svh"] = su[cut.first:cut.last].clone(), sv
            if bias and cut.bias_here:
                t["bias"] = self.tensor(f"{prefix}.bias", torch.float16)
            k = cut.last - cut.first
        return LinearFields(prefix, t, codebook, k_bits, k, n)

    def _sign_vec(self, prefix: str, name: str, legacy: str, size: int) -> torch.Tensor:
        if self.has(f"{prefix}.{name}"):
            return self.tensor(f"{prefix}.{name}", torch.float16)
        if self.has(f"{prefix}.{legacy}"):
            return torch.from_numpy(unpack_signs(self.numpy(f"{prefix}.{legacy}")))
        raise MissingTensorError(f"{self.ckpt.root}: linear {prefix} has no {name} (or {legacy})")

    def _dense(self, prefix: str, cut: Cut | None) -> LinearFields:
        name = f"{prefix}.weight"
        if not self.has(name):
            raise MissingTensorError(f"{self.ckpt.root}: no linear {prefix} (neither .trellis nor .weight)")
        w = self.tensor(name).t().contiguous()          # HF (out, in) -> (in, out)
        b = self.tensor(f"{prefix}.bias") if self.has(f"{prefix}.bias") else None
        if cut is not None and cut.kind == "col":
            w = w[:, cut.first:cut.last].contiguous()
            b = None if b is None else b[cut.first:cut.last].contiguous()
        elif cut is not None:
            w = w[cut.first:cut.last].contiguous()
            b = b if cut.bias_here else None
        t = {"weight": w}
        if b is not None:
            t["bias"] = b
        return LinearFields(prefix, t, None, None, w.shape[0], w.shape[1])

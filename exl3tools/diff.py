"""diff: how far two checkpoints' linears are apart, per linear and per layer (schemas/diff.v1.json).

A and B are two EXL3 checkpoints (another bitrate or codebook), or EXL3 and a plain HF checkpoint
(bf16/fp16/fp32 ``.weight``, e.g. one ``exl3tools dequantize`` wrote). Each linear present in both
is read as HF rows (out, in) at its real dims, EXL3 decoded by the reference decoder
(dequantize.linear_rows), ``SLAB_COLUMNS`` output channels at a time from both sides, and reduced
to four sums (float64), so memory stays bounded by one slab pair whatever the model. B is the
reference:

    rel_err = ||A - B||_F / ||B||_F      sqnr_db = 10 log10(||B||^2 / ||A - B||^2)  (null: identical)
    cosine  = <A, B> / (||A|| ||B||)     (1 exactly when identical)

A layer (``model.layers.N``; the head and other linears are their own rows) sums its linears'
sums. Rows are sorted worst first (largest rel_err). Biases, norms and embeddings are not compared.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from exl3tools.checkpoint import Checkpoint
from exl3tools.dequantize import SLAB_COLUMNS, linear_rows, refuse_undecodable
from exl3tools.errors import CheckpointError, UsageError
from exl3tools.exl3 import fmt_k
from exl3tools.layout import layer_of, real_dims, scan_refs

SCHEMA_ID = "https://exl3tools.dev/schemas/diff.v1.json"
_FLOAT = ("F32", "F16", "BF16")


@dataclass(frozen=True, slots=True)
class DiffRow:
    name: str
    elements: int
    rel_err: float
    sqnr_db: float | None      # None: A == B exactly (infinite SQNR)
    cosine: float
    a: str = ""                # what each side stores ("exl3 3 mcg", "bf16"); layers: ""
    b: str = ""


@dataclass(frozen=True, slots=True)
class DiffReport:
    a: str
    b: str
    linears: list[DiffRow]
    layers: list[DiffRow]
    missing_in_a: list[str] = field(default_factory=list)
    missing_in_b: list[str] = field(default_factory=list)
    activations: dict[str, Any] | None = None   # diff --prompt/--token-ids (runtime/evaluate.py)

    def to_json(self) -> dict[str, Any]:
        return {"$schema": SCHEMA_ID, "schema_version": 1, **asdict(self)}


class _Sums:
    __slots__ = ("d2", "a2", "b2", "ab", "n")

    def __init__(self) -> None:
        self.d2 = self.a2 = self.b2 = self.ab = 0.0
        self.n = 0

    def add(self, a: np.ndarray, b: np.ndarray) -> None:
        a, b = a.astype(np.float64), b.astype(np.float64)
        d = a - b
        self.d2 += float((d * d).sum())
        self.a2 += float((a * a).sum())
        self.b2 += float((b * b).sum())
        self.ab += float((a * b).sum())
        self.n += a.size

    def merge(self, o: _Sums) -> None:
        self.d2, self.a2, self.b2, self.ab, self.n = (self.d2 + o.d2, self.a2 + o.a2, self.b2 + o.b2,
                                                      self.ab + o.ab, self.n + o.n)

    def row(self, name: str, a: str = "", b: str = "") -> DiffRow:
        if self.d2 == 0.0:
            return DiffRow(name, self.n, 0.0, None, 1.0, a, b)
        rel = math.sqrt(self.d2 / self.b2) if self.b2 > 0 else math.inf
        sqnr = 10 * math.log10(self.b2 / self.d2) if self.b2 > 0 else -math.inf
        cos = self.ab / math.sqrt(self.a2 * self.b2) if self.a2 > 0 and self.b2 > 0 else 0.0
        return DiffRow(name, self.n, rel, sqnr, cos, a, b)


class _Side:
    """One checkpoint's linears as HF rows, EXL3 or dense."""

    def __init__(self, ck: Checkpoint):
        self.ck = ck
        L = ck.config.get("num_hidden_layers")
        self.scan = scan_refs(ck.tensors, L if isinstance(L, int) else None)
        self.dims = real_dims(ck.config, ck.tensors)

    def has(self, p: str) -> bool:
        return p in self.scan.linears or f"{p}.weight" in self.ck.tensors

    def describe(self, p: str) -> str:
        lin = self.scan.linears.get(p)
        if lin is not None:
            return f"exl3 {fmt_k(lin.bits) if lin.bits else '?'} {lin.codebook}"
        return self.ck.tensors[f"{p}.weight"].dtype.lower()

    def shape(self, p: str) -> tuple[int, int]:
        lin = self.scan.linears.get(p)
        if lin is not None:
            i_r, o_r = self.dims.get(p, (lin.k, lin.n))
            return o_r, i_r
        ref = self.ck.tensors[f"{p}.weight"]
        if len(ref.shape) != 2 or ref.dtype not in _FLOAT:
            raise CheckpointError(f"{self.ck.root}: {p}.weight is {ref.dtype} {list(ref.shape)}, "
                                  "not a 2-D float weight")
        return int(ref.shape[0]), int(ref.shape[1])

    def rows(self, p: str, shape: tuple[int, int]) -> Iterator[np.ndarray]:
        if p in self.scan.linears:
            yield from linear_rows(self.ck, p, shape)
            return
        for c0 in range(0, shape[0], SLAB_COLUMNS):
            yield self.ck.read_numpy_slice(f"{p}.weight", 0, c0, min(c0 + SLAB_COLUMNS, shape[0]))


def _layer_key(p: str) -> str:
    i = layer_of(p)
    return p if i is None else f"model.layers.{i}"


def diff_checkpoints(a: Checkpoint, b: Checkpoint, *,
                     progress: Callable[[int, int], None] | None = None) -> DiffReport:
    """Compare every linear present in both (see module doc). ``progress(done, total)`` per linear."""
    sa, sb = _Side(a), _Side(b)
    if not sa.scan.linears and not sb.scan.linears:
        raise UsageError(f"neither {a.root} nor {b.root} is an EXL3 checkpoint (no trellis tensors)")
    if a.architecture != b.architecture:
        raise UsageError(f"{a.root} is {a.architecture} but {b.root} is {b.architecture}")
    names = sorted(set(sa.scan.linears) | set(sb.scan.linears))
    common = [p for p in names if sa.has(p) and sb.has(p)]
    if not common:
        raise UsageError(f"{a.root} and {b.root} have no linear in common")
    for side in (sa, sb):
        refuse_undecodable(side.ck, set(common) & set(side.scan.linears))
    linears, layers = [], {}
    for i, p in enumerate(common):
        shape = sa.shape(p)
        if sb.shape(p) != shape:
            raise CheckpointError(f"{b.root}: {p} is {list(sb.shape(p))} (out, in) but {list(shape)} in {a.root}")
        sums = _Sums()
        for ra, rb in zip(sa.rows(p, shape), sb.rows(p, shape), strict=True):
            sums.add(ra, rb)
        for side, total in ((a, sums.a2), (b, sums.b2)):
            if not math.isfinite(total):  # NaN/Inf in a scale or weight: no ratio means anything (nor is JSON)
                raise CheckpointError(f"{side.root}: {p} holds NaN or Inf values (exl3tools validate names "
                                      "the tensor)")
        linears.append(sums.row(p, sa.describe(p), sb.describe(p)))
        layers.setdefault(_layer_key(p), _Sums()).merge(sums)
        if progress is not None:
            progress(i + 1, len(common))

    def worst_first(rows: list[DiffRow]) -> list[DiffRow]:
        return sorted(rows, key=lambda r: (-r.rel_err, r.name))

    return DiffReport(str(a.root), str(b.root), worst_first(linears),
                      worst_first([s.row(k) for k, s in layers.items()]),
                      [p for p in names if not sa.has(p)], [p for p in names if not sb.has(p)])

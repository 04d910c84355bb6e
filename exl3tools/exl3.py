"""EXL3 facts (exl3-format.md §3): tile size, tensor suffixes, markers, bitrate from trellis width."""

from __future__ import annotations

from fractions import Fraction

import numpy as np

TILE = 16
BLOCK = 128  # Hadamard block; the only exact cut granularity (§8.1)

MCG_MARKER = 0xCBAC1FED   # int32 -877912083
MUL1_MARKER = 0x83DCD12D  # int32 -2082680531
MARKERS = {"mcg": MCG_MARKER, "mul1": MUL1_MARKER}
CODEBOOKS = ("3inst", "mcg", "mul1")

LINEAR_SUFFIXES = ("trellis", "suh", "svh", "su", "sv", "bias", "mcg", "mul1", "scale")

# trellis last dim (int16 words per tile) -> K
WIDTH_TO_K: dict[int, float] = {16 * k: float(k) for k in range(1, 9)}
WIDTH_TO_K.update({24: 1.5, 40: 2.5, 56: 3.5})
HALF_WIDTHS = frozenset({24, 40, 56})


def k_from_width(width: int) -> float | None:
    """Bits per weight for a trellis last dim, None if illegal."""
    return WIDTH_TO_K.get(width)


def width_from_k(k: float) -> int:
    f = Fraction(k).limit_denominator(2)
    if f.denominator == 1 and 1 <= f <= 8:
        return 16 * int(f)
    if f.denominator == 2 and f in (Fraction(3, 2), Fraction(5, 2), Fraction(7, 2)):
        return 16 * int(f) + 8
    raise ValueError(f"illegal EXL3 bitrate K={k}")


def fmt_k(k: float) -> str:
    return str(int(k)) if float(k).is_integer() else str(k)


def marker_ok(name: str, value: int) -> bool:
    return (int(value) & 0xFFFFFFFF) == MARKERS[name]


def marker_bytes(name: str) -> bytes:
    return MARKERS[name].to_bytes(4, "little")


def unpack_signs(packed: np.ndarray) -> np.ndarray:
    """Legacy su/sv: int16 [n/16], bit i (LSB first) of word w -> element 16w+i; set bit = -1 (§5.9)."""
    words = packed.astype("<i2").view("<u2").astype(np.uint32)
    bits = (words[:, None] >> np.arange(16, dtype=np.uint32)[None, :]) & 1
    return np.where(bits.reshape(-1) == 1, -1.0, 1.0).astype(np.float16)


def pack_signs(signs: np.ndarray) -> np.ndarray:
    neg = (np.asarray(signs, dtype=np.float32) < 0).reshape(-1, 16).astype(np.uint32)
    words = (neg << np.arange(16, dtype=np.uint32)[None, :]).sum(axis=1).astype(np.uint16)
    return words.view(np.int16)

"""Copy one source tensor, whole or sliced, into the writers that want it.

Every byte is read with pread: a source truncated while it is copied is a CheckpointError naming the
file ("file ends before byte N"), never a SIGBUS from touching a memory map past its end.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from exl3tools.checkpoint.reader import pread_fd
from exl3tools.checkpoint.writer import FileRange

CHUNK_BYTES = 32 << 20   # bound on one contiguous piece handed to a writer
STRIDED_BYTES = 8 << 20  # rows read at once for strided (column) cuts: one such buffer per reader
SMALL_COPY = 1 << 20     # pieces below this travel as bytes even where the writer could copy in-kernel


@dataclass(frozen=True, slots=True)
class Part:
    """A target's slice for ``copy_tensor``: rows ``start:stop`` of dimension ``dim`` (None: whole)."""

    dim: int | None = None
    start: int | None = None
    stop: int | None = None


WHOLE = Part()


def copy_tensor(fd: int, begin: int, shape: tuple[int, ...], itemsize: int, targets: list[tuple[Any, Any]],
                progress: Callable[[int], None], *, path: Path | None = None, ranges: bool = False) -> None:
    """Feed every ``(writer, slice)`` target its part of the tensor at ``begin``; a slice has ``dim``
    (None = whole), ``start`` and ``stop``. Contiguous parts (whole tensors, dim-0 slices) go out in
    chunks: as FileRange when ``ranges`` (the writer hashes them and copies them in-kernel), else as
    bytes. Strided parts are gathered from chunks of whole dim-0 rows."""
    nbytes = math.prod(shape) * itemsize
    if nbytes == 0:
        return
    row = nbytes // shape[0] if shape else nbytes

    def send(w: Any, off: int, n: int) -> None:
        for o in range(off, off + n, CHUNK_BYTES):
            m = min(CHUNK_BYTES, off + n - o)
            w.write(FileRange(fd, o, m, path) if ranges and m >= SMALL_COPY else pread_fd(fd, o, m, path))
            progress(m)

    strided = []
    for w, t in targets:
        if t.dim is None:
            send(w, begin, nbytes)
        elif t.dim == 0:
            send(w, begin + t.start * row, (t.stop - t.start) * row)
        else:
            strided.append((w, t))
    step = max(1, STRIDED_BYTES // row)
    for r0 in range(0, shape[0] if strided else 0, step):
        r1 = min(shape[0], r0 + step)
        raw = pread_fd(fd, begin + r0 * row, (r1 - r0) * row, path)
        arr = np.frombuffer(raw, np.uint8).reshape((r1 - r0,) + shape[1:] + (itemsize,))
        for w, t in strided:
            idx: list[slice] = [slice(None)] * arr.ndim
            idx[t.dim] = slice(t.start, t.stop)
            piece = memoryview(np.ascontiguousarray(arr[tuple(idx)]).reshape(-1))
            w.write(piece)
            progress(piece.nbytes)

"""Crash-safe output files: write to a temp name, hash while writing, fsync, then rename.

ShardWriter writes one safetensors file sequentially (header first, then the tensors in header
order); the sha256 of the whole file is known when it closes, so nothing is read back. Indexes and
manifests are written last by the callers, through ``write_atomic``.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from exl3tools.checkpoint.header import header_bytes
from exl3tools.checkpoint.reader import pread_fd
from exl3tools.errors import CheckpointError, UsageError


def tmp_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp")


def _write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data).cast("B")
    while view:
        n = os.write(fd, view)
        view = view[n:]


class ShardWriter:
    """Sequential safetensors writer: ``write(bytes)`` in header order, then ``close()``."""

    def __init__(self, path: str | os.PathLike[str], tensors: list[tuple[str, str, tuple[int, ...]]]):
        self.path = Path(path)
        self.tmp = tmp_name(self.path)
        head, offsets = header_bytes(tensors)
        self.expected = len(head) + (offsets[-1][1] if offsets else 0)
        self.sha = hashlib.sha256()
        self.fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self.written = 0
        self.write(head)

    def write(self, data: bytes | memoryview) -> None:
        view = memoryview(data).cast("B")
        self.sha.update(view)
        _write_all(self.fd, view)
        self.written += view.nbytes

    def close(self) -> tuple[int, str]:
        """fsync + rename; returns (size, sha256)."""
        if self.written != self.expected:
            self.abort()
            raise RuntimeError(f"{self.path}: wrote {self.written} bytes, header promised {self.expected}")
        os.fsync(self.fd)
        os.close(self.fd)
        os.replace(self.tmp, self.path)
        return self.written, self.sha.hexdigest()

    def abort(self) -> None:
        try:
            os.close(self.fd)
        except OSError:
            pass
        self.tmp.unlink(missing_ok=True)


class NullWriter:
    """Stands in for a file that --resume found complete: accepts and drops bytes."""

    def write(self, data: bytes | memoryview) -> None:
        pass

    def close(self) -> None:
        return None

    def abort(self) -> None:
        pass


def write_atomic(path: str | os.PathLike[str], data: bytes) -> tuple[int, str]:
    """Write a small file via temp + fsync + rename; returns (size, sha256)."""
    def dump(fd: int) -> None:
        _write_all(fd, data)

    _atomic(Path(path), dump)
    return len(data), hashlib.sha256(data).hexdigest()


def write_atomic_text(path: str | os.PathLike[str], dump: Any) -> None:
    """Stream text into a file via temp + fsync + rename: ``dump(fh)`` writes it."""
    def via_text(fd: int) -> None:
        with open(fd, "w", encoding="utf-8", buffering=1 << 20, closefd=False) as fh:
            dump(fh)

    _atomic(Path(path), via_text)


def copy_atomic(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
    """Copy a (small) file via temp + fsync + rename; a failed copy leaves nothing behind."""
    def fill(fd: int) -> None:
        with open(src, "rb") as f:
            while b := f.read(16 << 20):
                _write_all(fd, b)

    _atomic(Path(dst), fill)


def _atomic(p: Path, fill: Any) -> None:
    """``fill(fd)`` writes the temp file; fsync, rename. On any failure (a full disk) the temp file is
    removed: a failed write leaves nothing behind."""
    tmp = tmp_name(p)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        try:
            fill(fd)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, p)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def refuse_overlap(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
    """An output that is its source, lies inside it or holds it would be written over the files it is
    read from (``rank-slice M M`` overwrote M/config.json)."""
    s, d = Path(src).resolve(), Path(dst).resolve()
    if s == d or s in d.parents or d in s.parents:
        how = "is" if s == d else "is inside" if s in d.parents else "contains"
        raise UsageError(f"{dst}: the output {how} the source {src}; choose a destination outside it")


def json_bytes(obj: object, indent: int | None = 2) -> bytes:
    return (json.dumps(obj, indent=indent) + "\n").encode()


def index_json(weight_map: dict[str, str], total_size: int) -> bytes:
    """The same bytes as ``json_bytes({"metadata": ..., "weight_map": ...}, indent=4)``, but with one
    C-encoded string per name: the stdlib encodes any indented JSON in pure Python (~15 s for 10^6
    names)."""
    if not weight_map:
        return json_bytes({"metadata": {"total_size": total_size}, "weight_map": weight_map}, indent=4)
    enc = json.encoder.encode_basestring_ascii
    body = ",\n".join(f"        {enc(k)}: {enc(v)}" for k, v in weight_map.items())
    return (f'{{\n    "metadata": {{\n        "total_size": {json.dumps(total_size)}\n    }},\n'
            f'    "weight_map": {{\n{body}\n    }}\n}}\n').encode()


def fsync_dir(path: str | os.PathLike[str]) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@dataclass(frozen=True, slots=True)
class FileRange:
    """``length`` bytes at ``offset`` of an open source file: an AsyncShardWriter hashes them (read by
    pread, so a source truncated meanwhile is an error, not a SIGBUS) and copies them in-kernel
    (copy_file_range)."""
    fd: int
    offset: int
    length: int
    path: Path | None = None

    @property
    def nbytes(self) -> int:
        return self.length


def _nbytes(item: Any) -> int:
    return item.length if isinstance(item, FileRange) else memoryview(item).nbytes


WRITEBACK_STEP = 64 << 20
HASH_STEP = 1 << 20  # a FileRange is hashed in pieces of this size (one buffer per writer thread)


class ByteBudget:
    """Bytes queued for writing, shared by every AsyncShardWriter of one job: bounds peak memory."""

    def __init__(self, limit: int = 192 << 20):
        import threading

        self.cv = threading.Condition()
        self.used = 0
        self.limit = limit

    def take(self, n: int) -> None:
        with self.cv:
            while self.used > 0 and self.used + n > self.limit:
                self.cv.wait()
            self.used += n

    def give(self, n: int) -> None:
        with self.cv:
            self.used -= n
            self.cv.notify_all()


class AsyncShardWriter(ShardWriter):
    """ShardWriter whose hashing and writing run on a background thread (hashlib and os.write release
    the GIL), so one reader can feed several output files on several cores. ``write`` blocks while
    the shared ByteBudget is exhausted, which bounds memory."""

    def __init__(self, path: str | os.PathLike[str], tensors: list[tuple[str, str, tuple[int, ...]]],
                 budget: ByteBudget | None = None):
        import queue
        import threading

        self._q: queue.Queue = queue.Queue()
        self._budget = budget or ByteBudget()
        self._flushed = 0
        self._err: BaseException | None = None
        super().__init__(path, tensors)   # writes the header synchronously
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            n = _nbytes(item)
            try:
                if self._err is None:
                    if isinstance(item, FileRange):
                        self._copy_range(item)
                    else:
                        ShardWriter.write(self, item)
                    if self.written - self._flushed >= WRITEBACK_STEP:
                        # start writeback of what is written and drop it from the page cache: the
                        # final fsync has little left to do, and a 700 GB job does not flood memory
                        os.posix_fadvise(self.fd, self._flushed, self.written - self._flushed,
                                         os.POSIX_FADV_DONTNEED)
                        self._flushed = self.written
            except BaseException as exc:  # reported by close()
                self._err = exc
            del item
            self._budget.give(n)

    _in_kernel = True  # copy_file_range works between these files (cleared on EXDEV and friends)

    def _copy_range(self, r: FileRange) -> None:
        for off in range(r.offset, r.offset + r.length, HASH_STEP):  # bounded memory per writer
            piece = pread_fd(r.fd, off, min(HASH_STEP, r.offset + r.length - off), r.path)
            self.sha.update(piece)
            if not self._in_kernel:
                _write_all(self.fd, piece)
        off, left = r.offset, r.length
        while left and self._in_kernel:
            try:
                n = os.copy_file_range(r.fd, self.fd, left, off)
            except OSError as exc:
                if exc.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP) or left != r.length:
                    raise
                self._in_kernel = False   # e.g. source and output on different filesystems
                for o in range(r.offset, r.offset + r.length, HASH_STEP):
                    _write_all(self.fd, pread_fd(r.fd, o, min(HASH_STEP, r.offset + r.length - o), r.path))
                break
            if n <= 0:
                raise CheckpointError(f"{r.path or '<source>'}: file ends before byte {off + left} (truncated "
                                      "while it was copied)")
            off += n
            left -= n
        self.written += r.length

    def write(self, data: bytes | memoryview) -> None:
        if not hasattr(self, "_t"):          # the header, from __init__
            ShardWriter.write(self, data)
            return
        self._budget.take(_nbytes(data))
        self._q.put(data)

    def _drain(self) -> None:
        self._q.put(None)
        self._t.join()

    def close(self) -> tuple[int, str]:
        self._drain()
        if self._err is not None:
            ShardWriter.abort(self)
            raise self._err
        return ShardWriter.close(self)

    def abort(self) -> None:
        if self._t.is_alive():
            self._err = self._err or RuntimeError("aborted")
            self._drain()
        ShardWriter.abort(self)

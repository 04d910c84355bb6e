"""Every file the offline tools read whole (config.json, the index, quantization_config.json, a
rank-slice manifest, tokenizer/generation configs, the rank-slice journal), read one way.

Threats, each with its check:
- a symlink to /dev/zero (or /dev/urandom) never ends: only regular files are read, decided by
  fstat on the opened descriptor (after the kernel resolved every symlink), never by the name;
- a FIFO blocks ``open`` forever: it is opened with O_NONBLOCK, then refused by the same fstat;
- a multi-GB file: its size is checked before reading, and the read stops at the limit anyway
  (a file that grows while it is read);
- ``[[[[...]]]]`` nested 10^5 deep: every consumer that recurses (json.dumps, jsonschema, deepcopy)
  hits Python's recursion limit. The nesting is measured on the bytes, before parsing.
Errors name the file and the problem in one line (CheckpointError by default, exit 1).
"""

from __future__ import annotations

import gc
import json
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from exl3tools.errors import CheckpointError, NotFoundError

MAX_JSON_BYTES = 64 << 20       # config / index: a GLM-5 index is ~20 MB
# quantization_config.json's tensor_storage holds ~1.2 KB per EXL3 linear (exllamav3 writes it
# indented): 72 MB at GLM-5's 59k linears (bench/synth_checkpoint.py --arch glm5 --layers 78)
MAX_QUANT_CONFIG_BYTES = 256 << 20
LIMITS = {"quantization_config.json": MAX_QUANT_CONFIG_BYTES}   # by file, else MAX_JSON_BYTES
MAX_MANIFEST_BYTES = 512 << 20  # a rank manifest grows with tensors x ranks (GLM-5 at tp 8: ~125 MB)
MAX_JSON_DEPTH = 64             # real configs nest 4 deep; Python's recursion limit is 1000
# arrays + objects per byte: real configs, indexes and manifests hold one per 64+ bytes; 60 MB of
# "[]," (one per 3) took validate 8 s and 1.9 GB to parse
JSON_BYTES_PER_CONTAINER = 16
MAX_JSON_CONTAINERS = 1 << 22   # whatever the size (~0.4 GB of Python objects); GLM-5's qconfig: 0.6M
MAX_TEXT_BYTES = 256 << 20      # tokenizer.json and friends, copied verbatim

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def loads_stdlib(raw: bytes | bytearray | memoryview) -> Any:
    """loads_json without orjson: str() decodes a memoryview too (the header reader passes views)."""
    return json.loads(str(raw, "utf-8"))


try:  # orjson parses a 240k-tensor GLM-5 header ~1.8x faster than the stdlib; both are strict JSON
    import orjson

    def loads_json(raw: bytes | bytearray | memoryview) -> Any:
        return orjson.loads(raw)
except ImportError:  # orjson is a dependency, but an environment without it must still read headers
    loads_json = loads_stdlib


@contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic GC while building ~10^6 small acyclic objects (a 256-expert header):
    its generation-0 passes otherwise cost ~3x the parse itself."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def kind_of_mode(mode: int) -> str:
    """'a FIFO (named pipe)', 'a directory', ... for a stat mode that is not a regular file."""
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def path_kind(path: str | os.PathLike[str]) -> str | None:
    """None when ``path`` (symlinks followed) does not exist; "file" for a regular file; otherwise what
    it is ("a FIFO (named pipe)", "a directory", ...). Never opens the path."""
    try:
        mode = os.stat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        return f"unreadable ({exc.strerror or exc})"
    return "file" if stat.S_ISREG(mode) else kind_of_mode(mode)


def _where(path: str | os.PathLike[str], what: str) -> str:
    """How a message starts: "x/model.bin: safetensors file", or just "x/config.json:" when ``what``
    would repeat the file name."""
    return f"{path}:" if os.path.basename(path) == what else f"{path}: {what}"


def not_regular(path: str | os.PathLike[str], what: str, kind: str) -> str:
    """The one-line message for a name that exists but is not a regular file."""
    return f"{_where(path, what)} is {kind}, not a regular file"


def open_regular(path: str | os.PathLike[str], what: str, error: type[Exception] = CheckpointError) -> int:
    """An O_RDONLY descriptor of ``path``, which must be a regular file once symlinks are resolved.

    O_NONBLOCK: opening a FIFO for reading must not wait for a writer (it would wait forever);
    it has no effect on regular files.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise NotFoundError(f"{_where(path, what)} does not exist") from None
    try:
        mode = os.fstat(fd).st_mode
    except BaseException:
        os.close(fd)
        raise
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise error(not_regular(path, what, kind_of_mode(mode)))
    return fd


def read_regular(path: str | os.PathLike[str], what: str, limit: int,
                 error: type[Exception] = CheckpointError) -> bytes:
    """The whole content of a regular file of at most ``limit`` bytes."""
    fd = open_regular(path, what, error)
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise error(f"{_where(path, what)} is {size} bytes, more than the {limit}-byte limit")
        chunks, got = [], 0
        while got <= limit:  # read to EOF, but never past the limit (the file may be growing)
            b = os.read(fd, min(limit + 1 - got, 16 << 20))
            if not b:
                break
            chunks.append(b)
            got += len(b)
    finally:
        os.close(fd)
    if got > limit:
        raise error(f"{_where(path, what)} grew past the {limit}-byte limit while it was read")
    return b"".join(chunks)


def load_json(path: str | os.PathLike[str], what: str, *, limit: int | None = None,
              max_depth: int = MAX_JSON_DEPTH, error: type[Exception] = CheckpointError) -> Any:
    """Parse a JSON file that is regular, at most ``limit`` bytes (default: LIMITS[what], else
    MAX_JSON_BYTES) and at most ``max_depth`` deep."""
    limit = limit or LIMITS.get(what, MAX_JSON_BYTES)
    return loads_bounded(read_regular(path, what, limit, error), _where(path, what), max_depth, error)


def loads_bounded(raw: bytes, where: str, max_depth: int = MAX_JSON_DEPTH,
                  error: type[Exception] = CheckpointError) -> Any:
    """Parse ``raw``; ``where`` ("path:" or "path: what") starts the error message."""
    deepest, n = shape_past(raw, max_depth)
    if deepest > max_depth:
        raise error(f"{where} nests deeper than {max_depth} levels")
    cap = min(len(raw) // JSON_BYTES_PER_CONTAINER, MAX_JSON_CONTAINERS) + 65536
    if n > cap:
        raise error(f"{where} holds {n} JSON arrays and objects in {len(raw)} bytes, more than a real file "
                    f"(at most {cap}: a nesting bomb)")
    try:
        with gc_paused():  # a GLM-5 index / tensor_storage holds ~10^6 small objects
            return loads_json(raw)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:  # JSONDecodeError is a ValueError
        raise error(f"{where} is not valid JSON ({exc.__class__.__name__})") from None


# ----------------------------------------------------------------------------- nesting depth
_QUOTE, _BACKSLASH = ord('"'), ord("\\")
_STEP = np.zeros(256, np.int8)  # +1 opens a container, -1 closes one
_STEP[[ord("["), ord("{")]] = 1
_STEP[[ord("]"), ord("}")]] = -1
_CHUNK = 4 << 20  # bounds the temporaries to a few x 4 MiB whatever the file size


def _structure(raw: bytes | bytearray, start: int = 0, end: int | None = None,
               commas: bool = False) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Per segment of ``raw[start:end]``: (absolute positions, nesting depth after each) of the
    brackets (and commas, if asked) that lie outside JSON strings. Vectorised, O(end - start), a few
    x 4 MiB of temporaries whatever the size.

    A quote is a string delimiter unless an odd run of backslashes precedes it; structure between an
    odd and an even delimiter is string content. Invalid JSON gives some answer; the parser that runs
    next rejects it either way.
    """
    end = len(raw) if end is None else end
    a = np.frombuffer(raw, np.uint8)
    depth = quotes = run = 0  # carried across segments: depth, delimiters so far, trailing backslashes
    for s in range(start, end, _CHUNK):
        e = min(s + _CHUNK, end)
        seg = a[s:e]
        q = np.flatnonzero(seg == _QUOTE)
        if run or raw.find(b"\\", s, e) >= 0:
            # last[i] = index of the last non-backslash at or before i; -1 - run stands for the one
            # before a run that started in an earlier segment
            last = np.where(seg != _BACKSLASH, np.arange(len(seg), dtype=np.int64), -1 - run)
            np.maximum.accumulate(last, out=last)
            before = np.where(q > 0, last[np.maximum(q - 1, 0)], -1 - run)
            q = q[(q - 1 - before) % 2 == 0]  # an even run (often 0) before it: a real delimiter
            run = len(seg) - 1 - int(last[-1])
        low = seg | 32  # '[' | 32 == '{' and ']' | 32 == '}': one compare per side
        hit = (low == ord("{")) | (low == ord("}"))
        if commas:
            hit |= seg == ord(",")
        br = np.flatnonzero(hit)
        quotes_before = np.searchsorted(q, br) + quotes
        quotes += q.size
        br = br[(quotes_before & 1) == 0]
        if br.size:
            levels = np.cumsum(_STEP[seg[br]], dtype=np.int64) + depth
            depth = int(levels[-1])
            yield br + s, levels


def shape(raw: bytes | bytearray) -> tuple[int, int]:
    """(deepest nesting, arrays and objects opened) outside JSON strings, in one vectorised pass."""
    deepest = n = depth = 0
    for _, levels in _structure(raw):
        deepest = max(deepest, int(levels.max()))
        n += (len(levels) + int(levels[-1]) - depth) // 2    # opens - closes = the change of depth
        depth = int(levels[-1])
    return deepest, n


def shape_past(raw: bytes | bytearray, limit: int) -> tuple[int, int]:
    """``shape(raw)``, or (0, 0) when ``raw`` holds at most ``limit`` brackets at all, strings
    included (then neither figure can pass ``limit``): the usual case, counted in C, no scan."""
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return 0, 0
    return shape(raw)


def split_object(raw: bytes | bytearray, start: int, end: int, piece: int) -> list[tuple[int, int]] | None:
    """Split the JSON object in ``raw[start:end]`` into byte ranges of whole members (``"k": v, ...``,
    without braces or the commas between ranges), each with about ``piece`` structural characters
    (brackets and commas) or fewer beyond its last member, so that each can be parsed on its own as
    ``{`` + range + ``}`` with bounded memory. None when the text is not one object with at least one
    member: the caller parses it whole, and that parse words the error.
    """
    pos_parts, lev_parts = [], []
    for pos, levels in _structure(raw, start, end, commas=True):
        pos_parts.append(pos)
        lev_parts.append(levels)
    if not pos_parts:
        return None
    pos, levels = np.concatenate(pos_parts), np.concatenate(lev_parts)
    first, last = int(pos[0]), int(pos[-1])
    if (raw[first] != ord("{") or raw[last] != ord("}") or int(levels[-1]) != 0 or int(levels[:-1].min()) < 1
            or raw[start:first].strip() or raw[last + 1:end].strip()):
        return None
    top = np.flatnonzero((levels == 1) & (np.frombuffer(raw, np.uint8)[pos] == ord(",")))
    cut = top[np.flatnonzero(np.diff(top // piece, prepend=0) > 0)]  # the first comma of each new piece
    bounds = [first, *(int(pos[i]) for i in cut), last]
    ranges = [(a + 1, b) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    if len(ranges) > 1 and any(not raw[a:b].strip() for a, b in ranges):
        return None  # "{,", ",,", ",}": not JSON, and a piece would parse as {}
    return ranges



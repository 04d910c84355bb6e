"""safetensors header: bytes -> Header, treating every byte as hostile.

Layout: u64 little-endian N, then N bytes of JSON, then the data buffer. Each tensor entry is
``{"dtype", "shape", "data_offsets": [begin, end]}`` with offsets relative to the data buffer.
Fatal problems raise HeaderError with a stable ``code`` (the validate rule it maps to); problems
that leave every tensor readable (gaps, trailing bytes) are recorded in ``Header.issues``.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from exl3tools.checkpoint.jsonio import gc_paused, loads_json, open_regular, split_object
from exl3tools.errors import HeaderError, NotFoundError

# safetensors dtype -> (itemsize in bytes, numpy dtype string or None where numpy has none)
DTYPES: dict[str, tuple[int, str | None]] = {
    "BOOL": (1, "bool"), "U8": (1, "u1"), "I8": (1, "i1"), "F8_E4M3": (1, None), "F8_E5M2": (1, None),
    "I16": (2, "<i2"), "U16": (2, "<u2"), "F16": (2, "<f2"), "BF16": (2, None),
    "I32": (4, "<i4"), "U32": (4, "<u4"), "F32": (4, "<f4"),
    "I64": (8, "<i8"), "U64": (8, "<u8"), "F64": (8, "<f8"),
}

# A real header of a 256-expert, 79-layer GLM-5 shard is a few MB; 100 MB is the safetensors
# library's own limit. Anything larger is a length bomb, not a header.
MAX_HEADER_BYTES = 100 * 1024 * 1024
MAX_NDIM = 8


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int  # absolute file offset of the first byte
    end: int    # absolute file offset one past the last byte

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype][0]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True, slots=True)
class Header:
    path: str
    header_len: int            # N, the JSON length
    data_start: int            # 8 + N
    file_size: int
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str] | None
    issues: tuple[tuple[str, str], ...] = field(default=())  # (code, message), non-fatal


def _fail(path: str, code: str, message: str) -> HeaderError:
    err = HeaderError(f"{path}: {message}")
    err.code = code  # type: ignore[attr-defined]
    return err


_ITEMSIZE = {k: v[0] for k, v in DTYPES.items()}
_INT_ONLY = frozenset((int,))
# object.__new__ plus the slot setters: what the frozen dataclass __init__ does, without its per-field
# object.__setattr__ calls (237k TensorInfos per GLM-5 checkpoint)
_INFO_SETTERS = (object.__new__, *(TensorInfo.__dict__[f].__set__ for f in ("name", "dtype", "shape", "begin", "end")))

def parse_header(raw_prefix: bytes | bytearray, file_size: int, path: str = "<bytes>") -> Header:
    """Parse a header from the first bytes of a file (at least 8 + N bytes of it)."""
    with gc_paused():
        return _parse_header(raw_prefix, file_size, path)


def _parse_header(raw_prefix: bytes | bytearray, file_size: int, path: str) -> Header:
    if file_size < 8 or len(raw_prefix) < 8:
        raise _fail(path, "E102", f"file is {file_size} bytes, too short for a safetensors header")
    n = int.from_bytes(raw_prefix[:8], "little")
    if n > MAX_HEADER_BYTES:
        raise _fail(path, "E102", f"header length {n} exceeds the {MAX_HEADER_BYTES}-byte limit (length bomb)")
    if 8 + n > file_size:
        raise _fail(path, "E102", f"header length {n} runs past the end of the {file_size}-byte file (truncated)")
    if len(raw_prefix) < 8 + n:
        raise _fail(path, "E102", "header truncated")
    _refuse_nesting_bombs(raw_prefix, n, path)
    data_start = 8 + n
    data_len = file_size - data_start
    metadata = None
    tensors: dict[str, TensorInfo] = {}
    spans: list[tuple[int, int, str]] = []
    # (dtype, shape) -> (bytes, shape tuple): a GLM-5 shard has ~6k tensors but only ~50 distinct shapes
    known: dict[tuple[str, tuple], tuple[int, tuple[int, ...]]] = {}
    new, set_name, set_dtype, set_shape, set_begin, set_end = _INFO_SETTERS
    for obj, p0, p1, wrapped in _pieces(raw_prefix, n, path):
        if "__metadata__" in obj:
            if metadata is not None:
                raise _fail(path, "E104", "key '__metadata__' appears twice in the header")
            metadata = obj.pop("__metadata__")
            if not (isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())):
                raise _fail(path, "E104", "__metadata__ must map strings to strings")
        before = len(tensors)
        pop = obj.pop
        for name in list(obj):
            # each parsed entry is dropped as soon as its TensorInfo exists: a 10^6-entry header never
            # holds both forms in full
            entry = pop(name)
            if name in tensors:  # the same name in two pieces of a split header
                raise _fail(path, "E104", f"key {name!r} appears twice in the header (a JSON parser keeps either one)")
            if type(entry) is not dict and not isinstance(entry, dict):
                raise _fail(path, "E104", f"tensor {name!r}: entry is not an object")
            dtype, shape, offs = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
            try:
                hit = known.get((dtype, tuple(shape))) if type(shape) is list else None
            except TypeError:  # unhashable dtype or dims: the checks below word the error
                hit = None
            # a hit means equal values; `type(d) is int` still has to hold (True == 1, 2.0 == 2)
            if hit is not None and _INT_ONLY.issuperset(map(type, shape)):
                expected, shape_t = hit
            else:
                # a list or object as dtype is unhashable: only a string can name one
                size = _ITEMSIZE.get(dtype) if type(dtype) is str else None
                if size is None:
                    raise _fail(path, "E104", f"tensor {name!r}: unknown dtype {dtype!r}")
                # `type(x) is int` on purpose: bool is an int subclass and must not pass as a dim or offset
                if type(shape) is not list or len(shape) > MAX_NDIM or not all(type(d) is int and d >= 0 for d in shape):
                    raise _fail(path, "E104", f"tensor {name!r}: bad shape {shape!r}")
                expected, shape_t = math.prod(shape) * size, tuple(shape)
                if len(known) < 4096:  # distinct shapes are few; a hostile header must not grow it
                    known[(dtype, shape_t)] = (expected, shape_t)
            if type(offs) is not list or len(offs) != 2 or type(offs[0]) is not int or type(offs[1]) is not int:
                raise _fail(path, "E104", f"tensor {name!r}: bad data_offsets {offs!r}")
            b, e = offs
            if b < 0 or e < b or e > data_len:
                raise _fail(path, "E105", f"tensor {name!r}: data_offsets [{b}, {e}] outside the {data_len}-byte data buffer")
            if e - b != expected:
                raise _fail(path, "E108", f"tensor {name!r}: {dtype}{shape} needs {expected} bytes, offsets span {e - b}")
            b += data_start
            e += data_start
            t = new(TensorInfo)  # TensorInfo(name, dtype, shape_t, b, e) at half the cost of the frozen __init__
            set_name(t, name)
            set_dtype(t, dtype)
            set_shape(t, shape_t)
            set_begin(t, b)
            set_end(t, e)
            tensors[name] = t
            if e > b:
                spans.append((b, e, name))

        dup = _duplicate_key(raw_prefix, p0, p1, len(tensors) - before, wrapped)
        if dup is not None:
            raise _fail(path, "E104", f"key {dup!r} appears twice in the header (a JSON parser keeps either one)")
    issues: list[tuple[str, str]] = []
    spans.sort()
    pos = data_start
    for b, e, name in spans:
        if b < pos:
            raise _fail(path, "E106", f"tensor {name!r} overlaps the tensor before it")
        if b > pos:
            issues.append(("E107", f"{path}: {b - pos}-byte hole before tensor {name!r}"))
        pos = e
    if pos < file_size:
        issues.append(("E109", f"{path}: {file_size - pos} unreferenced bytes after the last tensor"))
    return Header(path, n, data_start, file_size, tensors, metadata, tuple(issues))


_ENTRY_KEYS = (b'"dtype"', b'"shape"', b'"data_offsets"')


SPLIT_HEADER_BYTES = 8 << 20  # larger headers are parsed in pieces ...
PIECE_VALUES = 1 << 18        # ... of about this many brackets and commas (~25k tensor entries)


_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')
_NOT_BRACKETS = bytes(sorted(set(range(256)) - set(b"[]{}")))
_SKELETON = re.compile(rb"\{(?:\{\[\]\[\]\}|\{\})*\}")   # the root, of entries and __metadata__


def _refuse_nesting_bombs(raw: bytes | bytearray, n: int, path: str) -> None:
    """A safetensors header has one shape: an object of entry objects holding two int arrays each
    (and ``__metadata__``: strings). Where its arrays and objects could outnumber that (a large
    header, or more brackets than 3 per entry), its bracket skeleton outside strings must be
    ``{`` + (``{[][]}`` | ``{}``)* + ``}``: 90 MB of nested empty lists took validate 49 s and 3.2 GB
    to parse before any entry check saw them."""
    brackets = raw.count(b"[", 8, 8 + n) + raw.count(b"{", 8, 8 + n)
    if n <= SPLIT_HEADER_BYTES and brackets <= 3 * raw.count(b'"data_offsets"', 8, 8 + n) + 64:
        return
    skeleton = _JSON_STRING.sub(b"", memoryview(raw)[8:8 + n]).translate(None, _NOT_BRACKETS)
    if _SKELETON.fullmatch(skeleton) is None:
        raise _fail(path, "E104", "header nests arrays or objects where a safetensors header has none "
                    f"({brackets} of them in {n} bytes: a nesting bomb)")


def _pieces(raw: bytes | bytearray, n: int, path: str) -> Iterator[tuple[dict, int, int, bool]]:
    """The header object as (dict, start, end, wrapped): whole, or for a header over 8 MiB in pieces of
    whole members (``raw[start:end]`` wrapped in braces), so a 10^6-entry header never exists as one
    tree of 10^7 Python objects (peak memory ~ the raw bytes plus one piece)."""
    ranges = split_object(raw, 8, 8 + n, PIECE_VALUES) if n > SPLIT_HEADER_BYTES else None
    texts = [(memoryview(raw)[8:8 + n], 8, 8 + n, False)] if ranges is None else \
        ((b"{" + raw[a:b] + b"}", a, b, True) for a, b in ranges)
    for text, a, b, wrapped in texts:
        try:  # a view, not a copy, when whole: the JSON of a hostile header is up to 100 MB
            obj = loads_json(text)
        except (UnicodeDecodeError, ValueError, RecursionError) as exc:  # JSONDecodeError is a ValueError
            raise _fail(path, "E103", f"header is not valid JSON ({type(exc).__name__})") from None
        if not isinstance(obj, dict):
            raise _fail(path, "E103", "header JSON is not an object")
        yield obj, a, b, wrapped
        del obj, text


def _duplicate_key(raw: bytes | bytearray, start: int, end: int, entries: int, wrapped: bool) -> str | None:
    """A key repeated in one JSON object of the header (two entries of one tensor, or one key twice in
    an entry), or None. Parsers disagree on which copy wins, so the file means different things to
    different loaders. Fast path: each entry key occurs exactly once per tensor; only otherwise
    (duplicates, or those strings inside names or metadata) is the header re-parsed pair by pair."""
    if all(raw.count(k, start, end) == entries for k in _ENTRY_KEYS):
        return None
    found: list[str] = []

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        d = dict(items)
        if len(d) != len(items) and not found:
            seen: set[str] = set()
            for k, _ in items:
                if k in seen:
                    found.append(k)
                    break
                seen.add(k)
        return d

    text = raw[start:end].decode("utf-8")
    json.loads("{" + text + "}" if wrapped else text, object_pairs_hook=pairs)
    return found[0] if found else None


def read_header(path: str | os.PathLike[str]) -> Header:
    """Read and parse only the header of a safetensors file (never the data)."""
    p = str(path)
    try:  # a FIFO, directory or device named *.safetensors is refused, not opened for reading
        fd = open_regular(p, "file", HeaderError)
    except NotFoundError:
        raise _fail(p, "E101", "file does not exist") from None
    except HeaderError as exc:
        raise _fail(p, "E101", str(exc)[len(p) + 2:]) from None
    try:
        size = os.fstat(fd).st_size
        first = os.pread(fd, 8, 0)
        if len(first) < 8:
            raise _fail(p, "E102", f"file is {size} bytes, too short for a safetensors header")
        n = int.from_bytes(first, "little")
        if n > MAX_HEADER_BYTES or 8 + n > size:
            return parse_header(first, size, p)  # raises with the right message
        raw = bytearray(8 + n)  # read in place: no second copy of a header of up to 100 MB
        raw[:8] = first
        got = 8
        while got < 8 + n:
            k = os.preadv(fd, [memoryview(raw)[got:]], got)
            if k <= 0:
                break
            got += k
        return parse_header(raw if got == 8 + n else raw[:got], size, p)
    finally:
        os.close(fd)


def header_bytes(tensors: list[tuple[str, str, tuple[int, ...]]], metadata: dict[str, str] | None = None,
                 align: int = 8) -> tuple[bytes, list[tuple[int, int]]]:
    """Serialize a header for tensors laid out in order; returns (8+N bytes, relative offsets).

    The JSON is padded with spaces so the data buffer starts 8-byte aligned (safetensors allows it).
    """
    obj: dict[str, object] = {}
    if metadata:
        obj["__metadata__"] = metadata
    offsets = []
    pos = 0
    for name, dtype, shape in tensors:
        nb = math.prod(shape) * DTYPES[dtype][0]
        obj[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [pos, pos + nb]}
        offsets.append((pos, pos + nb))
        pos += nb
    js = json.dumps(obj, separators=(",", ":")).encode()
    pad = (-(8 + len(js))) % align
    js += b" " * pad
    return len(js).to_bytes(8, "little") + js, offsets


def describe(path: Path | str) -> str:
    return str(path)

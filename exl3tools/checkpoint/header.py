"""safetensors header: bytes -> Header, treating every byte as hostile.

Layout: u64 little-endian N, then N bytes of JSON, then the data buffer. Each tensor entry is
``{"dtype", "shape", "data_offsets": [begin, end]}`` with offsets relative to the data buffer.
Fatal problems raise HeaderError with a stable ``code`` (the validate rule it maps to); problems
that leave every tensor readable (gaps, trailing bytes) are recorded in ``Header.issues``.
"""

from __future__ import annotations

import gc
import json
import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from exl3tools.errors import HeaderError

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

try:  # orjson parses a 240k-tensor GLM-5 header ~1.8x faster than the stdlib; both are strict JSON
    import orjson

    def loads_json(raw: bytes) -> Any:
        return orjson.loads(raw)
except ImportError:  # pragma: no cover - orjson is a dependency, but the stdlib is enough
    def loads_json(raw: bytes) -> Any:
        return json.loads(raw.decode("utf-8"))


def parse_header(raw_prefix: bytes, file_size: int, path: str = "<bytes>") -> Header:
    """Parse a header from the first bytes of a file (at least 8 + N bytes of it)."""
    with gc_paused():
        return _parse_header(raw_prefix, file_size, path)


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


def _parse_header(raw_prefix: bytes, file_size: int, path: str) -> Header:
    if file_size < 8 or len(raw_prefix) < 8:
        raise _fail(path, "E102", f"file is {file_size} bytes, too short for a safetensors header")
    n = int.from_bytes(raw_prefix[:8], "little")
    if n > MAX_HEADER_BYTES:
        raise _fail(path, "E102", f"header length {n} exceeds the {MAX_HEADER_BYTES}-byte limit (length bomb)")
    if 8 + n > file_size:
        raise _fail(path, "E102", f"header length {n} runs past the end of the {file_size}-byte file (truncated)")
    if len(raw_prefix) < 8 + n:
        raise _fail(path, "E102", "header truncated")
    try:
        obj = loads_json(raw_prefix[8:8 + n])
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:  # JSONDecodeError is a ValueError
        raise _fail(path, "E103", f"header is not valid JSON ({type(exc).__name__})") from None
    if not isinstance(obj, dict):
        raise _fail(path, "E103", "header JSON is not an object")
    data_start = 8 + n
    data_len = file_size - data_start
    metadata = obj.pop("__metadata__", None)
    if metadata is not None and not (isinstance(metadata, dict)
                                     and all(isinstance(v, str) for v in metadata.values())):
        raise _fail(path, "E104", "__metadata__ must map strings to strings")

    tensors: dict[str, TensorInfo] = {}
    spans: list[tuple[int, int, str]] = []
    # (dtype, shape) -> (bytes, shape tuple): a GLM-5 shard has ~6k tensors but only ~50 distinct shapes
    known: dict[tuple[str, tuple], tuple[int, tuple[int, ...]]] = {}
    new, set_name, set_dtype, set_shape, set_begin, set_end = _INFO_SETTERS
    for name, entry in obj.items():
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
            size = _ITEMSIZE.get(dtype)  # type: ignore[arg-type]
            if size is None:
                raise _fail(path, "E104", f"tensor {name!r}: unknown dtype {dtype!r}")
            # `type(x) is int` on purpose: bool is an int subclass and must not pass as a dim or offset
            if type(shape) is not list or len(shape) > MAX_NDIM or not all(type(d) is int and d >= 0 for d in shape):
                raise _fail(path, "E104", f"tensor {name!r}: bad shape {shape!r}")
            expected, shape_t = math.prod(shape) * size, tuple(shape)
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


def read_header(path: str | os.PathLike[str]) -> Header:
    """Read and parse only the header of a safetensors file (never the data)."""
    p = str(path)
    try:
        fd = os.open(p, os.O_RDONLY)
    except FileNotFoundError:
        raise _fail(p, "E101", "file does not exist") from None
    try:
        size = os.fstat(fd).st_size
        first = os.pread(fd, 8, 0)
        if len(first) < 8:
            raise _fail(p, "E102", f"file is {size} bytes, too short for a safetensors header")
        n = int.from_bytes(first, "little")
        if n > MAX_HEADER_BYTES or 8 + n > size:
            return parse_header(first, size, p)  # raises with the right message
        raw = first + os.pread(fd, n, 8)
        return parse_header(raw, size, p)
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

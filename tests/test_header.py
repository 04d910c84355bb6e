"""Hostile safetensors headers: each attack is refused with a stable code, never a traceback or a hang."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from exl3tools.checkpoint.header import MAX_HEADER_BYTES, header_bytes, parse_header, read_header
from exl3tools.checkpoint.reader import slice_runs
from exl3tools.errors import HeaderError


def _raw(obj, data=b"", n=None):
    js = json.dumps(obj).encode()
    return struct.pack("<Q", len(js) if n is None else n) + js + data


def _parse(raw):
    return parse_header(raw, len(raw), "x.safetensors")


def _code(raw):
    with pytest.raises(HeaderError) as ei:
        _parse(raw)
    assert "x.safetensors" in str(ei.value)
    return ei.value.code


GOOD = {"a": {"dtype": "F16", "shape": [2, 2], "data_offsets": [0, 8]}}


def test_good_header_parses_with_absolute_offsets():
    h = _parse(_raw(GOOD, b"\0" * 8))
    t = h.tensors["a"]
    assert (t.dtype, t.shape, t.nbytes) == ("F16", (2, 2), 8) and t.begin == h.data_start and not h.issues


@pytest.mark.parametrize("raw,code", [
    (b"\x01\x02", "E102"),                                                   # shorter than the length prefix
    (struct.pack("<Q", MAX_HEADER_BYTES + 1) + b"{}", "E102"),              # length bomb
    (struct.pack("<Q", 2**63) + b"{}", "E102"),                             # absurd length
    (struct.pack("<Q", 1000) + b"{}", "E102"),                              # length past EOF (truncated)
    (struct.pack("<Q", 4) + b"{{{{", "E103"),                               # not JSON
    (struct.pack("<Q", 2) + b"\xff\xfe", "E103"),                           # not UTF-8
    (_raw([1, 2]), "E103"),                                                  # JSON but not an object
    (_raw({"a": 3}), "E104"),                                                # entry not an object
    (_raw({"a": {"dtype": "F17", "shape": [1], "data_offsets": [0, 2]}}, b"\0\0"), "E104"),
    (_raw({"a": {"dtype": "F16", "shape": [True], "data_offsets": [0, 2]}}, b"\0\0"), "E104"),  # bool is not a dim
    (_raw({"a": {"dtype": "F16", "shape": [-1], "data_offsets": [0, 2]}}, b"\0\0"), "E104"),
    (_raw({"a": {"dtype": "F16", "shape": [1] * 9, "data_offsets": [0, 2]}}, b"\0\0"), "E104"),
    (_raw({"a": {"dtype": "F16", "shape": [1], "data_offsets": [0]}}, b"\0\0"), "E104"),
    (_raw({"a": {"dtype": "F16", "shape": [1], "data_offsets": [0, 2.0]}}, b"\0\0"), "E104"),
    (_raw({"__metadata__": {"k": 1}}), "E104"),
    (_raw({"a": {"dtype": "F16", "shape": [1], "data_offsets": [0, 2]}}, b"\0"), "E105"),      # past the data
    (_raw({"a": {"dtype": "F16", "shape": [1], "data_offsets": [2, 0]}}, b"\0\0"), "E105"),    # reversed
    (_raw({"a": {"dtype": "F16", "shape": [1], "data_offsets": [-2, 0]}}, b"\0\0"), "E105"),
    (_raw({"a": {"dtype": "F16", "shape": [3], "data_offsets": [0, 4]}}, b"\0" * 4), "E108"),  # shape vs bytes
    (_raw({"a": {"dtype": "F16", "shape": [2], "data_offsets": [0, 4]},
           "b": {"dtype": "F16", "shape": [2], "data_offsets": [2, 6]}}, b"\0" * 6), "E106"),  # overlap
])
def test_hostile_headers_are_refused(raw, code):
    assert _code(raw) == code


def test_hole_and_trailing_bytes_are_issues_not_fatal():
    raw = _raw({"a": {"dtype": "F16", "shape": [1], "data_offsets": [2, 4]}}, b"\0" * 6)
    codes = [c for c, _ in _parse(raw).issues]
    assert codes == ["E107", "E109"]


def test_serializer_roundtrip_is_aligned(tmp_path):
    head, offs = header_bytes([("w", "F16", (3, 5)), ("m", "I32", ())], {"format": "pt"})
    assert len(head) % 8 == 0 and offs == [(0, 30), (30, 34)]
    p = tmp_path / "t.safetensors"
    p.write_bytes(head + bytes(34))
    h = read_header(p)
    assert h.metadata == {"format": "pt"} and h.tensors["m"].shape == () and not h.issues
    from safetensors.numpy import load_file  # the reference implementation accepts our bytes
    assert load_file(str(p))["m"].shape == ()


def test_read_header_missing_and_empty_file(tmp_path):
    with pytest.raises(HeaderError) as ei:
        read_header(tmp_path / "nope.safetensors")
    assert ei.value.code == "E101"
    (tmp_path / "empty.safetensors").write_bytes(b"")
    with pytest.raises(HeaderError):
        read_header(tmp_path / "empty.safetensors")


@pytest.mark.parametrize("dim,start,stop", [(0, 1, 3), (1, 2, 5), (2, 0, 4), (1, 0, 6), (0, 0, 4)])
def test_slice_runs_match_numpy(dim, start, stop):
    a = np.arange(4 * 6 * 4, dtype=np.int16).reshape(4, 6, 4)
    raw = a.tobytes()
    got = b"".join(raw[o:o + n] for o, n in slice_runs(a.shape, 2, dim, start, stop))
    want = np.ascontiguousarray(np.take(a, range(start, stop), axis=dim)).tobytes()
    assert got == want


def test_headers_parse_without_orjson(tmp_path):
    """orjson is optional at run time: without it (a bare PYTHONPATH, a trimmed environment) the
    stdlib reads the header views the reader passes (a memoryview crashed json.loads's fallback:
    'memoryview' object has no attribute 'decode'), for a whole header and a split one."""
    import subprocess
    import sys

    from exl3tools.checkpoint import header as h
    from tests.conftest import DEMO

    demo = next(DEMO.glob("*.safetensors"))
    big = tmp_path / "big.safetensors"                       # over SPLIT_HEADER_BYTES: parsed in pieces
    n = h.SPLIT_HEADER_BYTES // 60
    entries = {f"t{i:07d}": {"dtype": "F16", "shape": [1], "data_offsets": [2 * i, 2 * i + 2]} for i in range(n)}
    big.write_bytes(_raw(entries, bytes(2 * n)))
    code = ("import sys; sys.modules['orjson'] = None\n"
            "from exl3tools.checkpoint.header import read_header\n"
            "from exl3tools.checkpoint import jsonio\n"
            "assert jsonio.loads_json is jsonio.loads_stdlib\n"
            "for p in sys.argv[1:]: print(len(read_header(p).tensors))")
    r = subprocess.run([sys.executable, "-c", code, str(demo), str(big)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert [int(x) for x in r.stdout.split()] == [len(read_header(demo).tensors), n]

"""Property-based fuzzing (hypothesis) of every parser of untrusted bytes: the safetensors header, the
index and config readers, the rank-slice manifest, and the bounded JSON reader underneath them.

Property: any input either parses (and then satisfies the parser's invariants) or raises one of our
documented errors (an Exl3Error subclass, which cli/_errors.py maps to an exit code); never anything
else, and never a hang. Fixed budget, derandomized: the same examples on every run (CI).
"""

from __future__ import annotations

import json
import math
import shutil

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from exl3tools.checkpoint import Checkpoint, jsonio
from exl3tools.checkpoint import header as H
from exl3tools.checkpoint.header import DTYPES, parse_header, read_header
from exl3tools.checkpoint.manifest import load_manifest
from exl3tools.dequantize import plan_dequantize
from exl3tools.errors import CheckpointError, Exl3Error, HeaderError, IncompleteOutputError
from exl3tools.inspect import summarize
from exl3tools.slicing import plan_rank_slices, write_rank_shards
from exl3tools.validate.architecture import check_architecture
from exl3tools.validate.context import Context
from exl3tools.validate.findings import Sink
from exl3tools.validate.linears import check_linears
from exl3tools.validate.structure import check_quant_config, open_tolerant
from tests.conftest import DEMO

FUZZ = settings(max_examples=200, derandomize=True, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

scalars = (st.none() | st.booleans() | st.integers(-(2 ** 70), 2 ** 70) | st.floats(allow_nan=False)
           | st.text(max_size=8))
json_values = st.recursive(scalars, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=6), c, max_size=4),
                           max_leaves=16)


def _dump(obj, data) -> bytes:
    """JSON text with drawn separators and padding (what other writers produce)."""
    item, key = data.draw(st.sampled_from([(",", ":"), (", ", ": "), (" ,\n", " :\t")]))
    return json.dumps(obj, separators=(item, key)).encode() + b" " * data.draw(st.integers(0, 3))


# ----------------------------------------------------------------------------- safetensors header
@FUZZ
@given(st.binary(max_size=2048), st.integers(0, 1 << 41))
def test_header_any_bytes(raw, extra):
    try:
        parse_header(raw, len(raw) + extra)
    except HeaderError:
        pass


entries = st.fixed_dictionaries({
    "dtype": st.sampled_from(sorted(DTYPES)) | json_values,
    "shape": st.lists(st.integers(-1, 33), max_size=9) | json_values,
    "data_offsets": st.lists(st.integers(-3, 1 << 20), max_size=3) | json_values,
})
headers = st.dictionaries(st.text(max_size=10), entries | json_values, max_size=8)


def _check_invariants(h, data_len: int) -> None:
    spans = []
    for name, t in h.tensors.items():
        assert t.name == name and t.dtype in DTYPES and len(t.shape) <= H.MAX_NDIM
        assert h.data_start <= t.begin <= t.end <= h.data_start + data_len
        assert t.end - t.begin == math.prod(t.shape) * DTYPES[t.dtype][0]
        if t.end > t.begin:
            spans.append((t.begin, t.end))
    spans.sort()
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False))  # no overlap survives


@FUZZ
@given(headers, st.integers(0, 1 << 21), st.data())
def test_header_structured(obj, data_len, data):
    js = _dump(obj, data)
    raw = len(js).to_bytes(8, "little") + js
    try:
        h = parse_header(raw, len(raw) + data_len)
    except HeaderError:
        return
    _check_invariants(h, data_len)


@FUZZ
@given(st.dictionaries(st.text(max_size=10), entries, max_size=8), st.integers(1, 5), st.data())
def test_header_in_pieces_equals_whole(obj, piece, data):
    """The piecewise parse of a big header (forced here on small ones) means exactly the whole parse;
    a header the whole parse refuses is refused too (the first error found may differ: pieces check
    the entries of one piece before they parse the next)."""
    js = _dump(obj, data)
    raw = len(js).to_bytes(8, "little") + js
    size = len(raw) + (1 << 21)

    def parse():
        try:
            h = parse_header(raw, size)
            return list(h.tensors.items()), h.metadata
        except HeaderError as exc:
            return type(exc), exc.code

    whole = parse()
    saved = H.SPLIT_HEADER_BYTES, H.PIECE_VALUES
    H.SPLIT_HEADER_BYTES, H.PIECE_VALUES = 0, piece
    try:
        got = parse()
        assert got == whole or (got[0] is HeaderError and whole[0] is HeaderError)
    finally:
        H.SPLIT_HEADER_BYTES, H.PIECE_VALUES = saved


# ----------------------------------------------------------------------------- bounded JSON reader
def _depth(o) -> int:
    if isinstance(o, dict):
        return 1 + max(map(_depth, o.values()), default=0)
    if isinstance(o, list):
        return 1 + max(map(_depth, o), default=0)
    return 0


tricky_text = st.text(alphabet='ab"\\[]{},: \n', max_size=8)
nested = st.recursive(st.none() | st.integers() | tricky_text,
                      lambda c: st.lists(c, max_size=3) | st.dictionaries(tricky_text, c, max_size=3), max_leaves=30)


def _containers(obj) -> int:
    if isinstance(obj, dict):
        return 1 + sum(_containers(v) for v in obj.values())
    if isinstance(obj, list):
        return 1 + sum(_containers(v) for v in obj)
    return 0


@FUZZ
@given(nested, st.integers(0, 8), st.integers(1, 9), st.data())
def test_nesting_and_split_agree_with_the_parser(obj, cap, chunk, data):
    """The byte-level scans (depth, top-level members) agree with a real parse, whatever the strings
    hold (brackets, quotes, backslash runs) and wherever a scan segment boundary falls."""
    raw = b" " + _dump(obj, data)
    saved = jsonio._CHUNK
    jsonio._CHUNK = chunk
    try:
        assert (jsonio.shape_past(raw, cap)[0] > cap) == (_depth(obj) > cap)
        assert jsonio.shape(raw) == (_depth(obj), _containers(obj))
        ranges = jsonio.split_object(raw, 0, len(raw), data.draw(st.integers(1, 6))) if isinstance(obj, dict) else None
    finally:
        jsonio._CHUNK = saved
    if isinstance(obj, dict) and obj:
        merged = {}
        for a, b in ranges:
            merged.update(json.loads(b"{" + raw[a:b] + b"}"))
        assert merged == obj


@FUZZ
@given(st.binary(max_size=512) | st.builds(lambda v: json.dumps(v).encode(), json_values))
def test_loads_bounded_any_bytes(raw):
    try:
        jsonio.loads_bounded(raw, "x: fuzz")
    except CheckpointError:
        pass


# ----------------------------------------------------------------------------- index and config readers
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("fuzz") / "model"
    shutil.copytree(DEMO / "model", d)
    return d


NAMES = sorted(read_header(DEMO / "model" / "model.safetensors").tensors)[:20]
indexes = st.fixed_dictionaries({
    "metadata": json_values,
    "weight_map": st.dictionaries(st.sampled_from(NAMES) | st.text(max_size=8),
                                  st.sampled_from(["model.safetensors", "../x", "", "a/b", "missing.safetensors"])
                                  | json_values, max_size=6) | json_values,
}) | json_values


def _open_both(model) -> None:
    """Checkpoint.open and the plans built on it (inspect, rank-slice, dequantize) raise only
    documented errors; validate's opener and its header-only checks raise none at all (everything
    becomes a finding)."""
    try:
        ck = Checkpoint.open(model)
        summarize(ck, tp=2)
        plan_rank_slices(ck, 2, "ep")
        plan_dequantize(ck, model.parent / "never-written")
    except Exl3Error:
        pass
    sink = Sink(model)
    opened = open_tolerant(model, sink)
    if opened is None:  # nothing left to check (e.g. an index naming no file)
        return
    ck, bad = opened
    ctx = Context.build(ck, sink, bad)
    check_quant_config(ctx)
    check_linears(ctx)
    check_architecture(ctx)


@FUZZ
@given(st.binary(max_size=1024) | st.builds(lambda v: json.dumps(v).encode(), indexes))
def test_index_reader(model_dir, raw):
    (model_dir / "model.safetensors.index.json").write_bytes(raw)
    _open_both(model_dir)


@FUZZ
@given(st.dictionaries(st.sampled_from(["num_hidden_layers", "n_routed_experts", "num_attention_heads", "hidden_size",
                                        "head_dim", "num_key_value_heads", "architectures", "quantization_config",
                                        "vocab_size", "moe_intermediate_size"]), json_values, max_size=4))
def test_config_reader(model_dir, changes):
    cfg = json.loads((DEMO / "model" / "config.json").read_text())
    cfg.update(changes)
    (model_dir / "model.safetensors.index.json").unlink(missing_ok=True)
    (model_dir / "config.json").write_text(json.dumps(cfg))
    _open_both(model_dir)


# ----------------------------------------------------------------------------- rank-slice manifest
@pytest.fixture(scope="module")
def sliced(tmp_path_factory):
    out = tmp_path_factory.mktemp("fuzzset") / "tp2"
    ck = Checkpoint.open(DEMO / "model")
    write_rank_shards(ck, plan_rank_slices(ck, 2, "ep"), out)
    return out, json.loads((out / "manifest.json").read_text())


def _paths(o, prefix=()):
    yield prefix
    if isinstance(o, dict):
        for k, v in list(o.items())[:6]:
            yield from _paths(v, (*prefix, k))
    elif isinstance(o, list):
        for i, v in enumerate(o[:3]):
            yield from _paths(v, (*prefix, i))


@FUZZ
@given(st.data())
def test_manifest_reader(sliced, data):
    """A real manifest with one value anywhere replaced (or the bytes replaced): load_manifest raises
    only IncompleteOutputError (verify and validate exit 1), or returns a manifest."""
    out, real = sliced
    if data.draw(st.booleans()):
        raw = data.draw(st.binary(max_size=512))
    else:
        obj = json.loads(json.dumps(real))
        path = data.draw(st.sampled_from(list(_paths(obj))[1:]))
        parent = obj
        for k in path[:-1]:
            parent = parent[k]
        parent[path[-1]] = data.draw(json_values)
        raw = json.dumps(obj).encode()
    (out / "manifest.json").write_bytes(raw)
    try:
        load_manifest(out)
    except IncompleteOutputError:
        pass


@FUZZ
@given(st.dictionaries(st.text(max_size=12), st.text(max_size=12), max_size=6), st.integers(0, 2 ** 63))
def test_index_json_is_the_indented_dump(weight_map, total):
    """index_json formats by hand (the stdlib's indented encoder is pure Python): same bytes."""
    from exl3tools.checkpoint.writer import index_json, json_bytes

    assert index_json(weight_map, total) == json_bytes({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                       indent=4)

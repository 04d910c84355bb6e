"""validate: clean fixtures stay clean; a corruption suite of realistic damage is caught by code.

Every damage is applied to a copy of the demo checkpoint (or a small fixture) in tmp_path by
rewriting the safetensors file (header_bytes + data), then `exl3tools validate` runs through
click's CliRunner: the expected code must be reported, exit 1, and no traceback.
"""

from __future__ import annotations

import json
import re
import shutil
import struct
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from exl3tools.cli import main

from exl3tools.checkpoint.header import header_bytes, read_header
from exl3tools.exl3 import MARKERS
from exl3tools.validate import validate
from exl3tools.validate.rules import RULES
from tests.conftest import DEMO, FIXTURE_NAMES, REPO, fixture_dir

ST = "model.safetensors"
L0 = "model.layers.0"
L1 = "model.layers.1"


# ----------------------------------------------------------------------------- safetensors rewriting
def read_st(path: Path) -> list[list]:
    """[[name, dtype, shape, bytes], ...] in file order."""
    h = read_header(path)
    raw = path.read_bytes()
    return [[t.name, t.dtype, list(t.shape), raw[t.begin:t.end]]
            for t in sorted(h.tensors.values(), key=lambda t: t.begin)]


def write_st(path: Path, entries: list[list]) -> None:
    hb, _ = header_bytes([(n, d, tuple(s)) for n, d, s, _ in entries])
    path.write_bytes(hb + b"".join(e[3] for e in entries))


def edit_tensors(model: Path, fn, file: str = ST) -> None:
    entries = read_st(model / file)
    out = fn(entries)
    write_st(model / file, entries if out is None else out)


def edit_header(model: Path, fn, file: str = ST) -> None:
    """Edit the header JSON in place, keeping the data buffer byte for byte."""
    p = model / file
    raw = p.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    obj = json.loads(raw[8:8 + n])
    fn(obj)
    js = json.dumps(obj).encode()
    p.write_bytes(len(js).to_bytes(8, "little") + js + raw[8 + n:])


def find(entries: list[list], name: str) -> list:
    return next(e for e in entries if e[0] == name)


def drop(*names_or_prefixes: str):
    def fn(entries):
        return [e for e in entries if not any(e[0] == x or e[0].startswith(x + ".") for x in names_or_prefixes)]
    return fn


def set_values(name: str, index: int, value: float, dtype: str = "<f2"):
    def fn(entries):
        e = find(entries, name)
        if e[1] == "BF16":
            a = np.frombuffer(e[3], dtype="<u2").copy()
            a[index] = np.array([value], dtype=np.float32).view(np.uint32)[0] >> 16
        else:
            a = np.frombuffer(e[3], dtype=dtype).copy()
            a[index] = value
        e[3] = a.tobytes()
    return fn


def retype(name: str, dtype: str, shape: list[int] | None = None, fill: bytes | None = None):
    """Replace a tensor by one of another dtype/shape (bytes sized to match)."""
    sizes = {"F16": 2, "BF16": 2, "F32": 4, "I16": 2, "I32": 4, "I64": 8}

    def fn(entries):
        e = find(entries, name)
        e[1] = dtype
        if shape is not None:
            e[2] = shape
        nb = int(np.prod(e[2], dtype=np.int64)) * sizes[dtype]
        rng = np.random.default_rng(0)
        e[3] = fill if fill is not None else rng.integers(0, 256, nb, dtype=np.uint8).tobytes()
    return fn


def add_tensor(name: str, dtype: str, shape: list[int], data: bytes, after: str | None = None):
    def fn(entries):
        i = len(entries) if after is None else entries.index(find(entries, after)) + 1
        entries.insert(i, [name, dtype, shape, data])
    return fn


def trellis_width(prefix: str, width: int):
    def fn(entries):
        e = find(entries, f"{prefix}.trellis")
        kt, nt, _ = e[2]
        e[2] = [kt, nt, width]
        e[3] = np.random.default_rng(1).integers(-32768, 32767, kt * nt * width, dtype=np.int16).tobytes()
    return fn


def edit_json(file: str, fn):
    def apply(model: Path) -> None:
        p = model / file
        obj = json.loads(p.read_text())
        fn(obj)
        p.write_text(json.dumps(obj, indent=2))
    return apply


def both_configs(fn):
    def apply(model: Path) -> None:
        edit_json("config.json", lambda c: fn(c["quantization_config"]))(model)
        edit_json("quantization_config.json", fn)(model)
    return apply


def with_index(extra: dict[str, str] | None = None, omit: tuple[str, ...] = ()):
    """Add model.safetensors.index.json mapping every tensor to model.safetensors (+ extra, - omit)."""
    def apply(model: Path) -> None:
        names = read_header(model / ST).tensors
        wm = {n: ST for n in names if n not in omit}
        wm.update(extra or {})
        (model / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    return apply


def on_tensors(fn):
    return lambda model: edit_tensors(model, fn)


def on_header(fn):
    return lambda model: edit_header(model, fn)


def chain(*steps):
    def apply(model: Path) -> None:
        for s in steps:
            s(model)
    return apply


# ----------------------------------------------------------------------------- raw byte damage
def truncate(model: Path) -> None:
    p = model / ST
    p.write_bytes(p.read_bytes()[:-5000])


def flip_header_byte(model: Path) -> None:
    p = model / ST
    raw = bytearray(p.read_bytes())
    raw[8] ^= 0xFF  # the opening '{' of the JSON
    p.write_bytes(bytes(raw))


def length_bomb(model: Path) -> None:
    p = model / ST
    raw = p.read_bytes()
    p.write_bytes((1 << 40).to_bytes(8, "little") + raw[8:])


def header_past_eof(model: Path) -> None:
    p = model / ST
    raw = p.read_bytes()
    p.write_bytes((len(raw)).to_bytes(8, "little") + raw[8:])


def trailing_bytes(model: Path) -> None:
    with open(model / ST, "ab") as f:
        f.write(b"\0" * 100)


def overlap(obj: dict) -> None:
    a, b = obj[f"{L0}.self_attn.q_proj.suh"], obj[f"{L0}.self_attn.q_proj.svh"]
    b["data_offsets"] = [a["data_offsets"][0] + 2, a["data_offsets"][0] + 2 + (b["data_offsets"][1] - b["data_offsets"][0])]


def out_of_range(obj: dict) -> None:
    e = obj[f"{L0}.self_attn.q_proj.suh"]
    e["data_offsets"] = [10**9, 10**9 + 512]


def shape_vs_bytes(obj: dict) -> None:
    obj[f"{L0}.self_attn.q_proj.suh"]["shape"] = [300]


def hole(obj: dict) -> None:
    del obj[f"{L1}.mlp.experts.2.up_proj.mcg"]


def bad_entry(obj: dict) -> None:
    obj[f"{L0}.self_attn.q_proj.suh"]["dtype"] = "F17"


def remove_file(model: Path) -> None:
    (model / ST).unlink()


def duplicate_file(model: Path) -> None:
    entries = read_st(model / ST)
    write_st(model / "model-extra.safetensors", [find(entries, "model.norm.weight")])


def stray_copy(model: Path) -> None:
    """An old copy of an indexed shard left in the folder: exllamav3 globs *.safetensors and loads it."""
    with_index()(model)
    shutil.copy(model / ST, model / "stale-copy.safetensors")


def stray_file(model: Path) -> None:
    with_index()(model)
    write_st(model / "extra.safetensors", [["scratch.weight", "F16", [4], b"\0<" * 4]])


def zero_trellis(model: Path) -> None:
    edit_tensors(model, lambda es: [e if e[0] != f"{L1}.mlp.experts.7.down_proj.trellis" else
                                    [e[0], e[1], e[2], b"\0" * len(e[3])] for e in es])


def mul1_marker(prefix: str, drop_mcg: bool = True):
    def fn(entries):
        m = find(entries, f"{prefix}.mcg")
        i = entries.index(m)
        new = [f"{prefix}.mul1", "I32", [], MARKERS["mul1"].to_bytes(4, "little")]
        if drop_mcg:
            entries[i] = new
        else:
            entries.insert(i + 1, new)
    return fn


def legacy_su(prefix: str):
    def fn(entries):
        tr = find(entries, f"{prefix}.trellis")
        entries.insert(entries.index(tr), [f"{prefix}.su", "I16", [tr[2][0]], b"\x01\x00" * tr[2][0]])
    return fn


def huge_scales(prefix: str):
    def fn(entries):
        for s in ("suh", "svh"):
            e = find(entries, f"{prefix}.{s}")
            e[3] = np.full(len(e[3]) // 2, 60000, dtype="<f2").tobytes()
    return fn


def wrong_trellis_dim(entries):
    p = f"{L0}.self_attn.q_proj"
    tr, svh, bias = find(entries, f"{p}.trellis"), find(entries, f"{p}.svh"), find(entries, f"{p}.bias")
    tr[2] = [16, 24, 48]
    tr[3] = np.random.default_rng(2).integers(-32768, 32767, 16 * 24 * 48, dtype=np.int16).tobytes()
    for e in (svh, bias):
        e[2] = [384]
        e[3] = np.ones(384, dtype="<f2").tobytes()


GLM5 = "glm5_moe_dsa-3.0bpw-mul1"
KV_A = f"{L1}.self_attn.kv_a_proj_with_mqa"

# (id, source, damage, expected code)
CASES = [
    ("truncated-shard", "demo", truncate, "E102"),
    ("flipped-header-byte", "demo", flip_header_byte, "E103"),
    ("header-length-bomb", "demo", length_bomb, "E102"),
    ("header-length-past-eof", "demo", header_past_eof, "E102"),
    ("bad-header-dtype", "demo", on_header(bad_entry), "E104"),
    ("offsets-out-of-range", "demo", on_header(out_of_range), "E105"),
    ("overlapping-offsets", "demo", on_header(overlap), "E106"),
    ("hole-between-tensors", "demo", on_header(hole), "E107"),
    ("dtype-shape-vs-bytes", "demo", on_header(shape_vs_bytes), "E108"),
    ("trailing-bytes", "demo", trailing_bytes, "E109"),
    ("index-names-missing-file", "demo", with_index({"model.layers.9.extra": "model-00002-of-00002.safetensors"}), "E110"),
    ("indexed-tensor-not-in-file", "demo", with_index({f"{L1}.mlp.experts.99.up_proj.suh": ST}), "E111"),
    ("orphan-tensor-not-in-index", "demo", with_index(omit=(f"{L1}.mlp.experts.3.up_proj.suh",)), "E112"),
    ("duplicate-tensor", "demo", duplicate_file, "E113"),
    ("stray-copy-of-indexed-shard", "demo", stray_copy, "E119"),
    ("index-not-json", "demo", lambda m: (m / "model.safetensors.index.json").write_text("{oops"), "E114"),
    ("shard-file-missing", "demo", remove_file, "E101"),
    ("config-not-json", "demo", lambda m: (m / "config.json").write_text('{"architectures": ['), "E100"),
    ("config-lacks-hidden-size", "demo", edit_json("config.json", lambda c: c.pop("hidden_size")), "E100"),
    ("quant-config-json-broken", "demo", lambda m: (m / "quantization_config.json").write_text("[1, 2"), "E115"),
    ("wrong-quant-method", "demo", both_configs(lambda q: q.update(quant_method="gptq")), "E116"),
    ("illegal-head-bits", "demo", both_configs(lambda q: q.update(head_bits=7.5)), "E117"),
    ("unknown-codebook-field", "demo", both_configs(lambda q: q.update(codebook="mcq")), "E117"),
    ("head-bits-vs-lm-head", "demo", both_configs(lambda q: q.update(head_bits=4)), "E118"),
    ("missing-suh", "demo", on_tensors(drop(f"{L0}.self_attn.q_proj.suh")), "E201"),
    ("trellis-wrong-dtype", "demo", on_tensors(retype(f"{L0}.mlp.up_proj.trellis", "I32", [16, 32, 24])), "E202"),
    ("trellis-rank-2", "demo", on_tensors(retype(f"{L0}.mlp.up_proj.trellis", "I16", [16, 32 * 48])), "E203"),
    ("trellis-deleted", "demo", on_tensors(drop(f"{L0}.mlp.down_proj.trellis")), "E204"),
    ("suh-wrong-dtype", "demo", on_tensors(retype(f"{L0}.self_attn.o_proj.suh", "F32", [256])), "E205"),
    ("svh-wrong-length", "demo", on_tensors(retype(f"{L0}.self_attn.o_proj.svh", "F16", [384],
                                                    np.ones(384, "<f2").tobytes())), "E206"),
    ("wrong-trellis-dim", "demo", on_tensors(wrong_trellis_dim), "E208"),
    ("illegal-k", "demo", on_tensors(trellis_width(f"{L1}.mlp.experts.1.gate_proj", 50)), "E209"),
    ("half-k-without-mul1", "demo", on_tensors(trellis_width(f"{L1}.mlp.experts.1.gate_proj", 40)), "E210"),
    ("marker-wrong-dtype", "demo", on_tensors(retype(f"{L1}.mlp.experts.6.up_proj.mcg", "I64", [],
                                                      MARKERS["mcg"].to_bytes(8, "little"))), "E211"),
    ("illegal-marker-value", "demo", on_tensors(retype(f"{L1}.mlp.experts.6.up_proj.mcg", "I32", [],
                                                        struct.pack("<i", 12345))), "E212"),
    ("both-markers", "demo", on_tensors(mul1_marker(f"{L1}.mlp.shared_experts.up_proj", drop_mcg=False)), "E213"),
    ("codebook-vs-config", "demo", both_configs(lambda q: q.update(codebook="mul1")), "E214"),
    ("mixed-codebooks-in-layer", "demo", on_tensors(mul1_marker(f"{L1}.mlp.experts.3.up_proj")), "E215"),
    ("mixed-k-across-experts", "demo", on_tensors(trellis_width(f"{L1}.mlp.experts.4.down_proj", 64)), "E216"),
    ("bias-wrong-dtype", "demo", on_tensors(retype(f"{L0}.self_attn.k_proj.bias", "F32", [128])), "E217"),
    ("scale-present", "demo", on_tensors(add_tensor(f"{L0}.self_attn.o_proj.scale", "F16", [], b"\0<",
                                                    after=f"{L0}.self_attn.o_proj.mcg")), "E218"),
    ("legacy-su-mixed", "demo", on_tensors(legacy_su(f"{L0}.self_attn.o_proj")), "E219"),
    ("tensor-storage-shape", "demo", edit_json("quantization_config.json", lambda q: q["tensor_storage"]
                                               [f"{L0}.self_attn.o_proj"]["stored_tensors"]
                                               [f"{L0}.self_attn.o_proj.suh"].update(shape=[512])), "E220"),
    ("tensor-storage-bits", "demo", edit_json("quantization_config.json", lambda q: q["tensor_storage"]
                                              [f"{L0}.mlp.gate_proj"].update(bits_per_weight=4)), "E220"),
    ("missing-linear", "demo", on_tensors(drop(f"{L0}.self_attn.v_proj")), "E301"),
    ("missing-router", "demo", on_tensors(drop(f"{L1}.mlp.gate.weight")), "E302"),
    ("missing-score-bias", "demo", on_tensors(drop(f"{L1}.mlp.gate.e_score_correction_bias")), "E302"),
    ("missing-norm", "demo", on_tensors(drop("model.norm.weight")), "E302"),
    ("missing-expert", "demo", on_tensors(drop(f"{L1}.mlp.experts.5")), "E303"),
    ("missing-expert-projection", "demo", on_tensors(drop(f"{L1}.mlp.experts.15.down_proj")), "E303"),
    ("norm-wrong-shape", "demo", on_tensors(retype(f"{L1}.input_layernorm.weight", "BF16", [255])), "E304"),
    ("norm-int-dtype", "demo", on_tensors(retype(f"{L1}.post_attention_layernorm.weight", "I16", [256])), "E305"),
    ("missing-qkv-bias", "demo", on_tensors(drop(f"{L1}.self_attn.q_proj.bias")), "E307"),
    ("nan-in-suh", "demo", on_tensors(set_values(f"{L1}.mlp.experts.9.gate_proj.suh", 3, np.nan)), "E401"),
    ("inf-in-svh", "demo", on_tensors(set_values(f"{L1}.mlp.experts.9.gate_proj.svh", 7, np.inf)), "E401"),
    ("nan-in-bias", "demo", on_tensors(set_values(f"{L0}.self_attn.v_proj.bias", 0, np.nan)), "E401"),
    ("zero-in-suh", "demo", on_tensors(set_values(f"{L0}.mlp.down_proj.suh", 100, 0.0)), "E402"),
    ("nan-in-norm", "demo", on_tensors(set_values(f"{L0}.input_layernorm.weight", 5, np.nan)), "E404"),
    ("inf-in-embedding", "demo", on_tensors(set_values("model.embed_tokens.weight", 12345, np.inf)), "E404"),
    ("nan-in-router", "demo", on_tensors(set_values(f"{L1}.mlp.gate.weight", 17, np.nan)), "E404"),
    ("decode-overflows-fp16", "demo", on_tensors(huge_scales(f"{L0}.mlp.gate_proj")), "E406"),
    ("trellis-never-written", "demo", zero_trellis, "E409"),
    ("svh-nonzero-on-padding", GLM5, on_tensors(set_values(f"{KV_A}.svh", 600, 0.5)), "E403"),
    ("incomplete-mtp-layer", GLM5, on_tensors(drop("model.layers.2.eh_proj")), "E309"),
    ("mtp-expert-missing", GLM5, on_tensors(drop("model.layers.2.mlp.experts.3")), "E309"),
    ("missing-dsa-indexer", GLM5, on_tensors(drop(f"{L1}.self_attn.indexer.wk.weight")), "E302"),
    ("missing-kv-b-proj", GLM5, on_tensors(drop(f"{L0}.self_attn.kv_b_proj.weight")), "E302"),
    ("svh-all-zero", "demo", on_tensors(lambda es: find(es, f"{L1}.mlp.experts.0.up_proj.svh").__setitem__(
        3, b"\0" * 256)), "E402"),
]
WARN_CASES = [
    ("stray-unindexed-file", "demo", stray_file, "W101"),
    ("configs-disagree", "demo", edit_json("quantization_config.json", lambda q: q.update(bits=3.5)), "W102"),
    ("no-quantization-config-json", "demo", lambda m: (m / "quantization_config.json").unlink(), "W103"),
    ("linear-not-in-tensor-storage", "demo", edit_json("quantization_config.json",
                                                      lambda q: q["tensor_storage"].pop(f"{L0}.mlp.up_proj")), "W201"),
    ("unexpected-tensor", "demo", on_tensors(add_tensor("model.layers.0.mlp.extra.weight", "F16", [4],
                                                        b"\0<" * 4)), "W302"),
    ("mtp-not-declared", GLM5, edit_json("config.json", lambda c: c.update(num_nextn_predict_layers=0)), "W304"),
    ("norm-all-zero", "demo", on_tensors(lambda es: find(es, "model.norm.weight").__setitem__(3, b"\0" * 512)), "W403"),
]


def _src(which: str) -> Path:
    return DEMO / "model" if which == "demo" else fixture_dir(which) / "model"


def _damaged(tmp_path: Path, which: str, damage) -> Path:
    model = tmp_path / "model"
    shutil.copytree(_src(which), model)
    damage(model)
    return model


def run_cli(*args: str):
    return CliRunner().invoke(main, ["validate", *args], catch_exceptions=False)


def _json(result) -> dict:
    assert "Traceback" not in result.output
    return json.loads(result.stdout)


# ----------------------------------------------------------------------------- tests
def test_rule_table_is_documented():
    doc = (REPO / "docs" / "validate.md").read_text()
    documented = set(re.findall(r"^\| `?([EW]\d{3})`? \|", doc, flags=re.M))
    assert documented == set(RULES), f"undocumented: {set(RULES) - documented}, stale: {documented - set(RULES)}"


def test_corruption_suite_has_30_kinds():
    assert len({c[3] for c in CASES}) >= 30 and len(CASES) >= 30


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_fixtures_validate_clean(name):
    rep = validate(fixture_dir(name) / "model")
    assert not rep.errors, [f.line for f in rep.errors]
    # the only warning a fixture may have: the MTP layer its converter dropped
    assert {f.code for f in rep.warnings} <= {"W303"}
    cfg = json.loads((fixture_dir(name) / "model" / "config.json").read_text())
    dropped = cfg.get("num_nextn_predict_layers", 0) > 0 and "glm5" not in name
    assert ("W303" in rep.codes) == dropped


def test_demo_cli_clean_and_strict(tmp_path):
    ok = run_cli(str(DEMO / "model"))
    assert ok.exit_code == 0, ok.output
    assert "W303" in ok.output and "OK" in ok.output
    strict = run_cli(str(DEMO / "model"), "--strict", "--junit-xml", str(tmp_path / "v.xml"))
    assert strict.exit_code == 1
    root = ET.parse(tmp_path / "v.xml").getroot()
    fails = root.findall(".//failure")
    assert len(fails) == 1 and "W303" in fails[0].get("message")
    assert int(root.get("tests")) == len(RULES)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_corruption_detected(tmp_path, case):
    _id, which, damage, code = case
    model = _damaged(tmp_path, which, damage)
    res = run_cli(str(model), "--json", "--sample-blocks", "16")
    doc = _json(res)
    codes = {f["code"] for f in doc["findings"]}
    assert code in codes, (code, [f["code"] + " " + f["message"] for f in doc["findings"]])
    assert res.exit_code == 1
    hit = next(f for f in doc["findings"] if f["code"] == code)
    assert hit["severity"] == "error" and hit["message"]
    assert hit["file"] or hit["tensor"]  # one line naming where


@pytest.mark.parametrize("case", WARN_CASES, ids=[c[0] for c in WARN_CASES])
def test_warnings(tmp_path, case):
    _id, which, damage, code = case
    model = _damaged(tmp_path, which, damage)
    res = run_cli(str(model), "--json", "--sample-blocks", "8")
    doc = _json(res)
    assert code in {f["code"] for f in doc["findings"]}, doc["findings"]
    errors = [f for f in doc["findings"] if f["severity"] == "error"]
    assert res.exit_code == (1 if errors else 0), errors
    assert run_cli(str(model), "--json", "--strict", "--sample-blocks", "0").exit_code == 1


def test_junit_lists_error_findings(tmp_path):
    model = _damaged(tmp_path, "demo", on_tensors(drop(f"{L1}.mlp.experts.5")))
    res = run_cli(str(model), "--junit-xml", str(tmp_path / "r.xml"))
    assert res.exit_code == 1 and "E303" in res.output and "FAILED" in res.output
    case = [c for c in ET.parse(tmp_path / "r.xml").getroot().iter("testcase") if c.get("name").startswith("E303")]
    assert case and "experts.5.gate_proj" in case[0].find("failure").text


def test_deep_hashes_and_catches(tmp_path):
    import hashlib

    model = _damaged(tmp_path, "demo", on_tensors(set_values(f"{L1}.mlp.experts.2.down_proj.svh", 1, np.nan)))
    doc = _json(res := run_cli(str(model), "--deep", "--json"))
    assert res.exit_code == 1 and "E401" in {f["code"] for f in doc["findings"]}
    assert doc["stats"]["sha256"][ST] == hashlib.sha256((model / ST).read_bytes()).hexdigest()
    assert doc["stats"]["decoded_linears"] == 63 and doc["stats"]["bytes_read"] == (model / ST).stat().st_size
    clean = validate(DEMO / "model", deep=True)
    assert not clean.errors


def test_usage_errors_exit_2(tmp_path):
    assert run_cli(str(tmp_path / "nope")).exit_code == 2
    (tmp_path / "empty").mkdir()
    res = run_cli(str(tmp_path / "empty"))
    assert res.exit_code == 2 and "Traceback" not in res.output


def test_hostile_header_bounded_memory(tmp_path):
    """A length bomb is refused from 8 bytes: no allocation, no hang (child RSS well under 1 GiB)."""
    import subprocess
    import sys

    model = _damaged(tmp_path, "demo", length_bomb)
    code = ("import sys; from exl3tools.validate import validate; r=validate(sys.argv[1]); "
            "print(sorted(r.codes), next(l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM')))")
    out = subprocess.run([sys.executable, "-c", code, str(model)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    codes, rss_kb = out.stdout.rsplit(" ", 1)
    assert "E102" in codes and 0 < int(rss_kb) < 1024 * 1024


def test_report_api(tmp_path):
    import dataclasses

    from exl3tools.checkpoint import Checkpoint
    from exl3tools.errors import CheckpointError

    clean = validate(DEMO / "model")
    assert validate(Checkpoint.open(DEMO / "model")).codes == clean.codes == {"W303"}
    assert clean.ok() and not clean.ok(strict=True) and clean.exit_code() == 0 and clean.exit_code(strict=True) == 1
    clean.raise_for_errors()
    with pytest.raises(dataclasses.FrozenInstanceError):
        clean.findings[0].code = "E999"
    model = _damaged(tmp_path, "demo", on_tensors(drop(f"{L1}.mlp.experts.5")))
    rep = validate(model, sample_blocks=0)
    assert rep.exit_code() == 1 and all(f.severity == "error" for f in rep.errors)
    with pytest.raises(CheckpointError, match="validate error"):
        rep.raise_for_errors()
    assert rep.stats["decoded_blocks"] == 0
    e303 = [f.line for f in rep.errors if f.code == "E303"]
    assert len(e303) == 3 and e303[0].startswith("E303 model.safetensors:model.layers.1.mlp.experts.5.")


def test_multi_shard_forked_workers(tmp_path, monkeypatch):
    """Sharded checkpoint (index + 3 files) through the forked per-file workers: clean, then damaged."""
    import exl3tools.validate.numeric as N

    monkeypatch.setattr(N, "FORK_MIN_TENSORS", 0)
    model = tmp_path / "model"
    shutil.copytree(DEMO / "model", model)
    entries = read_st(model / ST)
    (model / ST).unlink()
    parts = [entries[:90], entries[90:180], entries[180:]]
    wm = {}
    for i, part in enumerate(parts):
        name = f"model-{i + 1:05d}-of-00003.safetensors"
        write_st(model / name, part)
        wm.update({e[0]: name for e in part})
    (model / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    rep = validate(model)
    assert not rep.errors and rep.codes == {"W303"} and rep.stats["files"] == 3
    assert rep.stats["decoded_blocks"] == 63
    victim = parts[2][-1][0].rsplit(".", 1)[0]  # a linear in the last shard
    edit_tensors(model, set_values(f"{victim}.suh", 0, np.nan), "model-00003-of-00003.safetensors")
    (model / "quantization_config.json").write_text("{not json")
    rep = validate(model)
    hit = [f for f in rep.errors if f.code == "E401"]
    assert hit and hit[0].file == "model-00003-of-00003.safetensors" and "E115" in rep.codes


@pytest.mark.parametrize("seed", range(12))
def test_random_damage_never_crashes(tmp_path, seed):
    """Random header/data/JSON damage: always a verdict (exit 0 or 1), never a traceback."""
    import random

    rng = random.Random(seed)
    model = _damaged(tmp_path, "demo", lambda m: None)
    p = model / ST
    raw = bytearray(p.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    kind = ("header", "data", "truncate", "json")[seed % 4]
    if kind == "header":
        for _ in range(rng.randint(1, 4)):
            raw[rng.randrange(8, 8 + n)] = rng.randrange(256)
    elif kind == "data":
        for _ in range(50):
            raw[rng.randrange(8 + n, len(raw))] = rng.randrange(256)
    elif kind == "truncate":
        raw = raw[:rng.randrange(0, len(raw))]
    else:
        q = model / rng.choice(["config.json", "quantization_config.json"])
        t = bytearray(q.read_bytes())
        t[rng.randrange(len(t))] = rng.randrange(32, 127)
        q.write_bytes(bytes(t))
    p.write_bytes(bytes(raw))
    res = run_cli(str(model), "--json", "--sample-blocks", "4")
    doc = _json(res)
    assert res.exit_code == (1 if doc["errors"] else 0)
    if kind == "truncate":
        assert res.exit_code == 1


def test_validate_is_torch_free():
    import subprocess
    import sys

    code = ("import sys, contextlib, io\nfrom exl3tools.cli import main\n"
            f"sys.argv = ['exl3tools', 'validate', {str(DEMO / 'model')!r}, '--json']\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            "    try:\n        main()\n    except SystemExit:\n        pass\n"
            "print(' '.join(sys.modules))")
    mods = set(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split())
    assert "exl3tools.validate.numeric" in mods
    assert "torch" not in mods and "exllamav3" not in mods and "cli" not in mods and "kernels" not in mods


def test_a_folder_above_the_checkpoint_names_it():
    """validate on the demo's folder (its goldens' safetensors beside model/): E100 names model/,
    the folder meant."""
    res = CliRunner().invoke(main, ["validate", str(DEMO), "--json"])
    assert res.exit_code == 1, res.output
    e100 = [f for f in json.loads(res.output)["findings"] if f["code"] == "E100"]
    assert e100 and e100[0]["message"].endswith(f"({DEMO / 'model'} has one: give that folder)"), e100

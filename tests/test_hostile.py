"""Issue 16, offline tools: hostile files get one line naming the file and the problem, a documented
exit code, and bounded time and memory; never a hang, a traceback or exit 70.

Everything runs the real CLI on real files under tmp_path (copies of the demo checkpoint). Cases that
hung or grew without bound before the fix (FIFOs, /dev/zero, counts of 1e9) run in a subprocess with
a timeout, so a regression fails instead of hanging the suite.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from exl3tools.cli import main

from exl3tools.checkpoint import Checkpoint
from exl3tools.checkpoint.header import header_bytes, read_header
from exl3tools.slicing import plan_rank_slices, write_rank_shards
from tests.conftest import DEMO

ST = "model.safetensors"
INDEX = "model.safetensors.index.json"
L0 = "model.layers.0"
TIMEOUT = 120  # a case that hung before the fix fails after this long instead of hanging


# ----------------------------------------------------------------------------- helpers
def demo_copy(tmp_path: Path, name: str = "model") -> Path:
    model = tmp_path / name
    shutil.copytree(DEMO / "model", model)
    return model


def edit_config(model: Path, **changes) -> None:
    cfg = json.loads((model / "config.json").read_text())
    cfg.update(changes)
    (model / "config.json").write_text(json.dumps(cfg))


def with_index(model: Path) -> None:
    names = read_header(model / ST).tensors
    (model / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": {n: ST for n in names}}))


def entries(path: Path) -> list[list]:
    h = read_header(path)
    raw = path.read_bytes()
    return [[t.name, t.dtype, list(t.shape), raw[t.begin:t.end]] for t in sorted(h.tensors.values(), key=lambda t: t.begin)]


def write_st(path: Path, es: list[list]) -> None:
    hb, _ = header_bytes([(n, d, tuple(s)) for n, d, s, _ in es])
    path.write_bytes(hb + b"".join(e[3] for e in es))


def edit_header_json(path: Path, edit) -> None:
    """Rewrite the header JSON text (keeping the data buffer), via ``edit(str) -> str``."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    js = edit(raw[8:8 + n].decode()).encode()
    path.write_bytes(len(js).to_bytes(8, "little") + js + raw[8 + n:])


def cli(*args: str):
    """In-process run of the real CLI (for cases that could not hang even before the fix)."""
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def cli_guarded(*args: str, env: dict | None = None, code: str | None = None) -> subprocess.CompletedProcess:
    """The real CLI in a subprocess with a timeout (a hang is a failure, not a stuck suite)."""
    cmd = [sys.executable, "-c", code, *args] if code else [sys.executable, "-m", "exl3tools.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT,
                          env={**os.environ, **(env or {}), "COLUMNS": "200"})


def output(res) -> str:
    return (res.stdout or "") + (res.stderr or "") if isinstance(res, subprocess.CompletedProcess) else res.output


def assert_clean(res, code: int, *needles: str) -> str:
    """Exit ``code``; no traceback, no internal error; every needle in the output."""
    rc = res.returncode if isinstance(res, subprocess.CompletedProcess) else res.exit_code
    out = output(res)
    assert rc == code, out[-3000:]
    assert "Traceback" not in out and "internal error" not in out, out[-3000:]
    for n in needles:
        assert n in out, (n, out[-3000:])
    return out


def findings(res) -> dict[str, list[dict]]:
    """--json findings by code."""
    doc = json.loads(res.stdout)
    by: dict[str, list[dict]] = {}
    for f in doc["findings"]:
        by.setdefault(f["code"], []).append(f)
    return by


def validate_json(path: Path, guarded: bool = False):
    args = ("validate", str(path), "--json", "--sample-blocks", "4")
    res = cli_guarded(*args) if guarded else cli(*args)
    assert "Traceback" not in output(res)
    return res, findings(res)


@pytest.fixture(scope="module")
def rank_set(tmp_path_factory) -> Path:
    """A complete rank-slice output of the demo (tp 2, moe ep); tests copy it."""
    out = tmp_path_factory.mktemp("set") / "tp2"
    ck = Checkpoint.open(DEMO / "model")
    write_rank_shards(ck, plan_rank_slices(ck, 2, "ep"), out)
    return out


def set_copy(rank_set: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "tp2"
    shutil.copytree(rank_set, dst)
    return dst


# ----------------------------------------------------------------------------- item 1: files that are not files
def test_config_symlinked_to_dev_zero(tmp_path):
    """It reached 10.6 GB in 20 s: now a finding / one line naming what it is, without reading it."""
    model = demo_copy(tmp_path)
    (model / "config.json").unlink()
    (model / "config.json").symlink_to("/dev/zero")
    res, by = validate_json(model, guarded=True)
    assert res.returncode == 1 and "character device" in by["E100"][0]["message"]
    assert_clean(cli_guarded("inspect", str(model)), 1, "config.json", "character device, not a regular file")
    assert_clean(cli_guarded("rank-slice", str(model), str(tmp_path / "out"), "--tp", "2", "--moe", "ep"), 1,
                 "character device")


@pytest.mark.parametrize("name, code", [("config.json", "E100"), (INDEX, "E114"),
                                        ("quantization_config.json", "E115"), (ST, "E101")])
def test_fifo_is_refused_not_read(tmp_path, name, code):
    """A FIFO blocked open() forever (and a FIFO shard was "missing"): now it is named for what it is."""
    model = demo_copy(tmp_path)
    if name == INDEX:
        with_index(model)
    if name == ST:  # no index: the shard is found by glob, and it is the only one
        shutil.copy(model / ST, model / "model-2.safetensors")
    (model / name).unlink(missing_ok=True)
    os.mkfifo(model / name)
    res, by = validate_json(model, guarded=True)
    assert res.returncode == 1
    hit = [f for f in by.get(code, []) if "FIFO" in f["message"]]
    assert hit and "missing" not in hit[0]["message"], by
    assert_clean(cli_guarded("inspect", str(model)), 1, name, "FIFO (named pipe), not a regular file")


@pytest.mark.parametrize("what", ["index-dir", "indexed-shard-dir"])
def test_directories_where_files_belong(tmp_path, what):
    """An index that is a directory was ignored silently; an indexed shard that is one was 'missing'."""
    model = demo_copy(tmp_path)
    if what == "index-dir":
        (model / INDEX).mkdir()
        code, name = "E114", INDEX
    else:
        with_index(model)
        idx = json.loads((model / INDEX).read_text())
        idx["weight_map"]["model.norm.weight"] = "model-00002.safetensors"
        (model / INDEX).write_text(json.dumps(idx))
        (model / "model-00002.safetensors").mkdir()
        code, name = "E101", "model-00002.safetensors"
    res, by = validate_json(model)
    assert res.exit_code == 1 and "directory" in by[code][0]["message"] and "E110" not in by
    assert_clean(cli("inspect", str(model)), 1, name, "is a directory, not a regular file")


def test_oversized_and_deeply_nested_config(tmp_path):
    """Size and depth are checked before parsing (item 1); 10^5 levels of nesting was exit 70 (item 9)."""
    model = demo_copy(tmp_path)
    with open(model / "config.json", "r+b") as f:
        f.truncate(100 << 20)  # sparse: 100 MB of zeros that are never read
    _, by = validate_json(model)
    assert "more than the" in by["E100"][0]["message"]
    (model / "config.json").write_text('{"a": ' + "[" * 100_000 + "]" * 100_000 + "}")
    _, by = validate_json(model)
    assert "nests deeper than 64 levels" in by["E100"][0]["message"]
    for cmd in (["inspect", str(model)], ["dequantize", str(model), str(tmp_path / "o")]):
        assert_clean(cli(*cmd), 1, "config.json", "nests deeper")


def test_rank_set_with_fifos(rank_set, tmp_path):
    """A rank's config.json or shard as a FIFO hung validate; a FIFO manifest too (and verify)."""
    out = set_copy(rank_set, tmp_path)
    cfg = out / "rank-1-of-2" / "config.json"
    cfg.unlink()
    os.mkfifo(cfg)
    shard = next((out / "rank-0-of-2").glob("*.safetensors"))
    shard.unlink()
    os.mkfifo(shard)
    res, by = validate_json(out, guarded=True)
    assert res.returncode == 1
    text = json.dumps(by)
    assert "rank-1-of-2/config.json" in text and "FIFO" in text
    assert any("FIFO" in f["message"] for f in by["E503"])  # the shard: listed, but not a regular file
    (out / "manifest.json").unlink()
    os.mkfifo(out / "manifest.json")
    res, by = validate_json(out, guarded=True)
    assert "FIFO" in by["E502"][0]["message"]
    assert_clean(cli_guarded("verify", str(DEMO / "model"), str(out)), 1, "manifest.json", "FIFO")


# ----------------------------------------------------------------------------- item 2 (+9): counts
@pytest.mark.parametrize("key, value", [("n_routed_experts", 10**9), ("num_hidden_layers", 10**9),
                                        ("num_hidden_layers", -5), ("num_hidden_layers", 4000),
                                        ("num_attention_heads", 0), ("hidden_size", True)])
def test_implausible_config_counts(tmp_path, key, value):
    """1e9 ran forever, -5 passed validate, 0 heads divided by zero (exit 70), 4000 layers over 2 stored
    ones would list 256k missing modules: each is one E100 / one line naming the key."""
    model = demo_copy(tmp_path)
    edit_config(model, **{key: value})
    res, by = validate_json(model, guarded=True)
    assert res.returncode == 1 and key in by["E100"][0]["message"], by.get("E100")
    assert "E301" not in by and "E303" not in by  # no completeness check against absurd counts
    for cmd in (["dequantize", str(model), str(tmp_path / "bf16")],
                ["rank-slice", str(model), str(tmp_path / "tp2"), "--tp", "2", "--moe", "ep"]):
        assert_clean(cli_guarded(*cmd), 1, "config.json", key)


def test_manifest_tp_1e9(rank_set, tmp_path):
    """tp 1e9 built a billion rank-dir names (3.3 GB); now E502 at once, and verify exits 1."""
    out = set_copy(rank_set, tmp_path)
    man = json.loads((out / "manifest.json").read_text())
    man["tp"] = 10**9
    (out / "manifest.json").write_text(json.dumps(man))
    res, by = validate_json(out, guarded=True)
    assert res.returncode == 1 and "tp 1000000000 is not plausible" in by["E502"][0]["message"]
    assert_clean(cli_guarded("verify", str(DEMO / "model"), str(out)), 1, "not plausible")


def test_deeply_nested_manifest(rank_set, tmp_path):
    """10^5 levels of nesting in manifest.json was exit 70 (RecursionError) in verify and validate."""
    out = set_copy(rank_set, tmp_path)
    man = json.loads((out / "manifest.json").read_text())
    text = json.dumps({**man, "tool_version": "@@"}).replace('"@@"', "[" * 100_000 + "]" * 100_000)
    (out / "manifest.json").write_text(text)
    _, by = validate_json(out)
    assert "nests deeper than 64 levels" in by["E502"][0]["message"]
    assert_clean(cli("verify", str(DEMO / "model"), str(out)), 1, "manifest.json", "nests deeper")


# ----------------------------------------------------------------------------- item 5: rank-slice destinations
def test_resume_over_another_tp_is_refused(tmp_path):
    """--tp 2 --resume over a partial --tp 4 output exited 0 and wrote a manifest over stale rank dirs."""
    src = DEMO / "model"
    out = tmp_path / "out"
    env = {"EXL3TOOLS_TEST_KILL_AFTER_FILES": "2"}
    killed = cli_guarded("rank-slice", str(src), str(out), "--tp", "4", "--moe", "ep", env=env)
    assert killed.returncode == -9 and (out / "rank-3-of-4").is_dir()
    res = cli("rank-slice", str(src), str(out), "--tp", "2", "--moe", "ep", "--resume")
    assert_clean(res, 2, "rank-0-of-4", "does not write")
    assert not (out / "manifest.json").exists()
    # the same dirs from another source (so another plan, per the journal) are refused too
    other = demo_copy(tmp_path, "other")
    edit_config(other, note="changed")
    res = cli("rank-slice", str(other), str(out), "--tp", "4", "--moe", "ep", "--resume")
    assert_clean(res, 2, "different plan")
    # the same plan still resumes
    assert_clean(cli("rank-slice", str(src), str(out), "--tp", "4", "--moe", "ep", "--resume"), 0)
    assert (out / "manifest.json").is_file()


@pytest.mark.parametrize("where", ["same", "inside", "contains"])
def test_destination_overlapping_source_is_refused(tmp_path, where):
    """rank-slice M M overwrote M/config.json; DST inside SRC or SRC inside DST is no better."""
    model = demo_copy(tmp_path / "x")
    before = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in model.iterdir()}
    dst = {"same": model, "inside": model / "tp2", "contains": tmp_path / "x"}[where]
    res = cli("rank-slice", str(model), str(dst), "--tp", "2", "--moe", "ep", "--resume")
    assert_clean(res, 2, "source")
    assert_clean(cli("dequantize", str(model), str(dst), "--overwrite"), 2, "source")
    assert {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in model.iterdir()} == before


# ----------------------------------------------------------------------------- item 7: dtype that is not a string
@pytest.mark.parametrize("dtype", [["F16"], {"x": 1}])
def test_header_dtype_list_or_object(tmp_path, rank_set, dtype):
    """TypeError (unhashable) and exit 70 in every command: now E104 / exit 1 naming the tensor."""
    model = demo_copy(tmp_path)
    name = f"{L0}.self_attn.q_proj.suh"

    def edit(js: str) -> str:
        obj = json.loads(js)
        obj[name]["dtype"] = dtype
        return json.dumps(obj)

    edit_header_json(model / ST, edit)
    _, by = validate_json(model)
    assert name in by["E104"][0]["message"] or by["E104"][0]["tensor"] == name
    for cmd in (["inspect", str(model)], ["dequantize", str(model), str(tmp_path / "o")],
                ["rank-slice", str(model), str(tmp_path / "r"), "--tp", "2"],
                ["normalize", str(model), str(tmp_path / "n")], ["verify", str(model), str(rank_set)]):
        assert_clean(cli(*cmd), 1, "unknown dtype")


# ----------------------------------------------------------------------------- item 8 (+9): dequantize of broken linears
@pytest.mark.parametrize("case", ["trellis-i32", "trellis-rank-2", "config-dims-too-big"])
def test_dequantize_refuses_what_validate_flags(tmp_path, case):
    """Each decoded to wrong weights with exit 0 (or died with exit 70 on the size mismatch)."""
    model = demo_copy(tmp_path)
    p = f"{L0}.mlp.up_proj"
    es = entries(model / ST)
    tr = next(e for e in es if e[0] == f"{p}.trellis")
    if case == "trellis-i32":
        tr[1], tr[2] = "I32", [16, 32, 24]
        code = "E202"
    elif case == "trellis-rank-2":
        tr[2] = [16, 32 * 48]
        code = "E203"
    else:
        code = "E208"
    write_st(model / ST, es)
    if case == "config-dims-too-big":
        edit_config(model, intermediate_size=100_000)
    _, by = validate_json(model)
    assert code in by
    res = cli("dequantize", str(model), str(tmp_path / "bf16"))
    assert_clean(res, 1, code, "wrong weights")
    assert not (tmp_path / "bf16" / "model.safetensors.index.json").exists()
    # a linear that is fine may still be dequantized alone
    assert_clean(cli("dequantize", str(model), str(tmp_path / "one"), "--tensor", f"{L0}.self_attn.o_proj"), 0)


# ----------------------------------------------------------------------------- item 9: SIGBUS
TRUNCATE_DURING_SLICE = """
import os, sys
import exl3tools.slicing as S
plan = S.plan_rank_slices

def truncating(ck, *a, **k):  # the source shrinks after it was opened and planned
    p = plan(ck, *a, **k)
    f = ck.root / "model.safetensors"
    os.truncate(f, os.path.getsize(f) // 2)
    return p

S.plan_rank_slices = truncating
from exl3tools.cli import main
sys.argv = ["exl3tools", "rank-slice", *sys.argv[1:]]
main()
"""


def test_source_truncated_during_rank_slice(tmp_path):
    """It died by SIGBUS (rc -7, no message) reading a memory map past the new end of file."""
    model = demo_copy(tmp_path)
    res = cli_guarded(str(model), str(tmp_path / "out"), "--tp", "2", "--moe", "ep", code=TRUNCATE_DURING_SLICE)
    assert_clean(res, 1, "model.safetensors", "truncated")
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_copy_of_a_file_truncated_midway_is_an_error(tmp_path):
    """The copy reads by pread: a shard cut short under a running copy is named, not a SIGBUS."""
    from exl3tools.checkpoint.copy import copy_tensor
    from exl3tools.errors import CheckpointError

    class Sink:
        def write(self, data):
            pass

    class Whole:
        dim = start = stop = None

    f = tmp_path / "x.bin"
    f.write_bytes(b"\1" * 4096)
    fd = os.open(f, os.O_RDONLY)
    try:
        os.truncate(f, 1000)
        with pytest.raises(CheckpointError, match="x.bin: file ends before byte"):
            copy_tensor(fd, 0, (64, 32), 2, [(Sink(), Whole())], lambda n: None, path=f)
    finally:
        os.close(fd)


# ----------------------------------------------------------------------------- item 10: bounded time and memory
def test_many_zero_size_tensors_under_one_prefix(tmp_path, monkeypatch):
    """collect_modules rebuilt a module per tensor (tuple + 1): 100k tensors took > 300 s."""
    from exl3tools.slicing import cuts

    model = demo_copy(tmp_path)
    es = entries(model / ST)
    write_st(model / ST, es + [[f"{L0}.mlp.zz.t{i}", "F16", [0], b""] for i in range(20_000)])
    built = []
    real = cuts.Module

    def counting(*a, **k):
        built.append(a[0] if a else k.get("prefix"))
        return real(*a, **k)

    monkeypatch.setattr(cuts, "Module", counting)
    assert_clean(cli("rank-slice", str(model), str(tmp_path / "out"), "--tp", "2", "--moe", "ep"), 0)
    assert built.count(f"{L0}.mlp.zz") == 1 and len(built) == len(set(built))


def test_huge_header_is_parsed_in_pieces_and_findings_are_capped(tmp_path, monkeypatch):
    """A 10^6-entry header took 43 s and 2.4 GB: a big header is parsed piecewise (same result; the
    8 MiB threshold is lowered here to keep the test small), and 10^6 W302 findings are capped per
    rule (the full-size figures: docs/validate.md, the issue 16 report)."""
    from exl3tools.checkpoint import header as H

    model = demo_copy(tmp_path)
    n = 15_000
    write_st(model / ST, entries(model / ST) + [[f"{L0}.z{i}.weight", "F16", [0], b""] for i in range(n)])
    whole = H.read_header(model / ST)
    monkeypatch.setattr(H, "SPLIT_HEADER_BYTES", 64 << 10)
    monkeypatch.setattr(H, "PIECE_VALUES", 4096)
    assert whole.header_len > H.SPLIT_HEADER_BYTES
    pieces = H.read_header(model / ST)
    assert pieces.tensors == whole.tensors and list(pieces.tensors) == list(whole.tensors)
    res, by = validate_json(model)
    assert res.exit_code == 0
    w302 = by["W302"]
    assert len(w302) == 10_001 and any(f"{n - 10_000:,} more W302" in f["message"] for f in w302)
    assert json.loads(res.stdout)["stats"]["findings_not_listed"] == n - 10_000


# ----------------------------------------------------------------------------- item 11
def test_names_with_newlines_and_escapes_are_printed_escaped(tmp_path):
    """A tensor name could forge lines (and colours) in validate's report and in error lines."""
    model = demo_copy(tmp_path)
    evil = f"{L0}.evil\nE999 model.safetensors: forged finding\x1b[31m"
    write_st(model / ST, entries(model / ST) + [[evil, "F16", [2], b"\0\0\0\0"]])
    out = assert_clean(cli("validate", str(model)), 0, "W302", "\\x0aE999 model.safetensors: forged finding\\x1b[31m")
    assert "\x1b" not in out and not any(line.startswith("E999") for line in out.splitlines())
    res = cli("inspect", str(model), "--tensor", "no.such\nE999 forged")
    assert_clean(res, 1, "no.such\\x0aE999 forged")
    assert len(res.output.strip().splitlines()) == 1


def test_verify_missing_sliced_is_a_usage_error(tmp_path):
    assert_clean(cli("verify", str(DEMO / "model"), str(tmp_path / "nope")), 2, "nope")


def test_dequantize_into_non_empty_non_checkpoint_dir(tmp_path):
    model = DEMO / "model"
    dst = tmp_path / "notes"
    dst.mkdir()
    (dst / "todo.txt").write_text("mine")
    for extra in ([], ["--overwrite"]):
        assert_clean(cli("dequantize", str(model), str(dst), *extra), 2, "not a checkpoint")
    assert sorted(p.name for p in dst.iterdir()) == ["todo.txt"]


def test_disk_full_while_writing_the_manifest_leaves_no_temp_file(tmp_path, monkeypatch):
    """ENOSPC left .manifest.json.tmp behind."""
    from exl3tools.checkpoint.manifest import RankManifest

    def dump(self, fh):
        fh.write('{"schema"')
        fh.flush()
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(RankManifest, "dump", dump)
    out = tmp_path / "out"
    assert_clean(cli("rank-slice", str(DEMO / "model"), str(out), "--tp", "2", "--moe", "ep"), 2,
                 "No space left on device")
    assert not (out / "manifest.json").exists() and not (out / ".manifest.json.tmp").exists()


@pytest.mark.parametrize("how", ["same-entry-twice", "key-twice-in-entry"])
def test_duplicate_header_keys(tmp_path, how):
    """Identical duplicate keys were accepted (loaders disagree on which copy wins)."""
    model = demo_copy(tmp_path)
    name = "model.norm.weight"

    def edit(js: str) -> str:
        obj = json.loads(js)
        entry = json.dumps(obj[name], separators=(",", ":"))
        if how == "same-entry-twice":
            return js[:-1].rstrip() + f',"{name}":{entry}' + "}"
        return js.replace(f'"{name}":{{"dtype"', f'"{name}":{{"dtype":"BF16","dtype"', 1)

    edit_header_json(model / ST, edit)
    _, by = validate_json(model)
    assert "appears twice" in by["E104"][0]["message"]
    assert_clean(cli("inspect", str(model)), 1, "appears twice")


# ----------------------------------------------------------------------------- item 12: stray shards
def test_stray_shard_messages(tmp_path):
    """A stray copy of an indexed tensor is E119 (exllamav3 loads every *.safetensors, the later wins);
    any other unreferenced shard is a W101 that says so."""
    model = demo_copy(tmp_path)
    with_index(model)
    write_st(model / "zz-stray.safetensors", [["model.norm.weight", "BF16", [256], np.ones(256, "<u2").tobytes()]])
    write_st(model / "aa-extra.safetensors", [["scratch.weight", "F16", [4], b"\0<" * 4]])
    res, by = validate_json(model)
    assert res.exit_code == 1
    assert by["E119"][0]["file"] == "zz-stray.safetensors" and "later file wins" in by["E119"][0]["message"]
    assert by["W101"][0]["file"] == "aa-extra.safetensors" and "exllamav3 loads" in by["W101"][0]["message"]


@pytest.mark.parametrize("mb,inner", [(12, b"[]"), (1, b"{}")])
def test_nesting_bomb_header_is_refused_before_parsing(tmp_path, mb, inner):
    """A header of nested empty lists (90 MB: 49 s and 3.2 GB in validate) or objects is refused as
    E104 from its bracket skeleton, before the JSON parser builds millions of containers; above 8 MiB
    and below it (more brackets than 3 per entry)."""
    model = demo_copy(tmp_path)
    st = model / "model.safetensors"
    n = mb * 2**20 // 3
    js = b'{"a":{"dtype":"F16","shape":[' + inner + (b"," + inner) * n + b'],"data_offsets":[0,2]}}'
    st.write_bytes(len(js).to_bytes(8, "little") + js + b"\0\0")
    res, by = validate_json(model, guarded=True)
    assert res.returncode == 1 and "nesting bomb" in by["E104"][0]["message"]


def test_large_header_with_brackets_in_strings_still_parses(tmp_path):
    """Over 8 MiB, the skeleton check runs on every header: brackets inside names and metadata
    strings do not count, so a real-shaped 40k-tensor header reads as before."""
    names = [f"w[{i}]{{x}}" for i in range(40_000)]
    hb, _ = header_bytes([(nm, "F16", (1,)) for nm in names], {"note": "[[{" * 2_000_000})
    assert len(hb) > 8 << 20
    path = tmp_path / "big.safetensors"
    path.write_bytes(hb + b"\0\0" * len(names))
    h = read_header(path)
    assert len(h.tensors) == len(names) and h.metadata["note"].startswith("[[{")


def test_config_json_nesting_bomb_is_refused_before_parsing(tmp_path):
    """config.json of nested empty lists (60 MB: validate 8 s and 1.9 GB) is refused from one scan
    that counts arrays and objects outside strings, before the parser builds them."""
    model = demo_copy(tmp_path)
    (model / "config.json").write_bytes(b'{"x":[' + b"[]," * 200_000 + b"[]]}")
    res, by = validate_json(model, guarded=True)
    assert res.returncode == 1
    assert [f["file"] for f in by["E100"]] == ["config.json"] and "nesting bomb" in by["E100"][0]["message"]

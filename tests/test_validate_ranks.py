"""validate on rank-slice outputs (E5xx): real sets from `exl3tools rank-slice`, then damaged."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from exl3tools.validate import validate
from tests.conftest import DEMO, fixture_dir
from tests.test_validate import _json, drop, edit_tensors, run_cli

MODEL_ST = "model-00001-of-00001.safetensors"


@pytest.fixture(scope="module")
def demo_set(tmp_path_factory) -> Path:
    from click.testing import CliRunner
    from exl3tools.cli import main

    out = tmp_path_factory.mktemp("rs") / "tp2"
    res = CliRunner().invoke(main, ["rank-slice", str(DEMO / "model"), str(out), "--tp", "2", "--moe", "ep"])
    assert res.exit_code == 0, res.output
    return out


@pytest.fixture(scope="module")
def glm5_set(tmp_path_factory) -> Path:
    from click.testing import CliRunner
    from exl3tools.cli import main

    out = tmp_path_factory.mktemp("rs") / "tp4"
    src = fixture_dir("glm5_moe_dsa-tp-4.0bpw-mcg") / "model"
    res = CliRunner().invoke(main, ["rank-slice", str(src), str(out), "--tp", "4"])
    assert res.exit_code == 0, res.output
    return out


def test_sets_validate_clean(demo_set, glm5_set):
    for d in (demo_set, glm5_set):
        rep = validate(d)
        assert not rep.errors, [f.line for f in rep.errors]
        assert rep.codes <= {"W303"}
        assert rep.stats["tp"] in (2, 4) and rep.stats["rank_dirs"] == rep.stats["tp"]
    for r in range(4):
        rep = validate(glm5_set / f"rank-{r}-of-4")
        assert not rep.errors and not rep.warnings, [f.line for f in rep.findings]


def _copy(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "set"
    shutil.copytree(src, dst)
    return dst


def _manifest(d: Path, fn) -> None:
    p = d / "manifest.json"
    m = json.loads(p.read_text())
    fn(m)
    p.write_text(json.dumps(m))


def _rank_cfg(d: Path, rank: str, fn) -> None:
    p = d / rank / "config.json"
    c = json.loads(p.read_text())
    fn(c["exl3tools"])
    p.write_text(json.dumps(c))


def _shift_slice(m):
    r1 = m["ranks"][1]["tensors"]
    spec = r1["model.layers.0.mlp.gate_proj.trellis"]
    spec[2] += 8
    spec[3] += 8


def _both_start_at_zero(m):
    r1 = m["ranks"][1]["tensors"]
    r1["model.layers.0.mlp.down_proj.suh"] = [None, 0, 0, 256]


CASES = [
    ("no-manifest", lambda d: (d / "manifest.json").unlink(), "E501"),
    ("manifest-not-json", lambda d: (d / "manifest.json").write_text("{"), "E502"),
    ("manifest-schema", lambda d: _manifest(d, lambda m: m.update(tp="two")), "E502"),
    ("manifest-path-escape", lambda d: _manifest(d, lambda m: m["files"].update(
        {"../../../etc/passwd": {"size": 1, "sha256": "0" * 64}})), "E502"),
    ("file-hash-mismatch", lambda d: (d / "rank-0-of-2" / "tokenizer_config.json").write_text("{}"), "E503"),
    ("file-missing", lambda d: (d / "rank-1-of-2" / "tokenizer.json").unlink(), "E503"),
    ("shard-truncated-size", lambda d: (d / "rank-1-of-2" / MODEL_ST).write_bytes(
        (d / "rank-1-of-2" / MODEL_ST).read_bytes()[:-10]), "E503"),
    ("rank-dir-missing", lambda d: shutil.rmtree(d / "rank-1-of-2"), "E504"),
    ("tp-vs-ranks", lambda d: _manifest(d, lambda m: m.update(tp=3)), "E504"),
    ("block-tp", lambda d: _rank_cfg(d, "rank-1-of-2", lambda b: b.update(tp=4)), "E505"),
    ("block-rank", lambda d: _rank_cfg(d, "rank-0-of-2", lambda b: b.update(rank=1)), "E505"),
    ("block-fingerprint", lambda d: _rank_cfg(d, "rank-0-of-2", lambda b: b.update(source_fingerprint="sha256:" + "0" * 64)), "E505"),
    ("tensor-dropped-from-rank", lambda d: edit_tensors(d / "rank-0-of-2", drop("model.layers.1.mlp.experts.3"),
                                                        MODEL_ST), "E506"),
    ("slice-gap", lambda d: _manifest(d, _shift_slice), "E507"),
    ("slice-overlap", lambda d: _manifest(d, _both_start_at_zero), "E507"),
    ("stray-tmp-file", lambda d: (d / "rank-0-of-2" / ".model.tmp").write_bytes(b"x"), "W501"),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_damaged_sets(demo_set, tmp_path, case):
    _id, damage, code = case
    d = _copy(demo_set, tmp_path)
    damage(d)
    res = run_cli(str(d), "--json", "--sample-blocks", "8")
    doc = _json(res)
    assert code in {f["code"] for f in doc["findings"]}, [f"{f['code']} {f['message']}" for f in doc["findings"]]
    errors = [f for f in doc["findings"] if f["severity"] == "error"]
    assert res.exit_code == (1 if errors else 0)
    if code.startswith("W"):
        assert run_cli(str(d), "--strict", "--sample-blocks", "0").exit_code == 1


def test_lone_rank_dir_without_manifest_is_incomplete(demo_set, tmp_path):
    d = _copy(demo_set, tmp_path)
    (d / "manifest.json").unlink()
    res = run_cli(str(d / "rank-0-of-2"), "--json")
    assert res.exit_code == 1 and "E508" in {f["code"] for f in _json(res)["findings"]}


def test_lone_rank_dir_checks_its_manifest_entry(demo_set, tmp_path):
    d = _copy(demo_set, tmp_path)
    (d / "rank-1-of-2" / "tokenizer.json").write_text("{}")
    (d / "rank-0-of-2" / "tokenizer.json").write_text("{}")
    doc = _json(run_cli(str(d / "rank-1-of-2"), "--json"))
    hits = [f for f in doc["findings"] if f["code"] == "E503"]
    assert len(hits) == 1 and hits[0]["file"] == "tokenizer.json"  # its own file, not rank 0's


def test_rank_slice_trellis_checked_against_its_slice(glm5_set, tmp_path):
    """A rank's sliced trellis must match the slice its config block names (localized E208)."""
    import numpy as np

    d = _copy(glm5_set, tmp_path)
    name = "model.layers.0.mlp.gate_proj"

    def widen(entries):
        for e in entries:
            if e[0] == f"{name}.trellis":
                kt, nt, w = e[2]
                e[2] = [kt, nt + 8, w]
                e[3] = np.random.default_rng(0).integers(0, 255, kt * (nt + 8) * w * 2, dtype=np.uint8).tobytes()
            if e[0] == f"{name}.svh":
                e[2] = [e[2][0] + 128]
                e[3] = np.ones(e[2][0], "<f2").tobytes()
    edit_tensors(d / "rank-2-of-4", widen, MODEL_ST)
    doc = _json(res := run_cli(str(d), "--json", "--sample-blocks", "8"))
    codes = {f["code"] for f in doc["findings"]}
    assert {"E208", "E506", "E503"} <= codes and res.exit_code == 1
    hit = next(f for f in doc["findings"] if f["code"] == "E208")
    assert hit["file"].startswith("rank-2-of-4/")


def test_deep_hashes_every_rank_file(demo_set):
    rep = validate(demo_set, deep=True)
    assert not rep.errors
    assert rep.stats["hashed_bytes"] == sum(p.stat().st_size for p in demo_set.rglob("*")
                                            if p.is_file() and p.name != "manifest.json")


@pytest.fixture(scope="module")
def hybrid_set(tmp_path_factory) -> Path:
    from click.testing import CliRunner
    from exl3tools.cli import main

    out = tmp_path_factory.mktemp("rs") / "hybrid"
    src = fixture_dir("glm5_moe_dsa-tp-4.0bpw-mcg") / "model"
    res = CliRunner().invoke(main, ["rank-slice", str(src), str(out), "--tp", "2", "--layout", "vllm-hybrid"])
    assert res.exit_code == 0, res.output
    return out


def test_vllm_hybrid_set(hybrid_set, tmp_path):
    rep = validate(hybrid_set)
    assert not rep.errors and not rep.warnings, [f.line for f in rep.findings]
    d = _copy(hybrid_set, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["hybrid_tr3_tail"]["codebook"] = "mul1"
    (d / "config.json").write_text(json.dumps(cfg))
    assert {"E505", "E503"} <= validate(d).codes
    (d / "manifest.json").unlink()
    (d / ".rank-slice.journal").write_text("")
    doc = _json(res := run_cli(str(d), "--json"))
    assert res.exit_code == 1 and "E501" in {f["code"] for f in doc["findings"]}

"""verify and the manifest schema: schema in step with the dataclasses; broken sets are caught."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from exl3tools.checkpoint import Checkpoint
from exl3tools.checkpoint.manifest import (
    RankEntry,
    RankManifest,
    SourceFile,
    SourceInfo,
    load_manifest,
    schema,
)
from exl3tools.errors import IncompleteOutputError, VerifyError
from exl3tools.slicing import plan_rank_slices, verify_sliced, write_rank_shards
from tests.conftest import fixture_dir


def test_schema_matches_dataclasses() -> None:
    sch = schema()
    top = set(sch["required"])
    assert top == {f.name for f in dataclasses.fields(RankManifest)} | {"schema"}
    src_fields = dataclasses.fields(SourceInfo)
    assert set(sch["properties"]["source"]["required"]) == {
        f.name for f in src_fields if f.default is dataclasses.MISSING}  # repo/revision: only from a Hub repo
    assert set(sch["properties"]["source"]["properties"]) == {f.name for f in src_fields}
    assert set(sch["properties"]["source"]["properties"]["files"]["items"]["required"]) == {
        f.name for f in dataclasses.fields(SourceFile)}
    assert set(sch["properties"]["ranks"]["items"]["required"]) == {f.name for f in dataclasses.fields(RankEntry)}


@pytest.fixture
def sliced(tmp_path: Path) -> tuple[Path, Path]:
    src = fixture_dir("glm4_moe-tp-2.0bpw-mul1") / "model"
    ck = Checkpoint.open(src)
    write_rank_shards(ck, plan_rank_slices(ck, 2), tmp_path / "o")
    return src, tmp_path / "o"


def test_round_trip_manifest(sliced: tuple[Path, Path]) -> None:
    _, out = sliced
    man = load_manifest(out)
    assert RankManifest.from_json(man.to_json()) == man


def test_missing_rank_file(sliced: tuple[Path, Path]) -> None:
    src, out = sliced
    (out / "rank-0-of-2" / "model-00001-of-00001.safetensors").unlink()
    with pytest.raises(VerifyError, match="missing"):
        verify_sliced(src, out)


def test_dropped_slice_is_not_covered(sliced: tuple[Path, Path]) -> None:
    """A manifest that forgets one rank's slice (and a rank file without it) leaves a hole."""
    src, out = sliced
    obj = json.loads((out / "manifest.json").read_text())
    del obj["ranks"][1]["tensors"]["lm_head.trellis"]
    (out / "manifest.json").write_text(json.dumps(obj))
    with pytest.raises(VerifyError, match="tensors differ from manifest"):
        verify_sliced(src, out, hash_files=False)


def test_not_a_sliced_output(tmp_path: Path) -> None:
    with pytest.raises(IncompleteOutputError):
        verify_sliced(fixture_dir("glm4_moe-tp-2.0bpw-mul1") / "model", tmp_path)


def test_schema_checks_tensor_entries(sliced: tuple[Path, Path]) -> None:
    from exl3tools.checkpoint.manifest import check_schema

    _, out = sliced
    obj = json.loads((out / "manifest.json").read_text())
    check_schema(obj)
    name = next(iter(obj["ranks"][0]["tensors"]))
    for bad in ([None, -1, None, None], [None, 0, 1], ["x", "rows", 0, 1], [3, None, None, None]):
        obj["ranks"][0]["tensors"][name] = bad
        with pytest.raises(IncompleteOutputError, match="tensors"):
            check_schema(obj)


def test_manifest_paths_outside_output_refused(sliced: tuple[Path, Path]) -> None:
    src, out = sliced
    obj = json.loads((out / "manifest.json").read_text())
    obj["files"]["../../etc/passwd"] = {"size": 1, "sha256": "0" * 64}
    (out / "manifest.json").write_text(json.dumps(obj))
    with pytest.raises(VerifyError, match="outside"):
        verify_sliced(src, out)

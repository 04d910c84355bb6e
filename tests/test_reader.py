"""Checkpoint.open on real files: single file, sharded with an index, and damaged directories."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from safetensors.torch import load_file, save_file

from exl3tools.checkpoint import Checkpoint
from exl3tools.errors import CheckpointError, HeaderError, NotACheckpointError, NotFoundError
from tests.conftest import DEMO


def _shard(src, dst, n_shards=3):
    """Copy the demo checkpoint into dst as n shards plus an index (the reference writer)."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors"))
    tensors = load_file(str(src / "model.safetensors"))
    names = sorted(tensors)
    weight_map = {}
    for i in range(n_shards):
        part = names[i::n_shards]
        fname = f"model-{i + 1:05d}-of-{n_shards:05d}.safetensors"
        save_file({k: tensors[k] for k in part}, str(dst / fname))
        weight_map.update({k: fname for k in part})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return tensors


def test_demo_opens_from_headers():
    ck = Checkpoint.open(DEMO / "model")
    assert ck.architecture == "Glm4MoeForCausalLM" and ck.is_exl3 and ck.index is None
    assert len(ck.tensors) == 266 and not ck.issues
    assert ck.quantization_config["codebook"] == "mcg"
    assert {p.name for p in ck.tokenizer_files()} >= {"tokenizer.json", "tokenizer_config.json"}


def test_sharded_checkpoint_reads_the_same_values(tmp_path):
    tensors = _shard(DEMO / "model", tmp_path / "sharded")
    ck = Checkpoint.open(tmp_path / "sharded")
    assert len(ck.headers) == 3 and set(ck.tensors) == set(tensors) and not ck.issues
    for name in ("model.layers.1.mlp.experts.3.down_proj.trellis", "model.norm.weight", "lm_head.mcg"):
        got = ck.read_numpy(name)
        want = tensors[name]
        want = want.float().numpy() if want.dtype.is_floating_point and want.itemsize == 2 and name.endswith("weight") else want.numpy()
        assert np.array_equal(got, want)
    t = ck.read_numpy("lm_head.trellis")
    assert np.array_equal(ck.read_numpy_slice("lm_head.trellis", 1, 8, 24), t[:, 8:24])


def test_index_problems_are_found(tmp_path):
    _shard(DEMO / "model", tmp_path / "s")
    idx = json.loads((tmp_path / "s/model.safetensors.index.json").read_text())
    moved = "model.norm.weight"
    del idx["weight_map"][moved]
    idx["weight_map"]["ghost.weight"] = "model-00001-of-00003.safetensors"
    (tmp_path / "s/model.safetensors.index.json").write_text(json.dumps(idx))
    with pytest.raises(CheckpointError, match="ghost.weight"):
        Checkpoint.open(tmp_path / "s")
    del idx["weight_map"]["ghost.weight"]          # only the unindexed tensor left: loaders survive it
    (tmp_path / "s/model.safetensors.index.json").write_text(json.dumps(idx))
    assert any(c == "E112" and moved in m for c, m in Checkpoint.open(tmp_path / "s").issues)


def test_missing_shard_and_bad_index(tmp_path):
    _shard(DEMO / "model", tmp_path / "s")
    (tmp_path / "s/model-00002-of-00003.safetensors").unlink()
    with pytest.raises(CheckpointError, match="missing"):
        Checkpoint.open(tmp_path / "s")
    (tmp_path / "s/model.safetensors.index.json").write_text('{"weight_map": {"a": "../../etc/passwd"}}')
    with pytest.raises(CheckpointError, match="outside"):
        Checkpoint.open(tmp_path / "s")


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(NotFoundError):
        Checkpoint.open(tmp_path / "nope")
    with pytest.raises(NotACheckpointError) as e:
        Checkpoint.open(tmp_path)
    assert "give that folder" not in str(e.value)
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")        # a download's model/ folder: named
    with pytest.raises(NotACheckpointError, match=r"model has one: give that folder\)$"):
        Checkpoint.open(tmp_path)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "config.json").write_text("{}")        # two: no guess
    with pytest.raises(NotACheckpointError, match="Hugging Face checkpoint directory$"):
        Checkpoint.open(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(NotACheckpointError, match="safetensors"):
        Checkpoint.open(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="config.json"):
        Checkpoint.open(tmp_path)


def test_truncated_shard_is_a_header_error(tmp_path):
    shutil.copytree(DEMO / "model", tmp_path / "m")
    p = tmp_path / "m/model.safetensors"
    with open(p, "r+b") as f:
        f.truncate(p.stat().st_size // 2)
    with pytest.raises(HeaderError) as ei:
        Checkpoint.open(tmp_path / "m")
    assert ei.value.code == "E105"


def test_quantization_config_may_be_larger_than_other_json(tmp_path):
    """quantization_config.json's tensor_storage is ~1.2 KB per EXL3 linear (72 MB for GLM-5 at full
    size, which the 64 MiB JSON limit refused); config.json keeps 64 MiB."""
    from exl3tools.checkpoint import jsonio
    from exl3tools.errors import CheckpointError

    p = tmp_path / "q.json"
    p.write_bytes(b"{" + b" " * (jsonio.MAX_JSON_BYTES + 1) + b"}")
    assert jsonio.load_json(p, "quantization_config.json") == {}
    with pytest.raises(CheckpointError, match="limit"):
        jsonio.load_json(p, "config.json")

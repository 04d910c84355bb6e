"""dequantize round-trip: the written HF weights equal the exllamav3 goldens (transposed, cropped)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from exl3tools.cli import main
from safetensors.numpy import load_file as load_np
from safetensors.torch import load_file

from exl3tools.checkpoint import Checkpoint
from tests.conftest import DEMO, fixture_dir


def _hf(golden: np.ndarray, hf_shape) -> np.ndarray:
    return golden.astype(np.float32).T[: hf_shape[0], : hf_shape[1]]


def _roundtrip(model_dir, goldens_dir, tmp_path, dtype, tol):
    out = tmp_path / "hf"
    r = CliRunner().invoke(main, ["dequantize", str(model_dir), str(out), "--dtype", dtype])
    assert r.exit_code == 0, r.output
    cfg = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in cfg and not (out / "quantization_config.json").exists()
    assert (out / "tokenizer.json").is_file()
    ck = Checkpoint.open(out)
    idx = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(idx) == set(ck.tensors)
    tensors = {}
    for f in sorted(set(idx.values())):
        tensors.update(load_file(str(out / f)))
    golden = load_np(str(goldens_dir / "goldens_weights.safetensors"))
    meta = json.loads((goldens_dir / "goldens_weights.json").read_text())
    worst = 0.0
    for p, g in golden.items():
        w = tensors[f"{p}.weight"].float().numpy()
        want = _hf(g, meta[p]["hf_shape"])
        assert w.shape == tuple(meta[p]["hf_shape"]), p
        worst = max(worst, float(np.abs(w - want).max() / np.abs(want).max()))
        assert (f"{p}.bias" in tensors) == meta[p]["has_bias"]
    assert worst <= tol, worst
    src = Checkpoint.open(model_dir)
    norm = tensors["model.norm.weight"]
    assert norm.dtype == torch.bfloat16 and np.array_equal(norm.float().numpy(), src.read_numpy("model.norm.weight"))
    return worst


@pytest.mark.parametrize("dtype,tol", [("fp32", 1e-3), ("bf16", 6e-3), ("fp16", 1.2e-3)])
def test_demo_roundtrip(tmp_path, dtype, tol):
    _roundtrip(DEMO / "model", DEMO, tmp_path, dtype, tol)


def test_mla_padded_dims_are_cropped(tmp_path):
    d = fixture_dir("glm5_moe_dsa-3.0bpw-mul1")
    _roundtrip(d / "model", d, tmp_path, "fp32", 1e-3)
    w = load_file(str(next((tmp_path / "hf").glob("model-00002-*.safetensors"))))
    assert w["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"].shape == (576, 256)


def test_single_tensor_and_dry_run(tmp_path):
    r = CliRunner().invoke(main, ["dequantize", str(DEMO / "model"), str(tmp_path / "x"), "--dry-run"])
    assert r.exit_code == 0 and "shards" in r.output and not (tmp_path / "x").exists()
    r = CliRunner().invoke(main, ["dequantize", str(DEMO / "model"), str(tmp_path / "one"),
                                  "--tensor", "model.layers.0.self_attn.q_proj", "--dtype", "fp32"])
    assert r.exit_code == 0, r.output
    ck = Checkpoint.open(tmp_path / "one")
    assert set(ck.tensors) == {"model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.q_proj.bias"}
    r = CliRunner().invoke(main, ["dequantize", str(DEMO / "model"), str(tmp_path / "one")])
    assert r.exit_code == 2 and "already" in r.output
    r = CliRunner().invoke(main, ["dequantize", str(DEMO / "model"), str(tmp_path / "z"), "--tensor", "nope"])
    assert r.exit_code == 1 and "nope" in r.output

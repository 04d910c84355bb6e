"""diff: zero against itself; a damaged linear is the worst entry (EXL3 vs EXL3 and EXL3 vs HF bf16)."""

from __future__ import annotations

import json
import shutil
from importlib import resources

import jsonschema
import numpy as np
import pytest
from click.testing import CliRunner
from exl3tools.cli import main

from exl3tools.checkpoint import Checkpoint
from exl3tools.diff import diff_checkpoints
from tests.conftest import FIXTURE_NAMES, fixture_dir

SCHEMA = json.loads(resources.files("exl3tools.schemas").joinpath("diff.v1.json").read_text())


def _damaged_copy(src, dst, tensor: str, how: str):
    """Copy checkpoint ``src`` to ``dst`` with one tensor's bytes changed in place."""
    shutil.copytree(src, dst)
    ref = Checkpoint.open(dst).tensors[tensor]
    with open(ref.file, "r+b") as f:
        f.seek(ref.info.begin)
        raw = np.frombuffer(f.read(ref.info.nbytes), dtype=np.uint16)
        if how == "flip":      # fp16 sign bit of every element: suh -> -suh
            new = raw ^ np.uint16(0x8000)
        else:                  # random trellis bits
            new = np.random.default_rng(0).integers(0, 2**16, raw.size, dtype=np.uint16)
        f.seek(ref.info.begin)
        f.write(new.tobytes())
    return dst


# one fixture per codebook (mul1, mcg, 3inst); the others run the same code on more linears
@pytest.mark.parametrize("name", [FIXTURE_NAMES[0], FIXTURE_NAMES[2], FIXTURE_NAMES[3]])
def test_diff_with_itself_is_exactly_zero(name):
    ck = Checkpoint.open(fixture_dir(name) / "model")
    rep = diff_checkpoints(ck, ck)
    assert rep.linears and rep.layers and not rep.missing_in_a and not rep.missing_in_b
    for row in rep.linears + rep.layers:
        assert (row.rel_err, row.sqnr_db, row.cosine) == (0.0, None, 1.0), row.name
    jsonschema.validate(rep.to_json(), SCHEMA)


def test_flipped_sign_vector_is_the_worst_linear(tmp_path):
    src = fixture_dir("llama-4.0bpw-mul1") / "model"
    bad = "model.layers.1.self_attn.k_proj"
    dst = _damaged_copy(src, tmp_path / "bad", f"{bad}.suh", "flip")
    res = CliRunner().invoke(main, ["diff", str(dst), str(src), "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    jsonschema.validate(doc, SCHEMA)
    worst = doc["linears"][0]
    assert worst["name"] == bad and abs(worst["rel_err"] - 2.0) < 1e-9 and abs(worst["cosine"] + 1) < 1e-9
    assert all(r["rel_err"] == 0.0 for r in doc["linears"][1:])
    assert doc["layers"][0]["name"] == "model.layers.1" and doc["layers"][-1]["rel_err"] == 0.0


def test_random_trellis_is_the_worst_against_a_bf16_reference(tmp_path):
    """EXL3 (one linear re-encoded with random bits) vs the HF bf16 checkpoint dequantize writes."""
    from exl3tools.dequantize import apply_dequantize, plan_dequantize

    src = fixture_dir("glm4_moe-3.0bpw-mcg") / "model"
    ck = Checkpoint.open(src)
    ref = apply_dequantize(plan_dequantize(ck, tmp_path / "bf16", "bf16"), ck)
    bad = "model.layers.1.mlp.experts.5.up_proj"
    dst = _damaged_copy(src, tmp_path / "bad", f"{bad}.trellis", "random")
    rep = diff_checkpoints(Checkpoint.open(dst), Checkpoint.open(ref))
    assert rep.linears[0].name == bad and rep.linears[0].rel_err > 0.5
    assert rep.linears[0].a == "exl3 3 mcg" and rep.linears[0].b == "bf16"
    assert all(0 < r.rel_err < 0.01 and r.sqnr_db > 40 for r in rep.linears[1:])   # bf16 rounding only
    assert rep.layers[0].name == "model.layers.1"
    clean = diff_checkpoints(ck, Checkpoint.open(ref))
    assert max(r.rel_err for r in clean.linears) < 0.01


def test_diff_refuses_other_models_in_one_line():
    a = str(fixture_dir("llama-4.0bpw-mul1") / "model")
    b = str(fixture_dir("qwen3_moe-2.5bpw-mul1") / "model")
    res = CliRunner().invoke(main, ["diff", a, b])
    assert res.exit_code == 2
    assert res.stderr.strip().splitlines() == [
        f"error: usage error: {a} is LlamaForCausalLM but {b} is Qwen3MoeForCausalLM"]
    res = CliRunner().invoke(main, ["diff", a, "/nonexistent"])
    assert res.exit_code == 2 and "does not exist" in res.stderr


def test_token_ids_localize_the_damaged_layer(tmp_path):
    """--token-ids: hidden states agree exactly up to the damaged layer, then drift; logits KL > 0."""
    src = fixture_dir("llama-4.0bpw-mul1") / "model"
    dst = _damaged_copy(src, tmp_path / "bad", "model.layers.1.self_attn.k_proj.suh", "flip")
    res = CliRunner().invoke(main, ["diff", str(dst), str(src), "--token-ids", "1,77,300,5,99,1000,42,7", "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    jsonschema.validate(doc, SCHEMA)
    act = doc["activations"]
    assert act["tokens"] == 8 and [r["layer"] for r in act["layers"]] == [0, 1]
    assert act["layers"][0]["cosine_min"] > 1 - 1e-12
    assert act["layers"][1]["cosine_min"] < 0.999 and act["logits"]["kl_mean"] > 0


def test_token_ids_against_itself_mla():
    src = str(fixture_dir("deepseek_v3-3.0bpw-3inst") / "model")
    res = CliRunner().invoke(main, ["diff", src, src, "--token-ids", "1,2,3,4,5", "--json"])
    assert res.exit_code == 0, res.output
    act = json.loads(res.stdout)["activations"]
    assert act["logits"]["kl_max"] == 0.0 and act["logits"]["top1_agree"] == 1.0
    assert all(r["cosine_min"] > 1 - 1e-12 for r in act["layers"])
    res = CliRunner().invoke(main, ["diff", src, src, "--token-ids", "1,x"])
    assert res.exit_code == 2 and "--token-ids must be comma-separated integers" in res.stderr

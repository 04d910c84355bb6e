"""inspect on every fixture, human and --json, checked against config.json and the goldens' metadata."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from importlib import resources

import jsonschema
import pytest
from click.testing import CliRunner
from exl3tools.cli import main

from tests.conftest import DEMO, FIXTURE_NAMES, fixture_dir

SCHEMA = json.loads(resources.files("exl3tools.schemas").joinpath("inspect.v1.json").read_text())


def _run(*args):
    r = CliRunner().invoke(main, list(args))
    assert "Traceback" not in (r.output or "")
    return r


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_inspect_json_matches_config_and_goldens(name):
    d = fixture_dir(name)
    cfg = json.loads((d / "model/config.json").read_text())
    gold = json.loads((d / "goldens.json").read_text())
    r = _run("inspect", str(d / "model"), "--json", "--tp", "2")
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    jsonschema.validate(out, SCHEMA)
    assert out["architecture"] == cfg["architectures"][0]
    assert out["dims"]["hidden_size"] == cfg["hidden_size"] and out["dims"]["vocab_size"] == cfg["vocab_size"]
    assert out["quantization"]["bits"] == cfg["quantization_config"]["bits"]
    assert out["quantization"]["head_bits"] == cfg["quantization_config"]["head_bits"]
    gw = gold["weights"]
    if "num_quantized_linears" in gw:
        assert out["totals"]["exl3_linears"] == gw["num_quantized_linears"]
    assert sorted({b["bits"] for b in out["bits"]}) == sorted(gw["bits_present"])
    assert sorted(out["codebooks"]) == sorted(gw["codebooks_present"])
    assert out["storage_bpw"]["head"] == pytest.approx(gold["storage"]["bpw_head"], abs=1e-6)
    # exllamav3's get_storage_info count, reproduced exactly from the headers
    assert out["storage_bpw"]["layers"] == pytest.approx(gold["storage"]["bpw_layers"], rel=1e-8)
    kinds = out["layers"]
    n_layers = cfg["num_hidden_layers"]
    assert kinds.get("dense", 0) + kinds.get("moe", 0) == n_layers
    has_mtp = "mtp" in gold and cfg["architectures"][0] == "GlmMoeDsaForCausalLM"
    assert kinds.get("mtp", 0) == (1 if has_mtp else 0)
    if "n_routed_experts" in cfg or "num_experts" in cfg:
        assert out["experts"]["routed"] == cfg.get("n_routed_experts", cfg.get("num_experts"))
        assert out["experts"]["top_k"] == cfg["num_experts_per_tok"]
    rank = out["per_rank_bytes"]
    assert rank["tp"] == 2 and rank["replicated_bytes"] < rank["bytes_per_rank"] < out["totals"]["tensor_bytes"]


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_inspect_human_output(name):
    d = fixture_dir(name)
    r = _run("inspect", str(d / "model"))
    assert r.exit_code == 0, r.output
    cfg = json.loads((d / "model/config.json").read_text())
    assert cfg["architectures"][0] in r.output and "bits per tensor family" in r.output


def test_inspect_tensor_reports_decoded_stats():
    r = _run("inspect", str(DEMO / "model"), "--tensor", "model.layers.1.mlp.experts.3.down_proj.trellis", "--json")
    assert r.exit_code == 0, r.output
    rep = json.loads(r.output)
    assert rep["prefix"] == "model.layers.1.mlp.experts.3.down_proj" and rep["codebook"] == "mcg"
    assert (rep["k_padded"], rep["n_padded"], rep["in_real"], rep["out_real"]) == (128, 256, 128, 256)
    assert rep["stats"]["finite"] == 1.0 and 0 < rep["stats"]["std"] < 1
    assert _run("inspect", str(DEMO / "model"), "--tensor", "model.norm").exit_code == 1


def test_inspect_reads_the_hub_cache_offline(tmp_path, monkeypatch):
    """A repo id resolves through the local Hugging Face cache with HF_HUB_OFFLINE=1."""
    cache = tmp_path / "hub"
    repo = cache / "models--exl3tools--demo-exl3"
    snap = repo / "snapshots" / ("a" * 40)
    shutil.copytree(DEMO / "model", snap)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("a" * 40)
    code = ("import sys; from exl3tools.cli import main; sys.argv=['exl3tools','inspect','exl3tools/demo-exl3','--json'];"
            "main()")
    env = {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["source"] == "hub-cache"
    missing = subprocess.run([sys.executable, "-c", code.replace("demo-exl3", "absent")], capture_output=True,
                             text=True, env=env)
    assert missing.returncode == 2 and "Traceback" not in missing.stderr and "not in the Hugging Face cache" in missing.stderr


def test_bad_inputs_give_one_line_errors(tmp_path):
    assert _run("inspect", str(tmp_path / "missing")).exit_code == 2
    assert _run("inspect", str(tmp_path)).exit_code == 2                   # not a checkpoint
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    import numpy as np
    from safetensors.numpy import save_file
    save_file({"model.norm.weight": np.ones(4, np.float16)}, str(plain / "model.safetensors"))
    r = _run("inspect", str(plain))
    assert r.exit_code == 1 and "not an EXL3 checkpoint" in r.output        # a non-EXL3 checkpoint
    bad = tmp_path / "bad"
    shutil.copytree(DEMO / "model", bad)
    (bad / "model.safetensors").write_bytes(b"garbage" * 10)               # garbage safetensors
    r = _run("inspect", str(bad))
    assert r.exit_code == 1 and "corrupt safetensors" in r.output and len(r.output.strip().splitlines()) == 1
    trunc = tmp_path / "trunc"
    shutil.copytree(DEMO / "model", trunc)
    with open(trunc / "model.safetensors", "r+b") as f:
        f.truncate(5000)
    r = _run("inspect", str(trunc))
    assert r.exit_code == 1 and "model.safetensors" in r.output

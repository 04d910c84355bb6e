"""bench/synth_checkpoint.py writes checkpoints our tools and runtime accept, laid out exactly like
the exllamav3 1.6.5 fixture; bench/gpu_e2e_model.py's argument parsing and byte accounting."""

from __future__ import annotations

import argparse
import json
import struct
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from exl3tools.cli import main as cli

from tests.conftest import REPO, fixture_dir

sys.path.insert(0, str(REPO / "bench"))
import gpu_e2e_model as g  # noqa: E402
import synth_checkpoint as sc  # noqa: E402
import synth_configs  # noqa: E402


def _header(path: Path) -> dict:
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        h = json.loads(f.read(n))
    h.pop("__metadata__", None)
    return {k: (v["dtype"], v["shape"]) for k, v in h.items()}


def _all_headers(d: Path) -> dict:
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(_header(f))
    return out


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> Path:
    """--small, 3 layers (1 dense + 2 MoE), cut into several shards with an index."""
    out = tmp_path_factory.mktemp("synth") / "small"
    assert sc.main([str(out), "--small", "--layers", "3", "--shard-mb", "1", "--jobs", "2"]) == 0
    return out


def test_bytes_do_not_depend_on_jobs(small, tmp_path):
    """Each shard has its own random stream: one process writes what two wrote, byte for byte."""
    one = tmp_path / "one"
    sc.write_checkpoint(one, small=True, layers=3, shard_mb=1, jobs=1)
    files = sorted(p.name for p in small.iterdir())
    assert files == sorted(p.name for p in one.iterdir()) and len(files) > 3
    for f in files:
        assert (small / f).read_bytes() == (one / f).read_bytes(), f


def test_layout_equals_the_exllamav3_fixture(tmp_path):
    """At the fixture's dims the tensor names, dtypes, shapes and the whole tensor_storage map (order
    included) are what exllamav3 1.6.5's converter wrote."""
    fx = fixture_dir("glm4_moe-3.0bpw-mcg") / "model"
    cfg = json.loads((fx / "config.json").read_text())
    dims = {k: cfg[k] for k in synth_configs.SMALL if k in cfg} | {"rope_theta": 10000.0}
    out = tmp_path / "fx"
    sc.write_checkpoint(out, layers=2, dense_layers=1, codebook="mcg", dims=dims, shard_mb=8192)
    assert _header(out / "model.safetensors") == _header(fx / "model.safetensors")
    # calibration differs; no MTP promised
    assert_configs_match(out, fx, {"quantization_config", "num_nextn_predict_layers"})


def assert_configs_match(out: Path, fx: Path, config_diff: set[str]) -> None:
    """quantization_config.json equal (tensor_storage in order; calibration aside) and config.json
    equal except for the keys ``config_diff``."""
    ours, theirs = (json.loads((d / "quantization_config.json").read_text()) for d in (out, fx))
    assert list(ours["tensor_storage"].items()) == list(theirs["tensor_storage"].items())
    assert {k: v for k, v in ours.items() if k not in ("tensor_storage", "calibration")} == \
        {k: v for k, v in theirs.items() if k not in ("tensor_storage", "calibration")}
    mine, cfg = (json.loads((d / "config.json").read_text()) for d in (out, fx))
    assert {k for k in set(mine) | set(cfg) if mine.get(k) != cfg.get(k)} == config_diff


def test_small_is_sharded_and_marked(small):
    files = sorted(p.name for p in small.glob("*.safetensors"))
    assert len(files) > 1 and all(f.startswith("model-0000") for f in files)
    idx = json.loads((small / "model.safetensors.index.json").read_text())
    h = _all_headers(small)
    assert set(idx["weight_map"]) == set(h)
    for name in h:   # every tensor is in the file the index names
        assert name in _header(small / idx["weight_map"][name])
    assert h["model.layers.0.mlp.gate_proj.svh"] == ("F16", [384])      # 320 padded to 384
    assert h["model.layers.1.mlp.experts.15.down_proj.trellis"] == ("I16", [8, 16, 48])
    assert h["lm_head.trellis"] == ("I16", [16, 128, 96])
    assert h["model.layers.2.mlp.gate.e_score_correction_bias"] == ("F32", [16])
    assert h["model.embed_tokens.weight"] == ("BF16", [2048, 256])
    from exl3tools.checkpoint import Checkpoint

    ck = Checkpoint.open(small)
    assert int(ck.read_numpy("lm_head.mul1")) & 0xFFFFFFFF == 0x83DCD12D
    svh = ck.read_numpy("model.layers.0.mlp.up_proj.svh")
    assert (svh[320:] == 0).all() and (svh[:320] != 0).all()


def test_small_validates_and_inspects(small):
    r = CliRunner().invoke(cli, ["validate", str(small)])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(cli, ["inspect", str(small), "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert out["architecture"] == "Glm4MoeForCausalLM"
    assert out["layers"] == {"dense": 1, "moe": 2}
    assert out["experts"]["routed"] == 16 and out["experts"]["top_k"] == 4
    assert out["experts"]["present_per_moe_layer"] == [16]
    bits = {(b["family"], b["bits"]) for b in out["bits"]}
    assert bits == {("attention", "3"), ("dense_mlp", "3"), ("experts", "3"), ("shared_experts", "3"), ("head", "6")}


def test_small_runs_in_our_runtime(small):
    from exl3tools.runtime.runner import load_runner

    runner = load_runner(small, device="cpu")
    try:
        assert runner.vocab_size == 2048
        runner.add_sequence("a")
        lg = runner.step([("a", [1, 17, 300, 42])])
        lg2 = runner.step([("a", [int(lg.argmax())])])
    finally:
        runner.close()
    assert lg.shape == lg2.shape == (1, 2048)
    assert torch.isfinite(lg).all() and torch.isfinite(lg2).all()
    assert 0.1 < float(lg.std()) < 100     # scales keep activations O(1): neither flat nor exploding
    assert not torch.equal(lg, lg2)


def test_tokenizer_padded_to_vocab(tmp_path):
    """A 151552-entry vocabulary gets a tokenizer that decodes every id (without writing 6 GB)."""
    from tokenizers import Tokenizer

    sc._write_tokenizer(tmp_path, 151552)
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert tok.get_vocab_size() == 151552
    assert tok.id_to_token(151551) == "<|synth_151551|>" and tok.id_to_token(7) == '"'


def test_full_size_plan_matches_the_anchor():
    """The default plan is the anchor checkpoint: 6.2 GB, and per-step bytes 1061.6 MB at batch 1
    (head 44 %), 2484 MB at batch 8 with 51.6 distinct experts (serving-expectations.md)."""
    cfg = synth_configs.make_config(synth_configs.AIR, 6, 1, None)
    mods = sc.plan(cfg, 3, 6, "mul1")
    assert round(sum(t.nbytes for m in mods for t in m.tensors) / 1e9, 1) == 6.2
    shards = sc.shard_plan(mods, 2048 << 20)
    assert len(shards) == 4
    tops = [{m.top for m in s} for s in shards]
    assert sum(map(len, tops)) == len(set().union(*tops)) == 6 + 3   # no top-level module split
    h = {t.name: (t.dtype, list(t.shape)) for m in mods for t in m.tensors}
    assert h["model.layers.0.mlp.gate_proj.trellis"] == ("I16", [256, 688, 48])   # 10944 -> 11008
    mb = _model_bytes_from_plan(mods, cfg)
    b1, b8 = g.step_bytes(mb, 1), g.step_bytes(mb, 8)
    assert round(b1["total"] / 1e6, 1) == 1061.6 and round(b1["head"] / b1["total"], 2) == 0.44
    assert round(b8["total"] / 1e6) == 2484 and round(b8["distinct_experts_per_layer"], 1) == 51.6
    assert round(g.roofline_fraction(b1["total"], 2.23), 3) == 0.112


def _model_bytes_from_plan(mods, cfg) -> dict:
    """model_bytes()'s record built from a plan instead of headers (the two are compared on a real
    checkpoint below), so the full-size figures need no 6 GB file."""
    layers: dict = {}
    head = 0
    for m in mods:
        if m.bits is None:
            continue
        k = m.tensors[0].shape[0]
        n = m.tensors[1].shape[0]
        b = g.linear_bytes(k, n, m.bits) + sum(t.nbytes for t in m.tensors if t.kind == "bias")
        if m.key == "lm_head":
            head += b
            continue
        li = int(m.key.split(".")[2])
        d = layers.setdefault(li, {"attention": 0, "dense_mlp": 0, "shared_experts": 0, "other": 0, "experts": {},
                                   "router": 0, "norms": 0})
        if ".experts." in m.key:
            e = int(m.key.split(".")[5])
            d["experts"][e] = d["experts"].get(e, 0) + b
        elif ".shared_experts." in m.key:
            d["shared_experts"] += b
        elif ".self_attn." in m.key:
            d["attention"] += b
        else:
            d["dense_mlp"] += b
    for m in mods:
        for t in m.tensors:
            if t.kind in ("router", "score_bias"):
                layers[int(t.name.split(".")[2])]["router"] += t.nbytes
            elif t.kind == "norm" and t.name.startswith("model.layers."):
                layers[int(t.name.split(".")[2])]["norms"] += t.nbytes
    return {"layers": layers, "head": head, "final_norm": 2 * cfg["hidden_size"], "embed_row": 2 * cfg["hidden_size"],
            "top_k": cfg["num_experts_per_tok"]}


def test_model_bytes_from_headers_equals_plan(small):
    cfg = json.loads((small / "config.json").read_text())
    mods = sc.plan(cfg, 3, 6, "mul1")
    assert g.model_bytes(small) == _model_bytes_from_plan(mods, cfg)
    mb = g.model_bytes(small)
    one = g.step_bytes(mb, 1)
    # batch 1 touches top_k experts per MoE layer; batch 1000 all 16; counted routing overrides both
    assert one["distinct_experts_per_layer"] == 4
    assert g.step_bytes(mb, 1000)["distinct_experts_per_layer"] == pytest.approx(16)
    assert g.step_bytes(mb, 8, distinct={1: 5, 2: 7})["distinct_experts_per_layer"] == 6
    per_expert = sum(mb["layers"][1]["experts"].values()) / 16
    assert g.step_bytes(mb, 1, distinct=5)["experts"] - one["experts"] == pytest.approx(2 * per_expert)
    parts = sum(v for k, v in one.items() if k not in ("total", "distinct_experts_per_layer"))
    assert one["total"] == parts


def test_expected_distinct_and_linear_bytes():
    assert g.expected_distinct_experts(160, 8, 1) == pytest.approx(8)
    assert [round(g.expected_distinct_experts(160, 8, b)) for b in (8, 32)] == [54, 129]   # §8
    assert [round(g.expected_distinct_experts(256, 8, b)) for b in (8, 32)] == [57, 163]
    assert g.linear_bytes(4096, 1408, 3) == 4096 * 1408 * 3 // 8 + 2 * (4096 + 1408)
    assert g.linear_bytes(256, 128, 2.5) == 256 * 128 * 5 // 16 + 2 * 384


def test_argument_parsing():
    assert g.parse_ints("1,8") == [1, 8]
    assert g.parse_impls("ours:cuda, ours:triton,exllamav3,ours:cuda") == ["ours:cuda", "ours:triton", "exllamav3"]
    for bad in ("ours", "exllamav3:x", "vllm", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            g.parse_impls(bad)
    with pytest.raises(argparse.ArgumentTypeError):
        g.parse_ints("0,8")
    with pytest.raises(SystemExit):
        g.main(["ckpt", "--max-len", "300"])          # not a multiple of 256
    with pytest.raises(SystemExit):
        g.main(["ckpt", "--steps", "300"])            # does not fit --max-len 256
    p = g.make_prompts(8, 32, 151552)
    assert len(p) == 8 and all(len(r) == 32 and r[0] == 1 and all(6 <= t < 2048 for t in r[1:]) for r in p)
    assert p == g.make_prompts(8, 32, 151552) and p[0] != p[1]


def test_rows_table_and_ratios():
    rows = [{"impl": "exllamav3", "mode": "generator", "batch": 1, "ms_per_step": 2.0, "tokens_per_s": 500.0},
            {"impl": "exllamav3", "mode": "forward", "batch": 1, "ms_per_step": 1.6, "tokens_per_s": 625.0},
            {"impl": "ours:cuda", "mode": "graph", "batch": 1, "ms_per_step": 1.0, "tokens_per_s": 1000.0},
            {"impl": "ours:triton", "batch": 1, "error": "UsageError: backend 'triton' is not available"}]
    g.finish_rows(rows, {1: {"total": 1.0e9}})
    assert rows[2]["vs_exllamav3_generator"] == 2.0 and rows[2]["vs_exllamav3_forward"] == 1.6
    assert rows[2]["roofline_fraction"] == pytest.approx(1e9 / 4.26e12 / 1e-3)
    assert "vs_exllamav3_generator" not in rows[0] and "roofline_fraction" not in rows[3]
    t = g.format_table(rows)
    assert "2.00x" in t and "1000.0" in t and "not available" in t and len(t.splitlines()) == 6


def test_rounds_take_their_own_exllamav3_row_and_a_median():
    """--rounds: each round's ours row against exllamav3's row of the same round; the medians
    table over the rounds with their spread."""
    rows = []
    for rnd, (ex, ours) in enumerate(((500.0, 1000.0), (400.0, 1200.0), (450.0, 1100.0)), start=1):
        rows += [{"impl": "exllamav3", "mode": "forward", "batch": 8, "ms_per_step": 1.0, "tokens_per_s": ex,
                  "round": rnd},
                 {"impl": "ours:cuda", "mode": "graph", "batch": 8, "ms_per_step": 1.0, "tokens_per_s": ours,
                  "round": rnd}]
    g.finish_rows(rows, {8: {"total": 1.0e9}})
    assert [r["vs_exllamav3_forward"] for r in rows if r["impl"] == "ours:cuda"] == [2.0, 3.0, 1100 / 450]
    m = g.round_medians(rows)
    assert "| ours:cuda | graph | 8 | 3 | 1100.0 | 20.0 % |" in m and "| exllamav3 | forward | 8 | 3 | 450.0 | 25.0 % |" in m

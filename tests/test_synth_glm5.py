"""bench/synth_checkpoint.py --arch glm5 / deepseek_v3: laid out exactly like the exllamav3 1.6.5
fixtures (MTP layer included), accepted by validate / inspect / plan, run by our CPU runtime, and the
real-size GLM-5 / DeepSeek-V3 checkpoints sized from the plan without writing them."""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from exl3tools.cli import main as cli

from tests.conftest import REPO, fixture_dir
from tests.test_synth_checkpoint import assert_configs_match

sys.path.insert(0, str(REPO / "bench"))
import synth_checkpoint as sc  # noqa: E402
import synth_configs  # noqa: E402

ARCH = {"glm5": "GlmMoeDsaForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM"}


def _headers(d: Path) -> dict:
    out = {}
    for p in sorted(d.glob("*.safetensors")):
        with open(p, "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            h = json.loads(f.read(n))
        h.pop("__metadata__", None)
        out.update({k: (v["dtype"], v["shape"]) for k, v in h.items()})
    return out


def _cli(*args: str) -> dict:
    r = CliRunner().invoke(cli, [*args, "--json"])
    assert r.exit_code == 0, r.output
    return json.loads(r.output)


@pytest.mark.parametrize("fixture, arch, layers, bits, codebook, mtp", [
    ("glm5_moe_dsa-3.0bpw-mul1", "glm5", 2, 3, "mul1", True),
    ("glm5_moe_dsa-tp-4.0bpw-mcg", "glm5", 3, 4, "mcg", True),
    ("deepseek_v3-3.0bpw-3inst", "deepseek_v3", 2, 3, "3inst", False),
])
def test_layout_equals_the_exllamav3_fixture(tmp_path, fixture, arch, layers, bits, codebook, mtp):
    """At the fixture's dims: every tensor name, dtype and shape (MTP layer included), the whole
    tensor_storage map in order (kv_b_proj and MTP unlisted), quantization_config and config.json."""
    fx = fixture_dir(fixture) / "model"
    cfg = json.loads((fx / "config.json").read_text())
    dims = {k: cfg[k] for k in sc.ARCHS[arch].small if k in cfg}
    assert set(dims) == set(sc.ARCHS[arch].small)
    out = tmp_path / "fx"
    sc.write_checkpoint(out, arch=arch, layers=layers, dense_layers=1, bits=bits, codebook=codebook, dims=dims,
                        mtp=mtp, shard_mb=8192)
    assert _headers(out) == _headers(fx)
    # calibration differs; the deepseek fixture says num_nextn_predict_layers 1 and has no MTP layer
    assert_configs_match(out, fx, {"quantization_config"} if mtp else {"quantization_config", "num_nextn_predict_layers"})


@pytest.fixture(scope="module", params=["glm5", "deepseek_v3"])
def small(request, synth_small) -> tuple[str, Path]:
    return request.param, synth_small(request.param)


def test_small_validates_and_inspects(small):
    arch, path = small
    v = _cli("validate", str(path))
    assert v["ok"] and v["errors"] == 0 and v["warnings"] == 0, v["findings"]
    out = _cli("inspect", str(path))
    assert out["architecture"] == ARCH[arch]
    assert out["layers"] == {"dense": 1, "moe": 3, "mtp": 1}
    assert out["experts"] == {"routed": 16, "shared": 1, "top_k": 4, "present_per_moe_layer": [16]}
    attn = "mla+dsa" if arch == "glm5" else "mla"
    assert [(x["index"], x["kind"], x["attention"]) for x in out["layer_list"]] == \
        [(0, "dense", attn), (1, "moe", attn), (2, "moe", attn), (3, "moe", attn), (4, "mtp", attn)]
    assert out["quantization"]["mtp_bits"] == 4
    bits = {(b["family"], b["bits"]) for b in out["bits"]}
    assert bits == {("attention", "3"), ("dense_mlp", "3"), ("experts", "3"), ("shared_experts", "3"),
                    ("head", "6"), ("mtp", "4")}


def _run(path: Path, prompts: list[list[int]]) -> tuple[list[torch.Tensor], bool]:
    from exl3tools.runtime.runner import load_runner

    runner = load_runner(path, max_cache_tokens=256)
    try:
        out = []
        for i, p in enumerate(prompts):
            runner.add_sequence(i)
            out.append(runner.step([(i, p)]))
        return out, runner.model.mtp is not None
    finally:
        runner.close()


def test_small_runs_in_our_runtime(small):
    """Finite, not flat logits for a short prompt and for one longer than index_topk (32), where the
    GLM-5 indexer's top-k selection makes attention sparse; the MTP head is loaded (GLM-5's and
    DeepSeek-V3's)."""
    arch, path = small
    (short, long), has_mtp = _run(path, [[1, 2, 3], list(range(1, 41))])
    for lg in (short, long):
        assert lg.shape == (1, 2048) and torch.isfinite(lg).all()
        assert 0.1 < float(lg.std()) < 100
    assert not torch.equal(short, long)
    assert has_mtp


def test_index_share_small(tmp_path):
    """--index-share: GLM-5.2's full/shared schedule; shared layers carry no indexer tensors, the
    MTP layer keeps its own; validate, inspect and the runtime accept it."""
    out = tmp_path / "share"
    assert sc.main([str(out), "--arch", "glm5", "--small", "--layers", "7", "--index-share"]) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["indexer_types"] == ["full", "full", "full", "shared", "shared", "shared", "full"]
    assert synth_configs.index_share_types(12)[6:] == ["full", "shared", "shared", "shared", "full", "shared"]
    h = _headers(out)
    have = {li for li in range(8) if f"model.layers.{li}.self_attn.indexer.wq_b.trellis" in h}
    assert have == {0, 1, 2, 6, 7}
    v = _cli("validate", str(out))
    assert v["ok"] and v["warnings"] == 0, v["findings"]
    kinds = [x["attention"] for x in _cli("inspect", str(out))["layer_list"]]
    assert kinds == ["mla+dsa"] * 3 + ["mla"] * 3 + ["mla+dsa"] * 2
    (lg,), has_mtp = _run(out, [list(range(1, 41))])
    assert torch.isfinite(lg).all() and has_mtp


def test_grouped_routing_is_config_only(tmp_path):
    out = tmp_path / "grp"
    s = sc.write_checkpoint(out, arch="deepseek_v3", small=True, layers=4, grouped_routing=True, sparse=True)
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["n_group"], cfg["topk_group"]) == (8, 4)
    flat = sc.write_checkpoint(tmp_path / "flat", arch="deepseek_v3", small=True, layers=4, dry_run=True)
    assert s["bytes"] == flat["bytes"]
    with pytest.raises(SystemExit):
        sc.build_plan(arch="glm5", grouped_routing=True)
    with pytest.raises(SystemExit):
        sc.build_plan(arch="deepseek_v3", index_share=True)


# ------------------------------------------------------------------ real sizes
def _shapes(mods) -> dict:
    return {t.name: (t.dtype, list(t.shape)) for m in mods for t in m.tensors}


def test_full_size_glm5_plan():
    """Default glm5: GLM-5's dims, 3 dense + 3 MoE layers + MTP; 19.4 GB at 3 bpw (MTP at 4)."""
    cfg, qcfg, mods = sc.build_plan(arch="glm5")
    assert (cfg["hidden_size"], cfg["num_attention_heads"], cfg["q_lora_rank"], cfg["kv_lora_rank"]) == (6144, 64, 2048, 512)
    assert cfg["mlp_layer_types"] == ["dense"] * 3 + ["sparse"] * 3 and cfg["indexer_types"] == ["full"] * 6
    assert qcfg["mtp_bits"] == 4 and cfg["num_nextn_predict_layers"] == 1
    h = _shapes(mods)
    assert h["model.layers.0.self_attn.kv_a_proj_with_mqa.trellis"] == ("I16", [384, 40, 48])   # 576 -> 640
    assert h["model.layers.0.self_attn.q_b_proj.trellis"] == ("I16", [128, 1024, 48])           # 64 x (192+64)
    assert h["model.layers.0.self_attn.kv_b_proj.weight"] == ("F16", [28672, 512])               # 64 x (192+256)
    assert h["model.layers.0.self_attn.o_proj.trellis"] == ("I16", [1024, 384, 48])
    assert h["model.layers.3.self_attn.indexer.wq_b.trellis"] == ("I16", [128, 256, 48])        # 32 x 128
    assert h["model.layers.3.self_attn.indexer.wk.weight"] == ("F16", [128, 6144])
    assert h["model.layers.3.self_attn.indexer.weights_proj.weight"] == ("F16", [32, 6144])
    assert h["model.layers.0.mlp.up_proj.trellis"] == ("I16", [384, 768, 48])                  # 12288
    assert h["model.layers.5.mlp.experts.255.down_proj.trellis"] == ("I16", [128, 384, 48])
    assert h["model.layers.6.eh_proj.trellis"] == ("I16", [768, 384, 64])                      # MTP, K 4
    assert h["model.layers.6.mlp.experts.255.up_proj.trellis"] == ("I16", [384, 128, 64])
    assert h["lm_head.trellis"] == ("I16", [384, 9680, 96])
    assert "model.layers.6.mlp.experts.0.up_proj" not in sc.tensor_storage(mods)
    fam = sc.family_bytes(mods)
    assert sum(fam.values()) == sum(t.nbytes for m in mods for t in m.tensors)
    assert round(sum(fam.values()) / 1e9, 1) == 19.4 and round(fam["mtp"] / 1e9, 1) == 5.0
    assert round(fam["experts"] / 1e9, 1) == 10.9


def test_full_size_deepseek_v3_plan():
    cfg, _, mods = sc.build_plan(arch="deepseek_v3")
    assert (cfg["n_group"], cfg["topk_group"], cfg["rope_parameters"]["rope_type"]) == (1, 1, "yarn")
    h = _shapes(mods)
    assert h["model.layers.0.self_attn.q_b_proj.trellis"] == ("I16", [96, 1536, 48])            # 128 x (128+64)
    assert h["model.layers.0.self_attn.kv_b_proj.weight"] == ("F16", [32768, 512])
    assert h["model.layers.0.mlp.down_proj.trellis"] == ("I16", [1152, 448, 48])                # 18432
    assert h["lm_head.trellis"] == ("I16", [448, 8080, 96])
    assert not any(".indexer." in n for n in h)
    fam = sc.family_bytes(mods)
    assert round(sum(fam.values()) / 1e9, 1) == 22.2 and round(fam["mtp"] / 1e9, 1) == 5.8


@pytest.mark.parametrize("arch, kv_per_token", [("glm5", 6 * (512 + 64) * 2 + 6 * 128 * 2),   # auto: fp16 planes
                                                ("deepseek_v3", 6 * (512 + 64) * 2)])
def test_full_size_sparse_plans_on_one_h200(tmp_path, arch, kv_per_token):
    """The header-only real-size checkpoint: plan reads exactly the planned bytes (the MTP layer
    included: the runtime builds both heads) and says it fits one H200 at its full context."""
    s = sc.write_checkpoint(tmp_path / arch, arch=arch, sparse=True)
    assert len(s["files"]) == 7 and 10e9 < s["bytes"] < 40e9
    p = _cli("plan", str(tmp_path / arch), "--gpu", "h200")
    assert p["architecture"] == ARCH[arch] and p["fits"]
    assert p["ranks"][0]["weight_bytes"] == s["bytes"]
    assert p["ranks"][0]["kv_bytes_per_token"] == kv_per_token
    assert p["max_context"] == json.loads((tmp_path / arch / "config.json").read_text())["max_position_embeddings"]


def test_dry_run_prints_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "none"
    assert sc.main([str(out), "--arch", "glm5", "--dry-run"]) == 0
    assert not out.exists()
    line = capsys.readouterr().out
    assert "would write" in line and "GlmMoeDsaForCausalLM" in line and "19.396 GB" in line and "1 MTP layer" in line


@pytest.mark.parametrize("arch", ["glm5", "deepseek_v3"])
def test_flat_logits_accept_every_mtp_draft(synth_small, arch):
    """--flat-logits: the norms before lm_head (the model's and the MTP head's) are zero, so every
    logit is exactly 0: greedy MTP decoding drafts token 0, the model agrees, every draft is
    accepted (the bench's upper bound of MTP in serve); the rest of the checkpoint is unchanged."""
    from exl3tools.runtime.mtp import greedy, greedy_mtp
    from exl3tools.runtime.runner import load_runner

    out = synth_small(arch, "--flat-logits")
    n = sc.ARCHS[arch].small_layers                  # the MTP layer's index: num_hidden_layers
    _, _, mods = sc.build_plan(arch=arch, small=True, layers=n, flat_logits=True)
    zero = {t.name for m in mods for t in m.tensors if t.kind == "zero"}
    assert zero == {"model.norm.weight", f"model.layers.{n}.shared_head.norm.weight"}
    assert [t.kind for m in sc.build_plan(arch=arch, small=True, layers=n)[2] for t in m.tensors if t.name in zero] == \
        ["norm", "norm"]
    runner = load_runner(out, max_cache_tokens=256)
    try:
        runner.add_sequence(0)
        assert torch.count_nonzero(runner.step([(0, list(range(1, 41)))])) == 0
        toks, stats = greedy_mtp(runner.model, [5, 6, 7], 9, 2)
        assert toks == greedy(runner.model, [5, 6, 7], 9) == [0] * 9
        assert stats.drafted > 0 and stats.acceptance_rate == 1.0
    finally:
        runner.close()


@pytest.mark.parametrize("arch", ["glm5", "deepseek_v3"])
def test_heads_option_writes_a_tensor_parallel_ranks_attention(synth_small, arch):
    """--heads: the MLA head count of a tensor-parallel rank's share (a proxy of its attention
    shapes on one GPU): the config and the per-head projections follow it, and our runtime loads
    and runs it (finite logits past glm5's index_topk too). The full-size plan at GLM-5's TP 4."""
    cfg, _, mods = sc.build_plan(arch="glm5", heads=16)
    h = _shapes(mods)
    assert cfg["num_attention_heads"] == cfg["num_key_value_heads"] == 16
    assert h["model.layers.0.self_attn.q_b_proj.trellis"] == ("I16", [128, 256, 48])          # 16 x (192+64)
    assert h["model.layers.0.self_attn.kv_b_proj.weight"] == ("F16", [7168, 512])              # 16 x (192+256)
    assert h["model.layers.0.self_attn.o_proj.trellis"] == ("I16", [256, 384, 48])             # 16 x 256 -> 6144
    path = synth_small(arch, "--heads", "2")
    assert json.loads((path / "config.json").read_text())["num_attention_heads"] == 2
    (short, long), _ = _run(path, [[1, 2, 3], list(range(1, 41))])
    for lg in (short, long):
        assert lg.shape == (1, 2048) and torch.isfinite(lg).all() and float(lg.std()) > 0.1
    with pytest.raises(SystemExit, match="--heads"):
        sc.build_plan(arch="glm4_moe", heads=16)

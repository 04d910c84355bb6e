"""plan: its bytes are the runtime's bytes (weights exactly, KV per token exactly) on every fixture."""

from __future__ import annotations

import json
from importlib import resources

import jsonschema
import pytest
from click.testing import CliRunner
from exl3tools.cli import main

from exl3tools.checkpoint import Checkpoint
from exl3tools.errors import DoesNotFitError, UsageError
from exl3tools.plan import GPUS, parse_bytes, plan_memory
from tests.conftest import fixture_dir

SCHEMA = json.loads(resources.files("exl3tools.schemas").joinpath("plan.v1.json").read_text())


def _runtime(model_dir, tp: int, rank: int):
    """(model the runtime builds for ``rank``, bytes it read while building it)."""
    import exl3tools.runtime.weights as W
    from exl3tools.runtime.loader import resolve
    from exl3tools.runtime.runner import build_local_model

    read = [0]
    W.progress_hook = lambda n, _total: read.__setitem__(0, read[0] + n)
    try:
        model = build_local_model(resolve(model_dir, tp), rank, tp, moe="tp")
    finally:
        W.progress_hook = None
    return model, read[0]


def _plan(model_dir, **kw):
    return plan_memory(Checkpoint.open(model_dir), gpu="h200", gpu_total=GPUS["h200"], **kw)


def test_plan_equals_runtime_on_every_fixture(fixture):
    import torch

    from exl3tools.runtime.kv_pool import bytes_per_token, kv_dtype_for, layer_specs
    from exl3tools.runtime.mla import has_mla

    model, read = _runtime(fixture / "model", 1, 0)
    specs = layer_specs(model)
    auto = kv_dtype_for("auto", torch.device("cuda"), mla=has_mla(model))   # what serve --device cuda takes
    assert auto == (torch.float16 if has_mla(model) else torch.bfloat16)
    for name, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16), ("auto", auto)):
        p = _plan(fixture / "model", kv_dtype=name)
        assert p.ranks[0].kv_bytes_per_token == bytes_per_token(specs, dt), name
        assert p.ranks[0].weight_bytes == read      # every tensor the runtime reads, MTP included
    jsonschema.validate(p.to_json(), SCHEMA)


def test_plan_tp2_kv_per_rank_matches_the_runtime():
    """GLM-4 tp (8 q / 4 kv heads of 128) cuts KV heads over 2 ranks: rank 0's model, cut in memory."""
    import torch

    from exl3tools.runtime.kv_pool import bytes_per_token, layer_specs

    src = fixture_dir("glm4_moe-tp-2.0bpw-mul1") / "model"
    p = _plan(src, tp=2, kv_dtype="bf16")
    model, _ = _runtime(src, 2, 0)
    assert p.ranks[0].kv_bytes_per_token == bytes_per_token(layer_specs(model), torch.bfloat16)
    assert p.ranks[0].kv_bytes_per_token * 2 == _plan(src, kv_dtype="bf16").ranks[0].kv_bytes_per_token


def test_plan_tp2_weights_are_what_each_rank_reads(tmp_path):
    """Per rank, the bytes the runtime reads from that rank's rank-slice output (the same cut)."""
    from exl3tools.slicing import plan_rank_slices, write_rank_shards

    src = fixture_dir("llama-4.0bpw-mul1") / "model"
    p = _plan(src, tp=2)
    ck = Checkpoint.open(src)
    write_rank_shards(ck, plan_rank_slices(ck, 2, "tp"), tmp_path / "out")
    for r in range(2):
        _, read = _runtime(tmp_path / "out" / f"rank-{r}-of-2", 2, r)
        assert p.ranks[r].weight_bytes == read
    assert p.ranks[0].weight_bytes < sum(ref.info.nbytes for ref in ck.tensors.values())


def test_kv_tokens_formula():
    src = fixture_dir("llama-4.0bpw-mul1") / "model"
    p = _plan(src, util=0.5, block_size=32)
    r = p.ranks[0]
    budget = int(0.5 * GPUS["h200"]) - r.weight_bytes - r.scratch_bytes
    assert r.kv_budget_bytes == budget
    assert r.kv_blocks == budget // (r.kv_bytes_per_token * 32)
    assert r.kv_tokens == (r.kv_blocks - 1) * 32 == p.kv_tokens
    assert p.max_context == min(p.model_max_context, p.kv_tokens) and p.fits


def test_refusal_message_names_gpu_and_bytes():
    src = fixture_dir("llama-4.0bpw-mul1") / "model"
    p = plan_memory(Checkpoint.open(src), gpu="rtx4090", gpu_total=GPUS["rtx4090"], max_model_len=30_000_000)
    assert not p.fits
    with pytest.raises(DoesNotFitError) as e:
        p.raise_unless_fits()
    msg = str(e.value)
    assert "\n" not in msg and "does not fit on rtx4090 (23.99 GiB)" in msg
    assert "rank 0 needs" in msg and "KV for 30000000 tokens" in msg and "21.59 GiB free" in msg


def test_cli_plan_json_and_refusal():
    src = str(fixture_dir("glm5_moe_dsa-3.0bpw-mul1") / "model")
    res = CliRunner().invoke(main, ["plan", src, "--gpu", "h200", "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    jsonschema.validate(doc, SCHEMA)
    assert doc["ranks"][0]["kv_bytes_per_token"] == 2816 and doc["fits"]
    res = CliRunner().invoke(main, ["plan", src, "--gpu-memory", "1GiB"])
    assert res.exit_code == 3
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: does not fit: ") and "1.00 GiB" in lines[0]
    assert "needs" in lines[0] and "free at --gpu-memory-utilization 0.9" in lines[0]
    res = CliRunner().invoke(main, ["plan", src, "--gpu", "tpu9"])
    assert res.exit_code == 2 and "unknown GPU 'tpu9'" in res.stderr
    res = CliRunner().invoke(main, ["plan", src])
    assert res.exit_code == 2 and "--gpu-memory" in res.stderr


def test_parse_bytes():
    assert parse_bytes("141GiB") == 141 * 2**30 and parse_bytes("80 GB") == 80 * 10**9
    assert parse_bytes("1024") == 1024 and parse_bytes("1.5KiB") == 1536
    for bad in ("", "12XB", "-3GB", "0"):
        with pytest.raises(UsageError):
            parse_bytes(bad)


def test_preflight_refuses_before_loading_with_the_plan_message(monkeypatch):
    """serve/generate on CUDA: the same plan, against the memory free now (mem_get_info faked)."""
    from exl3tools.cli._runtime import preflight_plan

    src = str(fixture_dir("llama-4.0bpw-mul1") / "model")
    total = 2**30
    with pytest.raises(DoesNotFitError) as e:
        preflight_plan(src, device="cuda:0", tp=1, moe="tp", mem_get_info=lambda i: (total, total))
    expect = plan_memory(Checkpoint.open(src), gpu="cuda:0", gpu_total=total).message
    assert str(e.value) == expect and "does not fit on cuda:0 (1.00 GiB)" in expect
    big = 64 * 2**30
    preflight_plan(src, device="cuda", tp=1, moe="tp", mem_get_info=lambda i: (big, big))  # fits
    with pytest.raises(DoesNotFitError):   # the same GPU with 63.5 GiB taken by another process
        preflight_plan(src, device="cuda", tp=1, moe="tp", mem_get_info=lambda i: (2**29, big))
    seen = []
    preflight_plan(src, device="cpu", tp=1, moe="tp", mem_get_info=lambda i: seen.append(i))
    assert seen == []                     # the CPU is never planned


def test_plan_reads_a_repo_id_through_the_hub_cache(tmp_path):
    import shutil
    import subprocess
    import sys

    from tests.conftest import DEMO

    snap = tmp_path / "hub" / "models--exl3tools--demo-exl3" / "snapshots" / ("a" * 40)
    shutil.copytree(DEMO / "model", snap)
    (snap.parent.parent / "refs").mkdir()
    (snap.parent.parent / "refs" / "main").write_text("a" * 40)
    code = ("import sys; from exl3tools.cli import main; "
            "sys.argv=['exl3tools','plan','exl3tools/demo-exl3','--gpu','h200','--json']; main()")
    env = {"HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["fits"] and doc["ranks"][0]["weight_bytes"] == _plan(DEMO / "model").ranks[0].weight_bytes


@pytest.mark.parametrize("arch", ["glm5", "deepseek_v3"])
def test_plan_counts_the_mtp_layer_the_runtime_reads(synth_small, arch):
    """The runtime builds both MLA architectures' MTP heads (no fixture has DeepSeek-V3's), so the
    plan counts the layer: its weight bytes are what the runtime reads, more than without it."""
    with_mtp, without = synth_small(arch), synth_small(arch, "--no-mtp")
    model, read = _runtime(with_mtp, 1, 0)
    assert model.mtp is not None
    assert _plan(with_mtp).ranks[0].weight_bytes == read > _plan(without).ranks[0].weight_bytes


def test_an_mla_plan_under_auto_is_the_fp16_plan():
    """MLA's latent is fp16 under auto on CUDA (kv_pool.kv_dtype_for): auto and fp16 plans hold the
    same tokens, fp32 about half as many."""
    src = fixture_dir("deepseek_v3-3.0bpw-3inst") / "model"
    ck = Checkpoint.open(src)
    probe = plan_memory(ck, gpu="x", gpu_total=GPUS["h200"])
    small = probe.ranks[0].weight_bytes + probe.ranks[0].scratch_bytes + 100 * 16 * probe.ranks[0].kv_bytes_per_token
    plans = {dt: plan_memory(ck, gpu="x", gpu_total=int(small / 0.9) + 1, kv_dtype=dt) for dt in ("auto", "fp16", "fp32")}
    assert plans["auto"].kv_tokens == plans["fp16"].kv_tokens < plans["auto"].model_max_context
    assert plans["fp32"].ranks[0].kv_bytes_per_token * 2 == plans["auto"].ranks[0].kv_bytes_per_token * 4
    assert plans["fp32"].kv_tokens < plans["auto"].kv_tokens

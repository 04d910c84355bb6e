"""rank-slice on the fixtures: cuts reassemble to the goldens, verify passes, rank dirs open and decode."""

from __future__ import annotations

import json
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from exl3tools.cli import main
from exl3tools.kernels.reference import decode_linear
from safetensors import safe_open

from exl3tools.checkpoint import Checkpoint
from exl3tools.checkpoint.manifest import check_schema, load_manifest, schema
from exl3tools.errors import IncompatibleSliceError, IncompleteOutputError, VerifyError
from exl3tools.slicing import plan_rank_slices, split128, verify_sliced, write_rank_shards
from tests.conftest import fixture_dir

TP_FIXTURES = ["glm5_moe_dsa-tp-4.0bpw-mcg", "glm4_moe-tp-2.0bpw-mul1"]


def slice_to(name: str, out: Path, tp: int, moe: str = "tp") -> Path:
    ck = Checkpoint.open(fixture_dir(name) / "model")
    write_rank_shards(ck, plan_rank_slices(ck, tp, moe), out)
    return out


@lru_cache(maxsize=None)
def samples(name: str) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    p = fixture_dir(name) / "goldens_weights_samples.safetensors"
    with safe_open(str(p), "np") as f:
        keys = {k.rsplit(".", 1)[0] for k in f.keys()}
        return {k: (f.get_tensor(f"{k}.idx"), f.get_tensor(f"{k}.val").astype(np.float32)) for k in keys}


def _codebook(ck: Checkpoint, p: str) -> str:
    return "mcg" if f"{p}.mcg" in ck else "mul1" if f"{p}.mul1" in ck else "3inst"


def rank_cut(block: dict, prefix: str) -> tuple[str, int, int]:
    """(cut, first, last) of one linear on one rank, from the config block (docs/rank-slice.md §4)."""
    mods = block["modules"]
    if prefix in mods:
        c = mods[prefix]
    else:  # routed expert: per-layer entry
        layer, rest = prefix.split(".mlp.experts.")
        e = mods[f"{layer}.mlp.experts"]
        if e["cut"] == "experts":
            return ("replicate", 0, 0) if e["first"] <= int(rest.split(".")[0]) < e["last"] else ("absent", 0, 0)
        c = {"cut": "row" if rest.endswith("down_proj") else "column", "first": e["first"], "last": e["last"]}
    return c["cut"], c.get("first", 0), c.get("last", 0)


def open_ranks(out: Path) -> list[Checkpoint]:
    """Every rank directory of a rank-slice output, opened (in rank order)."""
    return [Checkpoint.open(rd) for rd in sorted(out.glob("rank-*-of-*"))]


def reassemble(out: Path | list[Checkpoint], prefix: str, k: int, n: int) -> np.ndarray:
    """Decode every rank's slice of ``prefix`` and put it back in place: the full (in, out) W.
    ``out``: the output folder, or its ranks as ``open_ranks`` gives them (opened once for many
    linears: opening them for each took ~2/3 of a fixture's reassembly)."""
    w = np.full((k, n), np.nan, dtype=np.float32)
    for r in open_ranks(out) if isinstance(out, Path) else out:
        cut, f, last = rank_cut(r.config["exl3tools"], prefix)
        if cut == "absent":
            assert f"{prefix}.trellis" not in r
            continue
        part = decode_linear(r.read_numpy(f"{prefix}.trellis"), r.read_numpy(f"{prefix}.suh"),
                             r.read_numpy(f"{prefix}.svh"), _codebook(r, prefix))
        if cut == "column":
            w[:, f:last] = part
        elif cut == "row":
            w[f:last, :] = part
        else:
            w[:] = part
            break  # replicated: every rank holds the same bytes (verify checked them)
    assert not np.isnan(w).any(), f"{prefix}: ranks do not cover the whole matrix"
    return w


@pytest.mark.parametrize("name", TP_FIXTURES)
@pytest.mark.parametrize("tp,moe", [(2, "tp"), (4, "tp"), (4, "ep")])
def test_tp_fixture_reassembles_to_goldens(tmp_path: Path, name: str, tp: int, moe: str) -> None:
    out = slice_to(name, tmp_path / "out", tp, moe)
    rep = verify_sliced(fixture_dir(name) / "model", out, decode_samples=3)
    assert rep.ok and rep.decode_blocks > 0
    check_schema(json.loads((out / "manifest.json").read_text()))
    src = Checkpoint.open(fixture_dir(name) / "model")
    smp = samples(name)
    rng = np.random.default_rng(tp)
    ranks = open_ranks(out)
    prefixes = sorted(smp)
    # random non-expert linears and experts (the goldens below add one of each role; keeps it to seconds)
    chosen = list(rng.choice([p for p in prefixes if ".experts." not in p], 6, replace=False)) + list(
        rng.choice([p for p in prefixes if ".experts." in p], 4, replace=False))
    for p in chosen:
        kt, nt, _ = src.ref(f"{p}.trellis").shape
        w = reassemble(ranks, p, kt * 16, nt * 16)
        idx, val = smp[p]
        got = w.reshape(-1)[idx]
        tol = 1.2e-3 * max(float(np.abs(w).max()), 1e-6)
        assert np.abs(got - val).max() <= tol, p
    with safe_open(str(fixture_dir(name) / "goldens_weights.safetensors"), "np") as f:
        for p in f.keys():
            kt, nt, _ = src.ref(f"{p}.trellis").shape
            g = f.get_tensor(p).astype(np.float32)
            w = reassemble(ranks, p, kt * 16, nt * 16)
            assert np.abs(w - g).max() <= 1.2e-3 * np.abs(g).max(), p


def test_rank_dirs_are_checkpoints_with_consistent_blocks(tmp_path: Path) -> None:
    name = "glm5_moe_dsa-tp-4.0bpw-mcg"
    out = slice_to(name, tmp_path / "o", 4, "ep")
    man = load_manifest(out)
    assert [r.dir for r in man.ranks] == [f"rank-{r}-of-4" for r in range(4)]
    owned = []
    for r in range(4):
        ck = Checkpoint.open(out / f"rank-{r}-of-4")
        assert ck.is_exl3 and ck.tokenizer_files()
        b = ck.config["exl3tools"]
        assert (b["tp"], b["rank"], b["moe"], b["format_version"]) == (4, r, "ep", 1)
        assert b["source_fingerprint"] == man.source.fingerprint
        e = b["modules"]["model.layers.1.mlp.experts"]
        owned.append((e["first"], e["last"]))
        experts = {int(n.split(".mlp.experts.")[1].split(".")[0]) for n in ck.tensors
                   if n.startswith("model.layers.1.mlp.experts.")}
        assert experts == set(range(e["first"], e["last"]))
        att = b["attention"]["model.layers.0.self_attn"]
        assert att["cut"] == "heads" and att["q_heads"] == [r, r + 1]
        q = ck.ref("model.layers.0.self_attn.q_b_proj.trellis").shape
        assert q[1] * 16 == 256  # one head of qk 256
        assert ck.ref("model.layers.0.self_attn.kv_b_proj.weight").shape == (448, 512)
        assert ck.ref("model.layers.0.self_attn.kv_a_proj_with_mqa.trellis").shape == (32, 40, 64)
    assert owned == [(0, 4), (4, 8), (8, 12), (12, 16)]


def test_row_cut_bias_on_first_rank_only_and_column_bias_sliced(tmp_path: Path) -> None:
    out = slice_to("glm4_moe-tp-2.0bpw-mul1", tmp_path / "o", 2)
    src = Checkpoint.open(fixture_dir("glm4_moe-tp-2.0bpw-mul1") / "model")
    r0, r1 = (Checkpoint.open(out / f"rank-{r}-of-2") for r in range(2))
    qb = src.read_bytes("model.layers.1.self_attn.q_proj.bias")
    assert r0.read_bytes("model.layers.1.self_attn.q_proj.bias") + r1.read_bytes(
        "model.layers.1.self_attn.q_proj.bias") == qb
    for r in (r0, r1):  # markers copied, row-cut suh sliced, svh full
        assert r.read_bytes("model.layers.1.self_attn.o_proj.mul1") == src.read_bytes("model.layers.1.self_attn.o_proj.mul1")
        assert r.ref("model.layers.1.self_attn.o_proj.suh").shape == (512,)
        assert r.ref("model.layers.1.self_attn.o_proj.svh").shape == (512,)


def test_gqa_kv_heads_replicated_when_fewer_than_ranks(tmp_path: Path) -> None:
    name = "glm4_moe-tp-2.0bpw-mul1"  # 8 q / 4 kv heads, head_dim 128: tp 8 -> each kv head on 2 ranks
    ck = Checkpoint.open(fixture_dir(name) / "model")
    with pytest.raises(IncompatibleSliceError, match="--moe ep"):
        plan_rank_slices(ck, 8, "tp")  # expert width 512 is not a multiple of 128*8
    out = tmp_path / "o"
    write_rank_shards(ck, plan_rank_slices(ck, 8, "ep"), out)
    assert verify_sliced(fixture_dir(name) / "model", out, decode_samples=1).ok
    for r in range(8):
        b = json.loads((out / f"rank-{r}-of-8" / "config.json").read_text())["exl3tools"]
        a = b["attention"]["model.layers.1.self_attn"]
        assert a["kv_heads"] == [r // 2, r // 2 + 1] and a["q_heads"] == [r, r + 1]
        assert b["modules"]["model.layers.1.mlp.shared_experts.up_proj"]["cut"] == "replicate"
    w = reassemble(out, "model.layers.1.self_attn.k_proj", 512, 512)
    idx, val = samples(name)["model.layers.1.self_attn.k_proj"]
    assert np.abs(w.reshape(-1)[idx] - val).max() <= 1.2e-3 * np.abs(w).max()


def test_small_head_dim_replicates_attention_with_a_note(tmp_path: Path) -> None:
    ck = Checkpoint.open(fixture_dir("llama-4.0bpw-mul1") / "model")
    plan = plan_rank_slices(ck, 2)
    assert any("self_attn: replicated" in n and "head_dim 64" in n for n in plan.notes)
    assert plan.cuts[1]["attention"]["model.layers.0.self_attn"]["cut"] == "replicate"
    assert plan.cuts[1]["modules"]["model.layers.0.mlp.down_proj"] == {
        "cut": "row", "first": 384, "last": 768, "size": 768, "bias": False}
    write_rank_shards(ck, plan, tmp_path / "o")
    assert verify_sliced(fixture_dir("llama-4.0bpw-mul1") / "model", tmp_path / "o").ok


def test_split128_rule() -> None:
    assert split128(1408, 2) == [(0, 768), (768, 1408)]       # 11 units: 6 + 5
    assert split128(2048, 4) == [(0, 512), (512, 1024), (1024, 1536), (1536, 2048)]
    assert split128(256, 4) is None
    assert split128(200, 1) is None


def test_refusal_exit_3_writes_nothing(tmp_path: Path) -> None:
    src = fixture_dir("glm4_moe-3.0bpw-mcg") / "model"  # expert width 128 cannot split over 2
    res = CliRunner().invoke(main, ["rank-slice", str(src), str(tmp_path / "o"), "--tp", "2"])
    assert res.exit_code == 3, res.output
    assert "use --moe ep" in res.output
    assert not (tmp_path / "o").exists()


def test_cli_dry_run_and_existing_output(tmp_path: Path) -> None:
    src = fixture_dir("glm4_moe-tp-2.0bpw-mul1") / "model"
    res = CliRunner().invoke(main, ["rank-slice", str(src), str(tmp_path / "o"), "--tp", "2", "--dry-run", "--json"])
    assert res.exit_code == 0, res.output
    plan = json.loads(res.output)
    assert plan["cuts"][1]["modules"]["lm_head"] == {"cut": "column", "first": 1024, "last": 2048, "size": 2048}
    assert not (tmp_path / "o").exists()
    res = CliRunner().invoke(main, ["rank-slice", str(src), str(tmp_path / "o"), "--tp", "2"])
    assert res.exit_code == 0, res.output
    res = CliRunner().invoke(main, ["verify", str(src), str(tmp_path / "o")])
    assert res.exit_code == 0, res.output
    res = CliRunner().invoke(main, ["rank-slice", str(src), str(tmp_path / "o"), "--tp", "2"])
    assert res.exit_code == 2 and "--resume" in res.output


def test_verify_catches_tampering(tmp_path: Path) -> None:
    name = "glm4_moe-tp-2.0bpw-mul1"
    out = slice_to(name, tmp_path / "o", 2)
    shard = out / "rank-1-of-2" / "model-00001-of-00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-100] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(VerifyError, match="sha256"):
        verify_sliced(fixture_dir(name) / "model", out)
    with pytest.raises(VerifyError, match="differs"):
        verify_sliced(fixture_dir(name) / "model", out, hash_files=False)
    res = CliRunner().invoke(main, ["verify", str(fixture_dir(name) / "model"), str(out)])
    assert res.exit_code == 1


def test_manifest_schema_rejects_bad_documents(tmp_path: Path) -> None:
    out = slice_to("glm4_moe-tp-2.0bpw-mul1", tmp_path / "o", 2)
    obj = json.loads((out / "manifest.json").read_text())
    assert schema()["properties"]["schema_version"]["const"] == 1
    obj["tp"] = 0
    with pytest.raises(IncompleteOutputError):
        check_schema(obj)


def _run_slicer(src: Path, out: Path, kill_after: int | None, resume: bool) -> int:
    env = {**__import__("os").environ}
    env.pop("EXL3TOOLS_TEST_KILL_AFTER_FILES", None)
    if kill_after is not None:
        env["EXL3TOOLS_TEST_KILL_AFTER_FILES"] = str(kill_after)
    cmd = [sys.executable, "-m", "exl3tools.cli", "rank-slice", str(src), str(out), "--tp", "4", "--moe", "ep"]
    if resume:
        cmd.append("--resume")
    return subprocess.run(cmd, env=env, capture_output=True).returncode


@pytest.mark.parametrize("kill_after", [1, 3, 9])
def test_crash_then_resume(tmp_path: Path, kill_after: int) -> None:
    name = "glm4_moe-tp-2.0bpw-mul1"
    src = fixture_dir(name) / "model"
    out = tmp_path / "o"
    assert _run_slicer(src, out, kill_after, False) == -9   # SIGKILLed after N finished files
    assert not (out / "manifest.json").exists()
    journal = [json.loads(x) for x in (out / ".rank-slice.journal").read_text().splitlines()]
    assert len(journal) == kill_after
    inodes = {e["path"]: (out / e["path"]).stat().st_ino for e in journal}
    with pytest.raises(IncompleteOutputError):
        verify_sliced(src, out)
    res = CliRunner().invoke(main, ["verify", str(src), str(out)])
    assert res.exit_code == 1 and "incomplete" in res.output
    assert _run_slicer(src, out, kill_after + 2, True) == -9  # crash again while resuming
    for path, ino in inodes.items():  # finished files whose hash matched were kept, not rewritten
        assert (out / path).stat().st_ino == ino, path
    assert _run_slicer(src, out, None, True) == 0
    assert verify_sliced(src, out).ok
    clean = slice_to(name, tmp_path / "clean", 4, "ep")
    assert load_manifest(out).files == load_manifest(clean).files
    assert not list(out.rglob(".*.tmp"))


@pytest.mark.parametrize("tp", [2, 4])
def test_vllm_hybrid_layout(tmp_path: Path, tp: int) -> None:
    name = "glm5_moe_dsa-tp-4.0bpw-mcg"
    src = fixture_dir(name) / "model"
    ck = Checkpoint.open(src)
    out = tmp_path / "h"
    from exl3tools.slicing import dequantize_to_writer

    write_rank_shards(ck, plan_rank_slices(ck, tp, "tp", "vllm-hybrid"), out, dequant=dequantize_to_writer)
    assert verify_sliced(src, out, decode_samples=3).ok
    h = Checkpoint.open(out)
    blk = h.config["hybrid_tr3_tail"]
    assert blk["format"] == "exl3-trellis" and blk["codebook"] == "mcg" and blk["bits"] == 4.0
    assert blk["tp"] == tp and blk["experts_per_layer"] == 16 and blk["moe_layers"] == [1, 3]
    assert blk["tensor_schema"] == "model.layers.{L}.mlp.experts.{E}.{proj}.rank{r}.{trellis|suh|svh|mcg}"
    ir = 512 // tp   # rank-sliced-formats.md §1.3 geometry
    for r in range(tp):
        g = "model.layers.2.mlp.experts.5"
        assert h.ref(f"{g}.gate_proj.rank{r}.trellis").shape == (32, ir // 16, 64)
        assert h.ref(f"{g}.gate_proj.rank{r}.suh").shape == (512,)
        assert h.ref(f"{g}.gate_proj.rank{r}.svh").shape == (ir,)
        assert h.ref(f"{g}.down_proj.rank{r}.trellis").shape == (ir // 16, 32, 64)
        assert h.ref(f"{g}.down_proj.rank{r}.suh").shape == (ir,)
        assert h.ref(f"{g}.down_proj.rank{r}.mcg").shape == ()
    assert not any(n.endswith((".trellis", ".suh", ".svh")) and ".rank" not in n for n in h.tensors)
    meta = json.loads((fixture_dir(name) / "goldens_weights.json").read_text())
    with safe_open(str(fixture_dir(name) / "goldens_weights.safetensors"), "np") as f:
        for p in ("model.layers.0.self_attn.kv_a_proj_with_mqa", "lm_head", "model.layers.1.mlp.shared_experts.down_proj"):
            w = h.read_numpy(f"{p}.weight")
            g = f.get_tensor(p).astype(np.float32)
            assert list(w.shape) == meta[p]["hf_shape"]
            ref = g.T[: w.shape[0], : w.shape[1]]
            assert np.abs(w - ref).max() <= 5e-3 * np.abs(ref).max(), p


def test_vllm_hybrid_refusals(tmp_path: Path) -> None:
    src = fixture_dir("glm4_moe-tp-2.0bpw-mul1") / "model"
    res = CliRunner().invoke(main, ["rank-slice", str(src), str(tmp_path / "o"), "--tp", "2", "--layout", "vllm-hybrid"])
    assert res.exit_code == 3 and "mcg" in res.output and not (tmp_path / "o").exists()
    src = fixture_dir("glm5_moe_dsa-tp-4.0bpw-mcg") / "model"
    res = CliRunner().invoke(main, ["rank-slice", str(src), str(tmp_path / "o"), "--tp", "2", "--moe", "ep",
                                    "--layout", "vllm-hybrid"])
    assert res.exit_code == 3 and "expert parallelism" in res.output


def test_pipeline_normalizes_foreign_names_then_slices(tmp_path: Path) -> None:
    from exl3tools.pipeline import needs_normalize, slice_and_verify
    from tests.test_normalize import all_tensors, write_ckpt

    ck = Checkpoint.open(fixture_dir("glm4_moe-tp-2.0bpw-mul1") / "model")
    foreign = [(n.replace(".gate_proj.", ".w1.").replace(".up_proj.", ".w3.").replace(".down_proj.", ".w2."), d, s, b)
               for n, d, s, b in all_tensors(ck)]
    src = write_ckpt(ck, tmp_path / "foreign", foreign)
    assert needs_normalize(Checkpoint.open(src)) and not needs_normalize(ck)
    man, rep = slice_and_verify(src, tmp_path / "tp2", 2)
    assert rep.ok and man.tp == 2
    r1 = Checkpoint.open(tmp_path / "tp2" / "rank-1-of-2")
    assert r1.ref("model.layers.1.mlp.experts.3.down_proj.trellis").shape == (16, 32, 32)


@pytest.mark.parametrize("name", ["qwen3_moe-2.5bpw-mul1", "deepseek_v3-3.0bpw-3inst", "glm5_moe_dsa-3.0bpw-mul1"])
def test_small_fixtures_ep_tp2_verify(tmp_path: Path, name: str) -> None:
    """Half-integer K (2.5), 3INST without markers, MLA with a padded kv_a (576 -> 640), MTP layer."""
    src = fixture_dir(name) / "model"
    ck = Checkpoint.open(src)
    plan = plan_rank_slices(ck, 2, "ep")
    write_rank_shards(ck, plan, tmp_path / "o")
    assert verify_sliced(src, tmp_path / "o", decode_samples=2).ok
    if name.startswith("deepseek"):  # 2 heads x 192: one head per rank is not a multiple of 128
        assert plan.cuts[0]["attention"]["model.layers.0.self_attn"]["cut"] == "replicate"
    if name.startswith("glm5"):      # 2 heads x 256 (q) / 256 (v): cut by heads
        a = [plan.cuts[r]["attention"]["model.layers.2.self_attn"]["q_heads"] for r in range(2)]
        assert a == [[0, 1], [1, 2]]


def test_row_cut_partial_products_sum_to_full(tmp_path: Path) -> None:
    """Row-parallel o_proj/down_proj: sum over ranks of x[:, slice_r] @ W_r == x @ W (golden)."""
    name = "glm5_moe_dsa-tp-4.0bpw-mcg"
    out = slice_to(name, tmp_path / "o", 4)
    rng = np.random.default_rng(0)
    with safe_open(str(fixture_dir(name) / "goldens_weights.safetensors"), "np") as f:
        for p in ("model.layers.0.self_attn.o_proj", "model.layers.0.mlp.down_proj"):
            g = f.get_tensor(p).astype(np.float64)
            x = rng.standard_normal((3, g.shape[0]))
            acc = np.zeros((3, g.shape[1]))
            for r in range(4):
                ck = Checkpoint.open(out / f"rank-{r}-of-4")
                cut, first, last = rank_cut(ck.config["exl3tools"], p)
                assert cut == "row"
                w = decode_linear(ck.read_numpy(f"{p}.trellis"), ck.read_numpy(f"{p}.suh"),
                                  ck.read_numpy(f"{p}.svh"), _codebook(ck, p))
                acc += x[:, first:last] @ w
            ref = x @ g
            assert np.abs(acc - ref).max() <= 2e-3 * np.abs(ref).max(), p


def test_resume_on_complete_output_rewrites_nothing(tmp_path: Path) -> None:
    src = fixture_dir("glm4_moe-tp-2.0bpw-mul1") / "model"
    out = slice_to("glm4_moe-tp-2.0bpw-mul1", tmp_path / "o", 2)
    inodes = {p: p.stat().st_ino for p in out.rglob("*.safetensors")}
    res = CliRunner().invoke(main, ["rank-slice", str(src), str(out), "--tp", "2", "--resume"])
    assert res.exit_code == 0, res.output
    assert {p: p.stat().st_ino for p in out.rglob("*.safetensors")} == inodes
    assert verify_sliced(src, out).ok


def test_multi_shard_source_keeps_shard_layout(tmp_path: Path) -> None:
    """A 3-shard source with an index: each rank gets 3 shards (parallel readers) and its own index."""
    from tests.test_normalize import all_tensors, write_ckpt

    ck0 = Checkpoint.open(fixture_dir("glm4_moe-tp-2.0bpw-mul1") / "model")
    src = write_ckpt(ck0, tmp_path / "src", all_tensors(ck0), shards=3)
    ck = Checkpoint.open(src)
    out = tmp_path / "o"
    write_rank_shards(ck, plan_rank_slices(ck, 2), out, threads=3)
    assert verify_sliced(src, out, decode_samples=2).ok
    for r in range(2):
        rd = out / f"rank-{r}-of-2"
        assert sorted(p.name for p in rd.glob("*.safetensors")) == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
        idx = json.loads((rd / "model.safetensors.index.json").read_text())["weight_map"]
        for name, fname in idx.items():  # a tensor stays in the shard number it came from
            assert fname == ck.ref(name).file.name

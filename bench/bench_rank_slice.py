"""rank-slice throughput vs `cp -r`, and per-rank load time vs read-all-and-slice (tp 4).

Builds a synthetic EXL3 checkpoint with GLM-5 shapes (hidden 6144, 64 MLA heads, 256 routed
experts of width 2048 at K=2, a shared expert, lm_head at K=6; random trellis bytes) of about
5.7 GB, in three module-granular shards, then in ONE run:
  1. `exl3tools rank-slice --tp 4` (a child process; its peak RSS from wait4) and `cp -r` of the
     same source on the same disk, each followed by `sync` (rank-slice fsyncs every file itself);
  2. loading rank 0's tensors from the sliced output vs reading every source tensor and slicing
     rank 0's part in memory (what each TP rank does without pre-sliced shards).
Page cache: before every measurement `posix_fadvise(DONTNEED)` is called on every file involved
(after a `sync`, so the pages are clean and really dropped); all reads are therefore cold.
Everything is deleted at the end. EXL3TOOLS_BENCH_DIR picks the scratch folder (same disk as the
repo by default); EXL3TOOLS_BENCH_LAYERS the number of MoE layers (default 2).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from exl3tools.checkpoint import Checkpoint  # noqa: E402
from exl3tools.checkpoint.header import header_bytes  # noqa: E402
from exl3tools.exl3 import MCG_MARKER  # noqa: E402

H, NH, QL, KVL, NOPE, ROPE, V, E, INTER, VOCAB = 6144, 64, 2048, 512, 192, 64, 256, 256, 2048, 154880
TP = 4


def linear(p: str, k: int, n: int, bits: int) -> list[tuple[str, str, tuple[int, ...]]]:
    return [(f"{p}.trellis", "I16", (k // 16, n // 16, 16 * bits)), (f"{p}.suh", "F16", (k,)),
            (f"{p}.svh", "F16", (n,)), (f"{p}.mcg", "I32", ())]


def layer(li: int) -> list[tuple[str, str, tuple[int, ...]]]:
    p = f"model.layers.{li}"
    t = [(f"{p}.input_layernorm.weight", "BF16", (H,)), (f"{p}.post_attention_layernorm.weight", "BF16", (H,))]
    a = f"{p}.self_attn"
    t += linear(f"{a}.q_a_proj", H, QL, 4) + [(f"{a}.q_a_layernorm.weight", "BF16", (QL,))]
    t += linear(f"{a}.q_b_proj", QL, NH * (NOPE + ROPE), 4)
    t += linear(f"{a}.kv_a_proj_with_mqa", H, 640, 4) + [(f"{a}.kv_a_layernorm.weight", "BF16", (KVL,))]
    t += [(f"{a}.kv_b_proj.weight", "F16", (NH * (NOPE + V), KVL))]
    t += linear(f"{a}.o_proj", NH * V, H, 4)
    t += [(f"{p}.mlp.gate.weight", "F16", (E, H)), (f"{p}.mlp.gate.e_score_correction_bias", "F32", (E,))]
    for e in range(E):
        t += linear(f"{p}.mlp.experts.{e}.gate_proj", H, INTER, 2) + linear(f"{p}.mlp.experts.{e}.up_proj", H, INTER, 2)
        t += linear(f"{p}.mlp.experts.{e}.down_proj", INTER, H, 2)
    for proj, k, n in (("gate_proj", H, INTER), ("up_proj", H, INTER), ("down_proj", INTER, H)):
        t += linear(f"{p}.mlp.shared_experts.{proj}", k, n, 4)
    return t


def write_shard(path: Path, tensors: list[tuple[str, str, tuple[int, ...]]], rng: np.random.Generator) -> int:
    head, offs = header_bytes(tensors)
    with open(path, "wb") as f:
        f.write(head)
        for (name, dtype, shape), (a, b) in zip(tensors, offs, strict=True):
            if name.endswith((".mcg",)):
                f.write(MCG_MARKER.to_bytes(4, "little"))
            elif dtype == "I16":
                n = b - a
                for o in range(0, n, 64 << 20):
                    f.write(rng.bytes(min(64 << 20, n - o)))
            else:  # norms, signs, routers: 1.0 (bf16 0x3f80 / f16 0x3c00), values do not matter here
                one = {"BF16": b"\x80\x3f", "F16": b"\x00\x3c", "F32": b"\x00\x00\x80\x3f"}[dtype]
                f.write(one * math.prod(shape))
    return path.stat().st_size


def make_source(root: Path, layers: int) -> int:
    root.mkdir(parents=True)
    rng = np.random.default_rng(0)
    cfg = {"architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa", "hidden_size": H,
           "num_hidden_layers": layers, "num_attention_heads": NH, "num_key_value_heads": NH,
           "q_lora_rank": QL, "kv_lora_rank": KVL, "qk_nope_head_dim": NOPE, "qk_rope_head_dim": ROPE,
           "v_head_dim": V, "n_routed_experts": E, "n_shared_experts": 1, "moe_intermediate_size": INTER,
           "intermediate_size": 12288, "vocab_size": VOCAB, "first_k_dense_replace": 0,
           "mlp_layer_types": ["sparse"] * layers, "indexer_types": ["shared"] * layers,
           "quantization_config": {"quant_method": "exl3", "version": "1.6.5", "bits": 2.0, "head_bits": 6,
                                   "codebook": "mcg"}}
    (root / "config.json").write_text(json.dumps(cfg, indent=2))
    shards = [layer(li) for li in range(layers)]
    shards.append([("model.norm.weight", "BF16", (H,))] + linear("lm_head", H, VOCAB, 6))
    total, wm = 0, {}
    for i, ts in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        total += write_shard(root / name, ts, rng)
        wm.update({n: name for n, _, _ in ts})
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                    "weight_map": wm}))
    return total


def drop_cache(*roots: Path) -> None:
    os.sync()
    for root in roots:
        for p in root.rglob("*"):
            if p.is_file():
                fd = os.open(p, os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)


def du(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def timed_child(cmd: list[str]) -> tuple[float, int]:
    """(seconds incl. a final sync, peak RSS in bytes) of one child process."""
    t = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, ru = os.wait4(proc.pid, 0)
    err = proc.stderr.read().decode() if proc.stderr else ""
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"{cmd[0]} failed ({proc.returncode}): {err[-2000:]}")
    os.sync()
    return time.perf_counter() - t, ru.ru_maxrss * 1024


def load_rank_sliced(rank_dir: Path) -> int:
    ck = Checkpoint.open(rank_dir)
    return sum(len(ck.read_bytes(n)) for n in ck.tensors)


def load_read_all_and_slice(src: Path, rank_dir: Path) -> int:
    """What a TP rank does without pre-sliced shards: read each whole tensor, keep its slice."""
    ck = Checkpoint.open(src)
    man = json.loads((rank_dir.parent / "manifest.json").read_text())
    mine = next(r for r in man["ranks"] if r["dir"] == rank_dir.name)["tensors"]
    kept = 0
    for name, ref in ck.tensors.items():
        raw = ck.read_bytes(name)  # every rank reads everything
        spec = mine.get(name)
        if spec is None:
            continue
        _, dim, a, b = spec
        if dim is None:
            kept += len(raw)
            continue
        arr = np.frombuffer(raw, np.uint8).reshape(ref.shape + (ref.info.itemsize,))
        idx = [slice(None)] * arr.ndim
        idx[dim] = slice(a, b)
        kept += np.ascontiguousarray(arr[tuple(idx)]).nbytes
    return kept


def main() -> None:
    base = Path(os.environ.get("EXL3TOOLS_BENCH_DIR") or tempfile.mkdtemp(prefix="exl3bench-", dir=REPO / "out"
                                                                            if (REPO / "out").is_dir() else None))
    layers = int(os.environ.get("EXL3TOOLS_BENCH_LAYERS", "2"))
    base.mkdir(parents=True, exist_ok=True)
    src, sliced, copied = base / "src", base / "tp4", base / "cp"
    try:
        t = time.perf_counter()
        size = make_source(src, layers)
        print(f"synthetic GLM-5-shaped EXL3 checkpoint: {size / 1e9:.2f} GB, {layers} MoE layers x 256 experts, "
              f"3 shards (built in {time.perf_counter() - t:.0f} s) under {base}")
        print("page cache: sync + posix_fadvise(DONTNEED) on every file before each measurement (cold reads)")
        exe = [sys.executable, "-m", "exl3tools.cli"]
        rounds = int(os.environ.get("EXL3TOOLS_BENCH_ROUNDS", "2"))
        print(f"{rounds} rounds, alternating which command goes first (the disk is shared and noisy)")
        t_rs_all, t_cp_all, rss = [], [], 0
        for rnd in range(rounds):
            order = ("rs", "cp") if rnd % 2 == 0 else ("cp", "rs")
            for what in order:
                shutil.rmtree(sliced if what == "rs" else copied, ignore_errors=True)
                drop_cache(src)
                if what == "rs":
                    t, r = timed_child(exe + ["rank-slice", str(src), str(sliced), "--tp", str(TP)])
                    t_rs_all.append(t)
                    rss = max(rss, r)
                else:
                    t, _ = timed_child(["cp", "-r", str(src), str(copied)])
                    t_cp_all.append(t)
                    shutil.rmtree(copied)
        shutil.rmtree(copied, ignore_errors=True)
        out_bytes = du(sliced)
        t_rs, t_cp = sum(t_rs_all) / rounds, sum(t_cp_all) / rounds
        print("per round (s): rank-slice " + ", ".join(f"{x:.2f}" for x in t_rs_all)
              + " | cp -r " + ", ".join(f"{x:.2f}" for x in t_cp_all))
        rows = [("rank-slice --tp 4 (incl. fsync)", t_rs, size / t_rs, out_bytes / t_rs),
                ("cp -r (incl. sync)", t_cp, size / t_cp, size / t_cp)]
        print(f"\n{'mean over rounds':34s}{'seconds':>9s}{'source GB/s':>13s}{'written GB/s':>14s}")
        for name, s_, r, w in rows:
            print(f"{name:34s}{s_:9.2f}{r / 1e9:13.3f}{w / 1e9:14.3f}")
        print(f"throughput ratio rank-slice / cp (source bytes per second): {t_cp / t_rs:.2f}  (goal >= 0.9)")
        print(f"throughput ratio rank-slice / cp (bytes written per second): {(out_bytes / t_rs) / (size / t_cp):.2f}")
        print(f"rank-slice peak RSS: {rss / 2**20:.0f} MiB  (goal < 1024 MiB)")

        rank0 = sliced / f"rank-0-of-{TP}"
        t_sl, t_al = [], []
        for rnd in range(rounds):
            for what in (("sliced", "all") if rnd % 2 == 0 else ("all", "sliced")):
                drop_cache(src, sliced)
                t = time.perf_counter()
                if what == "sliced":
                    n_sliced = load_rank_sliced(rank0)
                    t_sl.append(time.perf_counter() - t)
                else:
                    n_all = load_read_all_and_slice(src, rank0)
                    t_al.append(time.perf_counter() - t)
        assert n_sliced == n_all, (n_sliced, n_all)
        t_sliced, t_all = sum(t_sl) / rounds, sum(t_al) / rounds
        print(f"\nload rank 0 of {TP} ({n_sliced / 1e9:.2f} GB of tensors), cold cache, mean of {rounds} rounds:")
        print("  per round (s): sliced " + ", ".join(f"{x:.2f}" for x in t_sl)
              + " | read all + slice " + ", ".join(f"{x:.2f}" for x in t_al))
        print(f"  from the sliced rank dir:            {t_sliced:7.2f} s")
        print(f"  read whole source + slice in memory: {t_all:7.2f} s")
        print(f"  speedup: {t_all / t_sliced:.2f}x  (goal >= 3.2x)")
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()

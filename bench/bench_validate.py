"""Benchmark `exl3tools validate` (run by `make bench`).

1. Default (sampled) mode on a synthetic checkpoint the size of GLM-5 (78 layers x 256 experts + the
   MTP layer, hidden 6144, moe_intermediate 2048, ~40 shards, ~60k EXL3 linears): real headers,
   index and tensor_storage; files extended to full size with os.truncate (sparse: data read as
   zeros), then the ranges validate must find non-zero are filled (sign vectors, markers, norms and
   the sampled trellis strip of every linear). Goal: under 5 s, peak RSS well under 1 GiB.
2. `--deep` throughput vs `cat` of the same files, on a smaller GLM-5-shaped checkpoint of real
   random bytes (both measured in this run, warm page cache).

    python bench/bench_validate.py [--dir DIR] [--deep-experts 32] [--keep]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from exl3tools.checkpoint.header import DTYPES, header_bytes
from exl3tools.exl3 import MARKERS
from exl3tools.layout import expected_modules, layer_of, pad128

SHARD_BYTES = 8 << 30

GLM5 = {
    "architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa",
    "hidden_size": 6144, "vocab_size": 154880, "num_hidden_layers": 78, "first_k_dense_replace": 3,
    "intermediate_size": 12288, "moe_intermediate_size": 2048, "n_routed_experts": 256, "n_shared_experts": 1,
    "num_experts_per_tok": 8, "num_attention_heads": 64, "num_key_value_heads": 64, "q_lora_rank": 2048,
    "kv_lora_rank": 512, "qk_nope_head_dim": 192, "qk_rope_head_dim": 64, "v_head_dim": 256,
    "index_n_heads": 32, "index_head_dim": 128, "index_topk": 2048, "n_group": 1, "topk_group": 1,
    "num_nextn_predict_layers": 1, "tie_word_embeddings": False, "rms_norm_eps": 1e-5,
    "quantization_config": {"quant_method": "exl3", "version": "1.6.5", "bits": 3.0, "head_bits": 6,
                            "calibration": {"rows": 250, "cols": 2048}, "out_scales": "auto",
                            "codebook": "mcg", "mtp_bits": 4},
}


def glm5_config(layers: int = 78, experts: int = 256, vocab: int = 154880) -> dict:
    cfg = json.loads(json.dumps(GLM5))
    dense = min(3, layers - 1)
    cfg.update(num_hidden_layers=layers, n_routed_experts=experts, vocab_size=vocab, first_k_dense_replace=dense,
               mlp_layer_types=["dense"] * dense + ["sparse"] * (layers - dense), indexer_types=["full"] * layers)
    return cfg


def _k(name: str, L: int) -> int:
    li = layer_of(name)
    if name.startswith("lm_head"):
        return 6
    if li is not None and li >= L:
        return 4
    if ".experts." in name:
        return 3
    return 5 if (".self_attn." in name or ".shared_experts." in name) else 4


def plan_tensors(cfg: dict) -> list[tuple[str, list[tuple[str, str, tuple[int, ...]]]]]:
    """Top-level modules in file order, each a list of (name, dtype, shape)."""
    L = cfg["num_hidden_layers"]
    groups: dict[str, list] = {}
    for e in expected_modules(cfg, [L]):
        li = layer_of(e.name)
        key = f"layer{li}" if li is not None else e.name.split(".")[0] + ("" if e.name.startswith("lm_head") else ".x")
        g = groups.setdefault(key, [])
        if e.kind == "linear":
            k, n, K = pad128(e.in_real), pad128(e.out_real), _k(e.name, L)
            g += [(f"{e.name}.suh", "F16", (k,)), (f"{e.name}.svh", "F16", (n,)), (f"{e.name}.mcg", "I32", ()),
                  (f"{e.name}.trellis", "I16", (k // 16, n // 16, 16 * K))]
        else:
            dt = ("F16" if e.name.endswith((".mlp.gate.weight", "kv_b_proj.weight", "wk.weight", "weights_proj.weight",
                                            "k_norm.weight", "k_norm.bias"))
                  else "F32" if e.name.endswith("e_score_correction_bias") else "BF16")
            g.append((e.name, dt, tuple(e.shape)))
    order = sorted(groups, key=lambda k: (0, -1) if k.startswith("model.x") and "embed" in str(groups[k][0][0])
                   else (1, int(k[5:])) if k.startswith("layer") else (2, 0))
    return [(k, groups[k]) for k in order]


def _nbytes(dtype: str, shape) -> int:
    return int(np.prod(shape, dtype=np.int64)) * DTYPES[dtype][0]


def write_checkpoint(root: Path, cfg: dict, *, random_data: bool) -> list[Path]:
    """Write config, quantization_config.json (with tensor_storage), shards and index.

    random_data=False: sparse files (headers + os.truncate). True: every byte written (valid values).
    """
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(cfg, indent=2))
    modules = plan_tensors(cfg)
    shards: list[list] = [[]]
    size = 0
    for _key, tensors in modules:
        nb = sum(_nbytes(d, s) for _, d, s in tensors)
        if shards[-1] and size + nb > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].extend(tensors)
        size += nb
    n = len(shards)
    weight_map, storage = {}, {}
    torch_dt = {"F16": "torch.float16", "BF16": "torch.bfloat16", "F32": "torch.float32", "I16": "torch.int16",
                "I32": "torch.int32"}
    paths = []
    rng = np.random.default_rng(0)
    for i, tensors in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{n:05d}.safetensors" if n > 1 else "model.safetensors"
        hb, offs = header_bytes(tensors)
        path = root / fname
        with open(path, "wb") as f:
            f.write(hb)
            if random_data:
                for name, dt, shape in tensors:
                    f.write(_values(name, dt, shape, cfg, rng))
        if not random_data:
            os.truncate(path, len(hb) + offs[-1][1])
        paths.append(path)
        for name, dt, shape in tensors:
            weight_map[name] = fname
            prefix = name.rsplit(".", 1)[0]
            leaf = storage.setdefault(prefix, {"stored_tensors": {}})
            leaf["stored_tensors"][name] = {"shape": list(shape), "n_bytes": _nbytes(dt, shape), "dtype": torch_dt[dt]}
            if name.endswith(".trellis") and layer_of(name) != cfg["num_hidden_layers"]:
                leaf.update(quant_format="exl3", bits_per_weight=shape[-1] // 16, mcg_multiplier=MARKERS["mcg"])
    L = cfg["num_hidden_layers"]
    storage = {k: v for k, v in storage.items() if layer_of(k) != L}  # like exllamav3: no MTP entries
    q = dict(cfg["quantization_config"], tensor_storage=storage)
    (root / "quantization_config.json").write_text(json.dumps(q))
    if n > 1:
        (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return paths


def _real_out(name: str, cfg: dict) -> int | None:
    if name.endswith("kv_a_proj_with_mqa.svh"):
        return cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]
    return None


def _values(name: str, dt: str, shape, cfg: dict, rng) -> bytes:
    count = int(np.prod(shape, dtype=np.int64))
    suffix = name.rsplit(".", 1)[-1]
    if suffix == "trellis":
        return rng.integers(0, 256, count * 2, dtype=np.uint8).tobytes()
    if suffix == "mcg":
        return MARKERS["mcg"].to_bytes(4, "little")
    if suffix in ("suh", "svh"):
        a = (np.where(rng.random(count) < 0.5, -1.0, 1.0) * rng.uniform(0.5, 2.0, count) * 0.01).astype("<f2")
        real = _real_out(name, cfg)
        if real is not None:
            a[real:] = 0
        return a.tobytes()
    if name.endswith("norm.weight"):
        a = np.ones(count, dtype=np.float32)
    else:
        a = rng.standard_normal(count, dtype=np.float32) * 0.02
    if dt == "BF16":
        return (a.view(np.uint32) >> 16).astype("<u2").tobytes()
    return a.astype({"F16": "<f2", "F32": "<f4"}[dt]).tobytes()


def fill_sampled_ranges(root: Path, cfg: dict) -> int:
    """Write valid bytes where sampled-mode validate must not find zeros; returns bytes written."""
    from exl3tools.validate.context import Context
    from exl3tools.validate.findings import Sink
    from exl3tools.validate.numeric import strip_span
    from exl3tools.validate.structure import open_tolerant

    sink = Sink(root)
    ckpt, bad = open_tolerant(root, sink)
    ctx = Context.build(ckpt, sink, bad)
    rng = np.random.default_rng(1)
    fds: dict[Path, int] = {}
    written = 0

    def fd_of(path: Path) -> int:
        if path not in fds:
            fds[path] = os.open(path, os.O_WRONLY)
        return fds[path]

    try:
        for name, ref in ckpt.tensors.items():
            i = ref.info
            suffix = name.rsplit(".", 1)[-1]
            data = None
            if suffix in ("suh", "svh", "mcg") or name.endswith("norm.weight"):
                data = _values(name, i.dtype, i.shape, cfg, rng)
            elif suffix == "trellis":
                off, n = strip_span(ctx, name[: -len(".trellis")])
                written += os.pwrite(fd_of(ref.file), rng.integers(0, 256, n, dtype=np.uint8).tobytes(), off)
            if data is not None:
                written += os.pwrite(fd_of(ref.file), data, i.begin)
    finally:
        for fd in fds.values():
            os.close(fd)
    return written


_RUN = """
import json, resource, sys, time
t = time.perf_counter()
from exl3tools.validate import validate
r = validate(sys.argv[1], deep=sys.argv[2] == "deep")
wall = time.perf_counter() - t
ru = resource.getrusage(resource.RUSAGE_SELF)
ch = resource.getrusage(resource.RUSAGE_CHILDREN)  # forked per-file workers
# VmHWM, not ru_maxrss: Linux carries ru_maxrss over exec from the (large) forking bench process
hwm = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM"))
print(json.dumps({"wall": wall, "rss_mb": hwm / 1024, "cpu": ru.ru_utime + ru.ru_stime, "cpu_workers": ch.ru_utime + ch.ru_stime,
                  "errors": len(r.errors), "warnings": sorted(r.codes), "stats": {k: v for k, v in r.stats.items() if k != "sha256"}}))
"""


def run_validate(path: Path, mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", _RUN, str(path), mode], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


class _Skip(Exception):
    pass


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default=None, help="where to build the synthetic checkpoints (default: a temp dir)")
    ap.add_argument("--deep-experts", type=int, default=16, help="routed experts of the deep-mode checkpoint")
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--only", choices=("sampled", "deep"), default=None)
    args = ap.parse_args()
    base = Path(args.dir or tempfile.mkdtemp(prefix="bench_validate_"))
    try:
        # ---- 1. GLM-5-size, header-only (sparse) checkpoint, sampled mode
        big = base / "glm5-sparse"
        cfg = glm5_config()
        if args.only == "deep":
            raise _Skip
        t = time.perf_counter()
        files = write_checkpoint(big, cfg, random_data=False)
        filled = fill_sampled_ranges(big, cfg)
        build = time.perf_counter() - t
        apparent = sum(p.stat().st_size for p in files)
        print(f"synthetic GLM-5: {len(files)} shards, {apparent / 1e9:.1f} GB apparent, "
              f"{filled / 1e6:.0f} MB of sampled ranges filled, built in {build:.1f} s")
        runs = [run_validate(big, "sampled") for _ in range(2)]
        for i, r in enumerate(runs):
            s = r["stats"]
            print(f"  sampled validate run {i + 1}: {r['wall']:.2f} s wall in-process (library {s['seconds']:.2f} s; "
                  f"CPU main {r['cpu']:.2f} s + workers {r['cpu_workers']:.2f} s on {os.cpu_count()} cores, "
                  f"load average {os.getloadavg()[0]:.1f}), "
                  f"{s['linears']} linears, {s['tensors']} tensors, {s['bytes_read'] / 1e6:.0f} MB read, "
                  f"{s['decoded_blocks']} blocks decoded, peak RSS {r['rss_mb']:.0f} MB, "
                  f"errors {r['errors']}, codes {r['warnings']}")
        best = min(r["wall"] for r in runs)
        print(f"  => sampled mode on GLM-5 size: {best:.2f} s (goal < 5 s: {'met' if best < 5 else 'NOT met'}); "
              f"peak RSS {max(r['rss_mb'] for r in runs):.0f} MB (goal << 1024 MB)")
        shutil.rmtree(big)
    except _Skip:
        pass
    try:
        if args.only == "sampled":
            return
        # ---- 2. deep throughput vs cat, real random bytes
        small = base / "glm5-random"
        cfg = glm5_config(layers=2, experts=args.deep_experts, vocab=32768)
        if not (small / "config.json").is_file():
            write_checkpoint(small, cfg, random_data=True)
        files = sorted(small.glob("*.safetensors"))
        total = sum(p.stat().st_size for p in files)
        cat_times = []
        for _ in range(2):  # first pass warms the page cache; both tools then read from it
            t = time.perf_counter()
            subprocess.run(["cat", *map(str, files)], stdout=subprocess.DEVNULL, check=True)
            cat_times.append(time.perf_counter() - t)
        cat_s = min(cat_times)
        deep = run_validate(small, "deep")
        samp = run_validate(small, "sampled")
        print(f"deep vs cat on {total / 1e9:.2f} GB of real random bytes ({len(files)} files):")
        print(f"  cat               {cat_s:7.2f} s  {total / cat_s / 1e6:8.0f} MB/s  (1.00x)")
        print(f"  validate --deep   {deep['wall']:7.2f} s  {total / deep['wall'] / 1e6:8.0f} MB/s  "
              f"({deep['wall'] / cat_s:.1f}x cat's time; sha256 + every linear decoded + every dense tensor), "
              f"CPU {deep['cpu']:.1f} s, peak RSS {deep['rss_mb']:.0f} MB, errors {deep['errors']}")
        print(f"  validate sampled  {samp['wall']:7.2f} s  ({samp['stats']['bytes_read'] / 1e6:.0f} MB read), "
              f"errors {samp['errors']}")
    finally:
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()

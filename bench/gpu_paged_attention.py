"""Paged decode attention (kernels/paged_attention.py) on the GPU: µs, K/V GB/s and HBM-roofline share.

    python3 bench/gpu_paged_attention.py [--quick] [--json OUT.json] [--sweep] [--mixed] [--q-dtype bfloat16]

GLM-4.5-Air attention shapes (96 query heads, 8 kv heads, head dim 128, bf16 cache), block size 16
and 32, batch 1/8/32, every row at the same context length 1k..128k (configurations whose paged +
contiguous caches would pass --max-gb are skipped). Block ids are a random permutation (a fragmented
cache). Each configuration is timed three ways, as CUDA-graph replays, median µs with cold L2
(triton.testing.do_bench flushes L2 before every replay):
- wide:   block table width fixed at 128k / block_size (max-model-len sized: cost must not follow it)
- narrow: block table exactly ctx / block_size wide
- sdpa:   torch SDPA on a contiguous (B, nkv, ctx, D) copy of the same K/V; the g = 12 query heads of a
          kv head are its 12 "query positions" (non-causal, so the same maths as GQA decode)
GB/s counts the K/V bytes a decode must read (B * ctx * nkv * D * 2 bytes * 2); roofline = 4.26 TB/s
(measured H200 HBM read rate, as bench/gpu_bench.py). err = max |ours - sdpa| / max |sdpa| (bf16 sdpa).
--sweep also times tile/warps/stages/splits variants per configuration and reports the best (slow:
use with --quick). --mixed first times a batch of 32 rows, one at 128k and 31 at 1k tokens, with the
default split rule and with more splits + min_split_tiles (the imbalance paged_attention.py notes).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_bench import bench_graph  # noqa: E402  (bench/ is not a package)

HBM = 4.26e12
DEV = "cuda"            # a module global so a CPU dry run of the plumbing can point it elsewhere
NQ, NKV, D = 96, 8, 128
MAX_CTX = 128 * 1024
CTXS = [1024, 4096, 16384, 32768, MAX_CTX]
BATCHES = [1, 8, 32]
BLOCK_SIZES = [16, 32]


def graph_us(fn) -> float:
    """Median µs of CUDA-graph replays of fn (no host launch overhead): gpu_bench's timer."""
    return bench_graph(fn)


def make_case(B: int, ctx: int, bs: int, q_dtype: torch.dtype, gen: torch.Generator):
    nblk = ctx // bs
    nb = B * nblk + 1
    k_cache = torch.empty(nb, bs, NKV, D, device=DEV, dtype=torch.bfloat16).normal_(generator=gen)
    v_cache = torch.empty_like(k_cache).normal_(generator=gen)
    ids = torch.randperm(nb - 1, device=DEV, generator=gen).to(torch.int32).view(B, nblk)
    wide = torch.zeros(B, MAX_CTX // bs, dtype=torch.int32, device=DEV)
    wide[:, :nblk] = ids
    narrow = ids.contiguous()
    lens = torch.full((B,), ctx, dtype=torch.int32, device=DEV)
    q = torch.randn(B, NQ, D, device=DEV, generator=gen).to(q_dtype)
    return q, k_cache, v_cache, wide, narrow, lens


def contiguous_kv(cache: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """(B, nkv, ctx, D) copy of the paged rows, one row at a time (no B-sized temporary)."""
    B, nblk = ids.shape
    bs = cache.shape[1]
    out = torch.empty(B, NKV, nblk * bs, D, device=DEV, dtype=cache.dtype)
    for b in range(B):
        out[b] = cache[ids[b].long()].reshape(nblk * bs, NKV, D).permute(1, 0, 2)
    return out


def sweep(pa, q, k_cache, v_cache, bt, lens, scale, out, default_splits):
    """Best (µs, config) over tile / warps / stages / splits variants (compile errors skipped)."""
    best = (math.inf, None)
    splits = sorted({max(1, default_splits // 2), default_splits, 2 * default_splits})
    for tn, warps, stages, ns in itertools.product((32, 64, 128), (4, 8), (2, 3, 5), splits):
        try:
            us = graph_us(lambda tn=tn, w=warps, st=stages, ns=ns: pa._paged_decode(
                q, k_cache, v_cache, bt, lens, scale, num_splits=ns, out=out, tile_n=tn, num_warps=w,
                num_stages=st))
        except Exception as exc:  # noqa: BLE001 - e.g. out of shared memory: report and go on
            print(f"  sweep tn={tn} warps={warps} stages={stages} splits={ns}: {type(exc).__name__}",
                  file=sys.stderr)
            continue
        if us < best[0]:
            best = (us, dict(tile_n=tn, num_warps=warps, num_stages=stages, num_splits=ns))
    return best


def run_config(pa, bs: int, B: int, ctx: int, q_dtype, scale: float, gen, do_sweep: bool) -> dict:
    kv_bytes = B * ctx * NKV * D * 2 * 2
    q, k_cache, v_cache, wide, narrow, lens = make_case(B, ctx, bs, q_dtype, gen)
    out = torch.empty(B, NQ, D, device=DEV)
    row = dict(bs=bs, B=B, ctx=ctx, kv_mb=kv_bytes / 2**20, floor_us=kv_bytes / HBM * 1e6)
    for name, bt in (("wide", wide), ("narrow", narrow)):
        row[f"{name}_splits"] = pa.default_num_splits(q, k_cache, bt)
        row[f"{name}_us"] = graph_us(lambda bt=bt, k=k_cache, v=v_cache: pa.paged_decode(q, k, v, bt, lens, scale,
                                                                                        out=out))
    if do_sweep:
        row["sweep_us"], row["sweep_cfg"] = sweep(pa, q, k_cache, v_cache, wide, lens, scale, out,
                                                  row["wide_splits"])
    ours = pa.paged_decode(q, k_cache, v_cache, wide, lens, scale)
    kc = contiguous_kv(k_cache, narrow)
    vc = contiguous_kv(v_cache, narrow)
    del k_cache, v_cache
    qs = q.to(torch.bfloat16).view(B, NKV, NQ // NKV, D)
    ref = F.scaled_dot_product_attention(qs, kc, vc, scale=scale).float().view(B, NQ, D)
    row["err"] = float((ours - ref).abs().max() / ref.abs().max())
    row["sdpa_us"] = graph_us(lambda: F.scaled_dot_product_attention(qs, kc, vc, scale=scale))
    for k in ("wide", "narrow", "sdpa", "sweep"):
        if f"{k}_us" in row:
            row[f"{k}_gbs"] = kv_bytes / row[f"{k}_us"] / 1e3
            row[f"{k}_roof"] = row["floor_us"] / row[f"{k}_us"]
    return row


def run_mixed(pa, q_dtype, scale: float, gen, bs: int = 16, B: int = 32, long: int = MAX_CTX,
              short: int = 1024) -> list[dict]:
    lens_l = [long] + [short] * (B - 1)
    need = [n // bs for n in lens_l]
    k_cache = torch.empty(sum(need) + 1, bs, NKV, D, device=DEV, dtype=torch.bfloat16).normal_(generator=gen)
    v_cache = torch.empty_like(k_cache).normal_(generator=gen)
    ids = torch.randperm(sum(need), device=DEV, generator=gen).to(torch.int32)
    bt = torch.zeros(B, MAX_CTX // bs, dtype=torch.int32, device=DEV)
    for b, (off, n) in enumerate(zip(itertools.accumulate([0] + need[:-1]), need, strict=True)):
        bt[b, :n] = ids[off:off + n]
    lens = torch.tensor(lens_l, dtype=torch.int32, device=DEV)
    q = torch.randn(B, NQ, D, device=DEV, generator=gen).to(q_dtype)
    out = torch.empty(B, NQ, D, device=DEV)
    kv_bytes = sum(lens_l) * NKV * D * 2 * 2
    ref = pa.paged_decode(q, k_cache, v_cache, bt, lens, scale).clone()
    rows = []
    default = pa.default_num_splits(q, k_cache, bt)
    for ns, mt in [(default, 1), (4, 16), (16, 16), (32, 16), (64, 16), (64, 4), (128, 16)]:
        got = pa._paged_decode(q, k_cache, v_cache, bt, lens, scale, num_splits=ns, min_split_tiles=mt)
        err = float((got - ref).abs().max() / ref.abs().max())
        us = graph_us(lambda ns=ns, mt=mt: pa._paged_decode(q, k_cache, v_cache, bt, lens, scale, num_splits=ns,
                                                            out=out, min_split_tiles=mt))
        rows.append(dict(bs=bs, B=B, long=long, short=short, num_splits=ns, min_split_tiles=mt, us=us,
                         gbs=kv_bytes / us / 1e3, roof=kv_bytes / HBM * 1e6 / us, err_vs_default=err))
        print(json.dumps(rows[-1]), flush=True)
    return rows


def print_mixed(rows) -> None:
    if not rows:
        return
    r0 = rows[0]
    print(f"\nmixed batch: B {r0['B']}, one row at {r0['long'] // 1024}k, the rest at {r0['short'] // 1024}k "
          f"(bs {r0['bs']}, wide table)\n")
    print("| num_splits | min_split_tiles | µs | GB/s | %roof | err vs default |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['num_splits']} | {r['min_split_tiles']} | {r['us']:.1f} | {r['gbs']:.0f} | "
              f"{100 * r['roof']:.0f}% | {r['err_vs_default']:.1e} |")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="block size 16, batch 1 and 32, ctx 4k and 32k")
    ap.add_argument("--json", default=None)
    ap.add_argument("--sweep", action="store_true", help="also search tile/warps/stages/splits")
    ap.add_argument("--mixed", action="store_true", help="also one 128k row among 31 1k rows")
    ap.add_argument("--q-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--max-gb", type=float, default=40.0, help="skip configs whose caches exceed this")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs CUDA", file=sys.stderr)
        return 1
    from exl3tools.kernels import paged_attention as pa

    q_dtype = getattr(torch, a.q_dtype)
    scale = 1.0 / math.sqrt(D)
    gen = torch.Generator(device=DEV).manual_seed(0)
    bss, batches, ctxs = (([16], [1, 32], [4096, 32768]) if a.quick else (BLOCK_SIZES, BATCHES, CTXS))
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"{torch.cuda.get_device_properties(0).multi_processor_count} SMs; nq {NQ} nkv {NKV} D {D} bf16 cache, "
          f"q {a.q_dtype}", flush=True)
    mixed = run_mixed(pa, q_dtype, scale, gen) if a.mixed else []
    torch.cuda.empty_cache()
    results = []
    for bs, B, ctx in itertools.product(bss, batches, ctxs):
        kv_bytes = B * ctx * NKV * D * 2 * 2
        if 2 * kv_bytes > a.max_gb * 1e9:    # paged + contiguous copies
            print(f"skip bs {bs} B {B} ctx {ctx}: {2 * kv_bytes / 1e9:.0f} GB > --max-gb", flush=True)
            continue
        row = run_config(pa, bs, B, ctx, q_dtype, scale, gen, a.sweep)
        results.append(row)
        print(json.dumps(row), flush=True)
        torch.cuda.empty_cache()
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"configs": results, "mixed": mixed}, f, indent=1)
    print_mixed(mixed)
    print_table(results, a.sweep)
    return 0


def print_table(results, swept: bool) -> None:
    """Markdown: µs, GB/s of K/V read, share of the 4.26 TB/s roofline; wide / narrow / sdpa."""
    hdr = ("| bs | B | ctx | K/V MB | floor µs | splits | wide µs | wide GB/s | wide %roof | narrow µs | "
           "narrow %roof | sdpa µs | sdpa %roof | wide/sdpa | err |")
    if swept:
        hdr += " sweep µs | sweep %roof | sweep cfg |"
    print()
    print(hdr)
    print("|" + "---|" * (hdr.count("|") - 1))
    for r in results:
        line = (f"| {r['bs']} | {r['B']} | {r['ctx'] // 1024}k | {r['kv_mb']:.0f} | {r['floor_us']:.1f} | "
                f"{r['wide_splits']} | {r['wide_us']:.1f} | {r['wide_gbs']:.0f} | {100 * r['wide_roof']:.0f}% | "
                f"{r['narrow_us']:.1f} | {100 * r['narrow_roof']:.0f}% | {r['sdpa_us']:.1f} | "
                f"{100 * r['sdpa_roof']:.0f}% | {r['wide_us'] / r['sdpa_us']:.2f} | {r['err']:.1e} |")
        if swept:
            cfg = r.get("sweep_cfg") or {}
            line += (f" {r.get('sweep_us', math.nan):.1f} | {100 * r.get('sweep_roof', math.nan):.0f}% | "
                     f"{' '.join(f'{k}={v}' for k, v in cfg.items())} |")
        print(line)


if __name__ == "__main__":
    sys.exit(main())

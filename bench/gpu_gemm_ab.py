"""Our dense paths against fp16 cuBLAS, interleaved: is the baseline's GEMM the same GEMM as ours?

    python3 bench/gpu_gemm_ab.py [--rows 256,2048] [--shapes 4096x14336,14336x4096] [--rounds 5]

bench/gpu_bench.py times fp16 cuBLAS once, after every path of ours at that shape (seconds of
tensor-core load later, so at whatever clock the card's power limit then allows); its 2048-row
rows have shown our own GEMM (decoded Ŵ, the same (n, k) layout as F.linear's) 25 % faster than
the baseline's F.linear of the same shape. This times each variant once a round, in the same order
every round, several rounds, and prints each variant's median over the rounds and the median of
its per-round ratio to ``fp16 nk`` (F.linear(x, W) on W as a checkpoint stores it), so that
clock drift shows up as spread, not as a ratio. Each call is timed as a CUDA-graph replay
(gpu_bench --graph), since our paths are 3-5 launches whose host time, timed eagerly, moved the
256-row ratios 2x between two H100 machines (2026-12-06); ``--eager`` times the calls as issued:

- fp16 / fp16 nk: the baseline's two GEMMs (x @ W (k, n); F.linear(x, W (n, k))), W the true
  weight (values ~0.01: svh scales every column by ±0.01)
- fp16 nk x100: F.linear on 100 W (values ~1, as the decoded Ŵ): do the values change the time?
- mm Ŵ: our GEMM of the unfolded path, F.linear(had_in(x), Ŵ) (Ŵ decoded, values ~1)
- ours: the linear's default path (up to WGR_MAX_ROWS rows of a large enough linear the wgr kernel,
  EXL3TOOLS_DENSE_WGR; its switches as the environment sets them); dec_mm / fold / fold2: decode +
  GEMM + passes, the output pass folded, both folded (gpu_bench's large_parts), never the wgr kernel
- wga / wgr / wgr_sk / wg2: had_in + exl3_wga_m256_t2 (the EXL3TOOLS_DENSE_WGA preview up to 256
  rows), exl3_wgr_m256_t2 (register A over TMA stages), exl3_wgr_sk_m256_t2 (the same, stream-K) or
  exl3_wg2_m256_t1 (register A, unswizzled x) over slots of 256 rows (the weight decoded inside the
  GEMM, never written) + had_out at every row count; wgr_out: had_in + exl3_wgr_out_m256_t2_f16
  (wgr with the output pass in its epilogue, a tile's K splits added inside it); wgr_rg: the same with
  the producer's warpgroup giving its registers to the consumers for four A operands in flight
  (exl3_wgr_rg_out_m256_t2_f16); wgr128: that kernel on 128-row slots (exl3_wgr_rg_out_m128_t2_f16,
  the MoE prefill candidate); each one's relative error to ``ours`` is printed under the table

``--splits 2,3,4``: wgr_rg with K split that many ways too (wgr_s2 ...; the one-wave rule of
``cuda_launch.wave_split`` aside, past one wave too: no split waits for another).
``--variants a,b``: only those rows (beside the baseline, ``ours`` and ``dec_mm``). ``--parts``: under each
table, every variant's kernels with their device µs a call (torch.profiler over CUDA-graph
replays, each after an L2 flush): what of a path is its GEMM and what the passes around it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_bench import bench, graph_profile, make, w_true  # noqa: E402  (bench/ is not a package)

IN_GEMM = ("wga", "wgr", "wgr_sk", "wgr_out", "wgr_rg", "wgr128", "wg2")     # the variants that decode inside the GEMM (their error is printed; wgr_s<N> too)


def variants(lin, x, w, splits=()):
    """name -> zero-argument call, in timing order (``splits``: a wgr_s<N> each)."""
    from exl3tools.kernels import cuda_dense as cd
    from exl3tools.kernels import cuda_exl3 as cx

    F = torch.nn.functional
    rows = x.shape[0]
    w_kn = w.half()
    w_nk = w_kn.t().contiguous()
    w_nk100 = (w_nk.float() * 100).half()
    wt = cd.decode_t(lin.mod, lin.trellis)
    xrot = cx.had_in(lin.mod, x, lin.suh_tab, rows, rows, lin.k)

    def path(fold, fold_in, wgr=False):
        def call():
            lin.fold, lin.fold_in, lin.wgr = fold, fold_in, wgr
            return lin(x)
        return call

    return {"fp16": lambda: torch.matmul(x, w_kn),
            "fp16 nk": lambda: F.linear(x, w_nk),
            "fp16 nk x100": lambda: F.linear(x, w_nk100),
            "mm Ŵ": lambda: F.linear(xrot, wt),
            "ours": path(None, None, None),
            "dec_mm": path(False, False),
            "fold": path(True, False),
            "fold2": path(False, True),
            "wga": lambda: lin._in_slots(x, 256, cx.WGA_KERNEL)[:rows],
            "wgr": lambda: lin._in_slots(x, 256, cx.WGR_KERNEL)[:rows],
            "wgr_sk": lambda: lin._in_slots(x, 256, cx.WGR_SK_KERNEL)[:rows],
            "wgr_out": lambda: lin._in_slots(x, 256, cx.WGR_OUT_KERNELS[x.dtype])[:rows],
            "wgr_rg": lambda: lin._in_slots(x, 256, cx.WGR_RG_OUT_KERNELS[x.dtype])[:rows],
            "wgr128": lambda: lin._in_slots(x, 128, cx.WGR_RG_OUT_M128_KERNELS[x.dtype])[:rows],
            "wg2": lambda: lin._in_slots(x, 256, cx.WG_KERNELS[256])[:rows],
            **{f"wgr_s{s}": lambda s=s: lin._in_slots(x, 256, cx.WGR_RG_OUT_KERNELS[x.dtype], splits=s)[:rows]
               for s in splits}}


def kernel_parts(fn, n: int = 5) -> list[tuple[str, float]]:
    """fn's kernels and their device µs a call, largest first (gpu_bench.graph_profile's replays)."""
    events, key = graph_profile(fn, n)
    parts = [(e.key, getattr(e, key) / n) for e in events if getattr(e, key) > 0]
    return sorted((p for p in parts if "FillFunctor<signed char>" not in p[0]), key=lambda p: -p[1])   # (the flush)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="256,2048")
    ap.add_argument("--shapes", default="4096x14336,14336x4096,8192x8192")
    ap.add_argument("--K", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--eager", action="store_true", help="time eager calls, not CUDA-graph replays")
    ap.add_argument("--splits", default="", help='wgr_rg at these K split counts too ("2,3,4": wgr_s2 ...)')
    ap.add_argument("--parts", action="store_true", help="print each variant's kernels (device µs a call)")
    ap.add_argument("--variants", default="",
                    help='only these (comma-separated, e.g. "wgr_out,wgr_rg,fold"; "fp16 nk", "ours" and "dec_mm" always run)')
    a = ap.parse_args()
    import gpu_bench

    gpu_bench.GRAPH = not a.eager
    from exl3tools.kernels import cuda_exl3 as cx
    from exl3tools.kernels.dispatch import make_linear

    cx.FOLD_MIN_OUT = cx.FOLD2_MIN_ROWS = 0      # every path at every shape, as large_parts
    gen = torch.Generator(device="cuda").manual_seed(0)
    out = []
    for shape in a.shapes.split(","):
        k, n = (int(v) for v in shape.split("x"))
        t = make(k, n, a.K, gen)
        w = w_true(t, "mul1")
        lin = make_linear(t, "mul1", a.K, "cuda", backend="cuda")
        for rows in (int(r) for r in a.rows.split(",")):
            x = torch.randn(rows, k, device="cuda", generator=gen).half()
            splits = [int(v) for v in a.splits.split(",") if v]
            calls = variants(lin, x, w, splits)
            if a.variants:
                keep = {"fp16 nk", "ours", "dec_mm", *a.variants.split(",")}
                if keep - set(calls):
                    ap.error(f"--variants: no {sorted(keep - set(calls))}; there are {list(calls)}")
                calls = {name: fn for name, fn in calls.items() if name in keep or name.startswith("wgr_s")}
            times = {name: [] for name in calls}
            for _ in range(a.rounds):
                for name, fn in calls.items():
                    times[name].append(bench(fn))
            base = times["fp16 nk"]
            print(f"\n{k}->{n} K {a.K}, {rows} rows, {a.rounds} interleaved rounds ({'eager' if a.eager else 'graphs'}): "
                  "variant | median µs | "
                  "min-max | x fp16 nk (median of the rounds' ratios)")
            for name, ts in times.items():
                ratio = statistics.median(t_ / b for t_, b in zip(ts, base, strict=True))
                print(f"  {name:13s} | {statistics.median(ts):8.1f} | {min(ts):7.1f}-{max(ts):7.1f} | {ratio:5.2f}")
            ref = calls["ours"]().float()
            errs = {name: float((fn().float() - ref).norm() / ref.norm()) for name, fn in calls.items()
                    if name in IN_GEMM or name.startswith("wgr_s")}
            print("  relative error to ours: " + ", ".join(f"{name} {e:.2e}" for name, e in errs.items()))
            if a.parts:
                for name, fn in calls.items():
                    print(f"  parts of {name}: " + ", ".join(f"{kern[:48]} {us:.1f}" for kern, us in kernel_parts(fn)))
            out.append(dict(k=k, n=n, K=a.K, rows=rows, times_us=times, errors=errs))
            del calls
        del t, w, lin
        torch.cuda.empty_cache()
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""GPU linear benchmark: our kernels (CUDA, Triton) vs exllamav3 1.6.5 vs fp16 cuBLAS vs the HBM floor.

    python3 bench/gpu_bench.py [--quick] [--json OUT.json] [--impls cuda,triton,exllamav3,fp16] [--graph]

Median µs per call with cold L2 (triton.testing.do_bench flushes a 256 MB buffer before every
call; warmup 25 ms, rep 100 ms), random trellis (every bit pattern is a valid trellis), MUL1 unless
the column says otherwise. floor = (trellis + suh + svh + x + y bytes) / 4.26 TB/s (measured HBM
read rate, serving-expectations.md §6). Also checks every configuration's output against
x @ W (W decoded by our bit-exact kernel + Hadamards in fp32) before timing it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from unittest import mock

import torch
from triton.testing import do_bench

HBM = 4.26e12
SHAPES = [(4096, 14336), (14336, 4096), (6144, 2048), (2048, 6144), (8192, 8192)]
ROWS = [1, 8, 32, 256, 2048]
# the kernels a dense linear of 128-2048 rows is timed on beside decode + cuBLAS (large_parts): the
# 128-row tile kernel (EXL3TOOLS_DENSE_TILES) and the wgmma kernels (EXL3TOOLS_WGMMA)
DENSE_TILES = ("exl3_tiles_m128_t2", "exl3_wg2_m128_t2", "exl3_wg4_m128_t1", "exl3_ws3_m128_t2", "exl3_ws4_m128_t2", "exl3_wg2_m256_t1",
               "exl3_wga_m256_t2", "exl3_wgr_m256_t2", "exl3_wgr_sk_m256_t2")
KS = [2, 3, 4]


def make(k, n, K, gen):
    width = int(16 * K) if float(K).is_integer() else int(16 * int(K) + 8)
    tr = torch.randint(-32768, 32768, (k // 16, n // 16, width), dtype=torch.int16, device="cuda", generator=gen)
    suh = (torch.randint(0, 2, (k,), device="cuda", generator=gen) * 2 - 1).half()
    svh = ((torch.randint(0, 2, (n,), device="cuda", generator=gen) * 2 - 1) * 0.01).half()
    return dict(trellis=tr, suh=suh, svh=svh)


def w_true(t, cb):
    from exl3tools.kernels.triton_exl3 import _hadamard_pm1, decode_rotated
    w = decode_rotated(t["trellis"], cb).float()
    h = _hadamard_pm1("cuda").float() / 128 ** 0.5
    k, n = w.shape
    w = (h @ w.view(k // 128, 128, n)).view(k, n) * t["suh"].float()[:, None]
    w = (w.view(k, n // 128, 128) @ h).view(k, n) * t["svh"].float()[None, :]
    return w


GRAPH = False
PROFILE = False


def bench(fn):
    """Median µs, cold L2. With --graph the call is captured in a CUDA graph first and the replay
    is timed: that removes host launch overhead (our Python wrapper issues 4-5 launches, Triton's
    launcher costs tens of µs each, more than the L2 flush between calls hides)."""
    if GRAPH:
        try:
            return bench_graph(fn)
        except Exception as exc:  # noqa: BLE001 - e.g. a library whose first call is not capturable
            print(f"graph capture failed ({exc}); timing eager calls", file=sys.stderr)
    return do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3   # µs


def capture(fn):
    """fn's CUDA graph, after two warm calls on a side stream (first-call work stays out of it)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


def bench_graph(fn):
    """Median µs of CUDA-graph replays of fn (device time without host launch overhead)."""
    return do_bench(capture(fn).replay, warmup=25, rep=100, return_mode="median") * 1e3


def graph_profile(fn, n: int = 5):
    """(torch.profiler's key averages, the device-time key) of n replays of fn's CUDA graph (CUPTI
    traces graph kernels), each replay after the same L2 flush do_bench does (an int8 fill)."""
    from torch.profiler import ProfilerActivity, profile

    g = capture(fn)
    flush = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            flush.zero_()
            g.replay()
        torch.cuda.synchronize()
    events = prof.key_averages()
    return events, "self_device_time_total" if hasattr(events[0], "self_device_time_total") else "self_cuda_time_total"


def profile_graph(fn, title: str, n: int = 5) -> None:
    """Kernels of n replays of fn's CUDA graph by device time (graph_profile): where a whole path's
    time goes beside its parts."""
    events, key = graph_profile(fn, n)
    print(f"--- profile: {title}, {n} replays (each after an L2 flush)", flush=True)
    print(events.table(sort_by=key, row_limit=12, max_name_column_width=60), flush=True)


def large_parts(lin, x):
    """Where the large-row paths' time goes: each launch timed alone (µs), both decode store
    patterns and the folded decode, beside a plain write of the decoded bytes (the store floor),
    and both whole paths (decode + GEMM + output pass; folded decode + GEMM)."""
    from exl3tools.kernels import cuda_dense as cd
    from exl3tools.kernels import cuda_exl3 as cx
    from exl3tools.kernels import cuda_launch as cl

    rows = x.shape[0]
    xrot = cx.had_in(lin.mod, x, lin.suh_tab, rows, rows, lin.k)
    wt = cd.decode_t(lin.mod, lin.trellis)
    y = torch.mm(xrot, wt.t())
    fold0 = lin.fold
    wga0, wgr0 = lin.wga, lin.wgr      # the decode + cuBLAS paths below (wga, wgr: their DENSE_TILES entries)
    lin.wga = lin.wgr = False
    out = {"cuda_had_in_us": bench(lambda: cx.had_in(lin.mod, x, lin.suh_tab, rows, rows, lin.k)),
           "cuda_decode_us": bench(lambda: cd.decode_t(lin.mod, lin.trellis)),
           "cuda_decode_fold_us": bench(lambda: cd.decode_fold(lin.mod, lin.trellis, lin.svh)),
           "cuda_decode_fold2_us": bench(lambda: cd.decode_fold2(lin.mod, lin.trellis, lin.suh, lin.svh)),
           "cuda_decode_coop_us": bench(lambda: cd.decode_t(lin.mod, lin.trellis, kernel="exl3_decode_t_coop")),
           "write_us": bench(lambda: wt.fill_(1.0)),
           "cuda_mm_us": bench(lambda: torch.mm(xrot, wt.t())),
           "cuda_had_out_us": bench(lambda: cx.had_out(lin.mod, y, torch.empty_like(y), lin.svh_tab, lin.bias_tab,
                                                       rows, rows, lin.n))}
    with mock.patch.dict(os.environ, {"EXL3TOOLS_HAD_GRID": "0"}):     # the 1-D passes (read per call)
        out["cuda_had_in_flat_us"] = bench(lambda: cx.had_in(lin.mod, x, lin.suh_tab, rows, rows, lin.k))
        out["cuda_had_out_flat_us"] = bench(lambda: cx.had_out(lin.mod, y, torch.empty_like(y), lin.svh_tab,
                                                               lin.bias_tab, rows, rows, lin.n))
    # the same dense linear through the DENSE_TILES kernels: slots of m rows over one weight (no
    # slot table: every slot reads expert 0), had_in + kernel + had_out; the weight is decoded once
    # per slot, never written (the question: does that beat decode + cuBLAS, and from how many rows)
    ref = lin(x).float()
    for name in DENSE_TILES:
        m, per = (int(v) for v in name.split("_m")[1].split("_t"))
        if rows % m or rows > 2048 or lin.nt % (cl.kernel_block(name)[0] * per):
            continue
        def tiles(m=m, name=name):
            xr = cx.had_in(lin.mod, x, lin.suh_tab, rows, rows, lin.k)
            acc = cx.workspace(lin.device, rows * lin.n)
            cx.gemv(lin.mod, xr, lin.tr_tab, lin.kt, lin.nt, m, rows // m, acc, kernel=name)
            return cx.had_out(lin.mod, acc, torch.empty(rows, lin.n, dtype=x.dtype, device=x.device),
                              lin.svh_tab, lin.bias_tab, rows, rows, lin.n)
        err = float((tiles().float() - ref).norm() / ref.norm())
        tag = name.removeprefix("exl3_")      # tiles_m128_t2, wg2_m256_t1
        out[f"cuda_dense_{tag}_us"] = bench(tiles)
        out[f"cuda_dense_{tag}_err"] = err
    keep, keep2, fold_in0 = cx.FOLD_MIN_OUT, cx.FOLD2_MIN_ROWS, lin.fold_in
    cx.FOLD_MIN_OUT = cx.FOLD2_MIN_ROWS = 0   # every path at every shape (the runtime folds above them)
    for tag, fold, fold_in in (("nofold", False, False), ("fold", True, False), ("fold2", False, True)):
        lin.fold, lin.fold_in = fold, fold_in
        out[f"cuda_{tag}_us"] = bench(lambda: lin(x))
        if fold_in:                      # the input pass folded too: x itself into cuBLAS
            out["cuda_fold2_err"] = float((lin(x).float() - ref).norm() / ref.norm())
        else:                            # the same path with the 1-D Hadamard passes (read per call)
            with mock.patch.dict(os.environ, {"EXL3TOOLS_HAD_GRID": "0"}):
                out[f"cuda_{tag}_hadflat_us"] = bench(lambda: lin(x))
        if PROFILE:
            profile_graph(lambda: lin(x), f"{lin.k}->{lin.n} rows {rows} {tag}")
    lin.fold, lin.fold_in, cx.FOLD_MIN_OUT, cx.FOLD2_MIN_ROWS = fold0, fold_in0, keep, keep2
    # the unfolded path with the cooperative-load decode (EXL3TOOLS_DECODE_COOP, read per call)
    lin.fold, lin.fold_in = False, False
    with mock.patch.dict(os.environ, {"EXL3TOOLS_DECODE_COOP": "1"}):
        out["cuda_coop_nofold_us"] = bench(lambda: lin(x))
        if PROFILE:
            profile_graph(lambda: lin(x), f"{lin.k}->{lin.n} rows {rows} decode_coop")
    lin.fold, lin.fold_in, lin.wga, lin.wgr = fold0, fold_in0, wga0, wgr0
    if PROFILE:
        profile_graph(lambda: torch.mm(xrot, wt.t()), f"{lin.k}->{lin.n} rows {rows}: the GEMM alone")
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="one shape, K=3")
    ap.add_argument("--json", default=None)
    ap.add_argument("--impls", default="cuda,exllamav3,fp16")
    ap.add_argument("--codebooks", default="mul1", help="extra codebooks at K=3 rows 1/8, e.g. mcg,3inst")
    ap.add_argument("--graph", action="store_true", help="time CUDA-graph replays (no host overhead)")
    ap.add_argument("--profile-dense", action="store_true",
                    help="rows > 64: also print the kernels of each whole dense path (torch.profiler)")
    ap.add_argument("--rows", default=",".join(map(str, ROWS)))
    ap.add_argument("--ks", default=",".join(map(str, KS)), help="bits per weight to run, e.g. 2,3,4")
    a = ap.parse_args()
    global GRAPH, PROFILE
    GRAPH, PROFILE = a.graph, a.profile_dense
    rows_all = [int(r) for r in a.rows.split(",")]
    from exl3tools.kernels.dispatch import make_linear

    impls = a.impls.split(",")
    have_exl3 = "exllamav3" in impls
    if have_exl3:
        try:
            import exllamav3.ext  # noqa: F401  (JIT build happens here)
        except Exception as exc:  # noqa: BLE001 - report and go on without it
            print(f"exllamav3 unavailable: {exc}", file=sys.stderr)
            have_exl3 = False
    gen = torch.Generator(device="cuda").manual_seed(0)
    shapes = SHAPES[:1] if a.quick else SHAPES
    ks = [3] if a.quick else [float(v) if "." in v else int(v) for v in a.ks.split(",")]
    configs = [(s, K, "mul1") for s in shapes for K in ks]
    configs += [(s, 3, cb) for s in shapes for cb in a.codebooks.split(",") if cb and cb != "mul1"]
    results = []
    for (k, n), K, cb in configs:
        t = make(k, n, K, gen)
        wt = w_true(t, cb)
        fns = {name: make_linear(t, cb, K, "cuda", backend=name) for name in ("cuda", "triton") if name in impls}
        pro_rows = 0
        if "cuda_pro" in impls:        # the gemv's own input pass (EXL3TOOLS_GEMV_PROLOGUE), where it applies
            from exl3tools.kernels.cuda_gemv import GEMV_PRO_MAX_ROWS as pro_rows

            fns["cuda_pro"] = make_linear(t, cb, K, "cuda", backend="cuda")
            fns["cuda_pro"].gemv_in = True
        if have_exl3:
            fns["exllamav3"] = make_linear(t, cb, K, "cuda", backend="exllamav3")
        w16 = wt.half()
        tbytes = t["trellis"].numel() * 2 + 2 * (k + n)
        rows_list = rows_all if cb == "mul1" else [r for r in rows_all if r <= 8]
        for rows in rows_list:
            fns_r = {m: f for m, f in fns.items() if m != "cuda_pro" or rows <= pro_rows}
            x = torch.randn(rows, k, device="cuda", generator=gen).half()
            yref = x.float() @ wt
            row = dict(k=k, n=n, K=K, cb=cb, rows=rows,
                       floor_us=(tbytes + 2 * rows * (k + n)) / HBM * 1e6,
                       fp16_floor_us=(2 * k * n + 2 * rows * (k + n)) / HBM * 1e6)
            for name, fn in fns_r.items():
                y = fn(x).float()
                row[f"{name}_err"] = float((y - yref).norm() / yref.norm())
                row[f"{name}_us"] = bench(lambda fn=fn, x=x: fn(x))
            if "cuda" in fns and rows > 64:
                row.update(large_parts(fns["cuda"], x))
            if "fp16" in impls:
                row["fp16_us"] = bench(lambda x=x, w=w16: torch.matmul(x, w))
                if rows > 64:   # the weight as an fp16 checkpoint stores it, (n, k): x @ W.T
                    w_nk = w16.t().contiguous()
                    row["fp16_nk_us"] = bench(lambda x=x, w=w_nk: torch.nn.functional.linear(x, w))
                    del w_nk
            results.append(row)
            print(json.dumps(row), flush=True)
        del t, wt, w16, fns
        torch.cuda.empty_cache()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    print_table(results)
    print_large(results)
    return 0


def print_table(results):
    """ours = the CUDA backend where measured, else Triton; µs, and ratios from the same run; pro: the
    CUDA backend with the gemv's own input pass (--impls ...,cuda_pro; rows up to
    cuda_gemv.GEMV_PRO_MAX_ROWS); err ours: the largest of our implementations' errors."""
    hdr = (f"{'in->out':>12} {'K':>3} {'cb':>5} {'rows':>5} | {'cuda':>8} {'pro':>8} {'triton':>8} {'exl3':>8} {'fp16':>8} "
           f"{'floor':>6} | {'ours/exl3':>9} {'ours/fp16':>9} {'ours/floor':>10} | err ours / exl3")
    print(hdr)
    print("-" * len(hdr))
    for r in results:
        c, p, t, e, f = (r.get(f"{k}_us") for k in ("cuda", "cuda_pro", "triton", "exllamav3", "fp16"))
        o = c if c is not None else t
        # the worst of ours measured (cuda, pro, triton): a wrong gemv_pro build shows with or
        # without the cuda column beside it (a defs A/B of --impls cuda_pro alone printed nan)
        oe = max((r[f"{k}_err"] for k in ("cuda", "cuda_pro", "triton") if f"{k}_err" in r), default=float("nan"))
        fmt = lambda v: f"{v:8.1f}" if v is not None else f"{'-':>8}"   # noqa: E731
        rat = lambda p, q: f"{p / q:9.2f}" if p and q else f"{'-':>9}"    # noqa: E731
        print(f"{r['k']:>5}->{r['n']:<6} {r['K']:>3} {r['cb']:>5} {r['rows']:>5} | {fmt(c)} {fmt(p)} {fmt(t)} {fmt(e)} {fmt(f)} "
              f"{r['floor_us']:6.1f} | {rat(o, e)} {rat(o, f)} {rat(o, r['floor_us']):>10} | "
              f"{oe:.1e} / {r.get('exllamav3_err', float('nan')):.1e}")


def print_large(results):
    """rows > 64: the two dense paths and their launches (µs), and each path against fp16 cuBLAS."""
    rows = [r for r in results if "cuda_fold_us" in r]
    if not rows:
        return
    cols = ("had_in", "decode", "decode_fold", "decode_fold2", "mm", "had_out")
    hdr = (f"{'in->out':>12} {'K':>3} {'rows':>5} | " + " ".join(f"{c:>12}" for c in cols)
           + f" {'write':>7} | {'unfolded':>8} {'folded':>8} {'folded2':>8} {'fp16':>8} {'fp16 nk':>8} | "
           f"{'unf/fp16':>8} {'fold/fp16':>9} {'fold2/fp16':>10} {'fold2 err':>9}")
    print("\nrows > 64, launch by launch (write: a fill of the decoded bytes, the store floor; folded: the output "
          "pass in the decoded weights; folded2: both passes, x itself into cuBLAS; fp16: cuBLAS on W (k, n), "
          "fp16 nk: F.linear on W (n, k), as a checkpoint stores it)")
    print("  caution: fp16 is timed once, after all of ours at its shape; at 2048 rows the card sits at its power "
          "cap and its clock drifts (H100 2026-12-06: 1.5-2.0 GHz), so these ratios are not side by side: "
          "bench/gpu_gemm_ab.py (gpu_all.sh cublas) interleaves them")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        f = r.get("fp16_us")
        rat = lambda p, f=f: f"{p / f:8.2f}" if f else f"{'-':>8}"   # noqa: E731
        print(f"{r['k']:>5}->{r['n']:<6} {r['K']:>3} {r['rows']:>5} | "
              + " ".join(f"{r[f'cuda_{c}_us']:12.1f}" for c in cols)
              + f" {r['write_us']:7.1f} | {r['cuda_nofold_us']:8.1f} {r['cuda_fold_us']:8.1f} {r['cuda_fold2_us']:8.1f} "
              + (f"{f:8.1f}" if f else f"{'-':>8}") + (f" {r['fp16_nk_us']:8.1f}" if "fp16_nk_us" in r else f" {'-':>8}")
              + f" | {rat(r['cuda_nofold_us'])} {rat(r['cuda_fold_us']):>9} {rat(r['cuda_fold2_us']):>10}"
              + f" {r['cuda_fold2_err']:9.1e}")
    had = [r for r in rows if "cuda_had_in_flat_us" in r]
    if had:
        print("\nrows > 64, the Hadamard passes on their 1-D grid (EXL3TOOLS_HAD_GRID=0) -> the _grid kernels (the "
              "default): µs, "
              f"each pass beside its HBM floor (fp16 in and out at {HBM / 1e12:.2f} TB/s), and the two dense paths")
        for r in had:
            f = r.get("fp16_us")
            rat = (lambda p, f=f: f" ({p / f:.2f}x)" if f else "")   # noqa: E731
            fl_in, fl_out = (r["rows"] * d * 4 / HBM * 1e6 for d in (r["k"], r["n"]))
            print(f"{r['k']:>5}->{r['n']:<6} {r['K']:>3} {r['rows']:>5} | had_in {r['cuda_had_in_flat_us']:6.1f} -> "
                  f"{r['cuda_had_in_us']:6.1f} (floor {fl_in:5.1f}) | had_out {r['cuda_had_out_flat_us']:6.1f} -> "
                  f"{r['cuda_had_out_us']:6.1f} (floor {fl_out:5.1f}) | unfolded {r['cuda_nofold_hadflat_us']:6.1f} -> "
                  f"{r['cuda_nofold_us']:6.1f}{rat(r['cuda_nofold_us'])} | folded "
                  f"{r['cuda_fold_hadflat_us']:6.1f} -> {r['cuda_fold_us']:6.1f}{rat(r['cuda_fold_us'])}")
    coop = [r for r in rows if "cuda_coop_nofold_us" in r]
    if coop:
        print("\nrows > 64, the decode with each quad of tiles loaded once a warp (exl3_decode_t_coop, "
              "EXL3TOOLS_DECODE_COOP): µs, decode alone and the unfolded path (x fp16 cuBLAS)")
        for r in coop:
            f = r.get("fp16_us")
            rat = (lambda p, f=f: f" ({p / f:.2f}x)" if f else "")   # noqa: E731
            print(f"{r['k']:>5}->{r['n']:<6} {r['K']:>3} {r['rows']:>5} | decode {r['cuda_decode_us']:6.1f} -> "
                  f"{r['cuda_decode_coop_us']:6.1f} | unfolded {r['cuda_nofold_us']:6.1f}{rat(r['cuda_nofold_us'])} -> "
                  f"{r['cuda_coop_nofold_us']:6.1f}{rat(r['cuda_coop_nofold_us'])}")
    tiled = [r for r in rows if any(k.startswith("cuda_dense_") for k in r)]
    if tiled:
        print("\nrows > 64 on the tile kernels (m-row slots over one weight, had_in + tiles + had_out; µs, x fp16 cuBLAS)")
        for r in tiled:
            f = r.get("fp16_us")
            tags = [n.removeprefix("exl3_") for n in DENSE_TILES if f"cuda_dense_{n.removeprefix('exl3_')}_us" in r]
            parts = [f"{t}: {r[f'cuda_dense_{t}_us']:7.1f}" + (f" ({r[f'cuda_dense_{t}_us'] / f:.2f}x)" if f else "")
                     + f" err {r[f'cuda_dense_{t}_err']:.1e}" for t in tags]
            print(f"{r['k']:>5}->{r['n']:<6} {r['K']:>3} {r['rows']:>5} | unfolded {r['cuda_nofold_us']:7.1f} | "
                  + " | ".join(parts))


if __name__ == "__main__":
    t0 = time.time()
    rc = main()
    print(f"total {time.time() - t0:.0f} s", file=sys.stderr)
    sys.exit(rc)

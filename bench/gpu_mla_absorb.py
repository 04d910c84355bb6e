"""MLA's absorbed products on the GPU: float32 W_UK / W_UV einsums (``EXL3TOOLS_MLA_W16=0``) against
fp16 weights through kernels/mla_absorb.absorb (the default on CUDA: its kernels up to WIDE_ROWS
rows, the widened einsum past them), side by side in one run, beside the memory floor of each
(the weights' bytes at the GPU's bandwidth, measured by a device copy here). The tf32x3 column
times the dot kernel at every row count, past WIDE_ROWS too.

    python3 bench/gpu_mla_absorb.py [--shapes deepseek_v3,glm5] [--rows 1,8,32,2048] [--sweep [--sweep-rows 8] [--sweep-products W_UV,W_UV^T]] [--json OUT.json]

Per shape (heads, nope, latent, v) and rows: the queries' nope part into the latent (W_UK) and the
latent output back to the value heads (W_UV, read transposed; and W_UV^T, the same product with the
weights stored (heads, latent, v), the mla_w16_vt layout), each timed as CUDA-graph replays
(median µs, gpu_bench.bench_graph, an L2 flush between replays), with the result checked against
the float32 einsum (max error relative to its largest value). A decode step runs both once a
layer: at DeepSeek-V3's 128 heads the float32 weights are 67 MB a layer against 34 in fp16.
``--sweep``: the first shape's rows of ``--sweep-rows`` (default 8: the dot kernel's tiles
(BM, BK, warps, k splits), each in IEEE float32 and tf32x3; 1: the row kernel's (BM, BK, warps),
swept in the 2026-12-07 14:47 session) at every tile of sweep_tiles, each checked, the fastest
three of each product printed beside the default's; at several rows the sweep also tries the row
kernel a program per row (``row``: each row's programs read their b block, from L2 after the first
row's), and the table has its time at 2-16 rows. Past SMALL_ROWS (``--sweep-rows 2048``, a
prompt's rows) the sweep tries the dot kernel's wide tiles (BT, BM, BK, warps, stages) in tf32x3
and tf32x2, whose times the table's fp32 einsum column (the default there) is the bar for. The floor is one read of the fp16 weights at
the rate of a device copy's traffic (read + write bytes over its time).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from exl3tools.kernels import mla_absorb  # noqa: E402
from gpu_bench import bench_graph  # noqa: E402  (bench/ is not a package)

SHAPES = {"deepseek_v3": (128, 128, 512, 128), "glm5": (64, 192, 512, 256)}   # heads, nope, latent, v


def copy_gbs() -> float:
    """The device's copy bandwidth (GB/s: read + write) of a 1 GiB buffer, the floor's rate."""
    a = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    return 2 * a.numel() / (bench_graph(lambda: b.copy_(a)) * 1e-6) / 1e9


def sweep_tiles(rows: int, transpose: bool) -> list[tuple[int, ...]]:
    """Tiles to try: one row's (BM, BK, warps): the 2026-12-07 14:47 sweep had wide contiguous
    loads win (m for W_UK, k for W_UV read transposed), so the contiguous side goes wider here; a
    b block of more than 256 values a thread, or fewer than one, is left out. Several rows: the
    dot kernel's (BM, BK, warps, k splits): the (BM, BK, warps) its 16-row IEEE float32 dot builds
    without spills at sm_90 (104-254 registers; bench/triton_sm90_check.py), in 1, 2 or 4 k splits:
    W_UV at DeepSeek-V3's shape had 256 programs of 16 k-steps (48.3 µs at 8 rows), W_UK 1024 of 4
    (24.0)."""
    if rows > mla_absorb.SMALL_ROWS:     # a prompt's rows: the dot kernel's (BT, BM, BK, warps, stages)
        return [(bt, bm, bk, w, st) for bt in (64, 128) for bm in (64, 128) for bk in (32, 64) for w in (4, 8)
                for st in (3,) if bt * bm <= 64 * 64 * w and bk * (bt + bm) <= 128 * 64]
    if rows > 1:
        fits = ((32, 32, 4), (64, 32, 4), (32, 64, 4), (128, 32, 4), (64, 64, 8), (128, 32, 8))
        return [(bm, bk, w, s) for bm, bk, w in fits for s in (1, 2, 4)]
    # m contiguous: W_UK (k 128-192, m 512) and W_UV^T (k 512, m 128-256), whose 64-column tile
    # leaves 256 one-warp programs at DeepSeek-V3's shape (15.1 µs against W_UV's 13.6): narrower too
    bms, bks = ((16, 32, 64), (128, 256, 512)) if transpose else ((16, 32, 64, 128, 256), (32, 64, 128))
    tiles = [(bm, bk, w) for bm in bms for bk in bks for w in (1, 2, 4)]
    return [t for t in tiles if t[0] * t[1] <= 256 * 32 * t[2] and t[0] * t[1] >= 32 * t[2]]


def sweep(name: str, prod: str, x: torch.Tensor, w16: torch.Tensor, tr: bool, want: torch.Tensor,
          floor: float) -> list[dict]:
    """The row (dot) kernel's tiles at x's rows, fastest first (a tile whose result is off is
    reported, not ranked)."""
    T, out = x.shape[0], []
    # the row kernel's tiles ("row": past one row a program per row, each re-reading its b block,
    # from L2 after the first); several rows: the dot kernel's too, in both precisions
    wide = T > mla_absorb.SMALL_ROWS     # a prompt's rows: wide tiles on tensor cores, no row kernel
    precs = ("tf32x3", "tf32x2") if wide else ("ieee", "tf32x3")
    tries = [(cfg, prec) for cfg in sweep_tiles(T, tr) for prec in precs] if T > 1 else []
    tries += [] if wide else [(cfg, "row") for cfg in sweep_tiles(1, tr)]
    for cfg, prec in tries:
        kw = dict(tile=cfg, row_rows=T) if prec == "row" else dict(tile=cfg, precision=prec)
        if wide:
            kw = dict(wide_tile=cfg, precision=prec, wide_rows=T)
        got = mla_absorb.absorb(x, w16, tr, **kw)
        err = ((got - want).abs().max() / want.abs().max()).item()
        t = bench_graph(lambda kw=kw: mla_absorb.absorb(x, w16, tr, **kw))
        out.append(dict(shape=name, product=prod, rows=T, tile=list(cfg), precision=prec, us=t, max_rel_err=err))
    out.sort(key=lambda r: (r["max_rel_err"] > 1e-5, r["us"]))
    row = T <= mla_absorb.ROW_KERNEL_ROWS               # the default's kernel at these rows
    dflt = list(mla_absorb.ROW_TILE[tr] if row else (mla_absorb.BM, mla_absorb.BK, 4, 1))   # contiguous w16: tr = k's
    dprec = "row" if row else mla_absorb.DOT_PRECISION or mla_absorb.DOT_BY_BLOCK[T <= mla_absorb.SMALL_ROWS]
    dflt = next((r for r in out if r["tile"] == dflt and r["precision"] == dprec), None)
    names = ("BT", "BM", "BK", "warps", "stages") if wide else ("BM", "BK", "warps", "splits")
    best = out[:3] if wide else [*out[:3], next(r for r in out if r["precision"] == "row")]   # the best row kernel's too
    best = [r for i, r in enumerate(best) if r not in best[:i]]
    for r in best + ([dflt] if dflt and dflt not in best else []):
        tile = " ".join(f"{n} {v}" for n, v in zip(names, r["tile"], strict=False)) + f" {r['precision']}"
        print(f"sweep {name} {prod} rows {T} {tile}: {r['us']:.1f} µs "
              f"(floor {floor:.1f}, err {r['max_rel_err']:.1e}){' the default' if r is dflt else ''}", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="deepseek_v3,glm5")
    ap.add_argument("--rows", default="1,8,32,2048")
    ap.add_argument("--sweep", action="store_true", help="time the kernels' tiles at --sweep-rows (sweep_tiles)")
    ap.add_argument("--sweep-rows", default="8", help="rows to sweep at (1: the row kernel; 2-16: the dot kernel)")
    ap.add_argument("--sweep-products", default="W_UK,W_UV,W_UV^T",
                    help="the products to sweep (at 8 rows each is ~36 compiles and timings)")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs CUDA", file=sys.stderr)
        return 2
    gbs = copy_gbs()
    print(f"{torch.cuda.get_device_name()}: device copy {gbs:.0f} GB/s")
    print("| shape | rows | product | fp32 einsum µs | fp16 absorb µs | fp32 / fp16 | fp16 floor µs | max rel err "
          "| one row through the dot kernel µs | the dot in tf32x3 µs (max rel err) | 2-16 rows: the row kernel µs |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    rows_out, swept = [], []
    sweep_rows = {int(r) for r in a.sweep_rows.split(",")} if a.sweep else set()
    g = torch.Generator(device="cuda").manual_seed(0)
    for name in a.shapes.split(","):
        H, N, C, V = SHAPES[name]
        w_uk = (torch.randn(H, N, C, device="cuda", generator=g) * 0.05).half()
        w_uv = (torch.randn(H, V, C, device="cuda", generator=g) * 0.05).half()
        w_uv_t = w_uv.transpose(1, 2).contiguous()
        for T in (int(r) for r in a.rows.split(",")):
            q = torch.randn(T, H, N + 64, device="cuda", generator=g)[..., :N]
            o = torch.randn(T, H, C, device="cuda", generator=g)
            # W_UV^T: W_UV stored (H, C, V), so its product reads m-contiguous rows as W_UK's does
            # (the mla_w16_vt preview's layout: whether holding it so pays at 2-16 rows)
            for prod, x, w16, tr in (("W_UK", q, w_uk, False), ("W_UV", o, w_uv, True),
                                     ("W_UV^T", o, w_uv_t, False)):
                w32 = w16.float()
                spec = "thk,hmk->thm" if tr else "thk,hkm->thm"
                t32 = bench_graph(lambda x=x, w32=w32, spec=spec: torch.einsum(spec, x, w32))
                t16 = bench_graph(lambda x=x, w16=w16, tr=tr: mla_absorb.absorb(x, w16, tr))
                want = torch.einsum(spec, x, w32)
                err = ((mla_absorb.absorb(x, w16, tr) - want).abs().max() / want.abs().max()).item()
                floor = w16.numel() * 2 / (gbs * 1e9) * 1e6      # one read of the fp16 weights
                # one row: the row kernel (the default) against the 16-row dot kernel it replaced
                tdot = bench_graph(lambda x=x, w16=w16, tr=tr: mla_absorb.absorb(x, w16, tr, row_kernel=False)) \
                    if T == 1 else None
                # 2-16 rows: the row kernel, a program per row (its b blocks re-read through L2)
                trow = bench_graph(lambda x=x, w16=w16, tr=tr, T=T: mla_absorb.absorb(x, w16, tr, row_rows=T)) \
                    if 1 < T <= 16 else None
                # several rows: the dot kernel on tensor cores (tf32x3), past WIDE_ROWS too
                ttf = etf = None
                if T > 1:
                    kw = dict(precision="tf32x3", wide_rows=T)
                    ttf = bench_graph(lambda x=x, w16=w16, tr=tr, kw=kw: mla_absorb.absorb(x, w16, tr, **kw))
                    got = mla_absorb.absorb(x, w16, tr, **kw)
                    etf = ((got - want).abs().max() / want.abs().max()).item()
                print(f"| {name} | {T} | {prod} | {t32:.1f} | {t16:.1f} | {t32 / t16:.2f}x | {floor:.1f} | {err:.1e} "
                      f"| {'-' if tdot is None else f'{tdot:.1f}'} "
                      f"| {'-' if ttf is None else f'{ttf:.1f} ({etf:.1e})'} "
                      f"| {'-' if trow is None else f'{trow:.1f}'} |", flush=True)
                rows_out.append(dict(shape=name, rows=T, product=prod, fp32_us=t32, fp16_us=t16, floor_us=floor,
                                     max_rel_err=err, dot_us=tdot, tf32x3_us=ttf, tf32x3_err=etf, row_us=trow))
                if T in sweep_rows and name == a.shapes.split(",")[0] and prod in a.sweep_products.split(","):
                    swept += sweep(name, prod, x, w16, tr, want, floor)
    if a.json:
        a.json.write_text(json.dumps({"copy_gbs": gbs, "rows": rows_out, "sweep": swept}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

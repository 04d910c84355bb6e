"""Paged MLA decode attention (kernels/mla_attention.py) on the GPU: µs, latent GB/s and HBM-roofline share.

    python3 bench/gpu_mla_attention.py [--quick] [--heads 64] [--sweep "H,B,CTX[;H,B,CTX]" [--sweep-kinds fp16,fp16_dsa] [--sweep-only]] [--json OUT.json]

GLM-5 / DeepSeek-V3 shapes: H absorbed heads (64 GLM-5, 128 DeepSeek-V3), latent C 512, rope 64,
fp32 latent planes (MLAttention.cache_spec), block size 64, batch 1/8/32, every row at one context
length 1k..32k, block ids a random permutation. Timed as CUDA-graph replays (median µs, cold L2):
- triton ieee / tf32x3: our kernel, both dot precisions (EXL3TOOLS_MLA_PRECISION picks the default)
- dsa K=2048: the kernel over a 2048-entry selection (GLM-5's index_topk): cost must stop
  following the context once it exceeds K
- indexer: kernels/dsa_indexer.paged_scores (H_i 32, D_i 128) + dsa.topk_positions, the rest of a
  DSA layer's attention-side decode cost; "tc + top-k" the decode step's pair as two calls, "select"
  as dsa_indexer.select makes it (the chunked top-k's first pass inside the scores kernel)
- torch: mla_decode_reference (gathers every table column; skipped past --max-ref-gb)
GB/s counts the latent bytes a dense decode must read (B * ctx * (C + rope) * 4); roofline =
4.26 TB/s (measured H200 HBM read rate, as bench/gpu_bench.py). err = max |triton - torch| / max |torch|.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_bench import bench_graph  # noqa: E402  (bench/ is not a package)

HBM = 4.26e12
C, R, BS = 512, 64, 64
CTXS = [1024, 4096, 16384, 32768]
BATCHES = [1, 8, 32]
TOPK = 2048


def make_case(B: int, H: int, ctx: int, gen: torch.Generator, table: int = 0, bs: int = BS):
    """``table``: block-table tokens when wider than ctx (serve's tables span --max-model-len; the
    columns past ctx point at block 0 and are never read). ``bs``: the planes' block size."""
    nblk = ctx // bs
    nb = B * nblk + 1
    ckv = torch.empty(nb, bs, C, device="cuda").normal_(generator=gen)
    kpe = torch.empty(nb, bs, R, device="cuda").normal_(generator=gen)
    tables = torch.randperm(nb - 1, device="cuda", generator=gen).to(torch.int32).view(B, nblk).contiguous()
    if table > ctx:
        tables = torch.cat([tables, tables.new_zeros(B, table // bs - nblk)], 1).contiguous()
    lens = torch.full((B,), ctx, dtype=torch.int32, device="cuda")
    q_lat = torch.randn(B, H, C, device="cuda", generator=gen) * 0.05
    q_pe = torch.randn(B, H, R, device="cuda", generator=gen) * 0.05
    sel = torch.stack([torch.randperm(ctx, device="cuda", generator=gen)[:TOPK] for _ in range(B)]).to(torch.int32)
    return q_lat, q_pe, ckv, kpe, tables, lens, sel


def run(B: int, H: int, ctx: int, max_ref_gb: float) -> dict:
    from exl3tools.kernels import dsa_indexer as di
    from exl3tools.kernels.mla_attention import mla_decode, mla_decode_reference

    from exl3tools.runtime.dsa import topk_positions

    gen = torch.Generator("cuda").manual_seed(0)
    q_lat, q_pe, ckv, kpe, tables, lens, sel = make_case(B, H, ctx, gen)
    scale = 192 ** -0.5
    out = torch.empty_like(q_lat)
    row = {"B": B, "H": H, "ctx": ctx}
    for prec in ("ieee", "tf32x3"):
        row[f"{prec}_us"] = bench_graph(lambda p=prec: mla_decode(q_lat, q_pe, ckv, kpe, tables, lens, scale,
                                                                   out=out, precision=p))
    row["dsa_us"] = bench_graph(lambda: mla_decode(q_lat, q_pe, ckv, kpe, tables, lens, scale, sel=sel, out=out))
    ckv16, kpe16 = ckv.half(), kpe.half()    # --kv-cache-dtype fp16: fp16 tensor-core dots, half the bytes
    row["fp16_us"] = bench_graph(lambda: mla_decode(q_lat, q_pe, ckv16, kpe16, tables, lens, scale, out=out))
    row["dsa_fp16_us"] = bench_graph(lambda: mla_decode(q_lat, q_pe, ckv16, kpe16, tables, lens, scale, sel=sel,
                                                         out=out))
    row["fp16_roofline"] = B * ctx * (C + R) * 2 / HBM / (row["fp16_us"] * 1e-6)
    qi = torch.randn(B, 32, 128, device="cuda", generator=gen)
    wi = torch.randn(B, 32, device="cuda", generator=gen)
    kidx = torch.empty(ckv.shape[0], BS, 128, device="cuda").normal_(generator=gen)
    fma = (qi, wi, kidx, tables, lens, 0.01)
    row["indexer_us"] = bench_graph(lambda: topk_positions(di.paged_scores(*fma), lens, TOPK))
    row["indexer_triton_us"] = bench_graph(lambda: di.topk_select(di.paged_scores(*fma), lens, TOPK))
    row["indexer_chunked_us"] = bench_graph(lambda: di.topk_select_chunked(di.paged_scores(*fma), lens, TOPK))
    # the scores alone on the served fp16 plane: the fp32 FMA kernel, and the tensor-core one (preview)
    qi16, kidx16 = qi.half().float(), kidx.half()
    row["scores_fp16_us"] = bench_graph(lambda: di.paged_scores(qi16, wi, kidx16, tables, lens, 0.01))
    row["scores_tc_us"] = bench_graph(lambda: di.paged_scores(qi16, wi, kidx16, tables, lens, 0.01, tensor_cores=True))
    row["scores_tc_roofline"] = B * ctx * 128 * 2 / HBM / (row["scores_tc_us"] * 1e-6)
    a = di.paged_scores(qi16, wi, kidx16, tables, lens, 0.01)
    b = di.paged_scores(qi16, wi, kidx16, tables, lens, 0.01, tensor_cores=True)
    fin = torch.isfinite(a)
    row["scores_tc_same"] = (a[fin] == b[fin]).float().mean().item()
    # the decode step's selection (tensor-core scores, the top-k by width) as two calls, and as
    # dsa_indexer.select makes it (at chunked widths the top-k's first pass inside the scores)
    tc = (qi16, wi, kidx16, tables, lens, 0.01)
    row["tc_topk_us"] = bench_graph(lambda: di.topk_auto(di.paged_scores_tc(*tc), lens, TOPK))
    row["select_us"] = bench_graph(lambda: di.select(*tc, TOPK, di.paged_scores_tc, di.topk_auto))
    two = di.topk_auto(di.paged_scores_tc(*tc), lens, TOPK)
    one = di.select(*tc, TOPK, di.paged_scores_tc, di.topk_auto)
    row["select_same"] = bool(torch.equal(two.sort(1).values, one.sort(1).values))
    nbytes = B * ctx * (C + R) * 4
    best = min(row["ieee_us"], row["tf32x3_us"])
    row["GBps"] = nbytes / (best * 1e-6) / 1e9
    row["roofline"] = nbytes / HBM / (best * 1e-6)
    got = mla_decode(q_lat, q_pe, ckv, kpe, tables, lens, scale)
    if B * ctx * (C + R) * 4 * 3 / 1e9 <= max_ref_gb:       # the gathered copies dominate its memory
        row["torch_us"] = bench_graph(lambda: mla_decode_reference(q_lat, q_pe, ckv, kpe, tables, lens, scale,
                                                                   out=out))
        ref = mla_decode_reference(q_lat, q_pe, ckv, kpe, tables, lens, scale)
        row["err"] = ((got - ref).abs().max() / ref.abs().max()).item()
        tf = mla_decode(q_lat, q_pe, ckv, kpe, tables, lens, scale, precision="tf32x3")
        row["err_tf32x3"] = ((tf - ref).abs().max() / ref.abs().max()).item()
        h = mla_decode(q_lat, q_pe, ckv16, kpe16, tables, lens, scale)   # vs fp32 math on the rounded planes
        ref16 = mla_decode_reference(q_lat, q_pe, ckv16, kpe16, tables, lens, scale)
        row["err_fp16"] = ((h - ref16).abs().max() / ref16.abs().max()).item()
    return row


SWEEP_KINDS = {"fp32": ("fp32", "ieee", False), "tf32x3": ("fp32", "tf32x3", False),
               "fp16": ("fp16", "ieee", False), "fp16_dsa": ("fp16", "ieee", True)}


def sweep(H: int, B: int, ctx: int, table: int = 0, kinds_wanted: list[str] | None = None,
          tiles: list[tuple[int, ...]] | None = None) -> list[dict]:
    """Tile configurations at one shape (µs; a failing compile is reported): fp32 planes in both
    precisions, and fp16 planes (serve's default for MLA on CUDA: tensor-core dots), dense and with
    a 2048-key DSA selection. fp16 candidates that compile for sm_90 without spills
    (bench/triton_sm90_check.py's ptxas): HB 16 x TN 16/32/64, HB 32 x TN 16/32/64 and, with the
    queries in as fp16 (mla_attention.Q16_MIN_HB: wgmma, the query in shared memory), HB 64 x TN
    16/32 at 8 warps. ``tiles``: only these (HB, TN, warps[, min_split_tiles[, num_splits[,
    num_stages]]]); 0,0,0 the default (0 in the last three: theirs)."""
    from exl3tools.kernels.mla_attention import mla_decode

    gen = torch.Generator("cuda").manual_seed(0)
    q_lat, q_pe, ckv, kpe, tables, lens, sel = make_case(B, H, ctx, gen, table)
    ckv16, kpe16 = ckv.half(), kpe.half()
    out = torch.empty_like(q_lat)
    rows = []
    kinds = [(planes, prec, sel if dsa else None) for name, (planes, prec, dsa) in SWEEP_KINDS.items()
             if kinds_wanted is None or name in kinds_wanted]
    for planes, prec, s in kinds:
        c, k = (ckv16, kpe16) if planes == "fp16" else (ckv, kpe)
        grid = tiles or [(hb, tn, warps) for hb in (16, 32, 64) for tn in (16, 32, 64) for warps in (4, 8)]
        for hb, tn, warps, *more in grid:
            # 0,0,0: mla_decode's own choice (default_config) at this shape; then min_split_tiles and
            # num_splits where given (0: the default)
            mst, ns, stages = (list(more) + [0, 0, 0])[:3]
            kw = dict(precision=prec, head_block=hb or None, tile_n=tn or None, num_warps=warps or None, out=out, sel=s,
                      min_split_tiles=mst or None, num_splits=ns or None, num_stages=stages or None)
            r = {"H": H, "B": B, "ctx": ctx, "table": max(table, ctx), "planes": planes, "precision": prec, "dsa": s is not None,
                 "HB": hb, "TN": tn, "warps": warps, "min_split_tiles": mst or None, "num_splits": ns or None,
                 "num_stages": stages or None}
            try:
                r["us"] = bench_graph(lambda kw=kw, c=c, k=k: mla_decode(q_lat, q_pe, c, k, tables, lens, 0.07, **kw))
            except Exception as exc:  # noqa: BLE001 - out of registers / shared memory
                r["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:120]
            print(json.dumps(r), flush=True)
            rows.append(r)
    ok = [r for r in rows if "us" in r]
    for planes, prec, s in kinds:
        best = min((r for r in ok if (r["planes"], r["precision"], r["dsa"]) == (planes, prec, s is not None)),
                   key=lambda r: r["us"], default=None)
        print(f"best {planes} {prec}{' dsa' if s is not None else ''}: {best}", flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="batch 1 and 32, ctx 4k and 32k")
    ap.add_argument("--heads", default="64,128", help="absorbed heads per row (GLM-5 64, DeepSeek-V3 128)")
    ap.add_argument("--max-ref-gb", type=float, default=8.0, help="skip the torch reference above this")
    ap.add_argument("--json", default=None)
    ap.add_argument("--sweep", default=None, metavar="H,B,CTX[,TABLE]",
                    help="also time head block / tile / warps variants at this shape (e.g. 64,8,16384)")
    ap.add_argument("--sweep-kinds", default=",".join(SWEEP_KINDS), help="which planes the sweep times: "
                    + ", ".join(SWEEP_KINDS) + " (fp16: serve's default planes on CUDA)")
    ap.add_argument("--sweep-only", action="store_true", help="the sweep alone, not the table")
    ap.add_argument("--sweep-tiles", default=None, metavar="HB,TN,W[,MIN_SPLIT_TILES[,NUM_SPLITS[,NUM_STAGES]]][;...]",
                    help="the sweep's tiles (default: all)")
    a = ap.parse_args()
    swept = []
    for shape in (a.sweep or "").split(";"):   # several shapes: "128,1,32768;64,1,32768"
        if shape:
            tiles = [tuple(int(v) for v in t.split(",")) for t in a.sweep_tiles.split(";")] if a.sweep_tiles else None
            swept += sweep(*(int(v) for v in shape.split(",")), kinds_wanted=a.sweep_kinds.split(","), tiles=tiles)
    if a.sweep_only:
        if a.json:
            with open(a.json, "w") as fh:
                json.dump({"configs": [], "sweep": swept}, fh, indent=1)
        return 0
    ctxs, batches = ([4096, 32768], [1, 32]) if a.quick else (CTXS, BATCHES)
    rows = []
    print("| H | B | ctx | ieee µs | tf32x3 µs | fp16 planes µs | dsa K=2048 µs | dsa fp16 µs | indexer µs | indexer triton top-k µs | chunked top-k µs | "
          "scores fp16 µs | scores tc µs | tc roofline | tc same | tc + top-k µs | select µs | same | torch µs | GB/s | roofline | fp16 roofline | err | err tf32x3 | err fp16 |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for H in (int(h) for h in a.heads.split(",")):
        for B in batches:
            for ctx in ctxs:
                try:
                    r = run(B, H, ctx, a.max_ref_gb)
                except torch.cuda.OutOfMemoryError:
                    print(f"| {H} | {B} | {ctx} | OOM |")
                    torch.cuda.empty_cache()
                    continue
                rows.append(r)

                def f(k, fmt="{:.1f}", r=r):
                    return fmt.format(r[k]) if k in r else "-"
                print(f"| {H} | {B} | {ctx} | {f('ieee_us')} | {f('tf32x3_us')} | {f('fp16_us')} | {f('dsa_us')} | {f('dsa_fp16_us')} | "
                      f"{f('indexer_us')} | {f('indexer_triton_us')} | {f('indexer_chunked_us')} | "
                      f"{f('scores_fp16_us')} | {f('scores_tc_us')} | {f('scores_tc_roofline', '{:.0%}')} | {f('scores_tc_same', '{:.4f}')} | "
                      f"{f('tc_topk_us')} | {f('select_us')} | {r.get('select_same', '-')} | "
                      f"{f('torch_us')} | {f('GBps', '{:.0f}')} | {f('roofline', '{:.0%}')} | "
                      f"{f('fp16_roofline', '{:.0%}')} | {f('err', '{:.1e}')} | {f('err_tf32x3', '{:.1e}')} | "
                      f"{f('err_fp16', '{:.1e}')} |", flush=True)
                torch.cuda.empty_cache()
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"configs": rows, "sweep": swept}, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The MLA decode kernels side by side on the GPU: Triton's split kernel (kernels/mla_attention.py)
against the CUDA one (TMA copies, wgmma: kernels/csrc/mla_decode.cu, EXL3TOOLS_MLA_CUDA), each with
the merge, on fp16 planes as serve keeps them (C 512, rope 64, block size 16), at the shapes
DeepSeek-V3 (128 heads, dense) and GLM-5 (64 heads, a 2048-key DSA selection) decode. Rows with a
selection take Triton either way (mla_decode), so their columns time the same kernel. "cuda": the
CUDA kernel computing each tile's scores on both warpgroups (EXL3TOOLS_MLA_PINGPONG=0); "ping-pong":
each tile's scores by one warpgroup in its plain order (EXL3TOOLS_MLA_SCALED_P=0); "scaled P": the
default, P_A stored scaled to B's maxima so warpgroup 1's two latent products go out back to back.
Both ping-pong columns pad head counts not in 64s to 64 (a tensor-parallel rank's 16 or 32 heads,
EXL3TOOLS_MLA_PAD_HEADS, the default), where "cuda" (and the opt-out) leave them to Triton's kernel.
The H100 of the 2026-12-05 session (prefetch: a removed preview reading the next pair's table entries
early, +0.3-3 µs everywhere): 128 heads batch 8 at 32k 210.4 -> 195.4 µs with scaled P; 32 heads
batch 8 at 32k Triton 180.5 -> 139.5 padded.

    python3 bench/gpu_mla_cuda.py [--shapes "H,B,CTX,SEL;..."] [--block-sizes 16,64]
    python3 bench/gpu_mla_cuda.py --merge      # the merge alone: merge_config against a sweep

--merge times the merge kernel alone (kernels/mla_attention.merge) on random partials at the rows x
partials the kernels leave (one DeepSeek-V3 row at 32k: 128 x 64; batch 8: 1024 x 8; GLM-5's DSA
rows: 64 x 32; batch 32: 4096 x 2): merge_config's choice beside every (CP, SC) with CP x SC <=
8192 (4 warps; 8 too from 4096 elements), a tenth of the partials empty (lse -inf, NaN o), each
after an L2 flush (do_bench).

µs: median CUDA-graph replay (bench/gpu_bench.bench_graph); GB/s: the latent bytes read once
(B x keys x 576 x 2) over the time; roofline: that against 4.26 TB/s; err: max |kernel - reference|
/ max |reference| (mla_decode_reference on the same fp16 planes, fp32 math).
"""

from __future__ import annotations

import argparse
import os
import sys
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_bench import bench_graph  # noqa: E402  (bench/ is not a package)
from gpu_mla_attention import make_case  # noqa: E402

HBM = 4.26e12
C, R, BS, TOPK = 512, 64, 16, 2048
SHAPES = ("128,1,4096,0;128,1,32768,0;128,8,4096,0;128,32,4096,0;128,8,32768,0;64,1,32768,0;64,1,32768,1;64,32,32768,1;"
          "32,1,32768,0;32,8,32768,0;16,1,32768,0;16,8,32768,0")     # the last four: a tensor-parallel rank's heads


def time_shape(H: int, B: int, ctx: int, use_sel: bool, bs: int = BS) -> dict:
    """Each kernel at one shape: µs and the error against the reference."""
    from exl3tools.kernels.mla_attention import mla_decode, mla_decode_reference

    q_lat, q_pe, ckv, kpe, tables, lens, sel = make_case(B, H, ctx, torch.Generator("cuda").manual_seed(0), bs=bs)
    ckv, kpe = ckv.half(), kpe.half()        # serve's planes for MLA on CUDA
    sel = sel if use_sel else None
    out = torch.empty_like(q_lat)
    scale = 192 ** -0.5

    def call():
        return mla_decode(q_lat, q_pe, ckv, kpe, tables, lens, scale, sel=sel, out=out)

    ref = mla_decode_reference(q_lat, q_pe, ckv, kpe, tables, lens, scale, sel=sel)
    row = {}
    for name, cuda, pp, pad, ps in (("triton", "0", "0", "0", "0"), ("cuda", "1", "0", "0", "0"),
                                    ("pp", "1", "1", "1", "0"), ("pp_ps", "1", "1", "1", "1")):
        os.environ["EXL3TOOLS_MLA_CUDA"], os.environ["EXL3TOOLS_MLA_PINGPONG"] = cuda, pp
        os.environ["EXL3TOOLS_MLA_PAD_HEADS"], os.environ["EXL3TOOLS_MLA_SCALED_P"] = pad, ps
        got = call().clone()
        row[f"err_{name}"] = ((got - ref).abs().max() / ref.abs().max()).item()
        row[name] = bench_graph(call)
    return row


MERGE_SHAPES = ((128, 64), (1024, 8), (64, 32), (4096, 2))


def merge_sweep() -> None:
    from exl3tools.kernels.mla_attention import merge, merge_config

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print("| rows | partials | merge_config (CP, SC) | its µs | best (CP, SC, warps) | best µs | (128, 16, 4) µs |")
    print("|---|---|---|---|---|---|---|")
    for rows, parts in MERGE_SHAPES:
        g = torch.Generator("cuda").manual_seed(rows)
        po = torch.randn(1, rows, parts, C, device="cuda", generator=g)
        plse = torch.randn(1, rows, parts, device="cuda", generator=g) * 4
        empty = torch.rand(1, rows, parts, device="cuda", generator=g) < 0.1
        plse[empty], po[empty] = float("-inf"), float("nan")
        out = torch.empty(1, rows, C, device="cuda")
        ref = merge(po, plse, out, (C, 1)).clone()
        times = {}
        for cp in (32, 64, 128, 512):
            for sc in (1 << i for i in range(7)):
                if sc > 2 * parts or cp * sc > 8192:
                    continue
                for warps in (4, 8) if cp * sc >= 4096 else (4,):
                    merge(po, plse, out, (cp, sc), warps)
                    assert torch.allclose(out, ref, rtol=1e-5, atol=1e-6), (cp, sc, warps)
                    times[cp, sc, warps] = bench_graph(partial(merge, po, plse, out, (cp, sc), warps))
        cfg = merge_config(rows, parts, C, sms)
        if (*cfg, 4) not in times:
            times[(*cfg, 4)] = bench_graph(partial(merge, po, plse, out, cfg, 4))
        best = min(times, key=times.get)
        print(f"| {rows} | {parts} | {cfg} | {times[(*cfg, 4)]:.1f} | {best} | {times[best]:.1f} | "
              f"{times.get((128, 16, 4), float('nan')):.1f} |", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=SHAPES, help="H,B,CTX,SEL (SEL 1: a 2048-key selection) separated by ;")
    ap.add_argument("--block-sizes", default=str(BS), help="the cache's block sizes to time, comma-separated "
                    "(a TMA copy is one block's rows: 16 rows x 128 bytes at 16)")
    ap.add_argument("--merge", action="store_true", help="time the merge alone (module doc) and exit")
    a = ap.parse_args()
    if a.merge:
        merge_sweep()
        return 0
    print("| bs | H | B | ctx | sel | triton µs | cuda µs | speedup | cuda GB/s | roofline | ping-pong µs | "
          "scaled P µs | scaled P / triton | err triton | err cuda | err ping-pong | err scaled P |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for bs, shape in ((int(b), sh) for b in a.block_sizes.split(",") for sh in a.shapes.split(";")):
        H, B, ctx, use_sel = (int(v) for v in shape.split(","))
        row = time_shape(H, B, ctx, bool(use_sel), bs)
        keys = B * (TOPK if use_sel else ctx)
        gbps = keys * (C + R) * 2 / (row["cuda"] * 1e-6) / 1e9
        print(f"| {bs} | {H} | {B} | {ctx} | {'2048' if use_sel else '-'} | {row['triton']:.1f} | {row['cuda']:.1f} | "
              f"{row['triton'] / row['cuda']:.2f}x | {gbps:.0f} | {gbps * 1e9 / HBM:.0%} | {row['pp']:.1f} | "
              f"{row['pp_ps']:.1f} | {row['pp_ps'] / row['triton']:.2f} | {row['err_triton']:.1e} | "
              f"{row['err_cuda']:.1e} | {row['err_pp']:.1e} | {row['err_pp_ps']:.1e} |", flush=True)
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The MLA decode kernels side by side on the GPU: Triton's split kernel (kernels/mla_attention.py)
against the CUDA one (TMA copies, wgmma: kernels/csrc/mla_decode.cu, EXL3TOOLS_MLA_CUDA), each with
the merge, on fp16 planes as serve keeps them (C 512, rope 64, block size 16), at the shapes
DeepSeek-V3 (128 heads, dense) and GLM-5 (64 heads, a 2048-key DSA selection) decode. Rows with a
selection take Triton either way (mla_decode), so their columns time the same kernel. "cluster
merge": the CUDA kernel with EXL3TOOLS_MLA_CLUSTER (clusters of splits merging their partials).

    python3 bench/gpu_mla_cuda.py [--shapes "H,B,CTX,SEL;..."] [--defines -DX]

µs: median CUDA-graph replay (bench/gpu_bench.bench_graph); GB/s: the latent bytes read once
(B x keys x 576 x 2) over the time; roofline: that against 4.26 TB/s; err: max |kernel - reference|
/ max |reference| (mla_decode_reference on the same fp16 planes, fp32 math). ``--defines``: build
the CUDA kernel with these nvcc defines instead (a diagnostic).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_bench import bench_graph  # noqa: E402  (bench/ is not a package)

HBM = 4.26e12
C, R, BS, TOPK = 512, 64, 16, 2048
SHAPES = "128,1,4096,0;128,1,32768,0;128,8,4096,0;128,32,4096,0;128,8,32768,0;64,1,32768,0;64,1,32768,1;64,32,32768,1"


def make_case(B: int, H: int, ctx: int, gen: torch.Generator):
    nblk = ctx // BS
    nb = B * nblk + 1
    ckv = torch.empty(nb, BS, C, device="cuda").normal_(generator=gen).half()
    kpe = torch.empty(nb, BS, R, device="cuda").normal_(generator=gen).half()
    tables = torch.randperm(nb - 1, device="cuda", generator=gen).to(torch.int32).view(B, nblk).contiguous()
    lens = torch.full((B,), ctx, dtype=torch.int32, device="cuda")
    q_lat = torch.randn(B, H, C, device="cuda", generator=gen) * 0.05
    q_pe = torch.randn(B, H, R, device="cuda", generator=gen) * 0.05
    sel = torch.stack([torch.randperm(ctx, device="cuda", generator=gen)[:TOPK] for _ in range(B)]).to(torch.int32)
    return q_lat, q_pe, ckv, kpe, tables, lens, sel


def load_variant(defines: list[str]) -> None:
    """Build mla_decode.cu with ``defines`` into a temporary cubin and make mla_cuda launch it."""
    from exl3tools.kernels import cuda_build, mla_cuda
    from exl3tools.kernels.cuda_driver import Module

    out = Path(tempfile.mkdtemp()) / "mla_variant.cubin"
    subprocess.run([cuda_build._nvcc(), *cuda_build.FLAGS, *defines, str(cuda_build.MLA_SRC), "-o", str(out)],
                   check=True)
    mla_cuda._modules[torch.cuda.current_device()] = Module(out, torch.device("cuda", torch.cuda.current_device()))


def time_shape(H: int, B: int, ctx: int, use_sel: bool) -> dict:
    """Each kernel at one shape: µs and the error against the reference."""
    from exl3tools.kernels.mla_attention import mla_decode, mla_decode_reference

    q_lat, q_pe, ckv, kpe, tables, lens, sel = make_case(B, H, ctx, torch.Generator("cuda").manual_seed(0))
    sel = sel if use_sel else None
    out = torch.empty_like(q_lat)
    scale = 192 ** -0.5

    def call():
        return mla_decode(q_lat, q_pe, ckv, kpe, tables, lens, scale, sel=sel, out=out)

    ref = mla_decode_reference(q_lat, q_pe, ckv, kpe, tables, lens, scale, sel=sel)
    row = {}
    for name, cuda, cluster in (("triton", "0", "0"), ("cuda", "1", "0"), ("cluster", "1", "1")):
        os.environ["EXL3TOOLS_MLA_CUDA"], os.environ["EXL3TOOLS_MLA_CLUSTER"] = cuda, cluster
        got = call().clone()
        row[f"err_{name}"] = ((got - ref).abs().max() / ref.abs().max()).item()
        row[name] = bench_graph(call)
    return row


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=SHAPES, help="H,B,CTX,SEL (SEL 1: a 2048-key selection) separated by ;")
    ap.add_argument("--defines", default="", help="nvcc defines for the CUDA kernel (diagnostic)")
    a = ap.parse_args()
    if a.defines:
        load_variant(a.defines.split())
    print("| H | B | ctx | sel | triton µs | cuda µs | speedup | cuda GB/s | roofline | cluster merge µs | err triton | "
          "err cuda | err cluster |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for shape in a.shapes.split(";"):
        H, B, ctx, use_sel = (int(v) for v in shape.split(","))
        row = time_shape(H, B, ctx, bool(use_sel))
        keys = B * (TOPK if use_sel else ctx)
        gbps = keys * (C + R) * 2 / (row["cuda"] * 1e-6) / 1e9
        print(f"| {H} | {B} | {ctx} | {'2048' if use_sel else '-'} | {row['triton']:.1f} | {row['cuda']:.1f} | "
              f"{row['triton'] / row['cuda']:.2f}x | {gbps:.0f} | {gbps * 1e9 / HBM:.0%} | {row['cluster']:.1f} | "
              f"{row['err_triton']:.1e} | {row['err_cuda']:.1e} | {row['err_cluster']:.1e} |", flush=True)
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

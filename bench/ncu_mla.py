"""One paged MLA decode call (kernels/mla_attention.mla_decode, fp16 planes as serve keeps them), for a
profiler (ncu) to look at: the split kernel and, with splits, the merge.

    ncu --clock-control none --kernel-name regex:_mla_ --launch-skip 6 --launch-count 2 \
        --section SpeedOfLight --section WarpStateStats python3 bench/ncu_mla.py [H B CTX [SEL [HB,TN,W[,SPLITS]]]]

SEL 1: over a 2048-entry DSA selection (GLM-5's index_topk) instead of the whole context.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_mla_attention import make_case  # noqa: E402  (bench/ is not a package)


def main() -> None:
    a = sys.argv[1:]
    H, B, ctx = (int(v) for v in (a[:3] if len(a) >= 3 else (128, 1, 32768)))
    use_sel = len(a) >= 4 and a[3] == "1"
    tile = [int(v) for v in a[4].split(",")] if len(a) >= 5 else []
    from exl3tools.kernels.mla_attention import mla_decode

    q_lat, q_pe, ckv, kpe, tables, lens, sel = make_case(B, H, ctx, torch.Generator("cuda").manual_seed(0))
    ckv, kpe = ckv.half(), kpe.half()
    kw = dict(zip(("head_block", "tile_n", "num_warps", "num_splits"), tile, strict=False))
    for _ in range(4):
        out = mla_decode(q_lat, q_pe, ckv, kpe, tables, lens, 0.07, sel=sel if use_sel else None, **kw)
    torch.cuda.synchronize()
    print("ok", out.norm().item())


if __name__ == "__main__":
    main()

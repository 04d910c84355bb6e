"""One MoE projection of a prompt on the GPU, path by path: which one should prefill take (issue 15)?

    python3 bench/gpu_moe_prefill.py [--shape glm5|air] [--tokens 256,2048] [--k 3] [--json OUT.json]

A random EXL3 projection of E experts (GLM-5: 256 experts, 6144 -> 2048; GLM-4.5-Air: 128, 4096 ->
1408 padded to 1536), K bits, MUL1 codebook, and T tokens x top-8 uniformly routed pairs. Timed
(CUDA events, median of 5 after a warm-up), each output the same (checked against the dense
reference of the first 4 experts' rows):

- ``cuda tiles``: kernels/cuda_experts.CudaExperts.tiles over runtime.layers.expert_tiles on the gemv
  kernel (the runtime's prefill before the tile kernels, and its tiles of fewer rows): tensor-core
  MMAs on 8-64-row tiles, each decoding its expert, every lane fetching its activations from
  global memory;
- ``exl3_tiles_m*``: each shared-memory tile kernel (cuda_exl3.TILE_KERNELS; the runtime's prefill
  takes the 64-row one unless EXL3TOOLS_PREFILL_TILES=0) on tiles of its own rows, padding rows
  skipped; ``fused_out``: the 64-row one with the output pass inside it (EXL3TOOLS_TILES_EPILOGUE);
- ``wgr_m128``: cuda_exl3.WGR_RG_OUT_M128_KERNELS on 128-row tiles (wgmma with each warp's decoded
  tile as the register A operand, the output pass in its epilogue), padding rows not stored;
- ``triton bm16/32/64``: kernels/triton_exl3.TritonExperts (tensor-core dots per group of bm rows);
- ``dense bmm``: fp16 weights decoded once (not timed) and one padded batched GEMM (E, max rows,
  k) x (E, k, n): the tensor-core floor without any decode;
- ``decode``: decoding every expert's fp16 weights (kernels/cuda_dense.decode_t per expert), what a
  decode-once-then-GEMM path adds to ``dense bmm``.

Also the HBM floor of reading the trellis once. Nothing here runs in CI.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_prefill import cuda_time  # noqa: E402  (bench/ is not a package)

HBM = 4.26e12
SHAPES = {"glm5": (256, 6144, 2048), "air": (128, 4096, 1536)}
TOP_K = 8


def experts(E: int, k: int, n: int, width: int, gen):
    import torch

    return [{"trellis": torch.randint(-32768, 32768, (k // 16, n // 16, width), dtype=torch.int16, device="cuda",
                                      generator=gen),
             "suh": (torch.randint(0, 2, (k,), device="cuda", generator=gen) * 2 - 1).half(),
             "svh": (torch.rand(n, device="cuda", generator=gen) * 0.01 + 0.001).half()} for _ in range(E)]


def run(shape: str, T: int, kbits: int) -> dict:
    import torch
    from exl3tools.kernels import cuda_dense, cuda_exl3, cuda_experts, triton_exl3

    from exl3tools.runtime.layers import expert_tiles, tile_rows

    E, k, n = SHAPES[shape]
    width = 16 * kbits
    gen = torch.Generator("cuda").manual_seed(0)
    ts = experts(E, k, n, width, gen)
    S = T * TOP_K
    tok = torch.arange(T, device="cuda").repeat_interleave(TOP_K)
    exp = torch.stack([torch.randperm(E, device="cuda", generator=gen)[:TOP_K] for _ in range(T)]).reshape(-1)
    x = torch.randn(T, k, device="cuda", generator=gen).half()
    row = {"shape": shape, "tokens": T, "pairs": S, "experts": E, "k": k, "n": n, "K": kbits}
    row["floor_ms"] = E * k * n * kbits / 8 / HBM * 1e3

    cu = cuda_experts.CudaExperts(ts, "mul1", "cuda")
    outs = {}

    def tiled(name: str, rows: int, kernel: str | None = None, skip_padding: bool = False) -> None:
        """Time ``cu.tiles`` on ``rows``-row tiles as ``name`` and keep its outputs by pair."""
        te, re_, sl, va = expert_tiles(exp, E, rows)
        sr = torch.where(va, tok[sl.clamp(max=S - 1)], 0)
        cnt = va.view(-1, rows).sum(1) if skip_padding else None      # as the runtime's MoE asks

        def call():
            return cu.tiles(x, sr, re_, te, rows, kernel=kernel, counts=cnt)
        row[f"{name}_ms"] = cuda_time(call)
        y = torch.zeros(S, n, device="cuda", dtype=torch.float16)
        y[sl[va]] = call()[va]
        outs[name] = y

    # the baseline column: the gemv kernel on every tile, at the runtime's tile rows
    cu.smem_tiles = cu.fused_out = False
    row["tile_rows"] = tile_rows(S, E)
    tiled("cuda_tiles", row["tile_rows"])
    # the shared-memory tile kernels, each on tiles of its own rows (the 128-row one decodes an
    # expert with 65-128 pairs once where 64-row tiles decode it twice)
    for mrows, kernel in cuda_exl3.TILE_KERNELS.items():
        tiled(kernel, mrows, kernel, skip_padding=True)
    # the 64-row one with the output pass fused into it (EXL3TOOLS_TILES_EPILOGUE), where one split
    cu.fused_out = True
    if cu._fused_out(cuda_exl3.TILE_KERNELS[64], x.dtype, S // 64 + min(E, S)) is not None:
        tiled("fused_out", 64, cuda_exl3.TILE_KERNELS[64], skip_padding=True)
    cu.fused_out = False
    # the wgmma kernel on 128-row tiles (the weight decoded into the register A operand, the output
    # pass in its epilogue; not yet on the runtime's route)
    try:
        tiled("wgr_m128", 128, cuda_exl3.WGR_RG_OUT_M128_KERNELS[x.dtype], skip_padding=True)
    except Exception as exc:  # noqa: BLE001 - a kernel's first run failing is a finding
        row["wgr_m128_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"

    tr = triton_exl3.TritonExperts(ts, "mul1", "cuda")
    for bm in (16, 32, 64):
        try:
            row[f"triton_bm{bm}_ms"] = cuda_time(lambda bm=bm: tr(x, tok, exp, bm=bm))
        except Exception as exc:  # noqa: BLE001 - a failed build is a finding
            row[f"triton_bm{bm}_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
    y_tr = tr(x, tok, exp, bm=16)

    mods = cu.mod
    w = torch.stack([cuda_dense.decode_t(mods, t["trellis"]).t() for t in ts])            # (E, k, n) fp16 Ŵ
    row["decode_ms"] = cuda_time(lambda: [cuda_dense.decode_t(mods, t["trellis"]) for t in ts])
    counts = torch.bincount(exp, minlength=E)
    mx = int(counts.max())
    order = torch.argsort(exp, stable=True)
    rank = torch.arange(S, device="cuda") - (torch.cumsum(counts, 0) - counts)[exp[order]]
    xp = torch.zeros(E, mx, k, device="cuda", dtype=torch.float16)
    xp[exp[order], rank] = x[tok[order]]
    row["dense_bmm_ms"] = cuda_time(lambda: torch.bmm(xp, w))
    row["max_rows_per_expert"] = mx

    # the same outputs: the reference of the first experts' rows (Hadamards and scales included)
    from exl3tools.kernels import reference as ref

    sel = (exp < 4).nonzero().reshape(-1)[:64]
    dense = {e: torch.from_numpy(ref.decode_linear(ts[e]["trellis"].cpu().numpy(), ts[e]["suh"].cpu().numpy(),
                                                   ts[e]["svh"].cpu().numpy(), "mul1")).float() for e in range(4)}
    want = torch.stack([x[tok[p]].float().cpu() @ dense[int(exp[p])] for p in sel.tolist()])
    for name, y in (("triton", y_tr), *outs.items()):
        got = y[sel].float().cpu()
        row[f"err_{name}"] = ((got - want).norm() / want.norm()).item()
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="glm5", choices=sorted(SHAPES))
    ap.add_argument("--tokens", default="256,2048")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    rows = []
    from exl3tools.kernels.cuda_exl3 import TILE_KERNELS

    smem = [*TILE_KERNELS.values(), "fused_out", "wgr_m128"]
    print("| shape | tokens | pairs | tile rows | cuda tiles ms | " + " | ".join(k.replace("exl3_tiles_", "smem ")
                                                                       for k in smem) +
          " | triton bm16 | bm32 | bm64 | decode all ms | dense bmm ms | HBM floor ms | err cuda | err smem max | err triton |")
    print("|---|---|---|---|---|" + "---|" * len(smem) + "---|---|---|---|---|---|---|---|---|")
    for T in (int(t) for t in a.tokens.split(",")):
        r = run(a.shape, T, a.k)
        rows.append(r)

        def f(key, r=r):
            return f"{r[key]:.3f}" if key in r else r.get(key.replace("_ms", "_error"), "-")
        err_smem = max(r[f"err_{k}"] for k in smem if f"err_{k}" in r)
        print(f"| {r['shape']} | {T} | {r['pairs']} | {r['tile_rows']} | {f('cuda_tiles_ms')} | "
              + "".join(f"{f(k + '_ms')} | " for k in smem) +
              f"{f('triton_bm16_ms')} | {f('triton_bm32_ms')} | {f('triton_bm64_ms')} | {f('decode_ms')} | "
              f"{f('dense_bmm_ms')} | {r['floor_ms']:.3f} | {r['err_cuda_tiles']:.1e} | {err_smem:.1e} | "
              f"{r['err_triton']:.1e} |", flush=True)
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

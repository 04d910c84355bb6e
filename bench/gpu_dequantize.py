"""GPU decode for dequantize / validate --deep (kernels/gpu_decode.py) next to the CPU reference, same run.

Figures: M weights/s and GB/s of weights (as bf16, 2 bytes each, what dequantize writes by default)
for (1) every EXL3 linear of one fixture, (2) a synthetic 4096x14336 linear per codebook at K=3:
GPU to a float32 Wᵀ on the device; GPU to bf16 bytes in host memory (what dequantize writes); CPU
reference decode_linear. Needs CUDA; fixtures from EXL3TOOLS_FIXTURES or ../shared/fixtures.

    python bench/gpu_dequantize.py [fixture-name]
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
from exl3tools.kernels import cuda_build
from exl3tools.kernels.gpu_decode import GpuDecoder
from exl3tools.kernels.reference import decode_linear

REPO = Path(__file__).resolve().parent.parent
FIXTURES = Path(os.environ.get("EXL3TOOLS_FIXTURES", REPO.parent / "shared" / "fixtures"))


def best_of(fn, reps=3, sync=True):
    fn()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if sync:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return min(times)


def row(label, n, t_dev, t_host, t_cpu):
    f = lambda t: f"{n / t / 1e6:>9.0f} {2 * n / t / 1e9:>7.2f}"  # noqa: E731
    print(f"{label:<34} {f(t_dev)}  {f(t_host)}  {f(t_cpu)}  {t_cpu / t_host:>6.1f}x")


def main():
    cuda_build.prebuild()
    gpu = GpuDecoder("cuda")
    print(f"GPU decode vs CPU reference; {torch.cuda.get_device_name()}, {os.cpu_count()} CPU cores")
    print(f"{'':<34} {'GPU->fp32 on device':>17}  {'GPU->bf16 in host':>17}  {'CPU reference':>17}  GPU/CPU")
    print(f"{'':<34} {'Mw/s':>9} {'GB/s':>7}  {'Mw/s':>9} {'GB/s':>7}  {'Mw/s':>9} {'GB/s':>7}")
    name = sys.argv[1] if len(sys.argv) > 1 else "glm4_moe-tp-2.0bpw-mul1"
    if (FIXTURES / name / "model").is_dir():
        from exl3tools.checkpoint import Checkpoint
        from exl3tools.layout import scan

        ck = Checkpoint.open(FIXTURES / name / "model")
        sc = scan({n: (r.dtype, r.shape) for n, r in ck.tensors.items()})
        lins = [(ck.read_numpy(f"{p}.trellis"), ck.read_numpy(f"{p}.suh"), ck.read_numpy(f"{p}.svh"), lin.codebook)
                for p, lin in sc.linears.items()]
        n = sum(t.shape[0] * t.shape[1] * 256 for t, *_ in lins)
        k_out = lambda t: (16 * t.shape[1], 16 * t.shape[0])  # noqa: E731  (rows, cols) of Wᵀ
        row(f"{name} ({len(lins)} linears)", n,
            best_of(lambda: [gpu.weight_t(*a) for a in lins]),
            best_of(lambda: [gpu.hf_rows_bytes(*a, *k_out(a[0]), "BF16") for a in lins]),
            best_of(lambda: [decode_linear(*a) for a in lins], reps=1, sync=False))
    else:
        print(f"(fixture {name} not under {FIXTURES}: skipped)")
    rng = np.random.default_rng(0)
    k, n_out = 4096, 14336
    tr = rng.integers(-32768, 32768, size=(k // 16, n_out // 16, 48), dtype=np.int16)
    suh = rng.standard_normal(k).astype(np.float16)
    svh = rng.standard_normal(n_out).astype(np.float16)
    for cb in ("3inst", "mcg", "mul1"):
        row(f"synthetic {k}x{n_out} K=3 {cb}", k * n_out,
            best_of(lambda cb=cb: gpu.weight_t(tr, suh, svh, cb)),
            best_of(lambda cb=cb: gpu.hf_rows_bytes(tr, suh, svh, cb, n_out, k, "BF16")),
            best_of(lambda cb=cb: decode_linear(tr, suh, svh, cb), reps=1, sync=False))


if __name__ == "__main__":
    main()

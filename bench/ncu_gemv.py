"""One skinny-GEMM call of the cuda backend, for a profiler (ncu) to look at.

    ncu --clock-control none --kernel-name regex:exl3_gemv --launch-count 1 \
        --section WarpStateStats --section SchedulerStats python3 bench/ncu_gemv.py [K IN OUT ROWS [KERNEL]]

KERNEL: a dense-slot GEMM kernel (bench/gpu_bench.py DENSE_TILES, e.g. exl3_ws3_m128_t2) over slots of
its rows, as the bench times it (had_in, the kernel, had_out), instead of the linear's own path.
"""

from __future__ import annotations

import sys

import torch
from exl3tools.kernels.dispatch import make_linear


def main() -> None:
    K, k, n, rows = (int(v) for v in (sys.argv[1:5] if len(sys.argv) >= 5 else (3, 4096, 14336, 1)))
    kernel = sys.argv[5] if len(sys.argv) >= 6 else None
    g = torch.Generator(device="cuda").manual_seed(0)
    t = dict(trellis=torch.randint(-32768, 32768, (k // 16, n // 16, 16 * K), dtype=torch.int16, device="cuda",
                                   generator=g),
             suh=torch.ones(k, dtype=torch.float16, device="cuda"),
             svh=torch.full((n,), 0.01, dtype=torch.float16, device="cuda"))
    lin = make_linear(t, "mul1", K, "cuda", backend="cuda")
    x = torch.randn(rows, k, device="cuda", generator=g).half()
    call = lin if kernel is None else (lambda x: _slots(lin, x, kernel))
    for _ in range(3):
        call(x)
    torch.cuda.synchronize()
    print("ok", call(x).float().norm().item())


def _slots(lin, x: torch.Tensor, kernel: str) -> torch.Tensor:
    from exl3tools.kernels import cuda_exl3 as cx
    from exl3tools.kernels import cuda_launch as cl

    m, rows = cl.slot_rows(kernel), x.shape[0]
    xr = cx.had_in(lin.mod, x, lin.suh_tab, rows, rows, lin.k)
    acc = cx.workspace(lin.device, rows * lin.n)
    cx.gemv(lin.mod, xr, lin.tr_tab, lin.kt, lin.nt, m, rows // m, acc, kernel=kernel)
    return cx.had_out(lin.mod, acc, torch.empty(rows, lin.n, dtype=x.dtype, device=x.device),
                      lin.svh_tab, lin.bias_tab, rows, rows, lin.n)


if __name__ == "__main__":
    main()

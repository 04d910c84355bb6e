"""One skinny-GEMM call of the cuda backend, for a profiler (ncu) to look at.

    ncu --clock-control none --kernel-name regex:exl3_gemv --launch-count 1 \
        --section WarpStateStats --section SchedulerStats python3 bench/ncu_gemv.py [K IN OUT ROWS]
"""

from __future__ import annotations

import sys

import torch
from exl3tools.kernels.dispatch import make_linear


def main() -> None:
    K, k, n, rows = (int(v) for v in (sys.argv[1:5] if len(sys.argv) >= 5 else (3, 4096, 14336, 1)))
    g = torch.Generator(device="cuda").manual_seed(0)
    t = dict(trellis=torch.randint(-32768, 32768, (k // 16, n // 16, 16 * K), dtype=torch.int16, device="cuda",
                                   generator=g),
             suh=torch.ones(k, dtype=torch.float16, device="cuda"),
             svh=torch.full((n,), 0.01, dtype=torch.float16, device="cuda"))
    lin = make_linear(t, "mul1", K, "cuda", backend="cuda")
    x = torch.randn(rows, k, device="cuda", generator=g).half()
    for _ in range(3):
        lin(x)
    torch.cuda.synchronize()
    print("ok", lin(x).float().norm().item())


if __name__ == "__main__":
    main()

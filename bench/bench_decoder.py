"""Reference decoder throughput on CPU (weights/s), per K and codebook, and against the goal.

Goal (issue 2): at least 50 M weights/s on 2 cores for the full decode (trellis -> W).
Printed side by side with a plain numpy float32 matmul of the same size, as a yardstick for the
machine's speed in this run.
"""

from __future__ import annotations

import os

import numpy as np
from _timing import best_of
from exl3tools.kernels.reference import decode_rotated, rotate_out

K_IN, N_OUT = 4096, 4096


def main():
    rng = np.random.default_rng(0)
    suh = rng.standard_normal(K_IN).astype(np.float16)
    svh = rng.standard_normal(N_OUT).astype(np.float16)
    x = rng.standard_normal((K_IN, 128)).astype(np.float32)
    w = rng.standard_normal((N_OUT, K_IN)).astype(np.float32)
    t_mm = best_of(lambda: w @ x)
    n = K_IN * N_OUT
    print(f"reference decoder, {K_IN}x{N_OUT} linear, {os.cpu_count()} cores")
    print(f"{'K':>4} {'codebook':>8} {'W_hat Mw/s':>11} {'W Mw/s':>8} {'vs goal 50':>10}")
    for width, K in ((32, 2), (40, 2.5), (48, 3), (64, 4), (96, 6)):
        tr = rng.integers(-32768, 32768, size=(K_IN // 16, N_OUT // 16, width), dtype=np.int16)
        for cb in ("3inst", "mcg", "mul1") if K == 3 else ("mul1",):
            t_hat = best_of(lambda tr=tr, cb=cb: decode_rotated(tr, cb))
            t_full = best_of(lambda tr=tr, cb=cb: rotate_out(decode_rotated(tr, cb), suh, svh))
            print(f"{K:>4} {cb:>8} {n / t_hat / 1e6:>11.1f} {n / t_full / 1e6:>8.1f} {n / t_full / 50e6:>9.2f}x")
    print(f"yardstick: numpy fp32 matmul {N_OUT}x{K_IN}x128 = {2 * N_OUT * K_IN * 128 / t_mm / 1e9:.1f} GFLOP/s")


if __name__ == "__main__":
    main()

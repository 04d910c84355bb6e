"""Reference decoder throughput on CPU (weights/s), per K and codebook, and against the goal.

Goal (issues 2 and 15): at least 50 M weights/s on 2 cores for the full decode (trellis -> W).
Columns: Ŵ only; W the pre-issue-15 way (decode Ŵ, then whole-matrix Hadamards: the same float32
operations, bit-identical output); W with the fused, banded ``decode_linear``. A plain numpy float32
matmul of the same size is the yardstick for the machine's speed in this run.
"""

from __future__ import annotations

import os

import numpy as np
from _timing import best_of
from exl3tools.kernels.reference import decode_linear, decode_rotated, had_cols, had_rows

K_IN, N_OUT = 4096, 4096


def whole_matrix_w(what, suh, svh):
    """decode_linear before issue 15: Ŵ for the whole linear, then whole-matrix passes."""
    w = had_rows(what.astype(np.float32))
    w *= suh.astype(np.float32)[:, None]
    w = had_cols(w)
    w *= svh.astype(np.float32)[None, :]
    return w


def main():
    rng = np.random.default_rng(0)
    suh = rng.standard_normal(K_IN).astype(np.float16)
    svh = rng.standard_normal(N_OUT).astype(np.float16)
    x = rng.standard_normal((K_IN, 128)).astype(np.float32)
    w = rng.standard_normal((N_OUT, K_IN)).astype(np.float32)
    t_mm = best_of(lambda: w @ x)
    n = K_IN * N_OUT
    print(f"reference decoder, {K_IN}x{N_OUT} linear, {os.cpu_count()} cores")
    print(f"{'K':>4} {'codebook':>8} {'W_hat Mw/s':>11} {'W old Mw/s':>11} {'W Mw/s':>8} {'new/old':>8} {'vs goal 50':>10}")
    for width, K in ((32, 2), (40, 2.5), (48, 3), (64, 4), (96, 6)):
        tr = rng.integers(-32768, 32768, size=(K_IN // 16, N_OUT // 16, width), dtype=np.int16)
        for cb in ("3inst", "mcg", "mul1") if K == 3 else ("mul1",):
            t_hat = best_of(lambda tr=tr, cb=cb: decode_rotated(tr, cb))
            t_old = best_of(lambda tr=tr, cb=cb: whole_matrix_w(decode_rotated(tr, cb), suh, svh))
            t_full = best_of(lambda tr=tr, cb=cb: decode_linear(tr, suh, svh, cb))
            print(f"{K:>4} {cb:>8} {n / t_hat / 1e6:>11.1f} {n / t_old / 1e6:>11.1f} {n / t_full / 1e6:>8.1f} "
                  f"{t_old / t_full:>7.2f}x {n / t_full / 50e6:>9.2f}x")
    print(f"yardstick: numpy fp32 matmul {N_OUT}x{K_IN}x128 = {2 * N_OUT * K_IN * 128 / t_mm / 1e9:.1f} GFLOP/s")


if __name__ == "__main__":
    main()

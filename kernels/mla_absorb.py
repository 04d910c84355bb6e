"""MLA's absorbed products with fp16 weights and float32 sums: ``out[t, h, m] = sum_k a[t, h, k] *
b[h, k, m]`` for float32 activations ``a`` and an fp16 ``b`` (W_UK: the queries' nope part into
the latent; W_UV, read transposed: the latent output back to the value heads).

Why: MLAttention held W_UK and W_UV in float32 (``kv_b_proj``, fp16 on disk, widened for the
float32 einsums), 67 MB a DeepSeek-V3 layer (128 heads), read whole by every decode step beside
~213 MB of that layer's 3-bit weights, and ~4 GB of KV blocks lost on one GPU. Held as fp16 (the
same values: kv_b is fp16) they take half; each product still widens every weight and sums in
float32 (``tl.dot`` in IEEE float32, FMA), so the result differs from the float32 einsum only by
its summation order.

One program per (head, 64 columns of m, a block of rows): reads its (K, 64) block of b once per
row block (once in all for the decode step's up to 16 rows), so a step reads each weight once. One
row (a one-stream decode step) takes ``_absorb_row_kernel``: a program per (head, BM columns), an
FMA loop and a sum over k, no dot (whose IEEE float32 tile pads one row to 16).
More than WIDE_ROWS rows (a prompt's) take ``absorb_reference``, the weights widened to float32
for one einsum: the float32 path's own arithmetic. Graph-capturable (the grid depends on shapes
only). ``absorb_reference``: the same contract in torch (the weights widened, one einsum).
"""

from __future__ import annotations

import os

import torch

from exl3tools.errors import UsageError

try:
    import triton
    import triton.language as tl
except ImportError:   # runtime-only installs: the reference still works
    triton = tl = None

BM, BK = 64, 32        # columns of m and of k a program takes at a time
SMALL_ROWS = 16        # row block of up to this many rows (a decode step); larger ones take 64
# one row (a one-stream decode step): no dot (the 16-row block's IEEE float32 dot is 15/16 padding
# there): the served one-stream decode ran 7 % slower with fp16 weights through the dot kernel than
# the float32 einsums (H100, the 2026-12-07 12:25 session). The row kernel's tile (BM, BK, warps)
# by b's layout, the fastest of bench/gpu_mla_absorb.py --sweep (H100, the 2026-12-07 14:47
# session, summed over DeepSeek-V3's and GLM-5's shapes): wide contiguous loads win; W_UK (m
# contiguous) 64 columns of m, W_UV (read transposed, k contiguous) 128 of k. There, one row:
# W_UK 13.2 µs against the einsum's 18.7 and the 32 x 64 tile's 16.5, W_UV 13.6 against 22.8 / 18.2.
# Keyed by whether b's k is its contiguous side (W_UV with the mla_w16_vt preview has m's)
ROW_TILE = {False: (64, 128, 1), True: (32, 128, 4)}


# the most rows the row kernel takes (a program per row and (head, m block), the rows of one block
# adjacent so its b block comes from L2 after the first row's): one. At DeepSeek-V3's shape on the
# H100 (the 2026-12-07 17:29 session) it took 20.8 / 23.3 / 21.4 µs at 8 rows (W_UK / W_UV /
# W_UV^T) and 30.0 / 36.1 / 29.3 at 16, behind the dot kernel in tf32x3 (16.6 / 19.9 / 18.5 and
# 17.0 / 20.8 / 19.4); ``row_rows`` keeps it for bench/gpu_mla_absorb.py
ROW_KERNEL_ROWS = 1


def _dot_precision(value: str | None) -> str | None:
    """EXL3TOOLS_MLA_ABSORB_DOT (a diagnostic, so a served A/B can time the dot kernel's precision
    as EXL3TOOLS_MLA_TILE does the MLA kernel's tiles): ieee, tf32x3 or tf32x2 (two tensor-core
    products, b being exact in tf32) for every row block; unset: None, each block's own
    (DOT_BY_BLOCK). A bad value is a UsageError naming the variable."""
    if not value:
        return None
    if value not in ("ieee", "tf32x3", "tf32x2"):
        raise UsageError(f"EXL3TOOLS_MLA_ABSORB_DOT={value!r}: expected ieee, tf32x3 or tf32x2")
    return value


# the dot kernel's products: IEEE float32 (FMA; 104-194 registers a thread at a 16-row block on 4
# warps, sm_90), or "tf32x3" on tensor cores as a_hi * b + a_lo * b (+ a_hi * b_lo, zero here: an
# fp16 weight is exact in tf32), the float32 activations split in two tf32 parts: within ~1e-6 of
# the einsum. H100, DeepSeek-V3's shape (the 2026-12-07 17:29 session, bench/gpu_mla_absorb.py):
# tf32x3 at 8 rows W_UK 16.6 µs against IEEE's 23.9, W_UV 19.9 against 47.9, W_UV^T (mla_w16_vt)
# 18.5 against 20.7 (the float32 einsums 32.4 / 38.1 / 35.9), max error 2.6e-7 / 2.6e-7 / 8.7e-7
# of the largest value (IEEE: 4.3e-7 / 7.8e-7 / 0); at 16 rows 17.0 / 20.8 / 19.4. Served on the
# DeepSeek-V3 shape (H100, the 2026-12-07 23:34 session, one run each, with mla_w16_vt): 1 / 8
# streams 458 / 1554 tok/s against IEEE's 457 / 1535 (the float32 einsums 444 / 1511). At 64-row
# blocks IEEE is as fast or faster (W_UK 55.9 against 55.3 µs, W_UV^T 46.4 against 52.2; same
# session), so each block keeps its own: DOT_BY_BLOCK[small block]. EXL3TOOLS_MLA_ABSORB_DOT
# forces one for both (DOT_PRECISION)
DOT_PRECISION = _dot_precision(os.environ.get("EXL3TOOLS_MLA_ABSORB_DOT"))
DOT_BY_BLOCK = {True: "tf32x3", False: "ieee"}
# more rows than this (prompt chunks: DSA's sparse prefill, eager rows beside a prompt) take the
# widened einsum, absorb_reference: the fp16 dot kernel's 64-row blocks fall behind cuBLAS's float32
# GEMM as rows grow. H100, the 23:34 session (bench/gpu_mla_absorb.py, DeepSeek-V3's shape): at 64
# rows W_UK 55.9 µs against the einsum's 38.3 (widening its 17 MB of fp16 adds ~20), W_UV^T 46.4
# against 43.9; at 2048 rows 1487.5 against 832.2 and 1248.5 against 672.7. Served on the GLM-5
# shape with every product on the kernels, a cold 2048-token prompt's TTFT (the server's own) was
# 106 ms against the float32 path's 65.3
WIDE_ROWS = 64
# 2-16 rows (decode steps of several streams) stay on the dot kernel: an FMA kernel with a
# (rows, BM) accumulator took 52-56 µs at 8 rows there against its 24.0 (W_UK) / 48.3 (W_UV)
# (H100, the 2026-12-07 14:47 session, call 4; removed). W_UV's 48.3 against the einsum's 38.5
# was the 8-stream step's loss (256 programs at DeepSeek-V3's shape, 16 k-steps each, against W_UK's
# 1024 x 4); with W_UV stored (heads, latent, v) (mla_w16_vt) the same product takes 20.7 and 8
# streams served 1539 tok/s against the float32 einsums' 1480 (the 17:29 session). ``tile`` lets
# bench/gpu_mla_absorb.py --sweep try the dot's tiles and k splits


if triton is not None:
    @triton.jit(do_not_specialize=["T"])    # one compile whatever the rows (T % 16 once made two)
    def _absorb_kernel(a_ptr, b_ptr, o_ptr, T, K, M, sa_t, sa_h, sa_k, sb_h, sb_k, sb_m, so_t, so_h, so_s,
                       BT: tl.constexpr, BK: tl.constexpr, BM: tl.constexpr, KS: tl.constexpr,
                       PREC: tl.constexpr):
        # KS 0: program axis 2 is the row block, k whole; KS > 0: one row block, axis 2 the split
        # of k (KS of it, a multiple of BK) whose partial sums go to plane so_s * split
        h = tl.program_id(0).to(tl.int64)
        m = tl.program_id(1) * BM + tl.arange(0, BM)
        if KS == 0:
            t = (tl.program_id(2) * BT + tl.arange(0, BT)).to(tl.int64)
            k_lo, k_hi = 0, K
        else:
            t = tl.arange(0, BT).to(tl.int64)
            k_lo = tl.program_id(2) * KS
            k_hi = tl.minimum(K, k_lo + KS)
            o_ptr += tl.program_id(2).to(tl.int64) * so_s
        tm, mm = t < T, m < M
        acc = tl.zeros((BT, BM), dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BK):
            k = k0 + tl.arange(0, BK)
            km = k < k_hi
            a = tl.load(a_ptr + h * sa_h + t[:, None] * sa_t + k[None, :] * sa_k, mask=tm[:, None] & km[None, :],
                        other=0.0)
            b = tl.load(b_ptr + h * sb_h + k[:, None] * sb_k + m[None, :] * sb_m, mask=km[:, None] & mm[None, :],
                        other=0.0).to(tl.float32)
            if PREC == "tf32x2":
                # b (fp16) is exact in tf32, so two tensor-core products of a's halves do what
                # tf32x3's three do (its third, a_hi * b_lo, is zero): a_hi keeps tf32's 10
                # mantissa bits, a_lo = a - a_hi the rest (its own tf32 rounding ~2^-22 of a)
                a_hi = (a.to(tl.uint32, bitcast=True) & 0xFFFFE000).to(tl.float32, bitcast=True)
                acc = tl.dot(a_hi, b, acc, input_precision="tf32")
                acc = tl.dot(a - a_hi, b, acc, input_precision="tf32")
            else:
                acc = tl.dot(a, b, acc, input_precision=PREC)
        tl.store(o_ptr + h * so_h + t[:, None] * so_t + m[None, :], acc, mask=tm[:, None] & mm[None, :])

    @triton.jit
    def _absorb_row_kernel(a_ptr, b_ptr, o_ptr, K, M, sa_t, sa_h, sa_k, sb_h, sb_k, sb_m, so_t, so_h,
                           BK: tl.constexpr, BM: tl.constexpr):
        # program axis 0 the row: a row's programs for one (head, m block) are adjacent in the
        # launch order, so the b block the first reads from memory the others find in L2
        t = tl.program_id(0).to(tl.int64)
        a_ptr += t * sa_t
        o_ptr += t * so_t
        h = tl.program_id(1).to(tl.int64)
        m = tl.program_id(2) * BM + tl.arange(0, BM)
        mm = m < M
        acc = tl.zeros((BM,), dtype=tl.float32)
        for k0 in range(0, K, BK):
            k = k0 + tl.arange(0, BK)
            km = k < K
            a = tl.load(a_ptr + h * sa_h + k * sa_k, mask=km, other=0.0)
            b = tl.load(b_ptr + h * sb_h + k[:, None] * sb_k + m[None, :] * sb_m, mask=km[:, None] & mm[None, :],
                        other=0.0).to(tl.float32)
            acc += tl.sum(a[:, None] * b, axis=0)
        tl.store(o_ptr + h * so_h + m, acc, mask=mm)


def _operands(a: torch.Tensor, w: torch.Tensor, transpose: bool) -> tuple[int, int, int, tuple[int, int, int]]:
    """(T, K, M, b's (head, k, m) strides) of ``absorb``'s operands, checked."""
    if a.dim() != 3 or w.dim() != 3 or a.shape[1] != w.shape[0] or a.dtype != torch.float32:
        raise ValueError(f"absorb: a {tuple(a.shape)} {a.dtype}, w {tuple(w.shape)}: need float32 (T, H, K) and "
                         "(H, K, M), or (H, M, K) with transpose")
    H, K, M = (w.shape[0], w.shape[2], w.shape[1]) if transpose else tuple(w.shape)
    if a.shape[2] != K:
        raise ValueError(f"absorb: a's last dim {a.shape[2]} is not w's k ({K}; transpose={transpose})")
    sb = (w.stride(0), w.stride(2), w.stride(1)) if transpose else tuple(w.stride())
    return a.shape[0], K, M, sb


def absorb(a: torch.Tensor, w: torch.Tensor, transpose: bool = False, row_kernel: bool = True,
           tile: tuple[int, ...] | None = None, precision: str | None = DOT_PRECISION,
           row_rows: int = ROW_KERNEL_ROWS, wide_rows: int = WIDE_ROWS,
           wide_tile: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """(T, H, M) float32: ``einsum("thk,hkm->thm", a, w)`` (``transpose``: w is (H, M, K),
    ``einsum("thk,hmk->thm")``) with w's entries widened to float32 and float32 sums. ``a`` may
    be a strided view (the queries' nope part); ``w`` fp16 (or any float dtype). ``row_kernel``
    False: one row through the dot kernel too. ``tile``: the row kernel's (BM, BK, warps) other
    than ROW_TILE's (by b's contiguous side), or the dot kernel's for up to SMALL_ROWS rows,
    (BM, BK, warps[, splits]) other than (BM, BK, 4, 1): with splits > 1 each program sums a 1/splits of k into a plane of
    partials, which one torch.sum adds (deterministic) (bench/gpu_mla_absorb.py sweeps these).
    ``precision``: the dot kernel's ``tl.dot`` input precision (None: DOT_BY_BLOCK's). ``row_rows``:
    the most rows the row kernel takes (a program per row), the dot kernel above. More than
    ``wide_rows`` rows: ``absorb_reference``. ``wide_tile``: the dot kernel's (BT, BM, BK, warps,
    stages) past SMALL_ROWS rows other than (64, BM, BK, 8, Triton's default stages)
    (bench/gpu_mla_absorb.py --sweep-rows 2048 times them against the einsum)."""
    T, K, M, sb = _operands(a, w, transpose)
    if T > wide_rows:
        return absorb_reference(a, w, transpose)
    H = w.shape[0]
    out = torch.empty(T, H, M, dtype=torch.float32, device=a.device)
    if T and M and row_kernel and T <= row_rows:
        bm, bk, warps = tile or ROW_TILE[sb[1] == 1]
        _absorb_row_kernel[(T, H, triton.cdiv(M, bm))](
            a, w, out, K, M, *a.stride(), *sb, out.stride(0), out.stride(1), BK=bk, BM=bm, num_warps=warps)
    elif T and M:
        # a prompt's rows in blocks of 64 on 8 warps (4 spilled the IEEE float32 dot's operands at sm_90)
        small = T <= SMALL_ROWS
        bm, bk, warps, splits = (*tile, 1)[:4] if tile and small else (BM, BK, 4 if small else 8, 1)
        bt, stages = SMALL_ROWS if small else 64, {}
        if wide_tile and not small:
            bt, bm, bk, warps, stages = *wide_tile[:4], {"num_stages": wide_tile[4]}
        ks = triton.cdiv(triton.cdiv(K, splits), bk) * bk if splits > 1 else 0
        dst = out if not ks else torch.empty(triton.cdiv(K, ks), T, H, M, dtype=torch.float32, device=a.device)
        _absorb_kernel[(H, triton.cdiv(M, bm), triton.cdiv(K, ks) if ks else triton.cdiv(T, bt))](
            a, w, dst, T, K, M, a.stride(0), a.stride(1), a.stride(2), *sb, dst.stride(-3), dst.stride(-2),
            dst.stride(0), BT=bt, BK=bk, BM=bm, KS=ks, PREC=precision or DOT_BY_BLOCK[small], num_warps=warps,
            **stages)
        if ks:
            torch.sum(dst, 0, out=out)
    return out


def absorbed(a: torch.Tensor, w: torch.Tensor, transpose: bool = False) -> torch.Tensor:
    """MLAttention's absorbed product with W_UK (H, nope, C), or with ``transpose`` W_UV (H, v, C):
    the float32 einsum where the weights are float32 (the reference), ``absorb`` where they are
    fp16 (the mla_w16 preview)."""
    return (absorb_reference if w.dtype == torch.float32 else absorb)(a, w, transpose)


def absorb_reference(a: torch.Tensor, w: torch.Tensor, transpose: bool = False) -> torch.Tensor:
    """``absorb`` in torch: the weights widened to float32, one einsum."""
    _operands(a, w, transpose)
    return torch.einsum("thk,hmk->thm" if transpose else "thk,hkm->thm", a, w.float())

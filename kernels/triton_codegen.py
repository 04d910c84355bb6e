"""Source generator for the trellis kernels (Triton), one specialisation per (tile width, codebook, mode).

Why generated: a tile is decoded in 8 groups of 32 trellis steps. Within a group the 16-bit window of
step ``b`` sits at a *fixed* bit offset of the group's ``K2 + 1`` uint16 words (exl3-format.md §5.3:
``S(32a + b) = 16·a·K2 + ((b+1)·K2 >> 1)``), and step ``b`` always lands in tile row ``r_b`` and
column half ``h_b`` (§5.5: ``t = 32a + b`` gives ``r = 2(b//8) + (b&1) + 8((b>>1)&1)``,
``c = a + 8((b>>2)&1)``). Unrolling over ``b`` at generation time turns every shift, word index,
row and column into a constant: no per-element index arithmetic, no gathers, ``K2 + 1`` loads per
32 weights. Triton has no lists of tensors, so the unrolled body is emitted as source text.

Modes (all share the load + state + codebook body):
- ``decode``: store Ŵ (k, n) fp16, bit-exact (also the first half of the large-batch path).
- ``dot``:    skinny GEMM on tensor cores, xh (rows ≤ BM) @ Ŵ, one ``tl.dot`` per step ``b``
              (K = 16 tile rows), output Hadamard + svh + bias fused, split-K by fp32 atomics.
- ``fma``:    rows == 1 on CUDA cores (no layout conversion for the MMA), same epilogue.
All three take expert groups (grouped MoE): program axis 0 is a group of ≤ BM rows that use one
expert's weights; a group with 0 rows returns at once (fixed grid, CUDA-graph friendly).
"""

from __future__ import annotations

CODEBOOKS = {"3inst": 0, "mcg": 1, "mul1": 2}


def _row_half(b: int) -> tuple[int, int]:
    q, e = b // 8, b % 8
    return 2 * q + (e & 1) + 8 * ((e >> 1) & 1), e >> 2


def _codebook_lines(cb: str, s: str, out: str, asm: bool) -> list[str]:
    """Lines computing fp16 ``out`` from uint32 state tensor ``s`` (exl3-format.md §5.4)."""
    if cb in ("3inst", "mcg"):
        mul = "x_ = {s} * 89226354 + 64248484" if cb == "3inst" else "x_ = {s} * 0xCBAC1FED"
        return [
            mul.format(s=s),
            "x_ = (x_ & 0x8FFF8FFF) ^ 0x3B603B60",
            "lo_ = (x_ & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True)",
            "hi_ = (x_ >> 16).to(tl.uint16).to(tl.float16, bitcast=True)",
            f"{out} = lo_ + hi_",
        ]
    lines = [f"x_ = {s} * 0x83DCD12D"]
    if asm:
        # GPU: byte sum and the +0x6400 (fp16 1024.0) in one dp4a; then one fp16 FMA (single
        # rounding, = the reference), which the compiler can pair into HFMA2
        return lines + [
            'h_ = tl.inline_asm_elementwise("dp4a.u32.u32 $0, $1, 16843009, 25600;", "=r,r", '
            '[x_], dtype=tl.uint32, is_pure=True, pack=1).to(tl.uint16).to(tl.float16, bitcast=True)',
            f"{out} = tl.fma(h_, tl.cast(0.00676727294921875, tl.float16), tl.cast(-10.3828125, tl.float16))"]
    lines += ["t_ = (x_ & 0x00FF00FF) + ((x_ >> 8) & 0x00FF00FF)",
              "bs_ = (t_ + (t_ >> 16)) & 0xFFFF"]
    # h = 1024 + b as fp16; v = RNE(h*kappa + beta). In fp32 both the product and the sum are exact
    # (integers over 2^18 below 16), so one rounding to fp16 gives the single-rounding result.
    lines += ["h_ = (bs_ + 0x6400).to(tl.uint16).to(tl.float16, bitcast=True)",
              f"{out} = (h_.to(tl.float32) * 0.00676727294921875 - 10.3828125).to(tl.float16)"]
    return lines


def generate(width: int, cb: str, mode: str, asm: bool) -> str:
    """Kernel source for trellis tile width ``width`` (int16 words), codebook ``cb``, ``mode``."""
    k2 = width // 8
    name = f"k_{mode}_{width}_{cb}_{int(asm)}"
    L: list[str] = ["import triton", "import triton.language as tl", "", "", "@triton.jit"]
    if mode == "decode":
        L.append(f"def {name}(tr_ptr, out_ptr, kt, nt, n, TK: tl.constexpr, TN: tl.constexpr):")
        L += ["    it = tl.program_id(0) * TK", "    jb = tl.program_id(1) * TN"]
    else:
        L.append(f"def {name}(xh_ptr, tr_ptr, svh_ptr, bias_ptr, y_ptr, h_ptr, g_row0_ptr, g_rows_ptr, "
                 "g_exp_ptr, k, n, kt, nt, tr_estride, sv_estride, split_tiles, "
                 "HAS_BIAS: tl.constexpr, BM: tl.constexpr, TN: tl.constexpr):")
        L += ["    g = tl.program_id(0)",
              "    rows = tl.load(g_rows_ptr + g)",
              "    if rows == 0:",
              "        return",
              "    row0 = tl.load(g_row0_ptr + g)",
              "    ex = tl.load(g_exp_ptr + g).to(tl.int64)",
              "    jb = tl.program_id(1) * TN",
              "    sp = tl.program_id(2)",
              "    tr_ptr = tr_ptr + ex * tr_estride",
              "    TK: tl.constexpr = " + ("16" if mode == "dot" else "8")]
    L += ["    ii = tl.arange(0, TK)[:, None, None]",
          "    jj = tl.arange(0, TN)[None, :, None]",
          "    aa = tl.arange(0, 8)[None, None, :]"]
    # int16 offset of word w of group a inside a tile: ring word (a*K2 - 1 + w) mod W16, pair-swapped
    for w in range(k2 + 1):
        L.append(f"    o{w} = ((aa * {k2} + {width - 1 + w}) % {width}) ^ 1")
    if mode == "decode":
        L += ["    mrow = (it + ii) < kt",
              "    tbase = ((it + ii) * nt + (jb + jj)) * " + str(width),
              "    if True:"]
        ind = "        "
    else:
        L += ["    t_lo = sp * split_tiles",
              "    t_hi = tl.minimum(t_lo + split_tiles, kt)",
              "    mm = tl.arange(0, BM)",
              "    rmask = mm < rows",
              "    xrow = xh_ptr + (row0 + mm).to(tl.int64)[:, None] * k",
              "    i16 = tl.arange(0, 16)[None, :] * 16"]
        if mode == "dot":
            L += ["    acc0 = tl.zeros([BM, TN * 8], dtype=tl.float32)",
                  "    acc1 = tl.zeros([BM, TN * 8], dtype=tl.float32)"]
        else:
            L += ["    acc0 = tl.zeros([TK, TN, 8], dtype=tl.float32)",
                  "    acc1 = tl.zeros([TK, TN, 8], dtype=tl.float32)"]
        L += ["    for it in range(t_lo, t_hi, TK):",
              "        mrow = (it + ii) < t_hi",
              "        tbase = ((it + ii) * nt + (jb + jj)) * " + str(width),
              "        xm = rmask[:, None] & ((it * 16 + i16) < t_hi * 16)"]
        ind = "        "
    for w in range(k2 + 1):
        L.append(f"{ind}w{w} = tl.load(tr_ptr + tbase + o{w}, mask=mrow, other=0).to(tl.uint32) & 0xFFFF")
    pairs_done: set[int] = set()
    xr_done: set[int] = set()
    for b in range(32):
        e = ((b + 1) * k2) >> 1
        u, o = e // 16, e % 16
        r, h = _row_half(b)
        if o == 0:
            L.append(f"{ind}s_ = w{u}")
        else:
            if u not in pairs_done:
                L.append(f"{ind}p{u} = (w{u} << 16) | w{u + 1}")
                pairs_done.add(u)
            L.append(f"{ind}s_ = (p{u} >> {16 - o}) & 0xFFFF")
        L += [ind + x for x in _codebook_lines(cb, "s_", "v_", asm)]
        if mode == "decode":
            L.append(f"{ind}dst = out_ptr + ((it + ii) * 16 + {r}).to(tl.int64) * n + (jb + jj) * 16 + {8 * h} + aa")
            L.append(f"{ind}tl.store(dst, v_, mask=mrow)")
        elif mode == "dot":
            if r not in xr_done:
                L.append(f"{ind}x{r} = tl.load(xrow + it * 16 + i16 + {r}, mask=xm, other=0.0)")
                xr_done.add(r)
            L.append(f"{ind}acc{h} = tl.dot(x{r}, tl.reshape(v_, [16, TN * 8]), acc{h})")
        else:
            if r not in xr_done:
                L.append(f"{ind}x{r} = tl.load(xh_ptr + row0.to(tl.int64) * k + (it + ii) * 16 + {r}, "
                         "mask=mrow, other=0.0).to(tl.float32)")
                xr_done.add(r)
            L.append(f"{ind}acc{h} += x{r} * v_.to(tl.float32)")
    if mode == "decode":
        return "\n".join(L) + "\n"
    # epilogue: rotated-basis partial (rows, TN*16) in natural column order -> fp32 atomic add.
    # The output Hadamard, svh and bias run in a separate pass (a fused one held a 128x128 H in
    # registers: 255 registers and spills on sm_90, see docs/gpu.md).
    L.append("    cc = tl.arange(0, TN * 16)")
    if mode == "dot":
        L += ["    a0 = tl.reshape(acc0, [BM, TN, 8])",
              "    a1 = tl.reshape(acc1, [BM, TN, 8])",
              "    out = tl.reshape(tl.permute(tl.join(a0, a1), (0, 1, 3, 2)), [BM, TN * 16])"]
    else:
        L += ["    a0 = tl.sum(acc0, axis=0)",
              "    a1 = tl.sum(acc1, axis=0)",
              "    out = tl.reshape(tl.permute(tl.join(a0, a1), (0, 2, 1)), [TN * 16])[None, :]",
              "    rmask = tl.arange(0, 1) < 1",
              "    mm = tl.arange(0, 1)"]
    L += ["    col = jb * 16 + cc",
          "    dst = y_ptr + (row0 + mm).to(tl.int64)[:, None] * n + col[None, :]",
          "    tl.atomic_add(dst, out, mask=rmask[:, None], sem='relaxed')"]
    return "\n".join(L) + "\n"

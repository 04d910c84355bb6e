"""A CPU mirror of exl3_decode_fold2 (kernels/csrc/exl3_gemv.cu, decode_fold2_body): the same lanes,
the same shared-memory addresses, the same butterflies and warp shuffles, in numpy. It checks what a
GPU run cannot show by itself: that the kernel computes diag(suh) · H · Ŵ · H · diag(svh) / 128 for a
128 x 128 block, that the second pass reads exactly what the first wrote, that no shared-memory
access has a bank conflict, and that every 16-byte store instruction writes whole 128-byte lines.
The layout constants and index expressions are read from the source, so the mirror follows an edit."""

from __future__ import annotations

import functools
import re
import sys

import numpy as np
import pytest

from tests.conftest import REPO

SRC = (REPO / "kernels" / "csrc" / "exl3_gemv.cu").read_text()
BODY = SRC[SRC.index("void decode_fold2_body("):]
BODY = BODY[:BODY.index("\n}\n")]                        # the kernel's body alone


def _source_expr(pattern: str, text: str = SRC) -> str:
    m = re.search(pattern, text)
    assert m, f"exl3_gemv.cu no longer has {pattern!r}: update the mirror with the kernel"
    return m.group(1)


LD = int(_source_expr(r"constexpr int F2_LD = (\d+);"))
F2_K = _source_expr(r"int f2_k\(int k\) \{\s*return (.+?);\s*\}")
KL = _source_expr(r"const int kl = (.+?);\n", BODY)    # the second pass: the lane's rows
NL = _source_expr(r"const int nl = (.+?);\n", BODY)    # and columns


@functools.lru_cache(maxsize=None)
def _code(expr: str):
    """``expr`` compiled once (eval of the string compiled it at each of ~50k calls a mirror run)."""
    return compile(expr, "<exl3_gemv.cu>", "eval")


def f2_k(k):
    return eval(_code(F2_K), {}, {"k": k})   # C integer arithmetic that is also Python's


def addr(n, k):
    return n * LD + f2_k(k)


def hadamard(m=128):
    h = np.array([[1.0]])
    while h.shape[0] < m:
        h = np.block([[h, h], [h, -h]])
    return h


def conflicts(word_addrs, lanes_per_phase):
    """The most wavefronts any phase of one warp instruction needs: word_addrs[lane] = its words."""
    worst = 1
    for p0 in range(0, 32, lanes_per_phase):
        banks = {}
        for lane in range(p0, p0 + lanes_per_phase):
            for w in word_addrs[lane]:
                banks.setdefault(w % 32, set()).add(w)
        worst = max(worst, max(len(a) for a in banks.values()))
    return worst


def bfly(a, b):
    return a + b, a - b


def run_mirror(w_hat, suh, svh):
    """W (k, n) as the kernel computes it, the worst bank conflict, and the store lines' check."""
    smem = np.full(128 * LD, np.nan)
    worst = 1
    # pass 1: warp w decodes k-tile w; lane (g, t) f[u][q][p] = Ŵ[16 w + 2 t + 8 (q & 1) + p, 16 u + 8 (q >> 1) + g]
    for warp in range(8):
        f = np.empty((32, 8, 4, 2))
        for lane in range(32):
            g, t = lane >> 2, lane & 3
            for u in range(8):
                for q in range(4):
                    for p in range(2):
                        f[lane, u, q, p] = w_hat[16 * warp + 2 * t + 8 * (q & 1) + p, 16 * u + 8 * (q >> 1) + g]
        # fold_n<false>: n bit 3 (q vs q + 2), n bits 4..6 (u vs u ^ s)
        f[:, :, [0, 1]], f[:, :, [2, 3]] = bfly(f[:, :, [0, 1]], f[:, :, [2, 3]])
        for s in (1, 2, 4):
            lo = [u for u in range(8) if not u & s]
            f[:, lo], f[:, [u + s for u in lo]] = bfly(f[:, lo], f[:, [u + s for u in lo]])
        # k bit 0 (p), then k bit 3 (q & 1)
        f[..., 0], f[..., 1] = bfly(f[..., 0], f[..., 1])
        f[:, :, [0, 2]], f[:, :, [1, 3]] = bfly(f[:, :, [0, 2]], f[:, :, [1, 3]])
        for u in range(8):
            for q in range(4):
                words = []
                for lane in range(32):
                    g, t = lane >> 2, lane & 3
                    a = (16 * u + 8 * (q >> 1) + g) * LD + f2_k(16 * warp + 2 * t + 8 * (q & 1))
                    assert a % 2 == 0                                   # float2 aligned
                    assert np.isnan(smem[a]) and np.isnan(smem[a + 1])
                    smem[a], smem[a + 1] = f[lane, u, q]
                    words.append((a, a + 1))
                worst = max(worst, conflicts(words, 16))                # 64-bit accesses: half-warps
    assert not np.isnan(smem[[addr(n, k) for n in range(128) for k in range(128)]]).any()
    # pass 2: v[a][h][e] = column nl + a, row kl + 64 h + e, two float4 loads a (a, h)
    v = np.empty((8, 32, 4, 2, 8))                                      # [warp, lane, a, h, e]
    for warp in range(8):
        for a in range(4):
            for h in range(2):
                for half in range(2):
                    words = []
                    for lane in range(32):
                        kl, nl = eval(_code(KL), {}, {"lane": lane}), eval(_code(NL), {}, {"lane": lane, "warp": warp})
                        w0 = (nl + a) * LD + f2_k(kl + 64 * h) + 16 * half
                        assert w0 % 4 == 0                              # float4 aligned
                        for e in range(4):
                            assert w0 + e == addr(nl + a, kl + 64 * h + 4 * half + e)
                        v[warp, lane, a, h, 4 * half:4 * half + 4] = smem[w0:w0 + 4]
                        words.append(tuple(range(w0, w0 + 4)))
                    worst = max(worst, conflicts(words, 8))             # 128-bit accesses: quarter-warps
    # k bits 1, 2 (e), 6 (h); n bits 0, 1 (a)
    for s in (2, 4):
        lo = [e for e in range(8) if not e & s]
        v[..., lo], v[..., [e + s for e in lo]] = bfly(v[..., lo], v[..., [e + s for e in lo]])
    v[..., 0, :], v[..., 1, :] = bfly(v[..., 0, :], v[..., 1, :])
    for s in (1, 2):
        lo = [a for a in range(4) if not a & s]
        v[:, :, lo], v[:, :, [a + s for a in lo]] = bfly(v[:, :, lo], v[:, :, [a + s for a in lo]])
    # across lanes: fmaf(sign, v, shfl_xor(v, m)), the sign -1 where lane & m
    for m in (2, 4, 8):
        other = v[:, np.arange(32) ^ m]
        sg = np.where(np.arange(32) & m, -1.0, 1.0)[None, :, None, None, None]
        v = sg * v + other
    w = np.full((128, 128), np.nan)
    lines_ok = True
    for warp in range(8):
        for h in range(2):
            for a in range(4):
                spans = []                                              # one 16-byte store a lane
                for lane in range(32):
                    kl, nl = eval(_code(KL), {}, {"lane": lane}), eval(_code(NL), {}, {"lane": lane, "warp": warp})
                    ks, n = kl + 64 * h + np.arange(8), nl + a
                    assert np.isnan(w[ks, n]).all()
                    w[ks, n] = v[warp, lane, a, h] * (svh[n] / 128) * suh[ks]
                    spans.append(2 * (n * 128 + kl + 64 * h))           # byte offset in a 128-column wt block
                lines = {}
                for b in spans:
                    lines.setdefault(b // 128, set()).add(b % 128)
                lines_ok &= all(offs == set(range(0, 128, 16)) for offs in lines.values())
    return w, worst, lines_ok


def test_fold2_computes_the_whole_weight_without_bank_conflicts():
    rng = np.random.default_rng(0)
    w_hat = rng.normal(size=(128, 128))
    suh, svh = rng.choice([-1.0, 1.0], 128) * rng.uniform(0.5, 1.5, 128), rng.normal(size=128)
    got, worst, lines_ok = run_mirror(w_hat, suh, svh)
    h = hadamard()
    want = suh[:, None] * (h @ w_hat @ h) * svh[None, :] / 128
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-10)
    assert worst == 1, f"a {worst}-way bank conflict"
    assert lines_ok, "a store instruction writes part of a 128-byte line"


def test_the_mirror_sees_a_wrong_layout(monkeypatch):
    """With k bits 3, 4 and 5, 6 trading places in a column's row (the second pass's float4 loads
    still contiguous) the loads conflict, and with a lane's k bits 3 and 4 swapped the result is
    wrong: both checks above can fail."""
    monkeypatch.setattr(sys.modules[__name__], "F2_K", "(k & 3) | ((k >> 3) & 12) | ((k & 4) << 2) | ((k << 2) & 0x60)")
    _, worst, _ = run_mirror(np.zeros((128, 128)), np.ones(128), np.ones(128))
    assert worst > 1
    monkeypatch.undo()
    monkeypatch.setattr(sys.modules[__name__], "KL", "8 * ((lane >> 1) & 1) + 16 * (lane & 1) + 32 * ((lane >> 3) & 1)")
    rng = np.random.default_rng(1)
    w_hat = rng.normal(size=(128, 128))
    got, _, _ = run_mirror(w_hat, np.ones(128), np.ones(128))
    h = hadamard()
    with pytest.raises(AssertionError):
        np.testing.assert_allclose(got, h @ w_hat @ h / 128, rtol=1e-6, atol=1e-6)


def test_the_launch_gives_the_kernel_its_shared_memory():
    from exl3tools.kernels import cuda_dense as cd

    assert cd.FOLD2_SMEM == 128 * LD * 4

"""A CPU mirror of exl3_decode_fold2s's three passes through shared memory (kernels/csrc/exl3_gemv.cu,
decode_fold2s_body): the same lanes, the same addresses with the same XOR swizzle, the same
butterflies, in numpy. It checks what a GPU run cannot show by itself: that the passes compute
diag(suh) · H · Ŵ · H · diag(svh) / 128 for a 128 x 128 block, that each pass reads exactly what the
one before wrote, and that no pass has a shared-memory bank conflict."""

from __future__ import annotations

import sys

import numpy as np

LD = 136                                   # F2_LD


def swz(n):
    return ((n >> 3) & 1) * 16 + ((n >> 2) & 1) * 4


def addr(n, k):
    return n * LD + (k ^ swz(n))


def hadamard(m=128):
    h = np.array([[1.0]])
    while h.shape[0] < m:
        h = np.block([[h, h], [h, -h]])
    return h


def butterflies(v, axis, bits):
    """Natural-order Hadamard butterflies over the given index bits of one axis: (x, y) -> (x + y, x - y)."""
    v = np.moveaxis(v, axis, 0).copy()
    for s in bits:
        for i in range(v.shape[0]):
            if not i & s:
                v[i], v[i + s] = v[i] + v[i + s], v[i] - v[i + s]
    return np.moveaxis(v, 0, axis)


def conflicts(word_addrs, lanes_per_phase):
    """The most wavefronts any phase of one warp instruction needs beyond the minimum:
    word_addrs[lane] = the 4-byte words the lane accesses."""
    worst = 1
    for p0 in range(0, 32, lanes_per_phase):
        banks = {}
        for lane in range(p0, p0 + lanes_per_phase):
            for w in word_addrs[lane]:
                banks.setdefault(w % 32, set()).add(w)
        worst = max(worst, max(len(a) for a in banks.values()))
    return worst


def run_mirror(w_hat, suh, svh):
    smem = np.full(128 * LD, np.nan)
    worst = 1
    # pass 1: warp w holds k-tile w; lane (g, t) f[u][q][p] = Ŵ[16 w + 2 t + 8 (q & 1) + p, 16 u + 8 (q >> 1) + g];
    # fold_n<false>: n bit 3 (q vs q + 2) and bits 4..6 (u) in registers
    for warp in range(8):
        f = np.empty((32, 8, 4, 2))
        for lane in range(32):
            g, t = lane >> 2, lane & 3
            for u in range(8):
                for q in range(4):
                    for p in range(2):
                        f[lane, u, q, p] = w_hat[16 * warp + 2 * t + 8 * (q & 1) + p, 16 * u + 8 * (q >> 1) + g]
        f[:, :, [0, 1]], f[:, :, [2, 3]] = f[:, :, [0, 1]] + f[:, :, [2, 3]], f[:, :, [0, 1]] - f[:, :, [2, 3]]
        f = butterflies(f, 1, (1, 2, 4))
        for u in range(8):
            for q in range(4):
                words = []
                for lane in range(32):
                    g, t = lane >> 2, lane & 3
                    n, kk = 16 * u + 8 * (q >> 1) + g, 16 * warp + 2 * t + 8 * (q & 1)
                    a = addr(n, kk)
                    assert a % 2 == 0                     # float2 aligned
                    assert np.isnan(smem[a]) and np.isnan(smem[a + 1])
                    smem[a], smem[a + 1] = f[lane, u, q, 0], f[lane, u, q, 1]
                    words.append((a, a + 1))
                worst = max(worst, conflicts(words, 16))  # 64-bit accesses: half-warps
    assert not np.isnan(smem[[addr(n, k) for n in range(128) for k in range(128)]]).any()
    # pass 2: thread (nh, kl) columns 8 nh + a, rows kl + 16 b; n bits 0..2, k bits 4..6
    out = {}
    for tid in range(256):
        kl, nh = tid & 15, tid >> 4
        v = np.array([[smem[addr(8 * nh + a, kl + 16 * b)] for b in range(8)] for a in range(8)])
        v = butterflies(butterflies(v, 0, (1, 2, 4)), 1, (1, 2, 4))
        out[tid] = v
    for a in range(8):
        for b in range(8):
            for warp in range(8):
                words = [(addr(8 * (tid >> 4) + a, (tid & 15) + 16 * b),) for tid in range(32 * warp, 32 * warp + 32)]
                worst = max(worst, conflicts(words, 32))
    for tid, v in out.items():
        kl, nh = tid & 15, tid >> 4
        for a in range(8):
            for b in range(8):
                smem[addr(8 * nh + a, kl + 16 * b)] = v[a, b]
    # pass 3: task -> column n, 16 rows from 16 seg (k bits 0..3), float4 loads, scaled by svh suh / 128
    w = np.full((128, 128), np.nan)
    for base in range(0, 1024, 32):               # one warp instruction: 32 consecutive tasks
        for j in range(4):
            words = []
            for task in range(base, base + 32):
                n, seg = (task & 7) + 8 * (task >> 6), (task >> 3) & 7
                a = addr(n, 16 * seg + 4 * j)
                assert a % 4 == 0                     # float4 aligned
                words.append(tuple(range(a, a + 4)))
            worst = max(worst, conflicts(words, 8))   # 128-bit accesses: quarter-warps
        for task in range(base, base + 32):
            n, seg = (task & 7) + 8 * (task >> 6), (task >> 3) & 7
            v = np.concatenate([smem[addr(n, 16 * seg + 4 * j):addr(n, 16 * seg + 4 * j) + 4] for j in range(4)])
            v = butterflies(v, 0, (1, 2, 4, 8))
            ks = 16 * seg + np.arange(16)
            assert np.isnan(w[ks, n]).all()
            w[ks, n] = v * svh[n] / 128 * suh[ks]
    return w, worst


def test_fold2s_passes_compute_the_whole_weight_without_bank_conflicts():
    rng = np.random.default_rng(0)
    w_hat = rng.normal(size=(128, 128))
    suh, svh = rng.choice([-1.0, 1.0], 128) * rng.uniform(0.5, 1.5, 128), rng.normal(size=128)
    got, worst = run_mirror(w_hat, suh, svh)
    h = hadamard()
    want = suh[:, None] * (h @ w_hat @ h) * svh[None, :] / 128
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-10)
    assert worst == 1, f"a {worst}-way bank conflict"


def test_the_mirror_sees_a_wrong_swizzle(monkeypatch):
    """Without the XOR the second pass's half-warps share banks: the check above can fail."""
    monkeypatch.setattr(sys.modules[__name__], "swz", lambda n: 0)
    _, worst = run_mirror(np.zeros((128, 128)), np.ones(128), np.ones(128))
    assert worst > 1

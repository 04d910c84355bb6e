"""Reference EXL3 decoder (numpy, vectorised): trellis -> Ŵ (rotated basis) -> W (original basis).

This is the executable form of exl3-format.md §5; every faster kernel is tested against it.
Ŵ is bit-exact (fp16). W is computed in float32 from Ŵ (the goldens are within ~9e-4 max|W|) by BLAS
GEMMs of one fixed shape (H · X with X 128 x 512, X · H with X 512 x 128, zero-padded), so every form
here (whole matrix, band by band, validate's tile stacks) gives the same bits on one machine: BLAS
kernels sum in an order that depends on the call's shape and an element's place in it. The GPU decoder
(kernels/gpu_decode.py) computes each Hadamard output as the float32 FMA chain over j = 0..127 in order
(``hadamard_chain``, exact and slow); the two are equal bit for bit where the host BLAS sums that way
(``blas_is_fma_chain()``: OpenBLAS's sgemm on some x86 cores) and within float32 rounding elsewhere.
Arrays follow the file layout: W and Ŵ are (in_features k, out_features n).
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

LOP3_AND, LOP3_XOR = np.uint32(0x8FFF8FFF), np.uint32(0x3B603B60)
MUL1_KAPPA = 1774 / 2**18          # fp16 0x1EEE
MUL1_BETA = -10.3828125            # fp16 0xC931
CHUNK_TILES = 4096                 # tiles decoded per numpy pass: bounds temporaries to ~10 MB
BAND_COLS = 512                    # decode_linear works on 128 x 512 bands: ~1 MB of buffers, in L2
H_BLOCK = BAND_COLS                # every Hadamard GEMM: (128,128)@(128,512) or (512,128)@(128,128)


# ------------------------------------------------------------------ pieces (unit-tested)
def perm() -> np.ndarray:
    """PERM[j] = tile_row_major index filled by trellis step j (§5.5)."""
    j = np.arange(256)
    L, e = j // 8, j % 8
    r = 2 * (L % 4) + (e & 1) + 8 * ((e >> 1) & 1)
    c = (L // 4) + 8 * (e >> 2)
    return 16 * r + c


def step_ends(width: int) -> np.ndarray:
    """S(t): ring position where the 16-bit window of step t ends (§5.3)."""
    k2 = width // 8
    return ((np.arange(256) + 1) * k2) >> 1


def ring_bit(u32: np.ndarray, p: int) -> int:
    """Ring bit p of one tile given its uint32 words (MSB-first within each word) (§5.2)."""
    return int((int(u32[p // 32]) >> (31 - p % 32)) & 1)


def tile_u32(words16: np.ndarray) -> np.ndarray:
    """Little-endian uint32 view of a tile's int16 words: u32[m] = w[2m] | w[2m+1] << 16."""
    w = np.asarray(words16).astype(np.int16).view(np.uint16).astype(np.uint32)
    return w[..., 0::2] | (w[..., 1::2] << np.uint32(16))


def state_slow(words16: np.ndarray, t: int) -> int:
    """The state of step t of one tile, bit by bit (the definition; used to test the fast path)."""
    width = len(words16)
    R = 16 * width
    u32 = tile_u32(words16)
    S = int(step_ends(width)[t])
    s = 0
    for q in range(16):
        s = (s << 1) | ring_bit(u32, (S - 16 + q) % R)
    return s


def _lop3_pair(x: np.ndarray) -> np.ndarray:
    x = (x & LOP3_AND) ^ LOP3_XOR
    lo = (x & np.uint32(0xFFFF)).astype(np.uint16).view(np.float16).astype(np.float32)
    hi = (x >> np.uint32(16)).astype(np.uint16).view(np.float16).astype(np.float32)
    return (lo + hi).astype(np.float16)  # exact sum in fp32, one RNE rounding to fp16


@lru_cache(maxsize=None)
def codebook_lut(codebook: str) -> np.ndarray:
    """fp16 value of every state 0..65535 for '3inst', 'mcg' or 'mul1' (§5.4)."""
    s = np.arange(65536, dtype=np.uint64)
    if codebook == "3inst":
        x = ((s * 89226354 + 64248484) & 0xFFFFFFFF).astype(np.uint32)
        lut = _lop3_pair(x)
    elif codebook == "mcg":
        x = ((s * 0xCBAC1FED) & 0xFFFFFFFF).astype(np.uint32)
        lut = _lop3_pair(x)
    elif codebook == "mul1":
        x = ((s * 0x83DCD12D) & 0xFFFFFFFF).astype(np.uint32)
        b = (x & 0xFF) + ((x >> 8) & 0xFF) + ((x >> 16) & 0xFF) + (x >> 24)
        lut = ((1024.0 + b.astype(np.float64)) * MUL1_KAPPA + MUL1_BETA).astype(np.float16)
    else:
        raise ValueError(f"unknown codebook {codebook!r}")
    lut.setflags(write=False)
    return lut


@lru_cache(maxsize=None)
def _gather_plan(width: int) -> tuple[np.ndarray, np.ndarray]:
    """For each tile element (row-major), the uint32 word index i1 and right shift of its state."""
    if width % 8 or not 16 <= width <= 128:
        raise ValueError(f"illegal trellis width {width}")
    R = 16 * width
    nw = width // 2
    e = step_ends(width) + R
    i1 = ((e - 1) // 32) % nw
    shift = ((e - 1) // 32 + 1) * 32 - e
    inv = np.empty(256, dtype=np.int64)
    inv[perm()] = np.arange(256)           # element -> step
    return i1[inv].astype(np.intp), shift[inv].astype(np.uint64)


def tile_states(trellis: np.ndarray) -> np.ndarray:
    """States of every tile element, row-major within the tile: (..., 256) uint32."""
    width = trellis.shape[-1]
    flat = np.ascontiguousarray(trellis).reshape(-1, width)
    u32 = tile_u32(flat).astype(np.uint64)
    # pairs[:, m] = u32[m-1] << 32 | u32[m]: the window ending in word m never needs more
    pairs = (np.roll(u32, 1, axis=1) << np.uint64(32)) | u32
    i1, shift = _gather_plan(width)
    states = (pairs[:, i1] >> shift[None, :]) & np.uint64(0xFFFF)
    return states.astype(np.uint32).reshape(*trellis.shape[:-1], 256)


# ------------------------------------------------------------------ decode
def decode_rotated(trellis: np.ndarray, codebook: str) -> np.ndarray:
    """Ŵ as fp16 (k, n) from an int16 trellis [k/16, n/16, W16]; bit-exact."""
    if trellis.ndim != 3:
        raise ValueError(f"trellis must be rank 3, got shape {trellis.shape}")
    kt, nt, width = trellis.shape
    lut = codebook_lut(codebook)
    i1, shift = _gather_plan(width)
    out = np.empty((kt * nt, 256), dtype=np.float16)
    flat = np.ascontiguousarray(trellis).reshape(-1, width)
    for a in range(0, kt * nt, CHUNK_TILES):
        u32 = tile_u32(flat[a:a + CHUNK_TILES]).astype(np.uint64)
        pairs = (np.roll(u32, 1, axis=1) << np.uint64(32)) | u32
        states = ((pairs[:, i1] >> shift[None, :]) & np.uint64(0xFFFF)).astype(np.intp)
        out[a:a + CHUNK_TILES] = lut[states]
    return out.reshape(kt, nt, 16, 16).transpose(0, 2, 1, 3).reshape(kt * 16, nt * 16)


@lru_cache(maxsize=None)
def hadamard128(dtype: str = "float32") -> np.ndarray:
    """Natural-order Sylvester H128 / sqrt(128): H[a, b] = (-1)^popcount(a & b) / sqrt(128)."""
    h = np.array([[1.0]])
    while h.shape[0] < 128:
        h = np.block([[h, h], [h, -h]])
    h = (h / np.sqrt(128.0)).astype(dtype)
    h.setflags(write=False)
    return h


def _h_left(x: np.ndarray, out: np.ndarray) -> None:
    """out = H · x for x (128, w), w <= H_BLOCK, through the one (128, 128) @ (128, H_BLOCK) GEMM."""
    h = hadamard128(x.dtype.name)
    w = x.shape[1]
    if w == H_BLOCK:
        np.matmul(h, x, out=out)
        return
    pad = np.zeros((128, H_BLOCK), x.dtype)
    pad[:, :w] = x
    out[...] = (h @ pad)[:, :w]


def _h_right(x: np.ndarray, out: np.ndarray) -> None:
    """out = x · H for x (r, 128), r <= H_BLOCK, through the one (H_BLOCK, 128) @ (128, 128) GEMM."""
    h = hadamard128(x.dtype.name)
    r = x.shape[0]
    if r == H_BLOCK:
        np.matmul(x, h, out=out)
        return
    pad = np.zeros((H_BLOCK, 128), x.dtype)
    pad[:r] = x
    out[...] = (pad @ h)[:r]


def _bands(k: int, n: int):
    """The (row, column) slices of the 128 x BAND_COLS bands every Hadamard here walks."""
    for c0 in range(0, n, BAND_COLS):
        for r0 in range(0, k, 128):
            yield slice(r0, r0 + 128), slice(c0, min(n, c0 + BAND_COLS))


def _per_band(x: np.ndarray, gemm) -> np.ndarray:
    """``gemm(band, out)`` on each contiguous 128 x <= BAND_COLS band of x, as decode_linear walks them."""
    k, n = x.shape
    out = np.empty((k, n), x.dtype)
    for rs, cs in _bands(k, n):
        band = np.ascontiguousarray(x[rs, cs])
        y = np.empty_like(band)
        gemm(band, y)
        out[rs, cs] = y
    return out


def had_rows(x: np.ndarray) -> np.ndarray:
    """H_k · x: Hadamard on each 128-row block (band by band, as decode_linear does it)."""
    return _per_band(x, _h_left)


def had_cols(x: np.ndarray) -> np.ndarray:
    """x · H_n: Hadamard on each 128-column block (band by band, as decode_linear does it)."""
    return _per_band(x, lambda band, y: _h_right(band.reshape(-1, 128), y.reshape(-1, 128)))


def hadamard_chain(x: np.ndarray, side: str) -> np.ndarray:
    """Exact float32 FMA chains, j = 0..127 in order from 0 (what the GPU decoder computes): H · x per
    128-row block (side "rows") or x · H per 128-column block ("cols"), x float32. Each product is
    exact in float64 and each step rounds once to float32 (float64 sum then float32 cast: a double
    rounding needs the float64 sum on a float32 midpoint with a nonzero remainder, i.e. a partial sum
    below 2^-29 of the next product; not seen). Python-speed: for tests and the BLAS probe."""
    x = np.asarray(x, np.float32)
    if side == "cols":
        return hadamard_chain(x.T, "rows").T
    k, n = x.shape
    h = hadamard128().astype(np.float64)
    blocks = x.reshape(k // 128, 128, n).astype(np.float64)
    acc = np.zeros((k // 128, 128, n), np.float32)
    for j in range(128):
        acc = (h[None, :, j:j + 1] * blocks[:, j:j + 1, :] + acc).astype(np.float32)
    return acc.reshape(k, n)


def rotate_out_chain(what: np.ndarray, suh: np.ndarray, svh: np.ndarray) -> np.ndarray:
    """rotate_out with hadamard_chain's exact FMA chains: the GPU decoder's W, bit for bit."""
    w = hadamard_chain(what.astype(np.float32), "rows") * suh.astype(np.float32)[:, None]
    return hadamard_chain(w, "cols") * svh.astype(np.float32)[None, :]


@lru_cache(maxsize=None)
def blas_is_fma_chain() -> bool:
    """Whether this host's BLAS computes both Hadamard GEMMs as in-order float32 FMA chains, so that
    decode_linear equals the GPU decoder bit for bit (else: within float32 rounding)."""
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((128, H_BLOCK)) * rng.choice([1e-3, 1.0, 30.0], (128, 1))).astype(np.float32)
    xt = x.T.copy()
    return bool(np.array_equal(had_rows(x), hadamard_chain(x, "rows"))
                and np.array_equal(had_cols(xt), hadamard_chain(xt, "cols")))


@lru_cache(maxsize=None)
def _lut32(codebook: str) -> np.ndarray:
    lut = codebook_lut(codebook).astype(np.float32)  # fp16 -> fp32 is exact
    lut.setflags(write=False)
    return lut


@lru_cache(maxsize=64)
def _band_plan(ct: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    """For a band of 8 x ct tiles, laid out as the (128, 16*ct) block of Ŵ it covers: the index of
    each element's word pair in the band's flattened (8*ct, width/2) pairs, and its right shift."""
    i1, shift = _gather_plan(width)
    a, r, j, c = np.ix_(np.arange(8), np.arange(16), np.arange(ct), np.arange(16))
    e = 16 * r + c                                              # element within its tile
    idx = ((a * ct + j) * (width // 2) + i1[e]).reshape(128, 16 * ct).astype(np.intp)
    sh = np.broadcast_to(shift[e], (8, 16, ct, 16)).reshape(128, 16 * ct).astype(np.uint64)
    idx.setflags(write=False)
    sh.setflags(write=False)
    return idx, sh


def _rotate_band(x: np.ndarray, su: np.ndarray, sv: np.ndarray, tmp: np.ndarray, out: np.ndarray) -> None:
    """out = diag(su) · H · x · H_n · diag(sv) for one 128 x <= BAND_COLS band x (float32, clobbered):
    the same GEMM calls on the same data as had_rows, * suh, had_cols, * svh on the whole matrix."""
    _h_left(x, tmp)
    tmp *= su[:, None]
    _h_right(tmp.reshape(-1, 128), x.reshape(-1, 128))
    np.multiply(x, sv[None, :], out=out)


def _check_dims(k: int, n: int, suh: np.ndarray, svh: np.ndarray) -> None:
    if k % 128 or n % 128:
        raise ValueError(f"W is {k} x {n}: both dims must be multiples of 128")
    if suh.shape != (k,) or svh.shape != (n,):
        raise ValueError(f"W is {k} x {n}, but suh {suh.shape} / svh {svh.shape}")


def rotate_out(what: np.ndarray, suh: np.ndarray, svh: np.ndarray) -> np.ndarray:
    """W = diag(suh) · H_k · Ŵ · H_n · diag(svh), float32 (k, n), band by band (bounded temporaries)."""
    k, n = what.shape
    _check_dims(k, n, suh, svh)
    su, sv = suh.astype(np.float32), svh.astype(np.float32)
    out = np.empty((k, n), np.float32)
    for c0 in range(0, n, BAND_COLS):
        c1 = min(n, c0 + BAND_COLS)
        tmp = np.empty((128, c1 - c0), np.float32)
        for r0 in range(0, k, 128):
            x = what[r0:r0 + 128, c0:c1].astype(np.float32)
            _rotate_band(x, su[r0:r0 + 128], sv[c0:c1], tmp, out[r0:r0 + 128, c0:c1])
    return out


def decode_linear(trellis: np.ndarray, suh: np.ndarray, svh: np.ndarray, codebook: str) -> np.ndarray:
    """Original-basis W, float32 (k, n) = (in, out); the HF weight is ``W.T[:out_real, :in_real]``.

    Equal bit for bit to ``rotate_out(decode_rotated(trellis, codebook), suh, svh)``, but fused: each
    128 x BAND_COLS band goes trellis -> states -> fp32 values -> rotated while it sits in cache.
    """
    if trellis.ndim != 3:
        raise ValueError(f"trellis must be rank 3, got shape {trellis.shape}")
    kt, nt, width = trellis.shape
    k, n = 16 * kt, 16 * nt
    _check_dims(k, n, suh, svh)
    _gather_plan(width)                                        # rejects an illegal width
    words = np.asarray(trellis).astype(np.int16, copy=False).view(np.uint16)
    lut = _lut32(codebook)
    su, sv = suh.astype(np.float32), svh.astype(np.float32)
    out = np.empty((k, n), np.float32)
    for c0 in range(0, n, BAND_COLS):
        c1 = min(n, c0 + BAND_COLS)
        idx, sh = _band_plan((c1 - c0) // 16, width)
        g = np.empty(idx.shape, np.uint64)
        x, tmp = np.empty(idx.shape, np.float32), np.empty(idx.shape, np.float32)
        for r0 in range(0, k, 128):
            w = words[r0 // 16:r0 // 16 + 8, c0 // 16:c1 // 16].astype(np.uint32)
            u32 = (w[..., 0::2] | (w[..., 1::2] << np.uint32(16))).astype(np.uint64).reshape(-1, width // 2)
            pairs = (np.roll(u32, 1, axis=1) << np.uint64(32)) | u32   # as in decode_rotated
            np.take(pairs.reshape(-1), idx, out=g, mode="clip")        # "clip": no bounds-check copy
            np.right_shift(g, sh, out=g)
            np.bitwise_and(g, np.uint64(0xFFFF), out=g)
            np.take(lut, g.view(np.int64), out=x, mode="clip")
            _rotate_band(x, su[r0:r0 + 128], sv[c0:c1], tmp, out[r0:r0 + 128, c0:c1])
    return out


def rotated_from_weight(w: np.ndarray, suh: np.ndarray, svh: np.ndarray) -> np.ndarray:
    """Invert rotate_out: Ŵ = H · diag(1/suh) · W · diag(1/svh) · H (zero where svh == 0)."""
    w = w.astype(np.float64)
    su = suh.astype(np.float64)
    sv = svh.astype(np.float64)
    inv_sv = np.divide(1.0, sv, out=np.zeros_like(sv), where=sv != 0)
    x = (w / su[:, None]) * inv_sv[None, :]
    x = had_rows(x)
    return had_cols(x)

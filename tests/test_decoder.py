"""The reference decoder is the spec: pieces for every K, and every fixture linear vs its golden."""

from __future__ import annotations

import numpy as np
import pytest
from exl3tools.kernels import reference as ref
from safetensors.numpy import load_file

from exl3tools.checkpoint import Checkpoint
from exl3tools.exl3 import HALF_WIDTHS, k_from_width, pack_signs, unpack_signs, width_from_k
from exl3tools.layout import scan
from tests.conftest import DEMO, FIXTURE_NAMES, fixture_dir

ALL_WIDTHS = sorted([16 * k for k in range(1, 9)] + [24, 40, 56])  # K 1..8, 1.5, 2.5, 3.5


# ------------------------------------------------------------------ pieces
def test_perm_is_bijection_with_documented_prefix():
    p = ref.perm()
    assert sorted(p.tolist()) == list(range(256))
    assert p[:8].tolist() == [0, 16, 128, 144, 8, 24, 136, 152]
    assert p[8:16].tolist() == [32, 48, 160, 176, 40, 56, 168, 184]


@pytest.mark.parametrize("width", ALL_WIDTHS)
def test_step_ends_consume_the_whole_ring(width):
    s = ref.step_ends(width)
    assert s[-1] == 16 * width  # S(255) = R: every bit consumed exactly once
    d = np.diff(np.concatenate([[0], s]))
    k = k_from_width(width)
    if width in HALF_WIDTHS:  # even steps KA bits, odd steps KA+1 (mask 0xAAAA)
        ka = int(k)
        assert d[0::2].tolist() == [ka] * 128 and d[1::2].tolist() == [ka + 1] * 128
    else:
        assert set(d.tolist()) == {int(k)}


def test_ring_bit_order_is_msb_first_le_uint32():
    w = np.zeros(16, dtype=np.int16)
    w[1] = np.int16(-32768)  # bit 15 of word 1 = MSB of u32[0] = ring bit 0
    u = ref.tile_u32(w)
    assert ref.ring_bit(u, 0) == 1 and sum(ref.ring_bit(u, p) for p in range(256)) == 1
    w[:] = 0
    w[0] = 1  # LSB of word 0 = LSB of u32[0] = ring bit 31
    assert ref.ring_bit(ref.tile_u32(w), 31) == 1


@pytest.mark.parametrize("width", ALL_WIDTHS)
def test_fast_states_equal_bitwise_definition(width):
    rng = np.random.default_rng(width)
    tile = rng.integers(-32768, 32768, size=width, dtype=np.int16)
    fast = ref.tile_states(tile[None, :])[0]  # tile row-major order
    slow = np.array([ref.state_slow(tile, t) for t in range(256)])  # step order
    assert (fast[ref.perm()] == slow).all()


def test_state_window_is_tail_biting():
    # K=2: the first step's window is the last 14 bits of the ring followed by the first 2.
    width = 32
    tile = np.zeros(width, dtype=np.int16)
    tile[-2] = 1  # u32[15] LSB = ring bit 511, the last bit of the ring
    assert ref.state_slow(tile, 0) == 1 << 2


def test_codebook_values_and_statistics():
    lut = {cb: ref.codebook_lut(cb).astype(np.float64) for cb in ("3inst", "mcg", "mul1")}
    assert abs(lut["3inst"].std() - 1.2437) < 1e-3
    assert abs(lut["mcg"].std() - 1.2441) < 1e-3
    assert abs(lut["mul1"].std() - 1.0003) < 1e-3 and abs(lut["mul1"].mean() + 0.0019) < 1e-3
    for cb in ("3inst", "mcg"):
        assert np.abs(lut[cb]).max() < 4 and np.isfinite(lut[cb]).all()
    # MUL1 state 0: x = 0, byte sum 0 -> fp16(1024 * kappa + beta)
    assert lut["mul1"][0] == np.float16(1024 * 1774 / 2**18 - 10.3828125)
    # 3INST state 0: x = LOP3(64248484)
    x = (64248484 & 0x8FFF8FFF) ^ 0x3B603B60
    lo = np.array([x & 0xFFFF], np.uint16).view(np.float16)[0]
    hi = np.array([x >> 16], np.uint16).view(np.float16)[0]
    assert lut["3inst"][0] == np.float16(np.float32(lo) + np.float32(hi))


@pytest.mark.parametrize("codebook", ["3inst", "mcg", "mul1"])
@pytest.mark.parametrize("width", ALL_WIDTHS)
def test_decode_rotated_matches_definition(codebook, width):
    rng = np.random.default_rng(width * 7 + len(codebook))
    tr = rng.integers(-32768, 32768, size=(2, 3, width), dtype=np.int16)
    what = ref.decode_rotated(tr, codebook)
    assert what.shape == (32, 48) and what.dtype == np.float16
    lut, p = ref.codebook_lut(codebook), ref.perm()
    for i in range(2):
        for j in range(3):
            tile = np.empty(256, np.float16)
            tile[p] = lut[[ref.state_slow(tr[i, j], t) for t in range(256)]]
            assert (what[16 * i:16 * i + 16, 16 * j:16 * j + 16] == tile.reshape(16, 16)).all()


def test_hadamard_is_orthonormal_and_rotation_inverts():
    h = ref.hadamard128("float64")
    assert np.allclose(h @ h.T, np.eye(128))
    rng = np.random.default_rng(0)
    what = rng.standard_normal((256, 384)).astype(np.float16)
    suh = rng.choice([-1, 1], 256) * rng.uniform(0.5, 2, 256)
    svh = rng.choice([-1, 1], 384) * rng.uniform(0.5, 2, 384)
    w = ref.rotate_out(what, suh.astype(np.float16), svh.astype(np.float16))
    back = ref.rotated_from_weight(w, suh.astype(np.float16), svh.astype(np.float16))
    assert np.abs(back - what.astype(np.float64)).max() < 1e-4


def test_bitrate_widths_roundtrip():
    for w in ALL_WIDTHS:
        assert width_from_k(k_from_width(w)) == w
    assert k_from_width(72) is None and k_from_width(20) is None
    with pytest.raises(ValueError):
        width_from_k(4.5)


def test_legacy_sign_packing_roundtrip():
    rng = np.random.default_rng(1)
    signs = rng.choice([-1.0, 1.0], 256).astype(np.float16)
    assert (unpack_signs(pack_signs(signs)) == signs).all()
    assert unpack_signs(np.array([1], np.int16))[0] == -1 and unpack_signs(np.array([1], np.int16))[1] == 1


@pytest.mark.parametrize("width", [32, 40, 64])
def test_128_aligned_slices_decode_exactly(width):
    rng = np.random.default_rng(width)
    tr = rng.integers(-32768, 32768, size=(16, 24, width), dtype=np.int16)  # 256 x 384
    suh = (rng.choice([-1, 1], 256) * rng.uniform(0.5, 2, 256)).astype(np.float16)
    svh = (rng.choice([-1, 1], 384) * rng.uniform(0.5, 2, 384)).astype(np.float16)
    full = ref.decode_linear(tr, suh, svh, "mul1")
    col = ref.decode_linear(tr[:, 8:16], suh, svh[128:256], "mul1")
    row = ref.decode_linear(tr[8:16], suh[128:256], svh, "mul1")
    # Ŵ of a slice is bit-identical; W equal up to float32 summation order
    assert np.array_equal(ref.decode_rotated(tr[:, 8:16], "mul1"), ref.decode_rotated(tr, "mul1")[:, 128:256])
    assert np.allclose(col, full[:, 128:256], rtol=0, atol=1e-5) and np.allclose(row, full[128:256], rtol=0, atol=1e-5)


def _whole_matrix_w(what, suh, svh):
    """The pre-issue-15 decode_linear (whole-matrix Hadamards): the oracle for the banded one."""
    w = ref.had_rows(what.astype(np.float32))
    w *= suh.astype(np.float32)[:, None]
    w = ref.had_cols(w)
    w *= svh.astype(np.float32)[None, :]
    return w


@pytest.mark.parametrize("kt,nt,width,codebook", [
    (8, 8, 48, "3inst"), (16, 72, 40, "mul1"), (24, 40, 64, "mcg"), (8, 200, 16, "mul1"),
    (32, 8, 128, "mcg"), (16, 96, 56, "mul1")])  # n below, at and past BAND_COLS, uneven last band
def test_fused_decode_linear_is_bit_identical_to_whole_matrix_form(kt, nt, width, codebook):
    rng = np.random.default_rng(kt * nt + width)
    tr = rng.integers(-32768, 32768, size=(kt, nt, width), dtype=np.int16)
    suh = rng.standard_normal(16 * kt).astype(np.float16)
    svh = rng.standard_normal(16 * nt).astype(np.float16)
    want = _whole_matrix_w(ref.decode_rotated(tr, codebook), suh, svh)
    assert np.array_equal(ref.decode_linear(tr, suh, svh, codebook), want)
    assert np.array_equal(ref.rotate_out(ref.decode_rotated(tr, codebook), suh, svh), want)
    # a strided, big-endian trellis (what a column slice of a file can be) decodes the same
    wide = np.concatenate([tr, tr], axis=1)[:, :nt].astype(">i2")
    assert np.array_equal(ref.decode_linear(wide, suh, svh, codebook), want)


def test_decode_linear_rejects_bad_shapes():
    tr = np.zeros((8, 8, 48), np.int16)
    with pytest.raises(ValueError):
        ref.decode_linear(tr, np.ones(64, np.float16), np.ones(128, np.float16), "mul1")
    with pytest.raises(ValueError):
        ref.decode_linear(tr[:4], np.ones(64, np.float16), np.ones(128, np.float16), "mul1")
    with pytest.raises(ValueError):
        ref.decode_linear(np.zeros((8, 8, 20), np.int16), np.ones(128, np.float16), np.ones(128, np.float16), "mul1")


def test_hadamard_chain_is_the_sequential_fp32_fma_chain():
    """hadamard_chain (what the GPU decoder computes): each output is fma(h[a, j], x[j], acc) for
    j = 0..127 in order, from 0; the oracle rounds once per step from an exact long double product."""
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((256, 256)) * rng.choice([1e-3, 1.0, 30.0], (256, 1))).astype(np.float32)
    h = ref.hadamard128().astype(np.longdouble)
    def chain(a, b):  # (m, 128) @ (128, n); a * b exact in longdouble, one rounding per step
        acc = np.zeros((a.shape[0], b.shape[1]), np.float32)
        for j in range(128):
            acc = (a[:, j:j + 1].astype(np.longdouble) * b[j:j + 1, :] + acc).astype(np.float32)
        return acc
    rows = np.concatenate([chain(h, x[i:i + 128]) for i in (0, 128)])
    assert np.array_equal(ref.hadamard_chain(x, "rows"), rows)
    cols = chain(x.reshape(-1, 128), h).reshape(256, 256)
    assert np.array_equal(ref.hadamard_chain(x, "cols"), cols)


def test_blas_hadamards_equal_the_chain_where_the_probe_says_so():
    """had_rows / had_cols (BLAS) equal the FMA chain bit for bit where blas_is_fma_chain() (then CPU
    and GPU W are the same bits), else within float32 rounding; the probe agrees with fresh data."""
    rng = np.random.default_rng(9)
    x = (rng.standard_normal((384, 1152)) * rng.choice([1e-3, 1.0, 30.0], (384, 1))).astype(np.float32)
    for got, want in ((ref.had_rows(x), ref.hadamard_chain(x, "rows")),
                      (ref.had_cols(x), ref.hadamard_chain(x, "cols"))):
        if ref.blas_is_fma_chain():
            assert np.array_equal(got, want)
        else:
            assert np.allclose(got, want, rtol=2e-6, atol=1e-6 * np.abs(want).max())


# ------------------------------------------------------------------ fixtures
def _check_checkpoint(model_dir, goldens_path, samples_path=None):
    ck = Checkpoint.open(model_dir)
    sc = scan({n: (r.dtype, r.shape) for n, r in ck.tensors.items()})
    golden = load_file(str(goldens_path))
    samples = load_file(str(samples_path)) if samples_path and samples_path.is_file() else {}
    worst, worst_key, worst_hat, checked = 0.0, "", 0.0, 0
    for p, lin in sc.linears.items():
        tr = ck.read_numpy(f"{p}.trellis")
        suh, svh = ck.read_numpy(f"{p}.suh"), ck.read_numpy(f"{p}.svh")
        what = ref.decode_rotated(tr, lin.codebook)
        w = ref.decode_linear(tr, suh, svh, lin.codebook)
        assert np.array_equal(w, _whole_matrix_w(what, suh, svh)), p
        if p in golden:
            g = golden[p].astype(np.float32)
            assert g.shape == w.shape, p
            err = float(np.abs(w - g).max() / np.abs(g).max())
            back = ref.rotated_from_weight(g, suh, svh)
            cols = svh != 0
            err_hat = float(np.abs(back[:, cols] - what[:, cols]).max())
            worst_hat = max(worst_hat, err_hat)
            checked += 1
        elif f"{p}.idx" in samples:
            idx, val = samples[f"{p}.idx"], samples[f"{p}.val"].astype(np.float32)
            err = float(np.abs(w.reshape(-1)[idx] - val).max() / max(np.abs(val).max(), 1e-12))
            checked += 1
        else:
            continue
        if err > worst:
            worst, worst_key = err, p
    return checked, len(sc.linears), worst, worst_key, worst_hat


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_every_linear_matches_goldens(name, record_property):
    d = fixture_dir(name)
    checked, total, worst, key, worst_hat = _check_checkpoint(
        d / "model", d / "goldens_weights.safetensors", d / "goldens_weights_samples.safetensors")
    record_property("worst_rel_err", worst)
    print(f"{name}: {checked}/{total} linears, worst {worst:.2e} x max|W| ({key}), W_hat {worst_hat:.4f}")
    assert checked == total, "every EXL3 linear must be checked against a golden or its samples"
    assert worst <= 1e-3, f"{key}: {worst:.2e} x max|W|"
    assert worst_hat <= 0.0035  # fp16 rounding of the golden; one wrong state is O(1)


def test_demo_checkpoint_matches_shipped_goldens():
    checked, total, worst, _, worst_hat = _check_checkpoint(DEMO / "model", DEMO / "goldens_weights.safetensors")
    assert checked == total == 63 and worst <= 1e-3 and worst_hat <= 0.0035

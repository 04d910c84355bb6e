"""MLA's absorbed products with fp16 W_UK / W_UV (kernels/mla_absorb.py, the mla_w16 preview:
EXL3TOOLS_MLA_W16=1): the kernel (Triton's interpreter on the CPU) against the float32 einsum of
the widened weights, strided rows and both layouts; and the DeepSeek-V3 and GLM-5 fixtures' logits
through prompts, the fixed-shape decode step and DSA's selection with the weights held in fp16,
against the float32 path."""

from __future__ import annotations

import pytest
import torch

from tests.test_fused_decode import _interpret


@pytest.mark.parametrize(("T", "H", "K", "M", "transpose"), [
    (1, 2, 128, 512, False),     # a decode row: the queries' nope part into the latent
    (1, 2, 512, 128, True),      # the latent output back to the value heads (W_UV read transposed)
    (1, 3, 70, 33, True),        # ragged k and m in the one-row kernel
    (8, 2, 128, 96, False),      # decode rows of 8 streams: the dot kernel's 16-row block
    (17, 3, 70, 33, False),      # ragged k and m, past the small row block
    (40, 2, 96, 72, True),
    (0, 2, 32, 64, False),
    (1, 2, 96, 40, "m"),         # W_UV read transposed from (H, K, M) storage (mla_w16_vt): m contiguous
    (8, 2, 96, 40, "m"),
])
def test_absorb_equals_the_widened_einsum(T, H, K, M, transpose):
    _interpret()
    from exl3tools.kernels import mla_absorb

    g = torch.Generator().manual_seed(T * 131 + K)
    if transpose == "m":
        w = torch.randn(H, K, M + 24, generator=g).half()[..., :M].transpose(1, 2)   # (H, M, K), m stride 1
        transpose = True
    else:
        w = torch.randn((H, M, K) if transpose else (H, K, M), generator=g).half()
    a = torch.randn(T, H, K + 16, generator=g)[..., 8:K + 8]         # a strided view, as q[..., :nope]
    got, want = mla_absorb.absorb(a, w, transpose), mla_absorb.absorb_reference(a, w, transpose)
    assert got.shape == want.shape == (T, H, M) and got.dtype == torch.float32
    if T:
        assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()
    with pytest.raises(ValueError, match="absorb"):
        mla_absorb.absorb(a.half(), w, transpose)                     # float32 rows only
    with pytest.raises(ValueError, match="absorb"):
        mla_absorb.absorb(a, w, not transpose)                        # k of the other layout


@pytest.mark.parametrize("transpose", [False, True, "m"])
def test_the_row_kernel_a_program_per_row_equals_the_widened_einsum(transpose):
    """The row kernel at several rows (``row_rows``: a program per row, bench/gpu_mla_absorb.py
    --sweep's "row"): each row's sums over strided rows and both layouts as the einsum's."""
    _interpret()
    from exl3tools.kernels import mla_absorb

    g = torch.Generator().manual_seed(5)
    T, H, K, M = 5, 3, 70, 33
    if transpose == "m":
        w = torch.randn(H, K, M, generator=g).half().transpose(1, 2)      # (H, M, K), m stride 1
    else:
        w = torch.randn((H, M, K) if transpose else (H, K, M), generator=g).half()
    a = torch.randn(T, H, K + 16, generator=g)[..., 8:K + 8]
    tr = bool(transpose)
    got, want = mla_absorb.absorb(a, w, tr, row_rows=8), mla_absorb.absorb_reference(a, w, tr)
    assert got.shape == want.shape == (T, H, M)
    assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()
    assert torch.equal(got[2:3], mla_absorb.absorb(a[2:3], w, tr))      # a row's sums whatever the rows beside it


def test_the_dot_precision_diagnostic_reads_ieee_tf32x3_or_tf32x2():
    """EXL3TOOLS_MLA_ABSORB_DOT: unset is each row block's own (tf32x3 for a decode step's block,
    IEEE float32 for 64 rows), ieee, tf32x3 and tf32x2 are taken, anything else a UsageError naming the
    variable (cli/serve.py reads it before loading: tests/test_server_cli.py)."""
    from exl3tools.kernels import mla_absorb

    from exl3tools.errors import UsageError

    assert mla_absorb._dot_precision(None) is mla_absorb._dot_precision("") is None
    assert mla_absorb.DOT_BY_BLOCK == {True: "tf32x3", False: "ieee"}
    assert mla_absorb._dot_precision("ieee") == "ieee"
    assert mla_absorb._dot_precision("tf32x3") == "tf32x3"
    assert mla_absorb._dot_precision("tf32x2") == "tf32x2"
    with pytest.raises(UsageError, match="EXL3TOOLS_MLA_ABSORB_DOT='tf32'"):
        mla_absorb._dot_precision("tf32")


@pytest.mark.parametrize(("T", "K", "tile"), [
    (8, 96, (64, 32, 4, 2)),      # k in two splits of 48 -> 64: the second split's k past K masked
    (5, 70, (32, 16, 4, 4)),      # ragged k: four splits of 32 (the last 6 wide)
    (3, 64, (64, 32, 4, 8)),      # more splits asked than k-steps: two of 32
    (20, 64, (64, 32, 4, 4)),     # past SMALL_ROWS the tile (and its splits) is not taken
])
@pytest.mark.parametrize("transpose", [False, True])
def test_absorb_in_k_splits_equals_the_widened_einsum(T, K, tile, transpose):
    """The dot kernel's k splits (decode rows of several streams, bench/gpu_mla_absorb.py
    --sweep): each program sums its part of k into a plane of partials, torch.sum adds them."""
    _interpret()
    from exl3tools.kernels import mla_absorb

    g = torch.Generator().manual_seed(T * 7 + K)
    H, M = 2, 40
    w = torch.randn((H, M, K) if transpose else (H, K, M), generator=g).half()
    a = torch.randn(T, H, K, generator=g)
    got, want = mla_absorb.absorb(a, w, transpose, tile=tile), mla_absorb.absorb_reference(a, w, transpose)
    assert got.shape == want.shape == (T, H, M)
    assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()
    assert (got - mla_absorb.absorb(a, w, transpose, tile=tile)).abs().max().item() == 0   # deterministic


# (deepseek_v3 with v_rows False: the same absorbed() calls in that layout as GLM-5's case, which runs
# MLA's dense path too (its prompts of <= index_topk tokens); dense decode in fp16: the True case)
@pytest.mark.parametrize(("name", "v_rows"), [("glm5_moe_dsa-3.0bpw-mul1", False),
                                             ("deepseek_v3-3.0bpw-3inst", True)])   # mla_w16_vt: V padded, rows of v
def test_fp16_absorption_gives_the_float32_logits(name, v_rows, monkeypatch):
    """Prompts (the eager path's absorbed queries and outputs), then decode steps through the
    fixed-shape step (GLM-5 selecting past its index_topk of 32) with W_UK / W_UV held in fp16:
    the float32 path's logits within summation-order noise, and the layers' weights in fp16."""
    _interpret()
    from exl3tools.runtime.mla import MLAttention
    from tests.test_mla_static_decode import STEPS, _model, _rel, _run

    # two batches of three decode rows, not six: each step costs ~1-2.5 s of the interpreter whatever
    # its rows, and every row reads W_UK / W_UV the same way; "a" (40 tokens) selects past GLM-5's
    # index_topk from the first step, "c" stays dense, the batches of one and two rows follow (the
    # dense -> sparse switch of "b" at step 4 is the static step's, test_mla_static_decode.py's)
    steps = STEPS[:2]
    monkeypatch.delenv("EXL3TOOLS_MLA_W16", raising=False)
    want = _run(_model(name), name, "static", steps=steps)
    model = _model.__wrapped__(name)          # a model of its own: its weights become fp16
    monkeypatch.setenv("EXL3TOOLS_MLA_W16", "1")
    monkeypatch.setenv("EXL3TOOLS_MLA_W16_VT", "1" if v_rows else "0")
    got = _run(model, name, "static", steps=steps)
    attns = [layer.attn for layer in model.layers if isinstance(layer.attn, MLAttention)]
    assert attns and all(a.w_uk.dtype == a.w_uv.dtype == torch.float16 for a in attns)
    assert all((a.w_uv.stride(1) == 1) == v_rows for a in attns)
    errs = [_rel(g, w) for g, w in zip(got, want, strict=True)]
    assert max(errs) < 1e-5, errs


@pytest.mark.parametrize("v_rows", [False, True])
def test_fp16_weights_are_never_rebound_by_a_decompression(monkeypatch, v_rows):
    """With fp16 W_UK / W_UV the decompression's copies (W_K's layout, W_UV padded) are made when
    the weights move (MLAttention._to) and W_UK / W_UV are views of them; a prompt decompressing
    K/V in fp16 afterwards reads those and never rebinds W_UK / W_UV: a decode graph captured
    before it reads them by address (rebinding freed what the graphs read: NaN logits on the H100,
    2026-12-07 13:23). The fp16 decompression equals the float32 one within fp16 rounding."""
    _interpret()
    from exl3tools.runtime.mla import MLAttention
    from tests.test_mla_static_decode import _model

    monkeypatch.setenv("EXL3TOOLS_MLA_W16", "1")
    monkeypatch.setenv("EXL3TOOLS_MLA_W16_VT", "1" if v_rows else "0")
    a = next(layer.attn for layer in _model.__wrapped__("deepseek_v3-3.0bpw-3inst").layers
             if isinstance(layer.attn, MLAttention))
    w_uv32 = a.w_uv.clone()
    a._to(torch.device("cpu"))
    w_uk, w_uv = a.w_uk, a.w_uv
    assert w_uk.dtype == torch.float16 and a._w16 is not None
    assert w_uv.data_ptr() == a._w16[2].data_ptr() and a._w16[2].shape[1] == a.nope + a.rope   # V padded
    assert torch.equal(w_uv.float(), w_uv32.half().float())         # kv_b's values, in either layout
    assert (w_uv.stride(1) == 1) == v_rows                          # mla_w16_vt: v contiguous
    g = torch.Generator().manual_seed(0)
    n, L = 5, 9
    q = torch.randn(1, a.nh, n, a.nope + a.rope, generator=g)
    c, r = torch.randn(1, L, a.kv_lora, generator=g), torch.randn(1, L, a.rope, generator=g)
    outs = {}
    for dt in (torch.float16, torch.float32):
        o = torch.zeros(1, n, a.nh, a.vd)
        a._sdpa_decompressed(q.to(dt), c.to(dt), r.to(dt), None, lambda h, x, o=o: o[:, :, h].copy_(x.float()))
        outs[dt] = o
        assert a.w_uk is w_uk and a.w_uv is w_uv
    assert (outs[torch.float16] - outs[torch.float32]).abs().max().item() < 2e-2 * outs[torch.float32].abs().max().item()
    if v_rows:     # the (H, C, v) storage's decompression: the (H, v, C) layout's fp16 output
        a._w16 = a._decompress_weights(torch.device("cpu"), torch.float16)
        o = torch.zeros(1, n, a.nh, a.vd)
        a._sdpa_decompressed(q.half(), c.half(), r.half(), None, lambda h, x: o[:, :, h].copy_(x.float()))
        assert (o - outs[torch.float16]).abs().max().item() <= 2e-3 * o.abs().max().item()


@pytest.mark.parametrize("transpose", [False, True])
def test_past_wide_rows_the_product_is_the_widened_einsum(transpose, monkeypatch):
    """A prompt's rows (more than WIDE_ROWS) take the float32 path's own arithmetic, the weights
    widened for one einsum, exactly; up to WIDE_ROWS the kernel (its sums in another order)."""
    _interpret()
    from exl3tools.kernels import mla_absorb

    g = torch.Generator().manual_seed(11)
    H, K, M = 2, 48, 40
    w = torch.randn((H, M, K) if transpose else (H, K, M), generator=g).half()
    a = torch.randn(20, H, K, generator=g)
    want = mla_absorb.absorb_reference(a, w, transpose)
    assert torch.equal(mla_absorb.absorb(a, w, transpose, wide_rows=19), want)
    calls = []
    monkeypatch.setattr(mla_absorb, "absorb_reference", lambda *x: calls.append(x) or want)
    got = mla_absorb.absorb(a, w, transpose, wide_rows=20)
    assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()
    mla_absorb.absorb(a, w, transpose)                  # 20 rows: under the default's 64, the kernel
    assert not calls and mla_absorb.WIDE_ROWS == 64


@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize(("precision", "wide_tile"), [
    ("tf32x2", None),                 # the default 64-row block, a_hi * b + a_lo * b
    ("tf32x2", (32, 64, 16, 4, 2)),   # a wide tile of bench/gpu_mla_absorb.py --sweep-rows 2048's kind
    ("tf32x3", (64, 32, 32, 8, 3)),
])
def test_a_prompts_rows_on_tensor_cores_equal_the_widened_einsum(transpose, precision, wide_tile):
    """Past SMALL_ROWS the dot kernel takes ``wide_tile`` (rows, m, k, warps, stages) and tf32x2: a
    split into tf32's leading bits and the rest, both summed (the interpreter's dot is float32 either
    way, so here a split that lost a part is what fails; on the GPU the sweep checks tf32's rounding)."""
    _interpret()
    from exl3tools.kernels import mla_absorb

    g = torch.Generator().manual_seed(3)
    T, H, K, M = 70, 2, 80, 72
    w = torch.randn((H, M, K) if transpose else (H, K, M), generator=g).half()
    a = torch.randn(T, H, K + 16, generator=g)[..., 8:K + 8] * 1e3     # large values: a_lo matters
    want = mla_absorb.absorb_reference(a, w, transpose)
    got = mla_absorb.absorb(a, w, transpose, precision=precision, wide_rows=T, wide_tile=wide_tile)
    assert got.shape == want.shape == (T, H, M)
    assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()

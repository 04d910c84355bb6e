"""Our CUDA trellis kernels (backend ``cuda``) against kernels/reference.py. CUDA only.

Every (K, codebook): Ŵ bit-exact; the linear at rows 1 … 200 (both paths and every row block of
the skinny kernel) within 2e-3 of x·W; many-expert slots; a CUDA-graph replay with new inputs.
The bit logic of the kernels (every lane's windows, every K) also has a host check that needs
only nvcc: tests/test_cuda_bit_logic.py.
"""

from __future__ import annotations

import numpy as np
import pytest
from exl3tools.kernels import reference as ref

from tests.gpu.kernel_cases import CASES, captured, graph_replays, tile_rows_reference
from tests.gpu.kernel_cases import as_tensors as _tensors
from tests.gpu.kernel_cases import cuda_experts as _experts
from tests.gpu.kernel_cases import random_linear as _lin
from tests.gpu.kernel_cases import rel_err as _rel


@pytest.mark.parametrize("width,cb", CASES)
def test_decode_bit_exact(cx, width, cb):
    import torch
    from exl3tools.kernels import cuda_dense as cd

    rng = np.random.default_rng(width * 7 + len(cb))
    tr = _lin(rng, 256, 384, width)[0]
    got = cx.decode_rotated(torch.from_numpy(tr).cuda(), cb).cpu().numpy()
    want = ref.decode_rotated(tr, cb).view(np.uint16)
    assert np.array_equal(got.view(np.uint16), want)
    # the cooperative-load kernel (EXL3TOOLS_DECODE_COOP), every width and codebook
    trd = torch.from_numpy(tr).cuda()
    coop = cd.decode_t(cx.module(width, cb, trd.device), trd, kernel="exl3_decode_t_coop").t().cpu().numpy()
    assert np.array_equal(coop.view(np.uint16), want)


@pytest.mark.parametrize("width,cb", CASES)
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 8, 13, 31, 64, 65, 128, 200])
def test_linear_matches_reference(cx, width, cb, rows, monkeypatch):
    import torch

    monkeypatch.setattr(cx, "FOLD_MIN_OUT", 0)     # the folded paths at these small shapes too
    monkeypatch.setattr(cx, "FOLD2_MIN_ROWS", 0)
    monkeypatch.setattr(cx, "DENSE_TILE_MIN_K", 0)   # and the 128-row tile kernel (dense_tiles)
    monkeypatch.setenv("EXL3TOOLS_DENSE_TILES", "1")
    if rows not in (1, 13) and cb != "mul1" and width != 48:
        pytest.skip("all rows on MUL1 and K=3; rows 1 and 13 on every case")
    rng = np.random.default_rng(width + rows)
    k, n = (384, 256) if rows % 2 else (256, 640)
    tr, suh, svh, b = _lin(rng, k, n, width, bias=rows % 2 == 1)
    x = rng.normal(0, 1, (rows, k)).astype(np.float16)
    w = ref.decode_linear(tr, suh, svh, cb).astype(np.float64)
    yref = x.astype(np.float64) @ w + (b.astype(np.float64) if b is not None else 0)
    lin = cx.CudaLinear(_tensors(torch, tr, suh, svh, b), cb, "cuda")
    assert lin.dense_tiles
    lin.wgr = False     # (whatever EXL3TOOLS_DENSE_WGR says: the wgr kernels are tests/gpu/test_wgmma_kernels.py's)
    # rows > 64: the three dense paths (decode + GEMM + output pass, the output pass folded, both
    # passes folded), and up to 128 rows the tile kernel
    paths = [(False, False, False), (False, True, False), (False, False, True)] \
        + ([(True, False, False)] if rows <= 128 else []) if rows > cx.SMALL_ROWS \
        else [(lin.dense_tiles, lin.fold, lin.fold_in)]
    for path in paths:
        lin.dense_tiles, lin.fold, lin.fold_in = path
        y = lin(torch.from_numpy(x).cuda()).float().cpu().numpy()
        assert _rel(y, yref) < 2e-3, path
        # the workspace was re-zeroed (split-K atomics add in any order: equal up to rounding)
        y2 = lin(torch.from_numpy(x).cuda()).float().cpu().numpy()
        assert _rel(y2, y) < 1e-3, path


def test_decode_column_chunks(cx):
    """decode_t of n-tiles j0..j1 (the kernel's row stride ``ld``) equals those rows of the whole Ŵᵀ."""
    import torch
    from exl3tools.kernels import cuda_dense as cd

    rng = np.random.default_rng(11)
    tr = torch.from_numpy(_lin(rng, 256, 384, 48)[0]).cuda()
    mod = cx.module(48, "mul1", tr.device)
    whole = cd.decode_t(mod, tr)
    for j0, j1 in ((0, 5), (5, 24), (23, 24), (7, 8)):
        assert torch.equal(cd.decode_t(mod, tr, j0, j1), whole[16 * j0:16 * j1])
    for j0, j1 in ((0, 24), (4, 12), (5, 9), (20, 24)):   # the quad kernel: n-tiles in fours, any start
        assert torch.equal(cd.decode_t(mod, tr, j0, j1, kernel="exl3_decode_t_coop"), whole[16 * j0:16 * j1])
    with pytest.raises(cx.UsageError, match="multiple of 4"):
        cd.decode_t(mod, tr, 0, 5, kernel="exl3_decode_t_coop")
    # a trellis view 4 bytes past an aligned start: the quad kernel refuses it, the default (4-byte
    # loads) takes it
    odd = torch.empty(tr.numel() + 2, dtype=tr.dtype, device=tr.device)[2:].view(tr.shape)
    odd.copy_(tr)
    with pytest.raises(cx.UsageError, match="16-byte aligned"):
        cd.decode_t(mod, odd, kernel="exl3_decode_t_coop")
    assert torch.equal(cd.decode_t(mod, odd), whole)
    buf = torch.full((16 * 19, 256), float("nan"), dtype=torch.float16, device=tr.device)   # into a given buffer
    assert cd.decode_t(mod, tr, 5, 24, out=buf) is buf and torch.equal(buf, whole[80:384])
    with pytest.raises(ValueError, match="contiguous fp16"):
        cd.decode_t(mod, tr, 5, 23, out=buf)


@pytest.mark.parametrize("width,cb", [(48, "mul1"), (16, "3inst"), (128, "mcg"), (40, "mul1")])
def test_decode_fold(cx, width, cb):
    """decode_fold's W'ᵀ = (Ŵ · H_n / sqrt(128) ⊙ svh)ᵀ, computed here in float64 from the bit-exact
    Ŵ, within fp16 rounding (a wrong lane, column or sign is off by O(1)); its 128-column chunks
    equal those rows of the whole."""
    import torch
    from exl3tools.kernels import cuda_dense as cd
    from exl3tools.kernels.triton_exl3 import _hadamard_pm1

    rng = np.random.default_rng(width)
    k, n = 256, 640
    tr, _, svh, _ = _lin(rng, k, n, width)
    trd, svd = torch.from_numpy(tr).cuda(), torch.from_numpy(svh).cuda()
    mod = cx.module(width, cb, trd.device)
    got = cd.decode_fold(mod, trd, svd).double().cpu()
    w = cd.decode_t(mod, trd).t().double().cpu()                                # Ŵ (k, n)
    h = _hadamard_pm1("cpu").double() / 128 ** 0.5
    want = ((w.view(k, n // 128, 128) @ h).view(k, n) * svd.double().cpu()[None]).t()
    err = (got - want).abs() / (want.abs() + 1e-3 * want.abs().max())
    assert err.max().item() < 2e-3
    whole = cd.decode_fold(mod, trd, svd)
    for j0, j1 in ((0, 8), (8, 40), (16, 24)):
        assert torch.equal(cd.decode_fold(mod, trd, svd, j0, j1), whole[16 * j0:16 * j1])
    with pytest.raises(cx.UsageError):
        cd.decode_fold(mod, trd, svd, 0, 12)


@pytest.mark.parametrize("width,cb", [(48, "mul1"), (16, "3inst"), (128, "mcg"), (40, "mul1")])
def test_decode_fold2_is_the_whole_weight(cx, width, cb):
    """decode_fold2's Wᵀ, both Hadamard passes and sign vectors folded into the decoded weights,
    is the reference decoder's final W within fp16 rounding (a wrong lane, row, column, sign or
    scale is off by O(1)); its 128-column chunks equal those rows of the whole; k or n not in
    whole 128-wide blocks is refused."""
    import torch
    from exl3tools.kernels import cuda_dense as cd

    rng = np.random.default_rng(width + 1)
    k, n = 384, 640
    tr, suh, svh, _ = _lin(rng, k, n, width)
    trd, sud, svd = (torch.from_numpy(a).cuda() for a in (tr, suh, svh))
    mod = cx.module(width, cb, trd.device)
    got = cd.decode_fold2(mod, trd, sud, svd).double().cpu().numpy().T      # W (k, n)
    want = ref.decode_linear(tr, suh, svh, cb).astype(np.float64)
    err = np.abs(got - want) / (np.abs(want) + 1e-3 * np.abs(want).max())
    assert err.max() < 2e-3, err.max()
    whole = cd.decode_fold2(mod, trd, sud, svd)
    for j0, j1 in ((0, 8), (8, 40), (16, 24)):
        assert torch.equal(cd.decode_fold2(mod, trd, sud, svd, j0, j1), whole[16 * j0:16 * j1])
    with pytest.raises(cx.UsageError):
        cd.decode_fold2(mod, trd, sud, svd, 0, 12)
    with pytest.raises(cx.UsageError):
        cd.decode_fold2(mod, trd[:20], sud[:320], svd)          # 20 k-tiles: not whole 128-row blocks


@pytest.mark.parametrize("fold", [False, True, "in"])
@pytest.mark.parametrize("chunk_tiles", [1, 3, 7])
def test_dense_path_in_column_chunks(cx, monkeypatch, chunk_tiles, fold):
    """rows > SMALL_ROWS with Ŵ decoded a few n-tiles at a time into one reused buffer
    (DENSE_CHUNK_BYTES, down from 256 MiB so that this shape splits, the last chunk short;
    folded: chunks of whole 128-column blocks; "in": both passes folded) gives what the whole
    decode gives."""
    import torch
    from exl3tools.kernels import cuda_dense as cd

    rng = np.random.default_rng(chunk_tiles)
    k, n, rows = 256, 640, 100
    tr, suh, svh, b = _lin(rng, k, n, 48, bias=True)
    x = torch.from_numpy(rng.normal(0, 1, (rows, k)).astype(np.float16)).cuda()
    lin = cx.CudaLinear(_tensors(torch, tr, suh, svh, b), "mul1", "cuda")
    lin.fold, lin.fold_in = fold is True, fold == "in"
    lin.wgr = False     # (100 rows: the decode + cuBLAS path, whatever EXL3TOOLS_DENSE_WGR says)
    monkeypatch.setattr(cx, "FOLD_MIN_OUT", 0)
    monkeypatch.setattr(cx, "FOLD2_MIN_ROWS", 0)
    whole = lin(x)
    monkeypatch.setattr(cd, "DENSE_CHUNK_BYTES", chunk_tiles * k * 16 * 2)
    y = lin(x).float().cpu().numpy()
    # cuBLAS may pick another kernel (summation order) for a narrower GEMM: equal up to rounding
    assert _rel(y, whole.float().cpu().numpy()) < 1e-3
    w = ref.decode_linear(tr, suh, svh, "mul1").astype(np.float64)
    assert _rel(y, x.cpu().numpy().astype(np.float64) @ w + b.astype(np.float64)) < 2e-3


def test_long_k_many_splits(cx):
    """k long enough for many split-K units per column group, n not a power of two."""
    import torch

    rng = np.random.default_rng(5)
    k, n = 4096, 2176
    tr, suh, svh, b = _lin(rng, k, n, 48)
    x = rng.normal(0, 1, (3, k)).astype(np.float16)
    w = ref.decode_linear(tr, suh, svh, "mul1").astype(np.float64)
    lin = cx.CudaLinear(_tensors(torch, tr, suh, svh, b), "mul1", "cuda")
    y = lin(torch.from_numpy(x).cuda()).float().cpu().numpy()
    assert _rel(y, x.astype(np.float64) @ w) < 2e-3


def test_expert_slots(cx):
    import torch

    rng = np.random.default_rng(11)
    E, k, n, T, top = 6, 256, 384, 5, 3
    lins = [_lin(rng, k, n, 48, bias=True) for _ in range(E)]
    ex = _experts([_tensors(torch, *p) for p in lins], "mul1", "cuda")
    x = rng.normal(0, 1, (T, k)).astype(np.float16)
    sel = np.stack([rng.choice(E, top, replace=False) for _ in range(T)])
    tok = np.repeat(np.arange(T), top)
    exp = sel.reshape(-1)
    y = ex.slots(torch.from_numpy(x).cuda(), torch.from_numpy(tok).cuda(), torch.from_numpy(exp).cuda())
    y = y.float().cpu().numpy()
    for s, (t, e) in enumerate(zip(tok, exp, strict=True)):
        tr, suh, svh, b = lins[e]
        want = x[t].astype(np.float64) @ ref.decode_linear(tr, suh, svh, "mul1") + b
        assert _rel(y[s], want) < 2e-3


@pytest.mark.parametrize("width,cb", [(48, "mul1"), (24, "mul1"), (64, "3inst"), (128, "mcg")])
def test_prefill_tile_kernels(cx, width, cb, monkeypatch):
    """Every shared-memory tile kernel (TILE_KERNELS) against the reference and the gemv kernel:
    tiles of its own rows and of fewer (zero-filled rows), a partial last tile per expert, unused
    tiles, with and without the real-row counts (padding skipped), many slots (one split) and two
    slots over a long k (split-K, four warps per block)."""
    import torch
    from exl3tools.kernels.cuda_build import CODEBOOKS, halves
    from exl3tools.kernels.cuda_launch import slot_rows

    from exl3tools.runtime.layers import expert_tiles

    rng = np.random.default_rng(width)
    E, k, n = 5, 256, 512
    lins = [_lin(rng, k, n, width, bias=True) for _ in range(E)]
    ex = _experts([_tensors(torch, *p) for p in lins], cb, "cuda")
    w = [ref.decode_linear(tr, suh, svh, cb).astype(np.float64) for tr, suh, svh, _ in lins]
    T, top = 150, 2
    x = rng.normal(0, 1, (T, k)).astype(np.float16)
    exp = np.stack([rng.choice(E, top, replace=False) for _ in range(T)]).reshape(-1)
    xd = torch.from_numpy(x).cuda()
    for kernel in cx.TILE_KERNELS.values():
        mrows = slot_rows(kernel)
        for rows in {mrows, mrows - 24}:
            tile_exp, row_exp, slot, valid = expert_tiles(torch.from_numpy(exp).cuda(), E, rows)
            src = torch.where(valid, slot // top, 0)
            y = ex.tiles(xd, src, row_exp, tile_exp, rows).float().cpu().numpy()
            v = valid.cpu().numpy()
            assert _rel(y[v], tile_rows_reference(x, lins, w, slot, row_exp, valid, top)) < 2e-3, (kernel, rows)
            if rows <= 64:   # the gemv kernel on the same tiles: the same sums up to their order
                g = ex.tiles(xd, src, row_exp, tile_exp, rows).float().cpu().numpy()
                assert _rel(y[v], g[v]) < 1e-3, (kernel, rows)
            # the tile kernel beside the default call (at rows it does not take: the gemv kernel,
            # whose halves build sums a 3INST / MCG weight's two halves exactly where the tile
            # kernel rounds them to fp16, and whose MUL1 AFF kernels apply the affine exactly)
            yk = ex.tiles(xd, src, row_exp, tile_exp, rows, kernel=kernel).float().cpu().numpy()
            assert _rel(yk[v], y[v]) < 1e-3, (kernel, rows, ex._tile_kernel(rows), halves(CODEBOOKS[cb]))
            # the real rows per tile: padding skipped by all three launches, the real rows as the
            # same kernel gives them without the counts, and the workspace left clean for the next
            # call (checked by the one after). (Against the default call at 1e-6 this failed on an
            # H100 at 3.3e-4 for 3INST / MCG at 8 rows, the two arithmetics above, in a run of this
            # file alone, 2026-12-06; it had passed in the full tests/gpu runs)
            counts = valid.view(-1, rows).sum(1)
            yc = ex.tiles(xd, src, row_exp, tile_exp, rows, kernel=kernel, counts=counts).float().cpu().numpy()
            assert _rel(yc[v], yk[v]) < 1e-6, (kernel, rows)
            if rows <= 64:   # the gemv kernel with the counts (expert_groups' tiles): the padding rows
                # point at a NaN row of x, so reading or adding one would poison the workspace and
                # the plain call after it
                xn = torch.cat([xd, torch.full_like(xd[:1], float("nan"))])
                gc = ex.tiles(xn, torch.where(valid, src, T), row_exp, tile_exp, rows, counts=counts)
                # (EXL3TOOLS_GEMV_AFFINE: a tile of at most AFF_ROWS real rows takes the MUL1 AFF
                # kernel with its counts, the pair without: exact weights against fp16-rounded ones)
                same = 1e-3 if rows <= 8 and ex.mod.aff_rows else 1e-6
                assert _rel(gc.float().cpu().numpy()[v], g[v]) < same, (kernel, rows)
                again = ex.tiles(xd, src, row_exp, tile_exp, rows).float().cpu().numpy()
                assert _rel(again[v], g[v]) < 1e-6, (kernel, rows)
    # split-K: two slots of one expert over k = 4096 (many k-splits a column group)
    tr, suh, svh, b = _lin(rng, 4096, 384, width)
    one = _experts([_tensors(torch, tr, suh, svh, b)], cb, "cuda")
    wl = ref.decode_linear(tr, suh, svh, cb).astype(np.float64)
    xl = rng.normal(0, 1, (2 * 64, 4096)).astype(np.float16)
    zeros = torch.zeros(2 * 64, dtype=torch.int64, device="cuda")
    for kernel in ("exl3_tiles_m64_t2", "exl3_tiles_m128_t1"):
        rows = 64 if "m64" in kernel else 128
        te = torch.zeros(2 * 64 // rows, dtype=torch.int64, device="cuda")
        y = one.tiles(torch.from_numpy(xl).cuda(), None, zeros, te, rows).float().cpu().numpy()
        assert _rel(y, xl.astype(np.float64) @ wl) < 2e-3, kernel
    # the runtime sends 64-row tiles to them unless opted out of (or, EXL3TOOLS_MOE_WGR's default,
    # sends up to 128-row tiles to the wgmma kernel)
    monkeypatch.delenv("EXL3TOOLS_PREFILL_TILES", raising=False)
    monkeypatch.setenv("EXL3TOOLS_MOE_WGR", "0")
    on = _experts([_tensors(torch, *p) for p in lins], cb, "cuda")
    assert on.max_tile_rows == 64 and on._tile_kernel(64) == "exl3_tiles_m64_t2" and on._tile_kernel(32) is None
    monkeypatch.setenv("EXL3TOOLS_PREFILL_TILES", "0")
    assert _experts([_tensors(torch, *p) for p in lins], cb, "cuda").max_tile_rows == 64


@pytest.mark.parametrize("out", ["float16", "float32"])
def test_tile_kernel_with_the_output_pass_fused(cx, out, monkeypatch):
    """The default (EXL3TOOLS_TILES_EPILOGUE=0 opts out): the 64-row tile kernel applies the output Hadamard, svh and bias
    itself when a launch takes one split (k = 128: one split whatever the slots): the real rows
    equal the tile kernel + had_out bit for bit (the same fp32 operations in the same order), and
    both equal the reference; with k = 4096 (several splits) it falls back to had_out."""
    import torch

    from exl3tools.runtime.layers import expert_tiles

    dt = getattr(torch, out)
    rng = np.random.default_rng(7)
    E, k, n, T, top = 5, 128, 384, 150, 2
    lins = [_lin(rng, k, n, 48, bias=True) for _ in range(E)]
    tensors = [_tensors(torch, *p) for p in lins]
    x = rng.normal(0, 1, (T, k)).astype(np.float16)
    exp = np.stack([rng.choice(E, top, replace=False) for _ in range(T)]).reshape(-1)
    tile_exp, row_exp, slot, valid = expert_tiles(torch.from_numpy(exp).cuda(), E, 64)
    src, counts = torch.where(valid, slot // top, 0), valid.view(-1, 64).sum(1)
    xd = torch.from_numpy(x).cuda()
    ys = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("EXL3TOOLS_TILES_EPILOGUE", flag)
        ex = _experts(tensors, "mul1", "cuda")
        assert (ex._fused_out(cx.TILE_KERNELS[64], dt, tile_exp.shape[0]) is not None) == (flag == "1")
        ys[flag] = ex.tiles(xd, src, row_exp, tile_exp, 64, out_dtype=dt, counts=counts)
    v = valid.cpu()
    assert torch.equal(ys["1"].cpu()[v], ys["0"].cpu()[v])
    w = [ref.decode_linear(tr, suh, svh, "mul1").astype(np.float64) for tr, suh, svh, _ in lins]
    want = tile_rows_reference(x, lins, w, slot, row_exp, valid, top)
    assert _rel(ys["1"].float().cpu().numpy()[v.numpy()], want) < 2e-3
    # several splits (a long k over few slots): the unfused kernel and had_out
    tr, suh, svh, b = _lin(rng, 4096, 384, 48, bias=True)
    one = _experts([_tensors(torch, tr, suh, svh, b)], "mul1", "cuda")
    assert one._fused_out(cx.TILE_KERNELS[64], dt, 2) is None
    xl = rng.normal(0, 1, (128, 4096)).astype(np.float16)
    zeros = torch.zeros(128, dtype=torch.int64, device="cuda")
    y = one.tiles(torch.from_numpy(xl).cuda(), None, zeros, zeros[:2], 64, out_dtype=dt).float().cpu().numpy()
    assert _rel(y, xl.astype(np.float64) @ ref.decode_linear(tr, suh, svh, "mul1") + b) < 2e-3


@pytest.mark.parametrize("xdt", ["float16", "float32"])
def test_gemv_with_its_own_input_pass(cx, xdt, monkeypatch):
    """EXL3TOOLS_GEMV_PROLOGUE (preview): the gemv kernel rotates its split of raw x itself (no
    had_in launch; the preview at one row a slot, its kernel up to 8). Linears of 1-8 rows (fp16 and fp32 activations, bias; a long
    k whose splits the shared-memory cap shortens) and expert slots with source rows and a
    skipped tile (bias alone) against the reference and the had_in path, call after call and in
    a replayed graph."""
    import torch
    from exl3tools.kernels import cuda_gemv

    dt = getattr(torch, xdt)
    monkeypatch.setattr(cuda_gemv, "GEMV_PRO_MAX_ROWS", 8)   # the kernel's 8 rows (the preview takes 1)
    rng = np.random.default_rng(23)
    cases = {(k, n): _lin(rng, k, n, 48, bias=True) for k, n in ((14336, 512), (4096, 640), (256, 384))}
    ys = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("EXL3TOOLS_GEMV_PROLOGUE", flag)
        for (k, _n), (tr, suh, svh, b) in cases.items():
            lin = cx.CudaLinear(_tensors(torch, tr, suh, svh, b), "mul1", "cuda")
            assert lin.gemv_in == (flag == "1")
            w = ref.decode_linear(tr, suh, svh, "mul1").astype(np.float64)
            for rows in (1, 3, 8):
                x = np.random.default_rng(rows).normal(0, 1, (rows, k)).astype(np.float16)
                xd = torch.from_numpy(x).cuda().to(dt)
                for rep in range(2):
                    y = lin(xd)
                    assert y.dtype == dt
                    assert _rel(y.float().cpu().numpy(), x.astype(np.float64) @ w + b) < 2e-3, (flag, k, rows, rep)
                ys[flag, k, rows] = y.float().cpu()
    for key in [k for k in ys if k[0] == "1"]:     # the same rotation, split-K rounding apart
        assert _rel(ys[key].numpy(), ys[("0",) + key[1:]].numpy()) < 1e-3, key
    # expert slots: rows from source indices, one skipped tile (-1): bias alone
    monkeypatch.setenv("EXL3TOOLS_GEMV_PROLOGUE", "1")
    E, k, n = 4, 512, 256
    el = [_lin(rng, k, n, 48, bias=True) for _ in range(E)]
    ex = _experts([_tensors(torch, *p) for p in el], "mul1", "cuda")
    x = rng.normal(0, 1, (3, k)).astype(np.float16)
    row_exp = torch.tensor([2, 0, 3, 1, 2], device="cuda")
    tile_exp = torch.tensor([2, 0, -1, 1, 2], device="cuda")
    src = torch.tensor([0, 1, 2, 0, 2], device="cuda")
    y = ex.tiles(torch.from_numpy(x).cuda().to(dt), src, row_exp, tile_exp, 1).float().cpu().numpy()
    for s_, (t, e, te) in enumerate(zip(src.tolist(), row_exp.tolist(), tile_exp.tolist(), strict=True)):
        tr, suh, svh, b = el[e]
        want = b.astype(np.float64) if te < 0 else x[t].astype(np.float64) @ ref.decode_linear(tr, suh, svh, "mul1") + b
        assert _rel(y[s_], want) < 2e-3, s_
    # a graph replayed with new inputs
    graph_replays(cx, cases[(4096, 640)], 2, dt)


def test_graph_replay(cx):
    import torch

    graph_replays(cx, _lin(np.random.default_rng(3), 512, 768, 48, bias=True), 4, torch.float16)


@pytest.mark.parametrize("pro", ["0", "1"])
@pytest.mark.parametrize("xdt", ["float16", "float32"])
def test_grouped_linears(cx, pro, xdt, monkeypatch):
    """CudaGroup (EXL3TOOLS_GROUPED_PROJ's q/k/v and gate/up): linears of one input cut into column
    chunks of one width (q 4 chunks, k and v one each; gate and up one each), one gemv launch with
    each chunk's trellis width (exl3_gemv_ld_*, gemv_pro's too) and one output pass: each output
    against the reference and the linear alone, at 1-64 rows (one row: views; more: slot-major
    chunks copied into place), bias on some linears only (the others a zero bias), call after
    call and in a replayed graph; and what cannot be one group is not."""
    import torch

    dt = getattr(torch, xdt)
    monkeypatch.setenv("EXL3TOOLS_GEMV_PROLOGUE", pro)
    rng = np.random.default_rng(31)
    k = 1024
    qkv = [_lin(rng, k, 1024, 48, bias=True), _lin(rng, k, 256, 48), _lin(rng, k, 256, 48, bias=True)]
    gu = [_lin(rng, k, 640, 48), _lin(rng, k, 640, 48)]
    for arrays, chunks in ((qkv, [4, 1, 1]), (gu, [1, 1])):
        lins = [cx.CudaLinear(_tensors(torch, *a), "mul1", "cuda") for a in arrays]
        g = cx.CudaLinear.grouped(lins)
        assert g is not None and [b - a for a, b in g.spans] == chunks
        ws = [ref.decode_linear(*a[:3], "mul1").astype(np.float64) for a in arrays]
        for rows in (1, 2, 8, 13, 64):
            x = np.random.default_rng(rows).normal(0, 1, (rows, k)).astype(np.float16)
            xd = torch.from_numpy(x).cuda().to(dt)
            for rep in range(2):
                ys = g(xd)
                for i, (y, lin, w, a) in enumerate(zip(ys, lins, ws, arrays, strict=True)):
                    assert y.shape == (rows, lin.n) and y.dtype == dt
                    want = x.astype(np.float64) @ w + (0 if a[3] is None else a[3])
                    got = y.float().cpu().numpy()
                    assert _rel(got, want) < 2e-3, (chunks, rows, rep, i)
                    assert _rel(got, lin(xd).float().cpu().numpy()) < 1e-3, (chunks, rows, i)
        # one row, captured and replayed with new inputs
        xs = torch.zeros(1, k, dtype=dt, device="cuda")
        graph, ys = captured(g, xs)
        for seed in range(2):
            x = np.random.default_rng(100 + seed).normal(0, 1, (1, k)).astype(np.float16)
            xs.copy_(torch.from_numpy(x))
            graph.replay()
            torch.cuda.synchronize()
            for y, w, a in zip(ys, ws, arrays, strict=True):
                want = x.astype(np.float64) @ w + (0 if a[3] is None else a[3])
                assert _rel(y.float().cpu().numpy(), want) < 2e-3, seed
    # not one group: other inputs, other trellis widths
    other_k = cx.CudaLinear(_tensors(torch, *_lin(rng, 512, 256, 48)), "mul1", "cuda")
    other_w = cx.CudaLinear(_tensors(torch, *_lin(rng, k, 256, 40)), "mul1", "cuda")
    base = cx.CudaLinear(_tensors(torch, *qkv[1]), "mul1", "cuda")
    assert cx.CudaLinear.grouped([base, other_k]) is None and cx.CudaLinear.grouped([base, other_w]) is None


def test_launch_checks_the_parameter_count(cx):
    """A launch with fewer arguments than the kernel takes is refused (the driver's parameter
    info), not run on whatever lies past the packed values."""
    import torch

    mod = cx.module(48, "mul1", torch.device("cuda"))
    n = mod.param_count("exl3_gemv_ld_m8_t2")
    if n is None:
        pytest.skip("this driver has no cuFuncGetParamInfo")
    assert n == 12 and mod.param_count("exl3_gemv_m8_t2") == 12 and mod.param_count("exl3_had_in_f16") == 10
    with pytest.raises(RuntimeError, match="takes 12 parameters, launched with 11"):
        mod.launch("exl3_gemv_ld_m8_t2", 1, 128, *([None] * 5 + [1] * 6))


@pytest.mark.parametrize("pro", ["0", "1"])
@pytest.mark.parametrize("xdt", ["float16", "float32"])
def test_down_projection_takes_silu_gate_up(cx, pro, xdt, monkeypatch):
    """EXL3TOOLS_ACT_INPUT: CudaExperts.tiles(gu, act_rows=S) computes silu(gate) * up in its input
    pass (had_in's, or gemv_pro's at one row a slot) from a gate+up output of 2S rows, and gives
    what silu_mul then tiles gives: one row a slot (the decode step's), 64-row tiles (the tile
    kernel with its fused output pass) and one skipped tile, against the reference too."""
    import torch
    from exl3tools.kernels.fused_decode import silu_mul_reference

    dt = getattr(torch, xdt)
    monkeypatch.setenv("EXL3TOOLS_GEMV_PROLOGUE", pro)
    monkeypatch.setenv("EXL3TOOLS_ACT_INPUT", "1")
    rng = np.random.default_rng(41)
    E, k, n = 3, 512, 256
    el = [_lin(rng, k, n, 48, bias=True) for _ in range(E)]
    ex = _experts([_tensors(torch, *p) for p in el], "mul1", "cuda")
    assert ex.fused_act
    for S, rows in ((5, 1), (128, 64)):
        gu = torch.from_numpy(rng.normal(0, 2, (2 * S, k)).astype(np.float16)).cuda().to(dt)
        if rows == 1:
            row_exp = torch.tensor([2, 0, 1, 2, 1], device="cuda")
            tile_exp = torch.tensor([2, 0, -1, 2, 1], device="cuda")
        else:
            row_exp = torch.tensor([1] * 64 + [2] * 64, device="cuda")
            tile_exp = torch.tensor([1, 2], device="cuda")
        act = silu_mul_reference(gu[:S], gu[S:])
        want = ex.tiles(act, None, row_exp, tile_exp, rows).float().cpu().numpy()
        got = ex.tiles(gu, None, row_exp, tile_exp, rows, act_rows=S).float().cpu().numpy()
        assert _rel(got, want) < 1e-3, (S, rows)
        a64 = act.double().cpu().numpy()
        for s_, (e, te) in enumerate(zip(row_exp.tolist(), tile_exp.repeat_interleave(rows).tolist(), strict=True)):
            tr, suh, svh, b = el[e]
            ref_row = b.astype(np.float64) if te < 0 else a64[s_] @ ref.decode_linear(tr, suh, svh, "mul1") + b
            assert _rel(got[s_], ref_row) < 2e-3, (S, s_)
    with pytest.raises(Exception, match="src None"):
        ex.tiles(gu, torch.zeros(S, dtype=torch.int64, device="cuda"), row_exp, tile_exp, rows, act_rows=S)

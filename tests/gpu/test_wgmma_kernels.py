"""The dense wgmma GEMM kernels (kernels/csrc/exl3_wgmma.cuh: wg2, wg4, ws3 / ws4, wga, wgr, its
stream-K twin and its fused-output ones, wgr_out and wgr_rg_out) against the 128-row tile kernel,
had_out and kernels/reference.py, and the previews that route dense linears to them
(EXL3TOOLS_WGMMA, EXL3TOOLS_DENSE_WGA, EXL3TOOLS_DENSE_WGR). CUDA (sm_90) only.
"""

from __future__ import annotations

import numpy as np
import pytest
from exl3tools.kernels import cuda_gemv, cuda_workspace
from exl3tools.kernels import cuda_launch as cl
from exl3tools.kernels import reference as ref

from tests.gpu.kernel_cases import CASES, captured, tile_rows_reference
from tests.gpu.kernel_cases import as_tensors as _tensors
from tests.gpu.kernel_cases import cuda_experts as _experts
from tests.gpu.kernel_cases import random_linear as _lin
from tests.gpu.kernel_cases import rel_err as _rel


@pytest.mark.parametrize("width,cb", CASES)
def test_wgmma_dense_linear(cx, width, cb, monkeypatch):
    """EXL3TOOLS_WGMMA: dense linears of 65-1024 rows on the wgmma kernels (kernels/csrc/exl3_wgmma.cuh:
    slots of 128 or 256 rows, x padded to whole slots) within 2e-3 of x·W + bias on every K and
    codebook (rows 200; every row count on MUL1 K=3), and each kernel alone against the 128-row tile
    kernel's sums: slots of other experts, a slot's real rows (tile_n: the rest neither read nor
    added), an unused slot, and split-K over k = 4096."""
    import torch

    monkeypatch.setenv("EXL3TOOLS_WGMMA", "1")
    every = cb == "mul1" and width == 48
    rng = np.random.default_rng(width * 3 + len(cb))
    k, n = 512, 512     # (n-tiles a multiple of 16: the kernels' 256 columns a block)
    tr, suh, svh, b = _lin(rng, k, n, width, bias=True)
    w = ref.decode_linear(tr, suh, svh, cb).astype(np.float64)
    lin = cx.CudaLinear(_tensors(torch, tr, suh, svh, b), cb, "cuda")
    assert lin.wgmma
    for rows in (65, 128, 200, 256, 300, 1024) if every else (200,):
        x = rng.normal(0, 1, (rows, k)).astype(np.float16)
        y = lin(torch.from_numpy(x).cuda()).float().cpu().numpy()
        assert _rel(y, x.astype(np.float64) @ w + b.astype(np.float64)) < 2e-3, rows
    if not every:
        return
    # the kernels alone: 3 experts, slots of m rows, slot 1 of expert 2 with 37 real rows, slot 2 unused
    E = 3
    lins = [_lin(rng, k, n, width) for _ in range(E)]
    ex = _experts([_tensors(torch, *p) for p in lins], cb, "cuda")
    for kernel in (*cx.WG_KERNELS.values(), "exl3_wg4_m128_t1", "exl3_ws3_m128_t2",
                   "exl3_ws4_m128_t2", cx.WGA_KERNEL, cx.WGR_KERNEL, cx.WGR_SK_KERNEL):    # (and the bench's)
        m, slots = cl.slot_rows(kernel), 4
        x = rng.normal(0, 1, (slots * m, k)).astype(np.float16)
        xrot = cx.had_in(ex.mod, torch.from_numpy(x).cuda(), ex.suh_tab, 1, slots * m, k,
                         exp=torch.tensor(np.repeat([0, 2, 1, 1], m), dtype=torch.int32, device="cuda"))
        slot_exp = torch.tensor([0, 2, -1, 1], dtype=torch.int32, device="cuda")
        tile_n = torch.tensor([m, 37, m, m], dtype=torch.int32, device="cuda")
        got, base = (torch.zeros(slots * m, n, device="cuda") for _ in range(2))
        cx.gemv(ex.mod, xrot, ex.tr_tab, ex.kt, ex.nt, m, slots, got, slot_exp=slot_exp, kernel=kernel, tile_n=tile_n)
        for z in range(slots):     # the 128-row tile kernel (one n-tile a warp) as the oracle, slot by slot
            for h in range(0, m, 128):
                r0 = z * m + h
                cx.gemv(ex.mod, xrot[r0:r0 + 128].contiguous(), ex.tr_tab, ex.kt, ex.nt, 128, 1, base[r0:r0 + 128],
                        slot_exp=slot_exp[z:z + 1], kernel="exl3_tiles_m128_t1",
                        tile_n=(tile_n[z:z + 1] - h).clamp(0, 128).contiguous())
        g, bb = got.cpu().numpy(), base.cpu().numpy()
        assert not g[2 * m:3 * m].any() and not g[m + 37:2 * m].any(), kernel    # unused slot, padding rows
        live = np.r_[0:m, m:m + 37, 3 * m:4 * m]
        assert _rel(g[live], bb[live]) < 1e-5, kernel
        # the rotated-basis sums against the reference: slot 0 is expert 0's rows
        xr = xrot[:m].float().cpu().numpy().astype(np.float64)
        wr = ref.decode_rotated(lins[0][0], cb).astype(np.float64)
        assert _rel(g[:m], xr @ wr) < 1e-3, kernel
    # split-K: k = 4096, two slots of 256 rows of one weight
    tr, suh, svh, b = _lin(rng, 4096, 256, width)
    big = cx.CudaLinear(_tensors(torch, tr, suh, svh, b), cb, "cuda")
    wl = ref.decode_linear(tr, suh, svh, cb).astype(np.float64)
    xl = rng.normal(0, 1, (512, 4096)).astype(np.float16)
    y = big(torch.from_numpy(xl).cuda()).float().cpu().numpy()
    assert _rel(y, xl.astype(np.float64) @ wl) < 2e-3


@pytest.mark.parametrize("cb", ["3inst", "mul1"])
def test_stream_k_wgr_adds_any_cut_of_the_work(cx, cb, monkeypatch):
    """exl3_wgr_sk_m256_t2 cuts all slots' tiles x chunks (4 k-tiles) into one share a block: shares
    that start and end inside tiles, span several tiles (one block: all of them), skip a slot of no
    expert and add partial tiles by atomics give what the plain kernel gives (within fp32 atomics'
    order), and nothing in the unused slot or past a slot's real rows."""
    import torch

    rng = np.random.default_rng(11 + len(cb))
    k, n, m = 2048, 384, 256
    lins = [_lin(rng, k, n, 48) for _ in range(2)]
    ex = _experts([_tensors(torch, *p) for p in lins], cb, "cuda")
    x = rng.normal(0, 1, (3 * m, k)).astype(np.float16)
    xrot = cx.had_in(ex.mod, torch.from_numpy(x).cuda(), ex.suh_tab, 1, 3 * m, k,
                     exp=torch.tensor(np.repeat([0, 0, 1], m), dtype=torch.int32, device="cuda"))
    slot_exp = torch.tensor([0, -1, 1], dtype=torch.int32, device="cuda")
    tile_n = torch.tensor([m, m, 100], dtype=torch.int32, device="cuda")

    def run(kernel):
        acc = torch.zeros(3 * m, n, device="cuda")
        cx.gemv(ex.mod, xrot, ex.tr_tab, ex.kt, ex.nt, m, 3, acc, slot_exp=slot_exp, kernel=kernel, tile_n=tile_n)
        return acc.cpu().numpy()

    base = run(cx.WGR_KERNEL)
    live = np.r_[0:m, 2 * m:2 * m + 100]
    for least in (1, 3, 7, 40, 10**6):       # 3 x 3 x 32 chunks: 288 shares of 1 .. one share of all
        monkeypatch.setattr(cuda_gemv, "WGR_SK_MIN_CHUNKS", least)
        got = run(cx.WGR_SK_KERNEL)
        assert not got[m:2 * m].any() and not got[2 * m + 100:].any(), least
        assert _rel(got[live], base[live]) < 1e-5, least


@pytest.mark.parametrize("width,cb", CASES)
def test_wgr_out_writes_what_wgr_and_had_out_write(cx, width, cb, monkeypatch):
    """exl3_wgr_out_m256_t2_{f16,f32} (exl3_wgr_m256_t2 with the output pass in its epilogue) and
    exl3_wgr_rg_out_* (the same with four A operands, setmaxnreg). One split (as if on one SM): y
    bit-identical to exl3_wgr_m256_t2's sums, also one split, through had_out, in fp16 and fp32,
    with and without bias, over several slots of one weight; for experts, slots of other experts,
    a slot of 37 real rows and an unused slot, whose rows y keeps as it was (NaN here). K split
    (these shapes on the real SMs: each tile's splits added in the kernel): within rounding of the
    split kernel's atomics, the same bits on every run, and every tile's count back at zero."""
    import torch

    rng = np.random.default_rng(width * 7 + len(cb))
    k, n = 512, 384
    one_split = (cl, "sm_count", lambda device: 1)     # wave_split: one split, so acc held exact sums
    for bias in (True, False):
        tr, suh, svh, b = _lin(rng, k, n, width, bias=bias)
        lin = cx.CudaLinear(_tensors(torch, tr, suh, svh, b), cb, "cuda")
        w = ref.decode_linear(tr, suh, svh, cb).astype(np.float64)
        for rows, dtype in ((200, torch.float16), (700, torch.float32), (512, torch.float16)):
            x = torch.from_numpy(rng.normal(0, 1, (rows, k)).astype(np.float16)).cuda().to(dtype)
            ref_y = x.double().cpu().numpy() @ w + (0 if b is None else b.astype(np.float64))
            kernels = (cx.WGR_OUT_KERNELS[dtype], cx.WGR_RG_OUT_KERNELS[dtype])
            assert lin._wgr_kernel(dtype) == kernels[1]
            with monkeypatch.context() as mp:
                mp.setattr(*one_split)
                want = lin._in_slots(x, 256, cx.WGR_KERNEL)[:rows]
                for kernel in kernels:
                    got = lin._in_slots(x, 256, kernel)[:rows]
                    assert got.dtype == dtype and torch.equal(got, want), (kernel, bias, rows)
                    assert _rel(got.double().cpu().numpy(), ref_y) < 2e-3, kernel
            _, groups, units = cl.wave_split(lin.mod, kernels[0], lin.device, lin.kt, lin.nt // 2, -(-rows // 256))
            assert units > groups      # (K split)
            split = lin._in_slots(x, 256, cx.WGR_KERNEL)[:rows].double().cpu().numpy()
            for kernel in kernels:
                got = lin._in_slots(x, 256, kernel)[:rows]
                assert torch.equal(lin._in_slots(x, 256, kernel)[:rows], got), kernel   # split order, not timing
                # (fp32 sums in another order: within fp32 rounding, or fp16's where y is fp16)
                assert _rel(got.double().cpu().numpy(), split) < (1e-5 if dtype == torch.float32 else 1e-3), kernel
                assert _rel(got.double().cpu().numpy(), ref_y) < 2e-3, kernel
            assert not cuda_workspace._wgr_flags[lin.device.index].any()
    E, m, slots = 3, 256, 4
    lins = [_lin(rng, k, n, width, bias=True) for _ in range(E)]
    ex = _experts([_tensors(torch, *p) for p in lins], cb, "cuda")
    x = rng.normal(0, 1, (slots * m, k)).astype(np.float16)
    slot_exp = torch.tensor([0, 2, -1, 1], dtype=torch.int32, device="cuda")
    row_exp = slot_exp.clamp(min=0).repeat_interleave(m)
    xrot = cx.had_in(ex.mod, torch.from_numpy(x).cuda(), ex.suh_tab, 1, slots * m, k, exp=row_exp)
    tile_n = torch.tensor([m, 37, m, m], dtype=torch.int32, device="cuda")
    live = np.r_[0:m, m:m + 37, 3 * m:4 * m]
    for split in (False, True):
        with monkeypatch.context() as mp:
            if not split:
                mp.setattr(*one_split)
            acc = torch.zeros(slots * m, n, device="cuda")
            cx.gemv(ex.mod, xrot, ex.tr_tab, ex.kt, ex.nt, m, slots, acc, slot_exp=slot_exp, kernel=cx.WGR_KERNEL,
                    tile_n=tile_n)
            want = cx.had_out(ex.mod, acc, torch.empty(slots * m, n, dtype=torch.float16, device="cuda"), ex.svh_tab,
                              ex.bias_tab, 1, slots * m, n, exp=row_exp).cpu()
            for kernel in (cx.WGR_OUT_KERNELS[torch.float16], cx.WGR_RG_OUT_KERNELS[torch.float16]):
                got = torch.full((slots * m, n), float("nan"), dtype=torch.float16, device="cuda")
                cx.gemv(ex.mod, xrot, ex.tr_tab, ex.kt, ex.nt, m, slots, None, slot_exp=slot_exp, kernel=kernel,
                        tile_n=tile_n, out=(got, ex.svh_tab, ex.bias_tab))
                g = got.cpu()
                assert g[2 * m:3 * m].isnan().all() and g[m + 37:2 * m].isnan().all(), (kernel, split)
                if split:
                    assert _rel(g[live].double().numpy(), want[live].double().numpy()) < 1e-3, kernel
                else:
                    assert torch.equal(g[live], want[live]), kernel
    assert not cuda_workspace._wgr_flags[ex.device.index].any()


@pytest.mark.parametrize("width,cb", CASES[:3])
def test_wgr_out_splits_share_the_finishing(cx, width, cb, monkeypatch):
    """wgr_fixup at split counts that do and do not divide a tile's 32 row groups (3, 5, 7, 11, 16,
    each split finishing its share of rows): y within fp32 rounding of the atomics kernel at the
    same splits, the same bits on every run, x·W within 2e-3, a last slot of 8 real rows (only the
    first share holds rows) and every tile's counts back at zero."""
    import torch

    rng = np.random.default_rng(width * 11 + len(cb))
    k, n = 2048, 128                        # 128 k-tiles, one column tile a slot
    tr, suh, svh, b = _lin(rng, k, n, width, bias=True)
    lin = cx.CudaLinear(_tensors(torch, tr, suh, svh, b), cb, "cuda")
    w = ref.decode_linear(tr, suh, svh, cb).astype(np.float64)
    kernel = cx.WGR_RG_OUT_KERNELS[torch.float32]
    for rows, sms, splits in ((200, 3, 3), (200, 5, 5), (200, 7, 7), (200, 11, 11), (200, 16, 16), (520, 33, 11)):
        x = torch.from_numpy(rng.normal(0, 1, (rows, k)).astype(np.float16)).cuda().float()
        with monkeypatch.context() as mp:
            mp.setattr(cl, "sm_count", lambda device, s=sms: s)
            kps, groups, units = cl.wave_split(lin.mod, kernel, lin.device, lin.kt, lin.nt // 2, -(-rows // 256))
            assert -(-lin.kt // kps) == splits and units == splits * groups, (sms, kps)
            atomics = lin._in_slots(x, 256, cx.WGR_KERNEL)[:rows].double().cpu().numpy()
            got = lin._in_slots(x, 256, kernel)[:rows]
            assert torch.equal(lin._in_slots(x, 256, kernel)[:rows], got), sms
        g = got.double().cpu().numpy()
        assert _rel(g, atomics) < 1e-5, sms
        assert _rel(g, x.double().cpu().numpy() @ w + b.astype(np.float64)) < 2e-3, sms
        assert not cuda_workspace._wgr_flags[lin.device.index].any(), sms


@pytest.mark.parametrize("width,cb", CASES[:2])
def test_wgr_splits_past_one_wave(cx, width, cb):
    """K split 16 ways over 3 slots of 8 tiles (384 blocks of one an SM: several waves; the last
    split to arrive finishes the tile, none waits for another): the same bits on every run, within
    fp32 rounding of the atomics kernel, x·W within 2e-3, every tile's count back at zero."""
    import torch

    rng = np.random.default_rng(width * 13 + len(cb))
    k, n, rows = 2048, 1024, 520           # 128 k-tiles
    tr, suh, svh, b = _lin(rng, k, n, width, bias=True)
    lin = cx.CudaLinear(_tensors(torch, tr, suh, svh, b), cb, "cuda")
    x = torch.from_numpy(rng.normal(0, 1, (rows, k)).astype(np.float16)).cuda().float()
    kernel = cx.WGR_RG_OUT_KERNELS[torch.float32]
    got = lin._in_slots(x, 256, kernel, splits=16)[:rows]
    assert torch.equal(lin._in_slots(x, 256, kernel, splits=16)[:rows], got)
    g = got.double().cpu().numpy()
    atomics = lin._in_slots(x, 256, cx.WGR_KERNEL)[:rows].double().cpu().numpy()
    w = ref.decode_linear(tr, suh, svh, cb).astype(np.float64)
    assert _rel(g, atomics) < 1e-5
    assert _rel(g, x.double().cpu().numpy() @ w + b.astype(np.float64)) < 2e-3
    assert not cuda_workspace._wgr_flags[lin.device.index].any()


@pytest.mark.parametrize("width,cb", CASES)
def test_wgr_m128_slots(cx, width, cb, monkeypatch):
    """exl3_wgr_rg_out_m128_t2_* (128-row slots, wgmma.m64n128k16; for MoE prefill tiles): a dense
    linear within fp32 rounding of the 256-row kernel (one split each), K split within 1e-5 of one
    split and the same bits on every run; experts through CudaExperts.tiles (slots of other
    experts, a slot of 37 real rows, an unused slot): each live row
    within 1e-3 of the m64 tile kernel's and 2e-3 of x·W + bias; every tile's counts back at zero."""
    import torch

    rng = np.random.default_rng(width * 13 + len(cb))
    k, n = 1024, 384
    one_split = (cl, "sm_count", lambda device: 1)
    tr, suh, svh, b = _lin(rng, k, n, width, bias=True)
    lin = cx.CudaLinear(_tensors(torch, tr, suh, svh, b), cb, "cuda")
    w = ref.decode_linear(tr, suh, svh, cb).astype(np.float64)
    for rows, dtype in ((200, torch.float32), (300, torch.float16)):
        x = torch.from_numpy(rng.normal(0, 1, (rows, k)).astype(np.float16)).cuda().to(dtype)
        kernel = cx.WGR_RG_OUT_M128_KERNELS[dtype]
        with monkeypatch.context() as mp:
            mp.setattr(*one_split)
            one = lin._in_slots(x, 128, kernel)[:rows]
            m256 = lin._in_slots(x, 256, cx.WGR_RG_OUT_KERNELS[dtype])[:rows]
        split = lin._in_slots(x, 128, kernel)[:rows]
        assert torch.equal(lin._in_slots(x, 128, kernel)[:rows], split), rows
        tol = 1e-5 if dtype == torch.float32 else 1e-3
        assert _rel(one.double().cpu().numpy(), m256.double().cpu().numpy()) < tol, rows
        assert _rel(split.double().cpu().numpy(), one.double().cpu().numpy()) < tol, rows
        assert _rel(split.double().cpu().numpy(), x.double().cpu().numpy() @ w + b.astype(np.float64)) < 2e-3, rows
    assert not cuda_workspace._wgr_flags[lin.device.index].any()
    E, m = 3, 128
    lins = [_lin(rng, k, n, width, bias=True) for _ in range(E)]
    ex = _experts([_tensors(torch, *p) for p in lins], cb, "cuda")
    tile_exp = torch.tensor([0, 2, -1, 1, 0], dtype=torch.int32, device="cuda")
    counts = torch.tensor([m, 37, m, m, m], dtype=torch.int32, device="cuda")
    row_exp = tile_exp.clamp(min=0).repeat_interleave(m)
    T = 200
    x = torch.from_numpy(rng.normal(0, 1, (T, k)).astype(np.float16)).cuda()
    src = torch.from_numpy(rng.integers(0, T, row_exp.shape[0])).cuda()
    live = np.r_[0:m, m:m + 37, 3 * m:5 * m]
    got = ex.tiles(x, src, row_exp, tile_exp, m, kernel=cx.WGR_RG_OUT_M128_KERNELS[torch.float16], counts=counts)
    want = ex.tiles(x, src, row_exp, tile_exp, m, kernel=cx.TILE_KERNELS[128], counts=counts)
    g, wt = got.double().cpu().numpy()[live], want.double().cpu().numpy()[live]
    assert _rel(g, wt) < 1e-3
    ws = [ref.decode_linear(*p[:3], cb).astype(np.float64) for p in lins]
    xs, re_ = x.double().cpu().numpy()[src.cpu().numpy()], row_exp.cpu().numpy()
    exact = np.stack([xs[r] @ ws[re_[r]] + lins[re_[r]][3].astype(np.float64) for r in live])
    assert _rel(g, exact) < 2e-3
    assert not cuda_workspace._wgr_flags[ex.device.index].any()


@pytest.mark.parametrize("width,cb", [(48, "mul1"), (64, "3inst"), (32, "mcg")])
def test_moe_wgr_routes_128_row_tiles(cx, width, cb, monkeypatch):
    """EXL3TOOLS_MOE_WGR (the default, read per call): experts take tiles of up to 128 rows, and a
    128-row tiles call runs exl3_wgr_rg_out_m128_t2_* (y in fp16 or fp32 from its epilogue; the
    real rows within 2e-3 of the reference and 1e-3 of the 128-row tile kernel), a down projection
    taking silu(gate) * up too; 64-row tiles keep the tile kernel; off: 64-row tiles as before.
    (Every CUDA expert set's k and n come in 128s: CudaExperts refuses others, _check_dims.)"""
    import torch

    from exl3tools.runtime.layers import expert_tiles

    rng = np.random.default_rng(width + 3 * len(cb))
    E, k, n, T, top = 4, 512, 384, 300, 2
    lins = [_lin(rng, k, n, width, bias=True) for _ in range(E)]
    tensors = [_tensors(torch, *p) for p in lins]
    monkeypatch.delenv("EXL3TOOLS_MOE_WGR", raising=False)       # (the default)
    ex = _experts(tensors, cb, "cuda")
    assert ex.moe_wgr and ex.max_tile_rows == 128
    monkeypatch.setenv("EXL3TOOLS_MOE_WGR", "0")                 # read per call (an A/B in one process)
    assert not ex.moe_wgr and ex.max_tile_rows == 64
    monkeypatch.setenv("EXL3TOOLS_MOE_WGR", "1")
    kernels = []
    real = cx.gemv
    monkeypatch.setattr(cx, "gemv", lambda *a, **kw: (kernels.append(kw.get("kernel")), real(*a, **kw))[1])
    import exl3tools.kernels.cuda_experts as ce
    monkeypatch.setattr(ce, "gemv", cx.gemv)
    w = [ref.decode_linear(tr, suh, svh, cb).astype(np.float64) for tr, suh, svh, _ in lins]
    x = rng.normal(0, 1, (T, k)).astype(np.float16)
    exp = np.stack([rng.choice(E, top, replace=False) for _ in range(T)]).reshape(-1)
    xd = torch.from_numpy(x).cuda()
    tile_exp, row_exp, slot, valid = expert_tiles(torch.from_numpy(exp).cuda(), E, 128)
    src, counts = torch.where(valid, slot // top, 0), valid.view(-1, 128).sum(1)
    v = valid.cpu().numpy()
    want = tile_rows_reference(x, lins, w, slot, row_exp, valid, top)
    tiles = ex.tiles(xd, src, row_exp, tile_exp, 128, kernel=cx.TILE_KERNELS[128], counts=counts)
    for dt in (torch.float16, torch.float32):
        kernels.clear()
        y = ex.tiles(xd, src, row_exp, tile_exp, 128, out_dtype=dt, counts=counts)
        assert kernels == [cx.WGR_RG_OUT_M128_KERNELS[dt]] and y.dtype == dt, kernels
        assert _rel(y.double().cpu().numpy()[v], want) < 2e-3, dt
        assert _rel(y.double().cpu().numpy()[v], tiles.double().cpu().numpy()[v]) < 1e-3, dt
    # silu(gate) * up inside the input pass (act_rows): the down projection of a gate+up output
    gu = torch.from_numpy(rng.normal(0, 1, (2 * row_exp.shape[0], k)).astype(np.float16)).cuda()
    kernels.clear()
    y = ex.tiles(gu, None, row_exp, tile_exp, 128, counts=counts, act_rows=row_exp.shape[0])
    assert kernels == [cx.WGR_RG_OUT_M128_KERNELS[torch.float16]], kernels
    a = torch.nn.functional.silu(gu[:row_exp.shape[0]].float()) * gu[row_exp.shape[0]:].float()
    re_ = row_exp.cpu().numpy()
    exact = np.stack([a[r].double().cpu().numpy() @ w[re_[r]] + lins[re_[r]][3].astype(np.float64)
                      for r in np.nonzero(v)[0]])
    assert _rel(y.double().cpu().numpy()[v], exact) < 2e-3
    te64, re64, sl64, va64 = expert_tiles(torch.from_numpy(exp).cuda(), E, 64)
    kernels.clear()
    y64 = ex.tiles(xd, torch.where(va64, sl64 // top, 0), re64, te64, 64)   # (the fused tile kernel: no gemv)
    assert not any(k_ and k_.startswith("exl3_wgr") for k_ in kernels), kernels
    assert _rel(y64.double().cpu().numpy()[va64.cpu().numpy()],
                tile_rows_reference(x, lins, w, sl64, re64, va64, top)) < 2e-3


@pytest.mark.parametrize("switch", ["EXL3TOOLS_DENSE_WGA", "EXL3TOOLS_DENSE_WGR"])
@pytest.mark.parametrize("width,cb", CASES)
def test_dense_in_gemm_previews_run_their_rows_on_their_kernel(cx, width, cb, switch, monkeypatch):
    """EXL3TOOLS_DENSE_WGA / EXL3TOOLS_DENSE_WGR: a dense linear of 65-256 rows (wga) or 65-
    WGR_MAX_ROWS rows and WGR_MIN_WEIGHTS weights (wgr; a smaller one takes the default path) runs
    slots of 256 rows of exl3_wga_m256_t2 / a wgr kernel (up to WGR_M128_ROWS rows: one 128-row
    slot of the m128 wgr kernel) (x padded; the
    rest read, never added; wgr: exl3_wgr_out_*, whose K splits here are added in the kernel),
    within 2e-3 of x·W + bias on every K and codebook and fp16 / fp32 activations, several slots
    too (wgr), in a CUDA graph too (within 1e-3 of the eager call: wga's fp32 atomics); the other
    row counts and the switch off take the default paths, which agree."""
    import torch

    kernel, top = (cx.WGA_KERNEL, cx.WGA_MAX_ROWS) if switch == "EXL3TOOLS_DENSE_WGA" else (cx.WGR_KERNEL, cx.WGR_MAX_ROWS)
    for var in ("EXL3TOOLS_WGMMA", "EXL3TOOLS_DENSE_TILES", "EXL3TOOLS_DENSE_WGA"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("EXL3TOOLS_DENSE_WGR", "0")    # (ahead of wga)
    monkeypatch.setenv(switch, "1")
    rng = np.random.default_rng(width * 5 + len(cb) + len(switch))
    k, n = 512, 384
    tr, suh, svh, b = _lin(rng, k, n, width, bias=True)
    w = ref.decode_linear(tr, suh, svh, cb).astype(np.float64)
    kernels = []
    real = cx.gemv
    monkeypatch.setattr(cx, "gemv", lambda *a, **kw: (kernels.append(kw.get("kernel")), real(*a, **kw))[1])
    lin = cx.CudaLinear(_tensors(torch, tr, suh, svh, b), cb, "cuda")
    if switch == "EXL3TOOLS_DENSE_WGR":     # under WGR_MIN_WEIGHTS: the default path
        lin(torch.from_numpy(rng.normal(0, 1, (200, k)).astype(np.float16)).cuda())
        assert not any(k_ and k_.startswith("exl3_wgr") for k_ in kernels), kernels
        monkeypatch.setattr(cx, "WGR_MIN_WEIGHTS", k * n)
    for rows, dtype in ((64, torch.float16), (65, torch.float16), (128, torch.float32), (129, torch.float16),
                        (200, torch.float32), (256, torch.float16), (257, torch.float16), (700, torch.float16),
                        (cx.WGR_MAX_ROWS + 1, torch.float16)):
        x = rng.normal(0, 1, (rows, k)).astype(np.float32)
        kernels.clear()
        y = lin(torch.from_numpy(x).cuda().to(dtype))
        assert y.dtype == dtype and y.shape == (rows, n)
        if 64 < rows <= top:
            want_kernel = kernel
            if kernel == cx.WGR_KERNEL:
                want_kernel = cx.CudaLinear._wgr_kernel(dtype, cx.WGR_M128_ROWS if rows <= cx.WGR_M128_ROWS else 256)
                assert ("_m128_" in want_kernel) == (rows <= 128), want_kernel
            assert kernels == [want_kernel], (rows, kernels)
        else:
            assert not any(k_ and k_.startswith(kernel[:8]) for k_ in kernels), (rows, kernels)
        assert _rel(y.float().cpu().numpy(), x.astype(np.float64) @ w + b.astype(np.float64)) < 2e-3, rows
    x = torch.from_numpy(rng.normal(0, 1, (200, k)).astype(np.float16)).cuda()
    want = lin(x).float()
    g, got = captured(lin, x)
    g.replay()
    torch.cuda.synchronize()
    # (K splits add in fp32 atomics: the order, and so the last bits, may change from run to run)
    assert _rel(got.float().cpu().numpy(), want.cpu().numpy()) < 1e-3
    monkeypatch.setenv(switch, "0")
    kernels.clear()
    off = cx.CudaLinear(_tensors(torch, tr, suh, svh, b), cb, "cuda")(x).float()
    assert kernels == [] and _rel(off.cpu().numpy(), want.cpu().numpy()) < 2e-3

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

from tests.gpu.kernel_cases import CASES
from tests.gpu.kernel_cases import as_tensors as _tensors
from tests.gpu.kernel_cases import random_linear as _lin
from tests.gpu.kernel_cases import rel_err as _rel


@pytest.fixture(scope="module")
def cx():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from exl3tools.kernels import cuda_build, cuda_exl3

    # all modules in parallel up front (nvcc is single-threaded; ~2 s each)
    cuda_build.prebuild()
    return cuda_exl3


@pytest.mark.parametrize("width,cb", CASES)
def test_decode_bit_exact(cx, width, cb):
    import torch

    rng = np.random.default_rng(width * 7 + len(cb))
    tr = _lin(rng, 256, 384, width)[0]
    got = cx.decode_rotated(torch.from_numpy(tr).cuda(), cb).cpu().numpy()
    assert np.array_equal(got.view(np.uint16), ref.decode_rotated(tr, cb).view(np.uint16))


@pytest.mark.parametrize("width,cb", CASES)
@pytest.mark.parametrize("rows", [1, 5, 8, 13, 31, 64, 65, 200])
def test_linear_matches_reference(cx, width, cb, rows):
    import torch

    if rows not in (1, 13) and cb != "mul1" and width != 48:
        pytest.skip("all rows on MUL1 and K=3; rows 1 and 13 on every case")
    rng = np.random.default_rng(width + rows)
    k, n = (384, 256) if rows % 2 else (256, 640)
    tr, suh, svh, b = _lin(rng, k, n, width, bias=rows % 2 == 1)
    x = rng.normal(0, 1, (rows, k)).astype(np.float16)
    w = ref.decode_linear(tr, suh, svh, cb).astype(np.float64)
    yref = x.astype(np.float64) @ w + (b.astype(np.float64) if b is not None else 0)
    lin = cx.CudaLinear(_tensors(torch, tr, suh, svh, b), cb, "cuda")
    y = lin(torch.from_numpy(x).cuda()).float().cpu().numpy()
    assert _rel(y, yref) < 2e-3
    # the workspace was re-zeroed (split-K atomics add in any order: equal up to rounding)
    y2 = lin(torch.from_numpy(x).cuda()).float().cpu().numpy()
    assert _rel(y2, y) < 1e-3


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
    ex = cx.CudaExperts([_tensors(torch, *p) for p in lins], "mul1", "cuda")
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


def test_graph_replay(cx):
    import torch

    rng = np.random.default_rng(3)
    tr, suh, svh, b = _lin(rng, 512, 768, 48, bias=True)
    lin = cx.CudaLinear(_tensors(torch, tr, suh, svh, b), "mul1", "cuda")
    xs = torch.zeros(4, 512, dtype=torch.float16, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        lin(xs)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        ys = lin(xs)
    w = ref.decode_linear(tr, suh, svh, "mul1").astype(np.float64)
    for seed in range(3):
        x = np.random.default_rng(seed).normal(0, 1, (4, 512)).astype(np.float16)
        xs.copy_(torch.from_numpy(x))
        g.replay()
        torch.cuda.synchronize()
        assert _rel(ys.float().cpu().numpy(), x.astype(np.float64) @ w + b) < 2e-3

"""Paged prefill attention (kernels/paged_attention.paged_prefill): the Triton kernel against its
torch reference, over packed batches of new tokens that follow cached ones (chunked prefill) or
start a sequence, mixed with single decode rows.

Slots are shuffled; the slot table past each sequence's length holds ids that must never be read
(out of range), and every slot no sequence owns holds NaN. On CUDA the full product of shapes
runs; on the Triton interpreter (TRITON_INTERPRET=1, CPU) a small subset."""

from __future__ import annotations

import itertools
import math

import pytest

from tests.conftest import cuda_available

FULL = cuda_available()
TOL = {"float32": 1e-5, "float16": 2e-4, "bfloat16": 2e-4}

# (new tokens per sequence, cached tokens per sequence)
BATCHES = [([7], [0]), ([70, 1, 33], [0, 90, 5]), ([1, 1, 1], [3, 200, 17]), ([130], [64])]
if FULL:
    CASES = [(b, nq, nkv, D, dt) for b, (nq, nkv), D, dt in itertools.product(
        BATCHES, ((4, 4), (8, 2), (96, 8)), (64, 128, 256), ("float32", "bfloat16", "float16"))]
else:
    CASES = [(BATCHES[1], 8, 2, 64, "float32"), (BATCHES[0], 4, 4, 32, "bfloat16"),
             (BATCHES[2], 12, 1, 128, "bfloat16")]


def _case(batch, nq, nkv, D, dtype, device):
    import torch

    news, cached = batch
    lens = [n + c for n, c in zip(news, cached, strict=True)]
    g = torch.Generator().manual_seed(sum(lens) * 7 + nq + D)
    slots = sum(lens) + 50
    kp = torch.randn(slots, nkv, D, generator=g).to(dtype)
    vp = torch.randn(slots, nkv, D, generator=g).to(dtype)
    perm = torch.randperm(slots, generator=g)
    width = max(lens) + 9
    table = torch.full((len(lens), width), 10**8, dtype=torch.int32)      # never read past a length
    o = 0
    for b, L in enumerate(lens):
        table[b, :L] = perm[o:o + L].to(torch.int32)
        o += L
    owned = perm[:o]
    free = torch.ones(slots, dtype=torch.bool)
    free[owned] = False
    kp[free] = float("nan")
    vp[free] = float("nan")
    starts = [0]
    for n in news:
        starts.append(starts[-1] + n)
    q = torch.randn(starts[-1], nq, D, generator=g)
    i32 = dict(dtype=torch.int32, device=device)
    return (q.to(device), kp.to(device), vp.to(device), table.to(device), torch.tensor(starts, **i32),
            torch.tensor(lens, **i32), 1 / math.sqrt(D), max(news))


@pytest.mark.parametrize("batch,nq,nkv,D,dtype", CASES)
def test_paged_prefill_matches_reference(batch, nq, nkv, D, dtype):
    pytest.importorskip("triton")
    import torch
    from exl3tools.kernels.paged_attention import INTERPRET, paged_prefill, paged_prefill_reference

    if not FULL and not INTERPRET:
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    device = "cuda" if FULL else "cpu"
    args = _case(batch, nq, nkv, D, getattr(torch, dtype), device)
    out = torch.full(args[0].shape, float("nan"), device=device)
    got = paged_prefill(*args, out=out)
    ref = paged_prefill_reference(*args)
    assert got.data_ptr() == out.data_ptr() and torch.isfinite(got).all()
    err = (got - ref).abs().max().item() / ref.abs().max().item()
    assert err < TOL[dtype], err


@pytest.mark.parametrize("batch", [BATCHES[1], BATCHES[3]])
def test_paged_prefill_on_a_fixed_grid_of_tiles(batch):
    """``tiles`` (a graph's fixed launch): the same outputs bit for bit as the (sequence, row
    tile, head) grid, whatever tiles are left over as padding; padded query rows past the last
    sequence are never written; too few tiles is an error."""
    pytest.importorskip("triton")
    import torch
    from exl3tools.kernels.paged_attention import INTERPRET, paged_prefill, prefill_block_rows, prefill_tiles

    if not FULL and not INTERPRET:
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    device = "cuda" if FULL else "cpu"
    q, kp, vp, table, starts, lens, scale, max_new = _case(batch, 8, 2, 64, torch.float16, device)
    want = paged_prefill(q, kp, vp, table, starts, lens, scale, max_new)
    bm = prefill_block_rows(kp.dtype)
    n = q.shape[0]
    pad = torch.zeros(n + 5, *q.shape[1:], device=device)        # rows past the sequences: a graph's padding
    pad[:n] = q
    count = -(-(n + 5) // bm) + len(batch[0])
    tiles = torch.tensor(prefill_tiles(starts.tolist(), bm, count), dtype=torch.int32, device=device)
    out = torch.full(pad.shape, 7.0, device=device)
    got = paged_prefill(pad, kp, vp, table, starts, lens, scale, n + 5, out=out, tiles=tiles)
    assert torch.equal(got[:n], want) and (got[n:] == 7.0).all()
    with pytest.raises(ValueError, match="do not fit"):
        prefill_tiles(starts.tolist(), bm, 1)

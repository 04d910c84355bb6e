"""Paged decode attention (kernels/paged_attention.py): Triton kernel and torch reference against a
float64 oracle computed from the same (rounded) K/V.

Every case poisons ``out`` with NaN, shuffles the block ids, fills the table past each row's length
with ids that must never be read (a NaN block, out-of-range and negative ids) and NaNs the unused
slots of each row's last block. On CUDA the full product of shapes runs; on the Triton interpreter
(TRITON_INTERPRET=1) a covering subset, to stay within a few seconds.
"""

from __future__ import annotations

import itertools
import math

import pytest

from tests.conftest import cuda_available

FULL = cuda_available()
# 16-bit caches: q and p enter the MMAs as hi + lo pairs (~16 mantissa bits); ~1e-5 seen, 1e-3 would
# still pass with a bare bf16 p
TOL = {"float32": 1e-5, "float16": 2e-4, "bfloat16": 2e-4}

# (B, nq, nkv, D, block_size, cache dtype, q dtype, num_splits); None = the default rule
if FULL:
    CASES = [(B, nq, nkv, D, bs, dt, "float32", ns)
             for B, (nq, nkv), D, bs, dt, ns in itertools.product(
                 (1, 3, 8), ((4, 4), (8, 2), (12, 1)), (32, 64, 128), (16, 32), ("float32", "bfloat16"),
                 (None, 3))]
    CASES += [(3, 8, 2, D, 16, "bfloat16", "float32", None) for D in (96, 192, 256)]
    CASES += [(3, 12, 1, 128, bs, "bfloat16", "float32", None) for bs in (8, 64, 128)]
    CASES += [(3, 8, 2, 64, 16, "float16", qd, None) for qd in ("float32", "float16", "bfloat16")]
    CASES += [(3, 96, 8, 128, 16, "bfloat16", qd, None) for qd in ("float32", "bfloat16")]
    CASES += [(2, 128, 2, 256, 16, "bfloat16", "float32", 2)]   # g = 64 at D 256: four head chunks
else:
    CASES = [
        (1, 4, 4, 32, 16, "float32", "float32", None),
        (3, 8, 2, 64, 32, "bfloat16", "float32", 3),
        (8, 12, 1, 128, 16, "bfloat16", "float32", None),
        (3, 12, 1, 32, 32, "float32", "float32", 1),
        (8, 4, 4, 64, 16, "bfloat16", "float32", 1),
        (1, 8, 2, 128, 32, "float32", "float32", 8),     # more splits than tiles
        (3, 8, 2, 96, 16, "bfloat16", "float32", 2),     # D not a power of two
        (3, 8, 2, 64, 16, "float16", "float32", 2),
        (3, 12, 1, 64, 16, "bfloat16", "bfloat16", 2),   # q already in the cache dtype
        (3, 40, 1, 256, 16, "bfloat16", "float32", 2),   # D 256: heads in chunks of 16, 16 and 8
    ]


def _lens(rng, B: int, bs: int) -> list[int]:
    """0, 1, whole blocks, a block plus one, random up to a few blocks; B = 1 gets a random one."""
    pool = [0, 2 * bs + 5, 1, bs, 3 * bs, 2 * bs - 1]
    if B == 1:
        return [int(rng.integers(2, 4 * bs))]
    out = [pool[i] for i in range(min(B, len(pool)))]
    out += [int(rng.integers(1, 5 * bs)) for _ in range(B - len(out))]
    rng.shuffle(out)
    return out


def _inputs(seed, B, nq, nkv, D, bs, cache_dt, q_dt, dev, width_extra=3, lens=None):
    """q, k, v (views of one (blocks, 2, bs, nkv, D) tensor), block table, lens (device) and the
    float64 oracle (B, nq, D)."""
    import numpy as np
    import torch

    rng = np.random.default_rng(seed)
    lens = lens or _lens(rng, B, bs)
    need = [math.ceil(n / bs) for n in lens]
    W = max(need) + width_extra
    nb = sum(need) + 2
    kv = torch.randn(nb, 2, bs, nkv, D, generator=torch.Generator().manual_seed(seed))
    kv = kv.to(getattr(torch, cache_dt))
    nan_block = nb - 1
    kv[nan_block] = float("nan")
    ids = (torch.randperm(nb - 1, generator=torch.Generator().manual_seed(seed + 1))).tolist()
    bt = torch.empty(B, W, dtype=torch.int32)
    junk = [nan_block, nb + 7, 2**31 - 1, -5]
    for b in range(B):
        for j in range(W):
            bt[b, j] = ids.pop() if j < need[b] else junk[(b + j) % len(junk)]
        if lens[b] % bs:                                    # unwritten tail of the last block
            kv[bt[b, need[b] - 1], :, lens[b] % bs:] = float("nan")
    q = torch.randn(B, nq, D, generator=torch.Generator().manual_seed(seed + 2)).to(getattr(torch, q_dt))
    scale = 1.0 / math.sqrt(D)

    g = nq // nkv
    q64, kv64 = q.double(), kv.double()
    ref = torch.zeros(B, nq, D, dtype=torch.float64)
    for b in range(B):
        if lens[b] == 0:
            continue
        t = torch.arange(lens[b])
        rows = kv64[bt[b, t // bs].long(), :, t % bs]       # (L, 2, nkv, D)
        k = rows[:, 0].repeat_interleave(g, dim=1)          # (L, nq, D)
        v = rows[:, 1].repeat_interleave(g, dim=1)
        p = torch.softmax(torch.einsum("hd,lhd->hl", q64[b], k) * scale, dim=-1)
        ref[b] = torch.einsum("hl,lhd->hd", p, v)
    kv = kv.to(dev)
    return (q.to(dev), kv[:, 0], kv[:, 1], bt.to(dev), torch.tensor(lens, dtype=torch.int32, device=dev),
            scale, ref)


def _rel(got, ref) -> float:
    return float((got.double().cpu() - ref).abs().max() / ref.abs().max())


@pytest.mark.parametrize("B,nq,nkv,D,bs,cache_dt,q_dt,splits", CASES)
def test_paged_decode_matches_float64(dev, B, nq, nkv, D, bs, cache_dt, q_dt, splits):
    import torch
    from exl3tools.kernels import paged_attention as pa

    seed = B * 1000 + nq * 37 + D + bs + len(cache_dt)
    q, k, v, bt, lens, scale, ref = _inputs(seed, B, nq, nkv, D, bs, cache_dt, q_dt, dev)
    for fn in (pa.paged_decode, pa.paged_decode_reference):
        out = torch.full((B, nq, D), float("nan"), device=dev)
        got = fn(q, k, v, bt, lens, scale, num_splits=splits, out=out)
        assert got is out and got.dtype == torch.float32
        assert torch.isfinite(got).all(), fn.__name__
        assert (got[lens == 0] == 0).all(), fn.__name__
        assert _rel(got, ref) < TOL[cache_dt], (fn.__name__, _rel(got, ref))


def test_wide_table_tiles_and_splits(dev, monkeypatch):
    """A table much wider than any row (as at max-model-len); tiles smaller than, equal to and larger
    than a block; 1 split, several, more splits than tiles, and a merge in many chunks."""
    import torch
    from exl3tools.kernels import paged_attention as pa

    q, k, v, bt, lens, scale, ref = _inputs(7, 3, 4, 2, 64, 32, "bfloat16", "float32", dev, width_extra=300,
                                            lens=[150, 0, 77])
    combos = [(16, 3, 1), (32, 1, 1), (128, 2, 1), (16, 12, 4)]    # (tile, splits, min tiles per split)
    if FULL:
        combos += [(tn, ns, mt) for tn in (16, 32, 64, 128) for ns in (1, 2, 5, 10, 40, 200) for mt in (1, 3)]
    for tn, ns, mt in combos:
        got = pa._paged_decode(q, k, v, bt, lens, scale, num_splits=ns, tile_n=tn, min_split_tiles=mt)
        assert got.shape == (3, 4, 64) and torch.isfinite(got).all()
        assert _rel(got, ref) < TOL["bfloat16"], (tn, ns, mt, _rel(got, ref))
    # 150 tokens = 10 tiles of 16 over 12 splits (two never written), merged 2 splits at a time
    monkeypatch.setattr(pa, "MERGE_CHUNK", 2)
    got = pa._paged_decode(q, k, v, bt, lens, scale, num_splits=12, tile_n=16)
    assert _rel(got, ref) < TOL["bfloat16"], _rel(got, ref)
    assert _rel(pa.paged_decode_reference(q, k, v, bt, lens, scale), ref) < TOL["bfloat16"]


@pytest.mark.parametrize("splits", [None, 1])
def test_cuda_graph_replay_with_new_tables(dev, splits):
    """Captured once, replayed with other q / K/V / block tables / lengths written into the same
    tensors: the Triton path and the torch reference (the CPU runtime's static step) both follow."""
    import torch
    from exl3tools.kernels import paged_attention as pa

    if dev != "cuda":
        pytest.skip("CUDA graphs need CUDA")
    B, nq, nkv, D, bs = 8, 24, 2, 128, 16
    sets = [_inputs(s, B, nq, nkv, D, bs, "bfloat16", "float32", "cpu", width_extra=0) for s in (11, 12, 13)]
    W = 64                                                   # static table width, wider than any set
    nb = max(s[1].shape[0] for s in sets)
    kv = torch.full((nb, 2, bs, nkv, D), float("nan"), dtype=torch.bfloat16, device=dev)
    q = torch.empty(B, nq, D, device=dev)
    bt = torch.full((B, W), 2**31 - 1, dtype=torch.int32, device=dev)
    lens = torch.zeros(B, dtype=torch.int32, device=dev)
    out = torch.empty(B, nq, D, device=dev)
    out_ref = torch.empty(B, nq, D, device=dev)

    def load(s):
        qs, ks, vs, bts, ls, _, ref = s
        kv.fill_(float("nan"))
        kv[: ks.shape[0], 0] = ks.to(dev)
        kv[: vs.shape[0], 1] = vs.to(dev)
        q.copy_(qs)
        bt.fill_(2**31 - 1)
        bt[:, : bts.shape[1]] = bts.to(dev)
        lens.copy_(ls)
        return ref

    def step():
        pa.paged_decode(q, kv[:, 0], kv[:, 1], bt, lens, 1 / math.sqrt(D), num_splits=splits, out=out)
        pa.paged_decode_reference(q, kv[:, 0], kv[:, 1], bt, lens, 1 / math.sqrt(D), out=out_ref)

    load(sets[0])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for s in sets[1:] + sets[:1]:
        ref = load(s)
        out.fill_(float("nan"))
        out_ref.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.isfinite(out).all() and torch.isfinite(out_ref).all()
        assert _rel(out, ref) < TOL["bfloat16"]
        assert _rel(out_ref, ref) < TOL["bfloat16"]


def test_rejects_bad_inputs(dev):
    import torch
    from exl3tools.kernels import paged_attention as pa

    q = torch.randn(2, 4, 32, device=dev)
    k = torch.randn(3, 16, 2, 32, device=dev)
    bt = torch.zeros(2, 2, dtype=torch.int32, device=dev)
    lens = torch.ones(2, dtype=torch.int32, device=dev)
    with pytest.raises(ValueError):
        pa.paged_decode(q, k, k, bt.long(), lens, 1.0)
    with pytest.raises(ValueError):
        pa.paged_decode(q, k, k.half(), bt, lens, 1.0)
    with pytest.raises(ValueError):
        pa.paged_decode(q[:, :3], k, k, bt, lens, 1.0)
    with pytest.raises(ValueError):
        pa.paged_decode(q, k, k, bt, lens, 1.0, out=torch.empty(2, 4, 32, device=dev, dtype=torch.float16))


def test_split_rule():
    """Wave-aware default (H200: 132 SMs x 2 resident programs at D 128): fills the slots, no thin
    last wave, one split once B * nkv covers the GPU."""
    pytest.importorskip("triton")
    from exl3tools.kernels.paged_attention import _choose_splits

    slots = 264
    assert _choose_splits(8, slots, 128) >= 30            # B 1 x 8 kv heads: ~one full wave
    assert _choose_splits(256, slots, 128) == 1           # B 32 x 8: already 97% of one wave
    assert _choose_splits(320, slots, 128) == 4           # B 40 x 8: 1 split = 1.2 waves
    assert _choose_splits(8, slots, 5) == 5               # capped by the tiles in the table
    for programs in range(1, 600, 7):                    # every slot busy, or one split
        s = _choose_splits(programs, slots, 128)
        assert s == 1 or programs * s >= 0.9 * min(slots, 128 * programs)

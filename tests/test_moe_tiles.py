"""Expert-sorted tiles (runtime.layers.expert_tiles, MoE.forward_static(tiles=True)): the layout
covers every held (token, expert) pair exactly once, and the tiled MoE equals the per-pair and
the host-grouped paths on real fixtures (reference backend: DenseExperts.tiles)."""

from __future__ import annotations

import os

import pytest
import torch

from exl3tools.runtime.layers import MoE, expert_tiles, tile_rows
from exl3tools.runtime.loader import resolve
from exl3tools.runtime.runner import build_local_model
from tests.conftest import fixture_dir


@pytest.mark.parametrize("S,E,rows", [(1, 4, 8), (7, 3, 8), (64, 16, 8), (300, 16, 64), (40, 128, 16)])
def test_expert_tiles_cover_each_pair_once(S, E, rows):
    g = torch.Generator().manual_seed(S * 31 + E)
    loc = torch.randint(-1, E, (S,), generator=g)             # -1: an expert held by another rank
    tile_exp, row_exp, slot, valid = expert_tiles(loc, E, rows)
    NT = S // rows + min(E, S)
    assert tile_exp.shape == (NT,) and row_exp.shape == slot.shape == valid.shape == (NT * rows,)
    got = slot[valid].tolist()
    assert sorted(got) == [s for s in range(S) if loc[s] >= 0]          # each held pair once
    assert (slot[~valid] == S).all()
    # a valid row's expert is its pair's expert and its tile's; unused tiles are -1
    assert (row_exp[valid] == loc[slot[valid]]).all()
    assert (tile_exp.repeat_interleave(rows)[valid] == row_exp[valid]).all()
    assert ((row_exp >= 0) & (row_exp < E)).all()
    used = tile_exp >= 0
    assert used.sum() == sum(-(-int((loc == e).sum()) // rows) for e in range(E))
    assert not valid.view(NT, rows)[~used].any()


def test_tile_rows_follows_the_mean():
    assert tile_rows(8, 128) == 8 and tile_rows(256, 128) == 8
    assert tile_rows(2048, 128) == 32 and tile_rows(16384, 128) == 64
    # a backend with 128-row tiles (the shared-memory CUDA kernels): 1.5x the mean fits in one
    assert tile_rows(16384, 256, 128) == 128 and tile_rows(16384, 128, 128) == 128
    assert tile_rows(2048, 128, 128) == 32 and tile_rows(8, 128, 16) == 8 and tile_rows(16384, 128, 16) == 16


@pytest.mark.parametrize("chunk_rows", [8192, 16])       # 16: several chunks of tiles per call
@pytest.mark.parametrize("name", ["qwen3_moe-2.5bpw-mul1", "glm4_moe-3.0bpw-mcg"])
def test_tiled_moe_equals_pairs_and_loop(name, chunk_rows, monkeypatch):
    import exl3tools.runtime.layers as layers

    monkeypatch.setattr(layers, "MOE_CHUNK_ROWS", chunk_rows)
    model = build_local_model(resolve(fixture_dir(name) / "model", 1), 0, 1)
    moes = [layer.mlp for layer in model.layers if isinstance(layer.mlp, MoE)]
    assert moes
    moe = moes[0]
    assert moe._tiled()
    H = model.info.hidden_size
    x = torch.randn(37, H, generator=torch.Generator().manual_seed(0))
    loop = moe(x)                                   # CPU: the host-grouped loop
    pairs = moe.forward_static(x, tiles=False)
    tiled = moe.forward_static(x, tiles=True)
    assert loop.abs().max() > 0
    torch.testing.assert_close(tiled, loop, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pairs, loop, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernel", ["reference", "triton"])
def test_moe_combine_adds_each_tokens_rows_in_order(kernel):
    """kernels/moe_combine: out[t] += sum_k w[t, k] * y[inv[t, k]] over inv >= 0; rows never
    referenced may be NaN; the Triton kernel (interpreter) equals the reference, and both the
    float64 sum."""
    from exl3tools.kernels import moe_combine

    if kernel == "triton":
        if os.environ.get("TRITON_INTERPRET") != "1" or moe_combine.triton is None:
            pytest.skip("needs TRITON_INTERPRET=1 (make test sets it)")
    g = torch.Generator().manual_seed(3)
    T, K, H, rows = 7, 3, 1100, 16                    # H: a partial second column block
    y = torch.randn(rows, H + 4, generator=g)          # wider than H: its stride, not H, steps rows
    y[5] = float("nan")                                # never referenced
    inv = torch.randint(0, rows, (T, K), generator=g, dtype=torch.int32)
    inv[inv == 5] = 6
    inv[0, 1], inv[3] = -1, -1                         # pairs of another chunk or rank
    w = torch.rand(T, K, generator=g)
    base = torch.randn(T, H, generator=g)
    fn = moe_combine.combine if kernel == "triton" else moe_combine.combine_reference
    got = fn(base.clone(), y, inv, w)
    want = base.double().clone()
    for t in range(T):
        for k in range(K):
            if inv[t, k] >= 0:
                want[t] += w[t, k].double() * y[inv[t, k], :H].double()
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)
    if kernel == "triton":
        torch.testing.assert_close(got, moe_combine.combine_reference(base.clone(), y, inv, w), rtol=1e-6, atol=1e-6)

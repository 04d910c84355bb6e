"""Expert-sorted tiles (runtime.layers.expert_tiles, MoE.forward_static(tiles=True)): the layout
covers every held (token, expert) pair exactly once, and the tiled MoE equals the per-pair and
the host-grouped paths on real fixtures (reference backend: DenseExperts.tiles)."""

from __future__ import annotations

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

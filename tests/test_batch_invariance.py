"""Batch-invariant runs (runtime/invariance.py) on the CPU: the pieces whose logic needs no GPU --
the fixed-shape GEMM chunks, the attention's fixed split rule (also through the Triton kernel on
the interpreter), the lone-row scan of the sampler, and the refusals (CPU, TP, no fixed-shape step).
tests/gpu/test_batch_invariance_gpu.py checks the whole step and the server on CUDA."""

from __future__ import annotations

import math
import os

import pytest
import torch

from exl3tools.errors import UsageError
from exl3tools.runtime import invariance


def test_rows_mm_equals_the_product_and_each_row_is_its_own():
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(150, 96, generator=g), torch.randn(96, 40, generator=g), torch.randn(40, generator=g)
    y = invariance.rows_mm(x, w, b)
    assert y.shape == (150, 40) and torch.allclose(y, x @ w + b, atol=1e-4)
    for lo, hi in [(0, 1), (3, 9), (60, 70), (0, 150)]:
        assert torch.equal(invariance.rows_mm(x[lo:hi], w, b), y[lo:hi]), (lo, hi)
    assert invariance.rows_mm(x[:0], w).shape == (0, 40)


def test_prefill_cap_keeps_every_step_in_the_prompt_buckets(monkeypatch):
    assert invariance.cap_prefill_tokens(2048, 32) == invariance.PROMPT_ROWS - 32
    assert invariance.cap_prefill_tokens(100, 32) == 100
    assert invariance.cap_prefill_tokens(2048, 1000) == 1
    pytest.importorskip("fastapi")
    from exl3tools.server.app import ServeConfig, prefill_tokens

    cfg = ServeConfig(max_prefill_tokens=2048, max_batch=32)
    monkeypatch.delenv(invariance.VARIABLE, raising=False)
    assert prefill_tokens(cfg) == 2048                     # the engine's and the runner's budget as given
    monkeypatch.setenv(invariance.VARIABLE, "1")
    assert prefill_tokens(cfg) == invariance.PROMPT_ROWS - 32   # capped for both in the mode


@pytest.mark.parametrize("table_tokens", [16, 1000, 4096, 32768, 131072, 202752])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_invariant_splits_give_every_row_the_same_tiles_per_split(table_tokens, dtype):
    """The split kernel's rule, tiles per split = max(ceil(tiles / splits), min_tiles), is min_tiles for
    every context the table can hold: a row's split points do not depend on the batch."""
    from exl3tools.kernels import paged_attention as pa

    splits, t = pa.invariant_splits(table_tokens, 128, dtype)
    tn = pa.default_config(128, dtype)[0]
    assert 1 <= splits <= pa.INVARIANT_MAX_SPLITS and t >= pa.INVARIANT_MIN_TILES
    for ctx in sorted({1, tn, tn + 1, table_tokens // 2, table_tokens - 1, table_tokens}):
        ntiles = math.ceil(ctx / tn)
        assert max(math.ceil(ntiles / splits), t) == t
        assert math.ceil(ntiles / t) <= splits                # every tile falls in a split


def test_paged_attention_rows_alone_equal_rows_in_a_batch_on_the_interpreter():
    pytest.importorskip("triton")
    from exl3tools.kernels import paged_attention as pa

    if not pa.INTERPRET:
        pytest.skip("needs TRITON_INTERPRET=1 (make test sets it) to run Triton on the CPU")
    g = torch.Generator().manual_seed(1)
    B, nq, nkv, D, bs, width = 4, 4, 2, 32, 4, 48
    k = torch.randn(B * width + 1, bs, nkv, D, generator=g)
    v = torch.randn(B * width + 1, bs, nkv, D, generator=g)
    q = torch.randn(B, nq, D, generator=g)
    tables = (torch.randperm(B * width, generator=g).to(torch.int32) + 1).view(B, width)
    lens = torch.tensor([190, 3, 77, 150], dtype=torch.int32)
    splits, t = pa.invariant_splits(width * bs, D, k.dtype)
    assert splits > 1
    full = pa.paged_decode(q, k, v, tables, lens, 0.2, num_splits=splits, min_split_tiles=t)
    assert torch.allclose(full, pa.paged_decode_reference(q, k, v, tables, lens, 0.2), atol=1e-4)
    for i in range(B):
        one = pa.paged_decode(q[i:i + 1], k, v, tables[i:i + 1], lens[i:i + 1], 0.2, num_splits=splits,
                              min_split_tiles=t)
        assert torch.equal(one, full[i:i + 1]), i


def test_sampling_scans_a_lone_row_as_a_row_of_a_matrix():
    from exl3tools.runtime import sampling

    t = torch.rand(3, 1000, dtype=torch.float64)
    assert torch.equal(sampling._cumsum_rows(t[:1]), torch.cumsum(t[:1], -1))     # the CPU: no change
    assert torch.equal(sampling._cumsum_rows(t), torch.cumsum(t, -1))


def test_the_runner_refuses_the_mode_off_cuda(monkeypatch):
    from exl3tools.runtime.runner import load_runner
    from tests.conftest import DEMO

    monkeypatch.setenv(invariance.VARIABLE, "1")
    with pytest.raises(UsageError, match="batch-invariant serving"):
        load_runner(DEMO / "model", max_context=64)
    assert os.environ[invariance.VARIABLE] == "1"

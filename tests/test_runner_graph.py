"""Runner in graph-decode mode (static KV cache rows, GraphDecoder.step for decode) against the
eager Runner, on the CPU with the static path forced (no CUDA graphs), over an interleaved
continuous-batching schedule; and GraphDecoder's per-row API."""

from __future__ import annotations

from functools import lru_cache

import pytest
import torch

from exl3tools.errors import UsageError
from exl3tools.runtime.graph_decode import GraphDecoder
from exl3tools.runtime.runner import CacheFullError, ContextLengthError, Runner, load_runner
from tests.conftest import fixture_dir

REL = 1e-4
NAMES = ["glm4_moe-3.0bpw-mcg", "llama-4.0bpw-mul1"]
A, B, C = [1, 17, 300, 42, 1999, 7, 512], [5, 6, 7], [9, 8, 7, 6, 5, 4, 3, 2, 1, 100, 88]


@lru_cache(maxsize=None)
def _eager(name: str) -> Runner:
    return load_runner(fixture_dir(name) / "model", max_context=48)


def _graph(name: str, slots: int = 3) -> Runner:
    eager = _eager(name)   # same model object: only the caches differ
    return Runner(eager.model, fixture_dir(name) / "model", name, max_cache_tokens=eager.max_cache_tokens,
                  graph_slots=slots, graph_max_len=48, graph_force=True)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item() / b.float().abs().max().item()


def schedule(runner: Runner) -> list[torch.Tensor]:
    """A prefill, B prefill, A+B decode (B alone once), A freed, C added and prefilled while B decodes, B+C decode
    (C's prompt in two chunks, the second appended to a row that already holds tokens)."""
    out = []
    runner.add_sequence("A")
    out.append(runner.step([("A", A)]))
    runner.add_sequence("B")
    out.append(runner.step([("B", B)]))
    for t in ([3, 4], [900, 11], [42, 1]):
        out.append(runner.step([("A", [t[0]]), ("B", [t[1]])]))
    out.append(runner.step([("B", [2])]))               # A sits idle for a step
    out.append(runner.step([("B", [12]), ("A", [13])]))
    runner.free_sequence("A")
    runner.add_sequence("C")
    out.append(runner.step([("B", [77]), ("C", C[:6])]))
    out.append(runner.step([("C", C[6:]), ("B", [8])]))
    for t in ([64, 128], [5, 1500], [2000, 6]):
        out.append(runner.step([("C", [t[0]]), ("B", [t[1]])]))
    assert runner.sequence_length("B") == len(B) + 3 + 2 + 2 + 3
    assert runner.sequence_length("C") == len(C) + 3
    assert runner.cache_tokens_used() == runner.sequence_length("B") + runner.sequence_length("C")
    runner.free_sequence("B")
    runner.free_sequence("C")
    assert runner.cache_tokens_used() == 0
    return out


@pytest.mark.parametrize("name", NAMES)
def test_graph_runner_matches_eager_interleaved(name):
    g = _graph(name)
    assert g.graph is not None and not g.graph.graphs
    ref, got = schedule(_eager(name)), schedule(g)
    for s, (x, y) in enumerate(zip(got, ref, strict=True)):
        assert x.shape == y.shape and x.dtype == y.dtype == torch.float32 and x.device == y.device, s
        assert _rel(x, y) < REL, (name, s, _rel(x, y))


def test_graph_runner_rows_limits_and_all_logits():
    name = "llama-4.0bpw-mul1"
    g, e = _graph(name, slots=2), _eager(name)
    assert g.max_context == 48
    g.add_sequence(1)
    g.add_sequence(2)
    with pytest.raises(CacheFullError, match="rows"):
        g.add_sequence(3)
    g.free_sequence(2)
    g.add_sequence(3)                                  # the freed row is reused
    with pytest.raises(ContextLengthError):
        g.step([(1, [1] * 49)])
    with pytest.raises(UsageError, match="unknown"):
        g.step([(2, [1])])
    e.add_sequence("x")
    try:
        want = e.step([("x", A)], all_logits=True)
        got = g.step([(3, A)], all_logits=True)
        assert got.shape == want.shape == (len(A), g.vocab_size)
        assert _rel(got, want) < REL
        assert _rel(g.step([(3, [5])]), e.step([("x", [5])])) < REL
    finally:
        e.free_sequence("x")
    g.free_sequence(1)
    g.free_sequence(3)


def test_graph_runner_falls_back_on_cpu_and_mla(caplog):
    e = _eager("llama-4.0bpw-mul1")
    with caplog.at_level("WARNING", logger="exl3tools.runtime"):
        r = Runner(e.model, fixture_dir("llama-4.0bpw-mul1") / "model", "x", graph_slots=2)
    assert r.graph is None and r.max_context == e.max_context
    assert "CUDA device" in caplog.text
    mla = load_runner(fixture_dir("deepseek_v3-3.0bpw-3inst") / "model", graph_decode="force", graph_slots=2,
                      graph_max_len=16)
    assert mla.graph is None
    mla.add_sequence(0)
    assert mla.step([(0, [1, 2, 3])]).shape == (1, mla.vocab_size)
    with pytest.raises(UsageError):
        load_runner(fixture_dir("llama-4.0bpw-mul1") / "model", graph_decode="yes")


def test_graph_decoder_row_api_leaves_other_rows_alone():
    """prefill_row / step with inactive rows: an inactive row's cache and position do not move,
    even a row that is full (its writes go to the scratch slot)."""
    model = _eager("llama-4.0bpw-mul1").model
    gd = GraphDecoder(model, 3, 8, graphs=False)
    gd.prefill_row(0, [1, 2, 3])
    gd.prefill_row(2, [4, 5, 6, 7, 8, 9, 10, 11])             # row 2 is full
    snap = [(k.clone(), v.clone()) for k, v in gd.kv]
    out = gd.step(torch.tensor([7, 0, 0]), [True, False, False])
    assert gd.pos.tolist() == [4, 0, 8] and gd.row_length(0) == 4
    for (k, v), (k0, v0) in zip(gd.kv, snap, strict=True):
        assert torch.equal(k[1:, :8], k0[1:, :8]) and torch.equal(v[1:, :8], v0[1:, :8])
    ref_cache = model.new_cache()
    model.forward([(ref_cache, [1, 2, 3])])
    assert _rel(out[0], model.forward([(ref_cache, [7])])[0]) < REL
    with pytest.raises(UsageError, match="max_len"):
        gd.step(torch.tensor([7, 0, 0]))                      # row 2 active and full
    gd.reset_row(2)
    assert gd.row_length(2) == 0
    with pytest.raises(UsageError, match="row 3"):
        gd.reset_row(3)

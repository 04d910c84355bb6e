"""The Runner on the paged KV cache (eager forward through block tables, and the fixed-shape decode
step of runtime/paged_decode.py without graphs) against the plain per-sequence cache, on real
fixtures, over an interleaved continuous-batching schedule; prefix-cache hits, preemption and
re-admission, block boundaries, limits."""

from __future__ import annotations

from functools import lru_cache
from types import SimpleNamespace

import pytest
import torch

from exl3tools.errors import UsageError
from exl3tools.runtime.block_manager import SCRATCH_BLOCK
from exl3tools.runtime.runner import CacheFullError, ContextLengthError, Runner, load_runner
from tests.conftest import fixture_dir

REL = 1e-4
GQA = ["glm4_moe-3.0bpw-mcg", "llama-4.0bpw-mul1", "qwen3_moe-2.5bpw-mul1"]
A, B, C = [1, 17, 300, 42, 1999, 7, 512], [5, 6, 7], [9, 8, 7, 6, 5, 4, 3, 2, 1, 100, 88]


@lru_cache(maxsize=None)
def _model(name: str):
    return load_runner(fixture_dir(name) / "model", max_context=48, max_cache_tokens=64).model


def _paged(name: str, decode: str, **kw) -> Runner:
    kw = {"max_cache_tokens": 256, "block_size": 4, "max_num_seqs": 3, **kw}
    return Runner(_model(name), fixture_dir(name) / "model", name, decode=decode, **kw)


class Reference:
    """The plain runtime: one growing SeqCache per sequence, CausalLM.forward."""

    def __init__(self, model):
        self.model, self.caches = model, {}

    def add_sequence(self, sid, tokens=()):
        self.caches[sid] = self.model.new_cache()
        return 0

    def free_sequence(self, sid):
        del self.caches[sid]

    def sequence_length(self, sid):
        return self.caches[sid].length

    def step(self, batch, all_logits=False):
        return self.model.forward([(self.caches[s], t) for s, t in batch], all_logits=all_logits)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item() / b.float().abs().max().item()


class Lockstep:
    """A runner ``r`` and the plain cache ``ref`` in step: ``step`` runs a batch on both and
    checks the logits agree within ``rel`` (returning ``r``'s path); ``add`` / ``free`` a sequence
    on both."""

    def __init__(self, r, ref, rel: float = REL):
        self.r, self.ref, self.rel = r, ref, rel

    def add(self, *sids) -> None:
        for sid in sids:
            self.r.add_sequence(sid)
            self.ref.add_sequence(sid)

    def free(self, sid) -> None:
        self.r.free_sequence(sid)
        self.ref.free_sequence(sid)

    def step(self, batch, **kw) -> str:
        got, want = self.r.step(batch, **kw), self.ref.step(batch, **kw)
        assert got.shape == want.shape and _rel(got, want) < self.rel, (batch, _rel(got, want))
        return self.r.last_path


def schedule(r) -> list[torch.Tensor]:
    """A prefill, B prefill, A+B decode (B alone once), A freed, C prefilled in two chunks while
    B decodes, B+C decode: blocks of 4 fill, cross boundaries and are reused after A is freed."""
    out = []
    r.add_sequence("A")
    out.append(r.step([("A", A)]))
    r.add_sequence("B")
    out.append(r.step([("B", B)]))
    for t in ([3, 4], [900, 11], [42, 1]):
        out.append(r.step([("A", [t[0]]), ("B", [t[1]])]))
    out.append(r.step([("B", [2])]))
    out.append(r.step([("B", [12]), ("A", [13])]))
    r.free_sequence("A")
    r.add_sequence("C")
    out.append(r.step([("B", [77]), ("C", C[:6])]))
    out.append(r.step([("C", C[6:]), ("B", [8])]))
    for t in ([64, 128], [5, 1500], [2000, 6]):
        out.append(r.step([("C", [t[0]]), ("B", [t[1]])]))
    assert r.sequence_length("B") == len(B) + 10 and r.sequence_length("C") == len(C) + 3
    r.free_sequence("B")
    r.free_sequence("C")
    return out


@pytest.mark.parametrize("decode", ["eager", "static"])
@pytest.mark.parametrize("name", GQA)
def test_paged_runner_matches_plain_cache(name, decode):
    ref, got = schedule(Reference(_model(name))), schedule(_paged(name, decode))
    for s, (x, y) in enumerate(zip(got, ref, strict=True)):
        assert x.shape == y.shape and x.dtype == torch.float32 and x.device.type == "cpu", s
        assert _rel(x, y) < REL, (name, decode, s, _rel(x, y))


@pytest.mark.parametrize("decode", ["eager", "static"])
def test_paged_runner_mla_and_dsa(decode):
    for name in ("deepseek_v3-3.0bpw-3inst", "glm5_moe_dsa-3.0bpw-mul1"):
        model = _model(name)
        r = Runner(model, fixture_dir(name) / "model", name, decode=decode, max_cache_tokens=128, block_size=4)
        assert r.decode_mode == decode           # MLA: the fixed-shape step too (MLAttention.decode_static)
        ref = Reference(model)
        for x in (r, ref):
            x.add_sequence(0)
        prompt = list(range(3, 40))
        assert _rel(r.step([(0, prompt)]), ref.step([(0, prompt)])) < REL
        for t in (5, 77, 1000):
            assert _rel(r.step([(0, [t])]), ref.step([(0, [t])])) < REL


@pytest.mark.parametrize("decode", ["eager", "static"])
def test_prefix_hits_and_readmission_give_the_same_logits(decode):
    name = "glm4_moe-3.0bpw-mcg"
    r, ref = _paged(name, decode), Reference(_model(name))
    system = list(range(200, 219))                     # 19 tokens: 4 whole blocks of 4
    p1, p2 = system + [7, 8, 9], system + [11, 12]
    ref.add_sequence("x")
    want1 = ref.step([("x", p1)])
    assert r.add_sequence("a", p1) == 0
    assert _rel(r.step([("a", p1)]), want1) < REL
    ref.add_sequence("y")
    want2 = ref.step([("y", p2)])
    cached = r.add_sequence("b", p2)                  # the system prompt's whole blocks are reused
    assert cached == 16 and r.sequence_length("b") == 16
    assert _rel(r.step([("b", p2[cached:])]), want2) < REL
    assert r.prefix_stats().hit_tokens == 16
    # decode both, then "preempt" a: free it and re-admit prompt + output: its own blocks come back
    outs = [3, 4, 5, 6]
    for t in outs:
        r.step([("a", [t]), ("b", [t])])
        ref.step([("x", [t]), ("y", [t])])
    r.free_sequence("a")
    hist = p1 + outs
    cached = r.add_sequence("a2", hist)
    assert cached == (len(hist) - 1) // 4 * 4
    got = r.step([("a2", hist[cached:])])
    assert _rel(got, ref.step([("x", [99])]) if False else got) == 0   # shape sanity
    assert _rel(r.step([("a2", [99])]), ref.step([("x", [99])])) < REL


def test_limits_back_pressure_and_slots():
    name = "llama-4.0bpw-mul1"
    r = _paged(name, "static", max_cache_tokens=16, max_num_seqs=2)   # 4 blocks of 4
    assert r.max_context == 16
    r.add_sequence(1)
    r.add_sequence(2)
    with pytest.raises(CacheFullError, match="slots"):
        r.add_sequence(3)
    with pytest.raises(ContextLengthError):
        r.step([(1, [1] * 17)])
    r.step([(1, list(range(1, 13)))])                # 3 blocks
    assert r.fits([(2, 4)]) and not r.fits([(2, 5)]) and not r.fits([(1, 1), (2, 4)])
    held = r.blocks_needed([(1, 1)])                 # the engine's admission: counted once, then added
    assert held == 1 and r.fits([(2, 4)], held - 1) and not r.fits([(2, 4)], held)
    with pytest.raises(CacheFullError, match="KV cache full"):
        r.step([(1, [5]), (2, [1, 2, 3, 4])])
    assert r.sequence_length(1) == 12 and r.sequence_length(2) == 0    # nothing changed
    r.free_sequence(2)
    r.add_sequence(3)                                  # the freed slot is reused
    with pytest.raises(UsageError, match="unknown"):
        r.step([(2, [1])])
    r.free_sequence(1)
    r.free_sequence(3)
    assert r.cache_tokens_used() == 0 and r.blocks.used_blocks() == 0
    with pytest.raises(UsageError):
        Runner(_model(name), fixture_dir(name) / "model", name, decode="graphs", max_cache_tokens=16)
    with pytest.raises(UsageError):
        load_runner(fixture_dir(name) / "model", decode="yes")


def test_a_failed_step_never_feeds_the_prefix_cache(monkeypatch):
    name = "llama-4.0bpw-mul1"
    r = _paged(name, "eager")
    prompt = list(range(30, 52))
    r.add_sequence("a", prompt)

    def broken(*a, **k):
        raise RuntimeError("simulated device fault")
    monkeypatch.setattr(r.paged, "forward", broken)
    with pytest.raises(RuntimeError, match="simulated"):
        r.step([("a", prompt)])
    monkeypatch.undo()
    assert r.sequence_length("a") == 0
    r.free_sequence("a")
    assert r.add_sequence("b", prompt) == 0            # nothing of the failed step was hashed
    r.step([("b", prompt)])
    r.free_sequence("b")
    assert r.add_sequence("c", prompt) == 20           # a good step is


# (qwen3_moe's case ran the same kernel at the same heads, 4 query / 2 KV of 64 dims, over the same
# schedule: its q/k norms and MoE layers are before and after the kernel)
@pytest.mark.parametrize("name", ["llama-4.0bpw-mul1"])
def test_paged_prefill_kernel_matches_plain_cache(name, monkeypatch):
    """The GPU's eager attention (kernels.paged_attention.paged_prefill: new K/V written, then one
    kernel over every sequence's blocks) run by Triton's interpreter on the CPU: the same schedule
    (prefills, a chunk after cached tokens, mixed decode rows) gives the plain cache's logits."""
    pytest.importorskip("triton")
    import exl3tools.kernels.paged_attention as pa

    import exl3tools.runtime.layers as layers

    if not pa.INTERPRET:
        pytest.skip("needs TRITON_INTERPRET=1 (make test sets it) to run Triton on the CPU")
    monkeypatch.setattr(layers, "PAGED_PREFILL_ON_CPU", True)
    calls = []
    real = pa.paged_prefill
    monkeypatch.setattr(pa, "paged_prefill", lambda *a, **k: calls.append(1) or real(*a, **k))
    ref, got = schedule(Reference(_model(name))), schedule(_paged(name, "eager"))
    assert calls                                   # the kernel ran, not the plain path
    for s, (x, y) in enumerate(zip(got, ref, strict=True)):
        assert _rel(x, y) < REL, (name, s, _rel(x, y))


@pytest.mark.parametrize("name", ["glm4_moe-3.0bpw-mcg", "qwen3_moe-2.5bpw-mul1"])
def test_short_prompts_and_mixed_steps_run_as_decode_rows(name, monkeypatch):
    """Up to max_num_seqs new tokens in a step run through the fixed-shape decode step, one row per
    token (rows of a sequence share its block-table row, attend causally): a prompt across block
    boundaries, all_logits, a prefix hit's tail, a prompt beside a decoding sequence."""
    r, ref = _paged(name, "static", max_num_seqs=8), Reference(_model(name))
    monkeypatch.setattr(r.paged, "forward", lambda *a, **k: pytest.fail("eager forward for <= 8 rows"))
    for x in (r, ref):
        x.add_sequence("A")
    got, want = r.step([("A", A)], all_logits=True), ref.step([("A", A)], all_logits=True)
    assert got.shape == want.shape == (len(A), want.shape[1]) and _rel(got, want) < REL
    for x in (r, ref):
        x.add_sequence("B")
    got, want = r.step([("A", [5]), ("B", B)]), ref.step([("A", [5]), ("B", B)])
    assert got.shape == want.shape == (2, want.shape[1]) and _rel(got, want) < REL
    for t in (6, 7):
        assert _rel(r.step([("A", [t]), ("B", [t])]), ref.step([("A", [t]), ("B", [t])])) < REL
    r.free_sequence("B")
    hist = B + [6, 7]
    cached = r.add_sequence("B2", hist)                 # whole blocks of B come back from the cache
    assert cached == 4
    ref.add_sequence("B2")
    assert _rel(r.step([("B2", hist[cached:])]), ref.step([("B2", hist)])) < REL
    monkeypatch.undo()
    r.add_sequence("C")                                 # 11 rows > 8: the eager forward again
    ref.add_sequence("C")
    assert _rel(r.step([("C", C)]), ref.step([("C", C)])) < REL


@pytest.mark.parametrize("name", ["glm4_moe-3.0bpw-mcg", "deepseek_v3-3.0bpw-3inst", "glm5_moe_dsa-3.0bpw-mul1"])
def test_prompt_steps_replay_larger_buckets(name, monkeypatch):
    """Past the decode buckets (max_num_seqs rows), short prompts beside decoding rows run the
    fixed-shape step in a prompt bucket, the eager forward untouched, with the plain cache's
    logits of each sequence's last row, DSA selecting where a row is past index_topk; all_logits
    or more context reads than PROMPT_GRAPH_READS take the eager forward."""
    import exl3tools.runtime.runner as R

    r, ref = _paged(name, "static", max_num_seqs=3, prompt_rows=16), Reference(_model(name))
    d = r.paged.decoder
    assert (d.max_rows, d.prompt_buckets) == (3, [4, 8, 16])
    eager, forward = [], r.paged.forward
    monkeypatch.setattr(r.paged, "forward", lambda *a, **k: eager.append(1) or forward(*a, **k))

    ls = Lockstep(r, ref)
    ls.add("A")
    assert ls.step([("A", A)]) == "prompt"                      # 7 rows: bucket 8
    ls.add("B")
    assert ls.step([("A", [5]), ("B", B)]) == "prompt"          # 1 + 3 rows: bucket 4
    ls.add("C")
    assert ls.step([("A", [6]), ("C", C), ("B", [7])]) == "prompt"  # 1 + 11 + 1: bucket 16
    assert ls.step([("A", [8]), ("B", [9]), ("C", [10])]) == "decode" and not eager
    ls.free("C")
    ls.add("D")
    assert ls.step([("D", C[:5])], all_logits=True) == "eager" and eager == [1]
    monkeypatch.setattr(R, "PROMPT_GRAPH_READS", 5 * 10 - 1)     # D's next 5 rows read 10 + ... > 49
    assert ls.step([("D", C[5:10]), ("A", [11])]) == "eager" and eager == [1, 1]
    monkeypatch.setattr(R, "PROMPT_GRAPH_READS", 512 * 512)
    if d.dsa_topk is not None:        # glm5: index_topk 32; A holds 11 tokens
        assert ls.step([("A", list(range(40, 55))), ("B", [12])]) == "prompt" and not d.last_sparse   # A ends at 26
        assert ls.step([("A", list(range(3, 10))), ("B", [13])]) == "prompt" and d.last_sparse   # at 33: selects
        assert eager == [1, 1]
    with pytest.raises(UsageError, match="draft step takes"):       # the MTP head's step: decode buckets only
        type(d).draft(SimpleNamespace(head_pool=1, max_rows=3), [1] * 4, [0] * 4, [0] * 4, [0] * 4, None)


def test_prompt_graphs_preview_sets_the_prompt_rows(monkeypatch):
    """prompt_rows defaults to PROMPT_GRAPH_ROWS (within the prefill budget) when the
    prompt_graphs preview is on, else no prompt buckets."""
    name = "llama-4.0bpw-mul1"
    monkeypatch.delenv("EXL3TOOLS_PROMPT_GRAPHS", raising=False)
    assert _paged(name, "static").paged.decoder.prompt_buckets == []
    monkeypatch.setenv("EXL3TOOLS_PROMPT_GRAPHS", "1")
    d = _paged(name, "static", max_num_batched_tokens=64).paged.decoder
    assert d.prompt_rows == 64 + 3 and d.prompt_buckets == [4, 8, 16, 24, 32, 48, 64, 67]
    assert _paged(name, "static", max_num_batched_tokens=4096).paged.decoder.prompt_rows == 512
    monkeypatch.setenv("EXL3TOOLS_ROW_STEPS", "0")
    assert _paged(name, "static").paged.decoder.prompt_buckets == []


@pytest.mark.parametrize("name", ["deepseek_v3-3.0bpw-3inst", "glm5_moe_dsa-3.0bpw-mul1"])
def test_mla_eager_rows_attend_through_the_decode_kernels(name, monkeypatch):
    """The mla_eager_rows preview: in an eager step (a prompt chunk of SDPA_MIN_ROWS+ rows), the
    decode and verify rows beside it attend in one pass of the decode step's attention
    (MLAttention.attend_rows: their torch references on the CPU), DSA selecting past index_topk
    (glm5's fixture: 32) in its full layer and reusing that in its shared one; the plain cache's
    logits. The prompts go through the decompressed SDPA path as on CUDA (SDPA_ON_CPU)."""
    from exl3tools.runtime import mla

    monkeypatch.setattr(mla, "SDPA_ON_CPU", True)
    monkeypatch.setenv("EXL3TOOLS_MLA_EAGER_ROWS", "1")
    model = _model(name)
    r = Runner(model, fixture_dir(name) / "model", name, decode="eager", max_cache_tokens=256, block_size=4)
    ref = Reference(model)
    calls = []
    real = mla.MLAttention.attend_rows
    monkeypatch.setattr(mla.MLAttention, "attend_rows",
                        lambda self, rows, *a: calls.append((self.layer, len(rows.rows))) or real(self, rows, *a))
    for x in (r, ref):
        x.add_sequence("A")
        x.add_sequence("B")
    prompt = list(range(3, 40))                    # 37 rows: the decompressed path
    assert _rel(r.step([("A", prompt)]), ref.step([("A", prompt)])) < REL and not calls
    batch = [("A", [5]), ("B", prompt)]            # A's decode row beside B's prompt
    assert _rel(r.step(batch), ref.step(batch)) < REL
    assert {n for _, n in calls} == {1} and len(calls) == len(model.layers)
    calls.clear()
    r.add_sequence("C")
    ref.add_sequence("C")
    batch = [("A", [6, 7, 8]), ("C", list(range(50, 90))), ("B", [9])]   # 3 verify-like rows, a prompt, a decode row
    assert _rel(r.step(batch, all_logits=True), ref.step(batch, all_logits=True)) < REL
    assert {n for _, n in calls} == {4}
    # A and B now hold 41 and 38 tokens: past glm5's index_topk, the rows select
    assert r.sequence_length("A") > 32 and r.sequence_length("B") > 32


def test_a_failed_prompt_graph_capture_keeps_the_decode_steps(caplog):
    """A prompt bucket whose capture fails (out of memory) drops every prompt bucket, says so, and
    prompt steps take the eager forward again; the decode buckets stay."""
    name = "llama-4.0bpw-mul1"
    r, ref = _paged(name, "static", max_num_seqs=3, prompt_rows=16), Reference(_model(name))
    d = r.paged.decoder

    def boom(_jobs, pool):
        assert pool == "decode"         # one graph pool with the decode buckets' (EXL3TOOLS_SHARED_GRAPH_POOL)
        d._pools[pool] = object()
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB\nmore")

    d._capture_keys = boom
    with caplog.at_level("WARNING", logger="exl3tools"):
        d._capture_prompt(d.prompt_buckets)
    assert d.prompt_buckets == [] and d.buckets == [1, 2, 3] and d._pools == {}     # the failed pool dropped
    assert any("prompt-step graphs" in m and "1.00 GiB" in m and "more" not in m for m in caplog.messages)
    for x in (r, ref):
        x.add_sequence("A")
    assert _rel(r.step([("A", A)]), ref.step([("A", A)])) < REL and r.last_path == "eager"
    assert _rel(r.step([("A", [3])]), ref.step([("A", [3])])) < REL and r.last_path == "decode"
    # a TP worker whose capture failed still runs its rank 0's prompt steps (bucket 8, no graph)
    out = d.step([5] * 7, list(range(7)), [SCRATCH_BLOCK * r.block_size] * 7, [0] * 7)
    assert out.shape == (1, ref.model.info.vocab_size)


def test_row_steps_switched_off_keep_multi_token_steps_eager(monkeypatch):
    """Several rows of one sequence in the decode step can be switched off (EXL3TOOLS_ROW_STEPS=0,
    runtime/preview.py): then a prompt takes the eager forward, single-token rows still the decode
    step, and the logits are the plain cache's."""
    name = "glm4_moe-3.0bpw-mcg"
    monkeypatch.setenv("EXL3TOOLS_ROW_STEPS", "0")
    r, ref = _paged(name, "static", max_num_seqs=8), Reference(_model(name))
    assert not r._row_steps
    calls = []
    forward = r.paged.forward
    monkeypatch.setattr(r.paged, "forward", lambda *a, **k: calls.append(1) or forward(*a, **k))
    for x in (r, ref):
        x.add_sequence("A")
    assert _rel(r.step([("A", B)]), ref.step([("A", B)])) < REL and calls == [1]
    assert _rel(r.step([("A", [4])]), ref.step([("A", [4])])) < REL and calls == [1]


def test_preview_switches(monkeypatch):
    """A preview is off unless its variable is "1"; a former preview is on unless it is "0"; the
    fused step on the CPU (the Triton interpreter, slow) only when asked for."""
    from exl3tools.kernels import fused_decode as fk

    from exl3tools.runtime import fused_step, preview

    monkeypatch.setitem(preview.SWITCHES, "trial", "EXL3TOOLS_TRIAL")
    for name, env, unset in [("trial", "EXL3TOOLS_TRIAL", False), *((n, e, True) for n, e in preview.OPT_OUTS.items())]:
        monkeypatch.delenv(env, raising=False)
        assert preview.switched_on(name) is unset and not preview.asked_for(name)
        monkeypatch.setenv(env, "1")
        assert preview.switched_on(name) and preview.asked_for(name)
        monkeypatch.setenv(env, "0")
        assert not preview.switched_on(name) and not preview.asked_for(name)
    monkeypatch.delenv("EXL3TOOLS_FUSED")
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert fused_step.resolve(None, cuda) is fk.available(cuda) and fused_step.resolve(None, cpu) is False
    monkeypatch.setenv("EXL3TOOLS_FUSED", "1")
    assert fused_step.resolve(None, cpu) is fk.available(cpu)
    monkeypatch.setenv("EXL3TOOLS_FUSED", "0")
    assert fused_step.resolve(None, cuda) is False
    # on_cuda: the DSA prompt paths, on CUDA unless "0", on the CPU only when "1"
    for env, want in ((None, (True, False)), ("1", (True, True)), ("0", (False, False))):
        monkeypatch.delenv("EXL3TOOLS_DSA_SPARSE_PREFILL", raising=False)
        if env is not None:
            monkeypatch.setenv("EXL3TOOLS_DSA_SPARSE_PREFILL", env)
        assert (preview.on_cuda("dsa_sparse_prefill", cuda), preview.on_cuda("dsa_sparse_prefill", cpu)) == want


@pytest.mark.parametrize("name", ["llama-4.0bpw-mul1", "deepseek_v3-3.0bpw-3inst"])
def test_a_failed_graph_capture_decodes_eagerly(name, caplog):
    """A capture that fails on one rank (out of memory, a kernel that does not build) leaves a
    runner that decodes eagerly with the same logits, and says so, instead of a dead server."""
    r, ref = _paged(name, "static"), Reference(_model(name))

    def boom(*_a, **_k):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore detail")

    r.paged.decoder.capture = boom
    with caplog.at_level("WARNING", logger="exl3tools"):
        r._capture()
    assert r.decode_mode == "eager" and r.paged.decoder is None
    assert any("CUDA graph capture failed, decoding eagerly" in m and "2.00 GiB" in m and "detail" not in m
               for m in caplog.messages), caplog.messages
    for x in (r, ref):
        x.add_sequence("A")
    assert _rel(r.step([("A", A)]), ref.step([("A", A)])) < REL
    for t in ([4], [9]):
        assert _rel(r.step([("A", t)]), ref.step([("A", t)])) < REL


def test_dsa_graph_widths_double_up_to_the_table():
    from exl3tools.runtime.paged_decode import widths

    assert widths(12672, 16) == [256, 512, 1024, 2048, 4096, 8192, 12672]    # GLM-5's 202752 tokens
    assert widths(2048, 16) == [256, 512, 1024, 2048]
    assert widths(100, 16) == [100] and widths(256, 64) == [64, 128, 256]

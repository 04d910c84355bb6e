"""The decoder's long step (PagedDecoder.long_step; on CUDA unless EXL3TOOLS_LONG_STEPS=0, on the
CPU with =1): a step past the prompt buckets runs the fused glue once, eagerly, each sequence's
rows attending through the paged prefill kernel (Triton's interpreter on the CPU). It gives the
plain cache's logits of each sequence's last row, alone or beside decoding rows, after cached
tokens and across block boundaries; every row's logits still take the eager forward."""

from __future__ import annotations

import pytest

from exl3tools.errors import UsageError
from tests.test_fused_decode import _interpret
from tests.test_paged_runner import Lockstep, Reference, _model, _paged

A, B = [1, 17, 300, 42, 1999, 7, 512], [9, 8, 7, 6, 5, 4, 3, 2, 1, 100, 88]
C = [(13 * i + 5) % 2000 + 2 for i in range(21)]
# The KV profile's tests check which steps profile_forward runs (row counts, paths), which depends on
# the model only through fused_step.supports (a GQA model): the dense llama fixture runs them at
# ~half qwen3_moe's interpreter time (the MoE glue of long steps: test_long_steps_match_plain_cache)
PROFILE_MODEL = "llama-4.0bpw-mul1"


def _long_runner(name: str, monkeypatch):
    _interpret()
    monkeypatch.setenv("EXL3TOOLS_FUSED", "1")
    monkeypatch.setenv("EXL3TOOLS_LONG_STEPS", "1")
    r = _paged(name, "static", max_num_seqs=3, prompt_rows=8)
    d = r.paged.decoder
    assert d.long_steps and (d.max_rows, d.prompt_buckets) == (3, [4, 8])
    paths = []
    real_forward, real_long = r.paged.forward, d.long_step
    monkeypatch.setattr(r.paged, "forward", lambda *a, **k: paths.append("eager") or real_forward(*a, **k))
    monkeypatch.setattr(d, "long_step", lambda *a: paths.append("long") or real_long(*a))
    return r, paths


@pytest.mark.parametrize("name", ["glm4_moe-3.0bpw-mcg", "qwen3_moe-2.5bpw-mul1", "llama-4.0bpw-mul1"])
def test_long_steps_match_plain_cache(name, monkeypatch):
    import exl3tools.runtime.runner as R

    r, paths = _long_runner(name, monkeypatch)
    ls = Lockstep(r, Reference(_model(name)))
    ls.add("A")
    assert ls.step([("A", A)]) == "prompt"                           # 7 rows: bucket 8
    ls.add("B")
    assert ls.step([("A", [5]), ("B", B)]) == "long"                 # 1 + 11 rows: past the buckets
    assert ls.step([("B", [6]), ("A", [7])]) == "decode"
    if name != "glm4_moe-3.0bpw-mcg":
        # the model's own part of a long step is each row's glue (qwen3_moe: q/k norms and MoE
        # layers without a shared expert; llama: dense MLPs), which the step above ran beside a
        # decoding row; the steps below vary what the decoder and the paged prefill kernel read
        # (chunks, cached tokens, PROMPT_GRAPH_READS), at the same 4 heads / 2 KV heads / 64 dims
        # on all three: glm4_moe's case (~9 s of the interpreter a model)
        assert paths == ["long"]
        return
    ls.add("C")
    # a chunk beside two decoding rows, then the rest after its cached 9 tokens (blocks of 4)
    assert ls.step([("A", [8]), ("C", C[:9]), ("B", [10])]) == "long"
    assert ls.step([("C", C[9:]), ("A", [11])]) == "long"
    assert ls.step([("A", [12]), ("B", [13]), ("C", [14])]) == "decode"
    assert paths == ["long", "long", "long"]
    ls.free("C")
    ls.add("D")
    assert ls.step([("D", C[:10])], all_logits=True) == "eager" and paths[-1] == "eager"
    monkeypatch.setattr(R, "PROMPT_GRAPH_READS", 10)        # D's 5 rows read 11..15 each: past it
    assert ls.step([("D", C[10:15]), ("A", [15])]) == "long" and paths[-1] == "long"


def test_long_graphs_pad_the_step_to_its_bucket(monkeypatch):
    """The long_graphs preview (on the CPU: its body eagerly, the inputs padded as a graph takes
    them): a long step of up to a bucket of rows and ``long_seqs`` sequences runs padded, rows
    past its own as padding and the prefill kernel on a fixed grid of row tiles, and gives the
    plain cache's logits; a step of more sequences takes the eager long step."""
    import exl3tools.runtime.long_steps as P
    import exl3tools.runtime.runner as R

    monkeypatch.setattr(P, "LONG_GRAPH_ROWS", (16, 32))
    monkeypatch.setattr(P, "LONG_GRAPH_SEQS", 2)
    monkeypatch.setenv("EXL3TOOLS_LONG_GRAPHS", "1")
    # the buckets, the padding and the shared outputs are the decoder's, whatever the glue: the
    # dense llama fixture (half glm4_moe's interpreter time); glm4_moe's routed glue over padding
    # rows: test_a_failed_long_graph_capture_runs_long_steps_eagerly (18 rows padded to 32)
    name = "llama-4.0bpw-mul1"
    r, paths = _long_runner(name, monkeypatch)
    d = r.paged.decoder
    assert (d.long_buckets, d.long_seqs) == ([16, 32, 576], 2)      # 576: the largest planned step, 512 + 3
    padded = []
    real = d._long_padded
    monkeypatch.setattr(d, "_long_padded", lambda R_, *a: padded.append((R_, len(a[0]))) or real(R_, *a))
    ls = Lockstep(r, Reference(_model(name)))
    ls.add("A")
    assert ls.step([("A", A)]) == "prompt"
    ls.add("B")
    assert ls.step([("A", [5]), ("B", B)]) == "long"                 # 12 rows, 2 sequences: padded to 16
    ls.add("C")
    assert ls.step([("A", [8]), ("C", C[:9]), ("B", [10])]) == "long"   # 3 sequences: the eager long step
    assert ls.step([("C", C[9:]), ("A", [11])]) == "long"            # 13 rows after C's cached 9
    assert ls.step([("A", [12]), ("B", [13]), ("C", [14])]) == "decode"
    ls.free("C")
    ls.add("E")
    assert ls.step([("E", C), ("A", [16])]) == "long"               # 22 rows: bucket 32
    ls.free("E")
    ls.add("D")
    monkeypatch.setattr(R, "PROMPT_GRAPH_READS", 0)
    assert ls.step([("D", C[:5]), ("A", [15])]) == "long"           # bucket 16 after 32: the shared outputs
    assert padded == [(16, 12), (16, 13), (32, 22), (16, 6)] and paths == ["long"] * 5
    assert d._long_out[1].shape[0] == 576 and set(d._long) == {16, 32}      # sized once, for the largest


def test_long_graph_buckets_stop_at_the_largest_planned_step(monkeypatch):
    """Long-step graphs are captured for the buckets past the prompt buckets up to the first that
    holds the largest step the server plans (its prompt budget beside every sequence's decode
    row): a bucket no step reaches would cost its capture and its KV reserve for nothing. Off the
    GPU only when asked for ("1"), and the KV budget reserves none there."""
    import exl3tools.runtime.long_steps as P

    assert P.long_buckets(512) == list(range(640, 2049, 128))      # every 128 rows past the prompt buckets
    # a default server (--max-prefill-tokens 2048 beside 64 decoding rows): one more that fits its largest step
    assert P.long_buckets(512, 2048 + 64) == [*range(640, 2049, 128), 2112]
    assert P.long_buckets(512, 1025) == [640, 768, 896, 1024, 1152] and P.long_buckets(512, 576) == [640]
    monkeypatch.setattr(P, "LONG_GRAPH_ROWS", (1024, 2048))
    assert P.long_buckets(512) == [1024, 2048] == P.long_buckets(512, 2048)
    assert (P.long_buckets(512, 576), P.long_buckets(512, 1024), P.long_buckets(512, 1025)) == ([1024], [1024],
                                                                                               [1024, 2048])
    assert P.long_buckets(512, 512) == [] == P.long_buckets(4352, 4400)
    assert P.long_buckets(1024, 1100) == [2048]
    assert (P.long_buckets(512, 2049), P.long_buckets(512, 4352), P.long_buckets(512, 4353)) == (
        [1024, 2048, 2112], [1024, 2048, 4352], [1024, 2048])     # the fit bucket: up to LONG_GRAPH_MAX_ROWS
    monkeypatch.setattr(P, "LONG_GRAPH_ROWS", (16, 32, 64))
    _interpret()
    monkeypatch.setenv("EXL3TOOLS_FUSED", "1")
    monkeypatch.setenv("EXL3TOOLS_LONG_STEPS", "1")
    name = "glm4_moe-3.0bpw-mcg"
    monkeypatch.delenv("EXL3TOOLS_LONG_GRAPHS", raising=False)
    assert _paged(name, "static", prompt_rows=8, max_num_batched_tokens=20).paged.decoder.long_buckets == []
    monkeypatch.setenv("EXL3TOOLS_LONG_GRAPHS", "1")
    r = _paged(name, "static", prompt_rows=8, max_num_batched_tokens=20)      # steps of up to 20 + 3 rows
    assert (r.paged.decoder.step_rows, r.paged.decoder.long_buckets) == (23, [16, 32])
    r = _paged(name, "static", prompt_rows=8, max_num_batched_tokens=64)      # 67 rows: the fit bucket
    assert r.paged.decoder.long_buckets == [16, 32, 64, 128]
    assert P.long_graph_rows(r.model, 8, 23) == 0                              # no graphs off CUDA


def test_a_failed_long_graph_capture_runs_long_steps_eagerly(monkeypatch):
    """A long-step graph whose capture fails (out of memory, say): that step runs its padded body
    eagerly and is right, later long steps take the eager long step (no more buckets)."""
    import exl3tools.runtime.long_steps as P

    monkeypatch.setattr(P, "LONG_GRAPH_ROWS", (32,))
    monkeypatch.setenv("EXL3TOOLS_LONG_GRAPHS", "1")
    name = "glm4_moe-3.0bpw-mcg"
    r, paths = _long_runner(name, monkeypatch)
    d = r.paged.decoder
    d.graphs = True              # as on CUDA: the long step's first use captures (and fails here)

    def fail(*a, **k):
        raise RuntimeError("CUDA out of memory (injected)")

    monkeypatch.setattr(d, "_capture_keys", fail)
    padded = []
    real = d._long_padded
    monkeypatch.setattr(d, "_long_padded", lambda R_, *a: padded.append(len(a[0])) or real(R_, *a))
    ls = Lockstep(r, Reference(_model(name)))
    ls.add("A")
    assert ls.step([("A", A + B)]) == "long"                         # 18 rows: bucket 32, capture fails
    assert d.long_buckets == [] and not d._graphs
    ls.add("C")
    assert ls.step([("C", C)]) == "long"                             # the eager long step
    assert padded == [18] and paths == ["long", "long"]


def test_long_steps_off_the_gpu_unless_asked_for(monkeypatch):
    """Off the GPU unless asked for ("1"; preview.on_cuda: on CUDA unless "0"), the eager forward
    then taking those steps; a decoder without the fused step (or an MLA model's) has none, and
    refuses one."""
    _interpret()
    name = "glm4_moe-3.0bpw-mcg"
    monkeypatch.setenv("EXL3TOOLS_FUSED", "1")
    monkeypatch.delenv("EXL3TOOLS_LONG_STEPS", raising=False)
    r = _paged(name, "static", max_num_seqs=3, prompt_rows=8)
    assert not r.paged.decoder.long_steps
    r.add_sequence("B")
    r.step([("B", B)])
    assert r.last_path == "eager"
    monkeypatch.setenv("EXL3TOOLS_LONG_STEPS", "1")
    monkeypatch.setenv("EXL3TOOLS_FUSED", "0")
    d = _paged(name, "static", max_num_seqs=3, prompt_rows=8).paged.decoder
    assert not d.long_steps
    with pytest.raises(UsageError, match="long steps need"):
        d.long_step([1], [0], [4], [0])
    monkeypatch.setenv("EXL3TOOLS_FUSED", "1")
    d = _paged("deepseek_v3-3.0bpw-3inst", "static", max_num_seqs=3, prompt_rows=8).paged.decoder
    assert d._fused is None or d._fused.mla
    assert not d.long_steps


# "1" (21 rows through the long step after the eager forward, no warm-up off CUDA) is the last
# profile_forward of test_kv_budget_profile_warms_the_other_row_class (long == eager == [21])
@pytest.mark.parametrize("on", ["0"])
def test_kv_budget_profile_takes_the_long_step_too(on, monkeypatch):
    """With long steps on, the KV budget's profile forward (rank_state.profile_forward) runs the
    same tokens through a throwaway decoder's long step after the eager forward, so the measured
    activation peak covers serve's path for those steps; off, the eager forward alone."""
    _interpret()
    from exl3tools.runtime import rank_state
    from exl3tools.runtime.paged_decode import PagedDecoder

    monkeypatch.setenv("EXL3TOOLS_FUSED", "1")
    monkeypatch.setenv("EXL3TOOLS_LONG_STEPS", on)
    calls = []
    real = PagedDecoder.long_step
    monkeypatch.setattr(PagedDecoder, "long_step", lambda self, *a: calls.append(len(a[0])) or real(self, *a))
    rank_state.profile_forward(_model(PROFILE_MODEL), 21)
    assert calls == ([21] if on == "1" else [])


def test_kv_budget_profile_warms_the_other_row_class(monkeypatch):
    """Triton compiles an int argument apart by whether it divides by 16: with ``warm`` (the
    default on CUDA) the profile forward runs the eager forward and the long step again at a row
    count of the other class, so a served step of either class finds its kernels compiled."""
    _interpret()
    from exl3tools.runtime import rank_state
    from exl3tools.runtime.model import CausalLM
    from exl3tools.runtime.paged_decode import PagedDecoder

    monkeypatch.setenv("EXL3TOOLS_FUSED", "1")
    monkeypatch.setenv("EXL3TOOLS_LONG_STEPS", "1")
    monkeypatch.delenv("EXL3TOOLS_FUSED_EAGER", raising=False)
    long, eager = [], []
    real_long, real_fwd = PagedDecoder.long_step, CausalLM.forward
    monkeypatch.setattr(PagedDecoder, "long_step", lambda self, *a: long.append(len(a[0])) or real_long(self, *a))
    monkeypatch.setattr(CausalLM, "forward", lambda self, b, **k: eager.append(len(b[0][1])) or real_fwd(self, b, **k))
    # (21 -> 16 runs below; a multiple of 16 the other way: 32 -> 31)
    assert rank_state.other_specialization(32) == 31
    n, other = 21, rank_state.other_specialization(21)
    assert other == 16
    model = _model(PROFILE_MODEL)
    rank_state.profile_forward(model, n, warm=True)
    assert long == eager == [n, other]
    long.clear(), eager.clear()
    rank_state.profile_forward(model, n)          # the CPU: no compiles to warm
    assert long == eager == [n]


def test_kv_budget_profile_warms_the_eager_long_step_beside_the_graphs(monkeypatch):
    """With long-step graphs the profile's n-row long step runs the body of its bucket (what the
    graphs replay) and the other row class's the eager long step, which steps past the buckets
    take: not the same bucket's shapes twice."""
    _interpret()
    import exl3tools.runtime.long_steps as P
    from exl3tools.runtime import rank_state

    monkeypatch.setenv("EXL3TOOLS_FUSED", "1")
    monkeypatch.setenv("EXL3TOOLS_LONG_STEPS", "1")
    monkeypatch.setenv("EXL3TOOLS_LONG_GRAPHS", "1")
    monkeypatch.delenv("EXL3TOOLS_FUSED_EAGER", raising=False)
    monkeypatch.setattr(P, "LONG_GRAPH_ROWS", (16,))     # (a bucket of 32 and 32 + 31 rows: twice the interpreter's time)
    long, padded = [], []
    real_long, real_pad = P.LongSteps.long_step, P.LongSteps._long_padded
    monkeypatch.setattr(P.LongSteps, "long_step", lambda self, *a: long.append(len(a[0])) or real_long(self, *a))
    monkeypatch.setattr(P.LongSteps, "_long_padded",
                        lambda self, R, *a: padded.append((R, len(a[0]))) or real_pad(self, R, *a))
    rank_state.profile_forward(_model(PROFILE_MODEL), 16, warm=True)
    assert long == [16, 15] and padded == [(16, 16)]


def test_kv_budget_profile_builds_no_decoder_for_an_mla_model(monkeypatch):
    """Long steps are GQA models': for an MLA model the profile forward builds no throwaway decoder
    (a start-up cost that would run nothing), the eager forward alone."""
    _interpret()
    from exl3tools.runtime import rank_state
    from exl3tools.runtime.paged_decode import PagedDecoder

    monkeypatch.setenv("EXL3TOOLS_FUSED", "1")
    monkeypatch.setenv("EXL3TOOLS_LONG_STEPS", "1")
    monkeypatch.delenv("EXL3TOOLS_FUSED_EAGER", raising=False)
    built = []
    real = PagedDecoder.__init__
    monkeypatch.setattr(PagedDecoder, "__init__", lambda self, *a, **k: built.append(1) or real(self, *a, **k))
    rank_state.profile_forward(_model("deepseek_v3-3.0bpw-3inst"), 9)
    assert built == []
    rank_state.profile_forward(_model(PROFILE_MODEL), 9)
    assert built == [1]

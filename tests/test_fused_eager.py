"""The eager forward with the fused step's glue (EXL3TOOLS_FUSED_EAGER, a preview; Triton's
interpreter on the CPU): steps no fixed-shape or long step takes (every row's logits; MLA models'
prompt chunks past the prompt buckets) run CausalLM.forward with PagedDecoder.eager_body, each
layer's own attention inside the fused norms, residual adds and routing. They give the plain
cache's logits: alone, beside decoding rows, after cached tokens, and for DSA past index_topk."""

from __future__ import annotations

import pytest

from tests.test_fused_decode import _interpret
from tests.test_paged_runner import Lockstep, Reference, _model, _paged

A, B = [1, 17, 300, 42, 1999, 7, 512], [9, 8, 7, 6, 5, 4, 3, 2, 1, 100, 88]
C = [(13 * i + 5) % 2000 + 2 for i in range(36)]        # 36 tokens: past GLM-5's index_topk (32)


def _runner(name: str, monkeypatch, on: str = "1"):
    """A static-step runner whose eager steps are counted (``calls``: rows of each body call)."""
    _interpret()
    monkeypatch.setenv("EXL3TOOLS_FUSED", "1")
    monkeypatch.setenv("EXL3TOOLS_FUSED_MLA", "1")
    monkeypatch.setenv("EXL3TOOLS_FUSED_EAGER", on)
    monkeypatch.delenv("EXL3TOOLS_LONG_STEPS", raising=False)
    r = _paged(name, "static", max_num_seqs=3, prompt_rows=8)
    d = r.paged.decoder
    calls = []
    if d.eager_body is not None:
        real = d.eager_body
        d.eager_body = lambda tokens, batch: calls.append(len(tokens)) or real(tokens, batch)
    return r, calls


# GQA on glm4_moe (its shared expert inside the routed glue); qwen3_moe's glue (FusedGqaStep._rest, which
# eager_body runs after each layer's own attention) over a step of many rows, eagerly:
# test_long_steps.py::test_long_steps_match_plain_cache[qwen3_moe-2.5bpw-mul1]
@pytest.mark.parametrize("name", ["glm4_moe-3.0bpw-mcg", "deepseek_v3-3.0bpw-3inst", "glm5_moe_dsa-3.0bpw-mul1"])
def test_fused_eager_steps_match_plain_cache(name, monkeypatch):
    r, calls = _runner(name, monkeypatch)
    ls = Lockstep(r, Reference(_model(name)))
    ls.add("A", "B")
    assert ls.step([("A", A)], all_logits=True) == "eager"               # every row's logits
    assert ls.step([("A", [5]), ("B", B)]) == "eager"                    # 1 + 11 rows: past the buckets
    assert ls.step([("B", [6]), ("A", [7])]) == "decode"
    ls.add("C")
    # C past index_topk in two chunks, the second after its cached 20 tokens, beside decoding rows
    assert ls.step([("A", [8]), ("C", C[:20]), ("B", [10])]) == "eager"
    assert ls.step([("C", C[20:]), ("A", [11])], all_logits=True) == "eager"
    assert ls.step([("A", [12]), ("B", [13]), ("C", [14])]) == "decode"
    assert calls == [7, 12, 22, 17]
    r.close()


def test_fused_eager_is_a_preview(monkeypatch):
    """Off unless asked for: the eager forward's own glue (no body); with states (what MTP reads)
    the body's final-normed rows come back beside the logits."""
    r, calls = _runner("glm4_moe-3.0bpw-mcg", monkeypatch, on="0")
    assert r.paged.decoder.eager_body is None
    r.add_sequence("A")
    r.step([("A", A)], all_logits=True)
    assert r.last_path == "eager" and calls == []
    r.close()
    r, calls = _runner("glm4_moe-3.0bpw-mcg", monkeypatch)
    logits, hn = r.paged.forward([((1, 2), 0, A)], states=True)
    ref_logits, ref_hn = _model("glm4_moe-3.0bpw-mcg").forward([(_model("glm4_moe-3.0bpw-mcg").new_cache(), A)],
                                                               to_cpu=False, states=True)
    assert calls == [7] and hn.shape == ref_hn.shape == (7, hn.shape[1]) and logits.shape == (1, logits.shape[1])
    assert (hn - ref_hn).abs().max() / ref_hn.abs().max() < 1e-4
    assert (logits - ref_logits).abs().max() / ref_logits.abs().max() < 1e-4
    r.close()


@pytest.mark.parametrize("on", ["1", "0"])
def test_kv_budget_profile_takes_the_fused_glue_too(on, monkeypatch):
    """The KV budget's profile forward (rank_state.profile_forward) runs serve's eager path: with
    the preview on, through a throwaway decoder's eager_body."""
    _interpret()
    from exl3tools.runtime import fused_step, rank_state

    monkeypatch.setenv("EXL3TOOLS_FUSED", "1")
    monkeypatch.setenv("EXL3TOOLS_FUSED_EAGER", on)
    monkeypatch.delenv("EXL3TOOLS_LONG_STEPS", raising=False)
    calls = []
    real = fused_step.FusedGqaStep.eager
    monkeypatch.setattr(fused_step.FusedGqaStep, "eager", lambda self, t, b: calls.append(len(t)) or real(self, t, b))
    # the dense llama fixture (half qwen3_moe's interpreter time): whether the profile takes the
    # body depends on the model only through fused_step.supports (a GQA model)
    rank_state.profile_forward(_model("llama-4.0bpw-mul1"), 21)
    assert calls == ([21] if on == "1" else [])

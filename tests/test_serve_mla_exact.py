"""Served logprobs of the MLA models equal the plain CPU runtime's (issue 14's exactness): DeepSeek-V3
(MLA) and GLM-5 (MLA + DSA, prompts past its index_topk so the sparse selection is on) at TP 1, and
the GLM-5 -tp fixture at TP 2 (gloo, CPU processes; the fixed-shape step) against the same checkpoint at TP 1. A real
server on 127.0.0.1, the openai client, two streams decoding together; the reference is
teacher-forced over the served tokens (tests/test_serve_paged_exact.py does the GQA fixtures)."""

from __future__ import annotations

import concurrent.futures as cf

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from exl3tools.runtime.runner import load_runner  # noqa: E402
from exl3tools.server.app import ServeConfig, create_app  # noqa: E402
from exl3tools.server.testing import LiveServer  # noqa: E402
from tests.conftest import fixture_dir  # noqa: E402
from tests.test_serve_paged_exact import _reference_logprobs  # noqa: E402

TOL = 1e-4          # logprob, absolute (as the GQA test; measured 2e-7 to 7e-7)
N = 6
PROMPTS = [list(range(3, 43)), [1] + list(range(500, 545))]     # 40 and 46 tokens: past GLM-5's index_topk (32)


@pytest.mark.parametrize("name,tp,graphs", [("deepseek_v3-3.0bpw-3inst", 1, None), ("deepseek_v3-3.0bpw-3inst", 1, "force"),
                                            ("glm5_moe_dsa-3.0bpw-mul1", 1, None), ("glm5_moe_dsa-3.0bpw-mul1", 1, "force"),
                                            # TP 2 served through the fixed-shape step; the eager MLA/DSA
                                            # forward at TP 2 against TP 1 (logits, p64 past index_topk):
                                            # test_runtime_mla_tp.py::test_tp2_rank_slice_equals_tp1_with_mtp
                                            pytest.param("glm5_moe_dsa-tp-4.0bpw-mcg", 2, "force", marks=pytest.mark.slow),
                                            ("glm5_moe_dsa-3.0bpw-mul1", 1, "fused")])
def test_served_mla_logprobs_equal_the_reference(name, tp, graphs, monkeypatch):
    """graphs "force": the fixed-shape decode step (MLAttention.decode_static) on the CPU too;
    "fused": that step with the fused glue around the attention (EXL3TOOLS_FUSED_MLA, Triton's
    interpreter)."""
    if graphs == "fused":
        from exl3tools.kernels import fused_decode

        if not fused_decode.INTERPRET:
            pytest.skip("needs TRITON_INTERPRET=1 (make test sets it) to run Triton on the CPU")
        monkeypatch.setenv("EXL3TOOLS_FUSED", "1")
        monkeypatch.setenv("EXL3TOOLS_FUSED_MLA", "1")
    path = fixture_dir(name) / "model"
    cfg = ServeConfig(model_path=str(path), served_model_name="m", tp=tp, max_batch=4, max_context=96, block_size=4,
                      cuda_graphs="force" if graphs == "fused" else graphs)
    app = create_app(cfg)
    with LiveServer(app) as s:
        client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0, timeout=300)

        def ask(prompt):
            r = client.completions.create(model="m", prompt=prompt, max_tokens=N, temperature=0, logprobs=1,
                                          extra_body={"ignore_eos": True, "return_token_ids": True})
            c = r.choices[0]
            return c.model_dump()["token_ids"], c.logprobs.token_logprobs

        with cf.ThreadPoolExecutor(2) as pool:
            served = list(pool.map(ask, PROMPTS))
        if tp == 1:
            runner = app.state.server.engine.runner
            assert runner.decode_mode == ("static" if graphs else "eager")
            if graphs == "fused":
                assert type(runner.paged.decoder._fused).__name__ == "FusedMlaStep"
    with load_runner(path, max_context=96, max_cache_tokens=256) as ref:
        for prompt, (ids, lps) in zip(PROMPTS, served, strict=True):
            assert len(ids) == N
            want = _reference_logprobs(ref.model, prompt, ids)
            err = max(abs(a - b) for a, b in zip(lps, want, strict=True))
            assert err < TOL, (name, tp, graphs, err)

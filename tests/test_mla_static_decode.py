"""The fixed-shape decode step for MLA/DSA models (MLAttention.decode_static inside
runtime/paged_decode.py's PagedDecoder, decode="static" on the CPU with the torch reference
attention) against the eager paged path, on the real DeepSeek-V3 and GLM-5 fixtures: a batch of
three sequences of different lengths, one of them past index_topk (32) so the DSA selection is
sparse, over several steps; the fixture with a "shared" indexer layer; the DSA selection against
Indexer.select directly (near-ties and -0.0 included); the Triton kernel inside the step
(interpreter); rows of one sequence in one step (causal, across index_topk); speculative decoding
through the step."""

from __future__ import annotations

import os
from functools import lru_cache

import pytest
import torch

from exl3tools.runtime.runner import Runner, load_runner
from tests.conftest import fixture_dir, speculate_beside_plain

REL = 1e-4
FP16_REL = 5e-3   # fp16 planes vs fp32 ones: the rounding of every cached latent (3.4e-4 measured)
MLA = ["deepseek_v3-3.0bpw-3inst", "glm5_moe_dsa-3.0bpw-mul1", "glm5_moe_dsa-tp-4.0bpw-mcg"]
# prompt lengths: 40 > index_topk (sparse from the first step), 29 turns sparse at step 4, 5 stays dense
PROMPTS = {"a": list(range(3, 43)), "b": [7 * i % 2000 + 1 for i in range(29)], "c": [11, 900, 5, 1999, 64]}
STEPS = [[5, 77, 1000], [3, 4, 5], [900, 11, 42], [1, 2, 3], [64, 128, 256], [8, 9, 10]]
# the fused glue's tests (each decode step ~1.4 s of the interpreter on the tp fixture) stop at the
# step where "b" turns sparse: "a" sparse and "c" dense throughout, then the batches of one and two
FUSED_STEPS = STEPS[:4]


@lru_cache(maxsize=None)
def _model(name: str, indexer_types: tuple[str, ...] | None = None):
    if indexer_types is None:
        return load_runner(fixture_dir(name) / "model", max_context=64, max_cache_tokens=64).model
    from exl3tools.checkpoint.reader import Checkpoint
    from exl3tools.runtime.arch import BuildContext
    from exl3tools.runtime.arch.glm_moe_dsa import build
    from exl3tools.runtime.tp import TPContext
    from exl3tools.runtime.weights import WeightSource

    ck = Checkpoint.open(fixture_dir(name) / "model")
    return build(BuildContext(dict(ck.config, indexer_types=list(indexer_types)), WeightSource(ck), TPContext(), False))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item() / b.float().abs().max().item()


def _run(model, name: str, decode: str, kv_dtype: str = "auto", steps: list[list[int]] = STEPS) -> list[torch.Tensor]:
    r = Runner(model, fixture_dir(name) / "model", name, decode=decode, max_cache_tokens=256, block_size=4,
               max_num_seqs=3, kv_dtype=kv_dtype)
    assert r.decode_mode == decode
    out = []
    for sid, p in PROMPTS.items():
        r.add_sequence(sid)
        out.append(r.step([(sid, p)]))
    for toks in steps:
        out.append(r.step([(sid, [t]) for sid, t in zip(PROMPTS, toks, strict=True)]))
    r.step([("b", [17])])                         # a batch of one (bucket 1) after batches of three
    out.append(r.step([("c", [18]), ("a", [19])]))
    return out


def _compare(model, name: str, kv_dtype: str = "auto", rel: float = REL) -> None:
    eager, static = _run(model, name, "eager", kv_dtype), _run(model, name, "static", kv_dtype)
    for i, (x, y) in enumerate(zip(static, eager, strict=True)):
        assert x.shape == y.shape, i
        assert _rel(x, y) < rel, (name, i, _rel(x, y))


@pytest.mark.parametrize("name", MLA)
def test_static_mla_decode_equals_eager(name):
    _compare(_model(name), name)


@pytest.mark.parametrize("name", MLA[:2])
def test_fp16_planes(name):
    """--kv-cache-dtype fp16 for an MLA model: the latent, rope-key and indexer planes are fp16 (half
    the bytes of auto's fp32); the static step reads them as eager decode does; logits stay near the
    fp32 pool's (the planes round to fp16, as exllamav3's cache does)."""
    from exl3tools.runtime.kv_pool import bytes_per_token, layer_specs

    model = _model(name)
    r = Runner(model, fixture_dir(name) / "model", name, decode="static", max_cache_tokens=64, block_size=4,
               max_num_seqs=3, kv_dtype="fp16")
    assert {t.dtype for planes in r.paged.pool.planes for t in planes.values()} == {torch.float16}
    specs = layer_specs(model)
    assert 2 * bytes_per_token(specs, torch.float16) == bytes_per_token(specs, torch.float32)
    _compare(model, name, "fp16")
    fp16, fp32 = _run(model, name, "eager", "fp16"), _run(model, name, "eager")
    err = max(_rel(x, y) for x, y in zip(fp16, fp32, strict=True))
    print(name, "fp16 vs fp32 planes", err)
    assert 0 < err < FP16_REL, err


def test_static_decode_with_a_shared_indexer_layer():
    # the 2-layer GLM-5 fixture (the 3-layer tp one costs ~10x on the CPU for the same check)
    name = "glm5_moe_dsa-3.0bpw-mul1"
    model = _model(name, ("full", "shared"))
    assert model.layers[1].attn.dsa_shared and model.layers[1].attn.indexer is None
    _compare(model, name)


def test_static_step_takes_the_sparse_selection(monkeypatch):
    """The decode step really runs DSA: with its selection dropped (dense attention in the static
    step only) the long sequence's rows move and the short one's do not."""
    from exl3tools.runtime.dsa import Indexer

    name = "glm5_moe_dsa-3.0bpw-mul1"
    model = _model(name)
    eager = _run(model, name, "eager")
    monkeypatch.setattr(Indexer, "select_paged", lambda self, *a, **k: None)
    dense = _run(model, name, "static")
    assert _rel(dense[3][0], eager[3][0]) > 1e-3                # "a": 41 keys > index_topk
    assert _rel(dense[3][2], eager[3][2]) < REL                 # "c": 6 keys, dense anyway


def test_dense_variant_until_a_row_passes_index_topk():
    """A step whose rows all see <= index_topk (32) keys runs the variant without DSA's scores and
    top-k (exact: selection starts past topk); the first step past it takes the sparse one."""
    name = "glm5_moe_dsa-3.0bpw-mul1"
    model = _model(name)
    outs, seen = {}, []
    for decode in ("eager", "static"):
        r = Runner(model, fixture_dir(name) / "model", name, decode=decode, max_cache_tokens=256, block_size=4,
                   max_num_seqs=3)
        if decode == "static":
            body = r.paged.decoder._body
            r.paged.decoder._body = lambda bs, width=None, sparse=True, body=body: seen.append(sparse) or body(bs, width, sparse)
        r.add_sequence("x")
        out = [r.step([("x", list(range(3, 33)))])]             # 30 tokens: the eager forward
        out += [r.step([("x", [100 + t])]) for t in range(5)]    # contexts 31 .. 35
        outs[decode] = out
    assert seen == [False, False, True, True, True]
    for x, y in zip(outs["static"], outs["eager"], strict=True):
        assert _rel(x, y) < REL


def test_topk_positions_is_indexer_select():
    """Device selection (dsa.topk_positions) vs Indexer.select's stable sort, on rows with ties
    at the threshold, -0.0 against +0.0, -inf past the context, and short (dense) rows."""
    from exl3tools.runtime.dsa import topk_positions

    gen = torch.Generator().manual_seed(0)
    T, k = 48, 8
    s = (torch.randint(0, 6, (5, T), generator=gen).float() / 4).half().float()   # many exact ties
    s[1, ::3] = -0.0
    s[1, 1::3] = 0.0
    s[2] = -torch.rand(T, generator=gen).half().float()
    ctx = torch.tensor([48, 40, 30, 8, 3], dtype=torch.int32)
    for b, n in enumerate(ctx.tolist()):
        s[b, n:] = float("-inf")
    got = topk_positions(s, ctx, k)
    assert got.shape == (5, k) and got.dtype == torch.int32
    for b, n in enumerate(ctx.tolist()):
        row = s[b, :n]
        if n > k:
            want = torch.sort(row, descending=True, stable=True).indices[:k]
        else:
            want = torch.arange(n)
        assert sorted(got[b][got[b] >= 0].tolist()) == sorted(want.tolist()), b


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1 (make test sets it)")
@pytest.mark.parametrize("chunked", [False, True, 512])
def test_triton_topk_select_is_topk_positions(chunked):
    """kernels/dsa_indexer.topk_select (and topk_select_chunked) picks dsa.topk_positions' set of
    positions (its order within a row may differ) on the interpreter: exact ties at the threshold
    across several 2048-score tiles, -0.0 against +0.0, negative scores, rows with fewer finite
    scores than K, dense short rows, and a table narrower than topk."""
    pytest.importorskip("triton")
    from exl3tools.kernels import dsa_indexer

    topk_select = dsa_indexer.topk_select_chunked if chunked else dsa_indexer.topk_select
    if chunked == 512:               # another chunk size (bench/gpu_topk.py sweeps them): 10 chunks a row
        def topk_select(sc, cx, k):
            return dsa_indexer.topk_select_chunked(sc, cx, k, tb=512, warps=4)

    from exl3tools.runtime.dsa import topk_positions

    gen = torch.Generator().manual_seed(0)
    s = (torch.randint(0, 3, (7, 5000), generator=gen).float() / 4).half().float()     # ties across tiles
    s[1, ::3], s[1, 1::3] = -0.0, 0.0
    s[2] = -torch.rand(5000, generator=gen).half().float()
    s[3] = torch.randn(5000, generator=gen).half().float()
    s[4, :4000] = float("-inf")                      # 1000 finite scores of 4500 visible, K 2048
    ctx = torch.tensor([5000, 4321, 2049, 4700, 4500, 2048, 7], dtype=torch.int32)
    cases = [(s, ctx, 2048), (s[:, :300], ctx.clamp(max=300), 2048), (s[:, :64], ctx.clamp(max=64), 16)]
    for sc, cx, k in cases:
        sc = sc.clone()
        for b, n in enumerate(cx.tolist()):
            sc[b, n:] = float("-inf")               # paged_scores' contract: -inf past the context
        got, want = topk_select(sc, cx, k), topk_positions(sc, cx, k)
        assert got.shape == want.shape and got.dtype == torch.int32
        for b in range(sc.shape[0]):
            assert sorted(got[b][got[b] >= 0].tolist()) == sorted(want[b][want[b] >= 0].tolist()), (k, b)
            assert (got[b] < 0).sum() == (want[b] < 0).sum(), (k, b)


def test_dsa_kernels_of_the_cuda_decode_step(monkeypatch):
    """The DSA top-k of the CUDA decode step: one program a row below CHUNKED_MIN_WIDTH scores, the
    chunked kernels from it (topk_auto); EXL3TOOLS_DSA_TOPK_CHUNKS=1 takes the chunked ones at every
    width, =0 never. Its scores: the tensor-core kernel unless EXL3TOOLS_DSA_SCORES_TC=0."""
    pytest.importorskip("triton")
    from exl3tools.kernels import dsa_indexer as di

    from exl3tools.runtime import paged_decode

    w = di.CHUNKED_MIN_WIDTH
    assert di.topk_for_width(w // 2) is di.topk_select and di.topk_for_width(w) is di.topk_select_chunked
    cuda = torch.device("cuda")
    for value, want in ((None, di.topk_auto), ("0", di.topk_select), ("1", di.topk_select_chunked)):
        if value is None:
            monkeypatch.delenv("EXL3TOOLS_DSA_TOPK_CHUNKS", raising=False)
        else:
            monkeypatch.setenv("EXL3TOOLS_DSA_TOPK_CHUNKS", value)
        assert paged_decode.mla_attention_fn(cuda)[2] is want, value
    # the indexer scores: the tensor-core kernel unless opted out of
    monkeypatch.delenv("EXL3TOOLS_DSA_SCORES_TC", raising=False)
    assert paged_decode.mla_attention_fn(cuda)[1] is di.paged_scores_tc
    monkeypatch.setenv("EXL3TOOLS_DSA_SCORES_TC", "0")
    assert paged_decode.mla_attention_fn(cuda)[1] is di.paged_scores


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1 (make test sets it)")
def test_static_step_with_the_triton_kernel_on_the_interpreter(monkeypatch):
    pytest.importorskip("triton")
    from exl3tools.runtime import paged_decode

    monkeypatch.setattr(paged_decode, "MLA_DECODE_ON_CPU", True)
    name = "glm5_moe_dsa-3.0bpw-mul1"
    _compare(_model(name), name)
    # fp16 planes: the kernel's fp16 tensor-core dots round the query and the probabilities too
    # (1.0e-4 here), the eager path widens the planes
    _compare(_model(name), name, "fp16", rel=1e-3)


def test_speculative_rows_run_the_decode_step_and_feed_the_head():
    """Rows with MTP draft state run the fixed-shape step too (a 40-token prompt as 40 rows, then a
    decode row): the step keeps every row's final-normed state, which feeds the head, so the drafts'
    logits equal the eager path's; no chained steps with drafts."""
    name = "glm5_moe_dsa-3.0bpw-mul1"
    path = fixture_dir(name) / "model"
    got = {}
    for decode in ("eager", "static"):
        with load_runner(path, max_cache_tokens=256, block_size=4, speculative_tokens=2, decode=decode,
                         max_num_seqs=48) as r:
            assert r.decode_mode == decode and not r.can_chain
            calls = []
            if r.paged.decoder is not None:
                step = r.paged.decoder.step
                r.paged.decoder.step = lambda *a, step=step, calls=calls: calls.append(len(a[0])) or step(*a)
            r.add_sequence(0)
            logits = [r.step([(0, PROMPTS["a"])])]
            logits.append(r.step([(0, [int(logits[0][0].argmax())])]))
            drafts, rows = r.draft(0, 3, 2, lambda row: int(row.argmax()))
            got[decode] = (torch.cat(logits), drafts, torch.stack(rows).float().cpu())
            assert calls == ([] if decode == "eager" else [len(PROMPTS["a"]), 1])
    (le, de, re_), (ls, ds, rs) = got["eager"], got["static"]
    assert _rel(ls, le) < REL and _rel(rs, re_) < REL
    assert len(ds) == len(de) == 2


# The 2-layer GLM-5 fixture only (the 3-layer tp one cost 31-44 s of the CPU suite for the same
# check): FusedMlaStep.draft is the embedding/eh_proj kernels, then the trunk's FusedMlaStep._layer
# around the head's block, and _layer on the tp fixture (MCG, 4 heads, 16 experts top-4) is
# checked by test_fused_glue_around_mla_equals_eager[glm5_moe_dsa-tp-4.0bpw-mcg-1].
@pytest.mark.parametrize("name", ["glm5_moe_dsa-3.0bpw-mul1"])
def test_fused_draft_step_equals_the_torch_one(name, monkeypatch):
    """The MTP head's draft steps through the fused step's glue (FusedMlaStep.draft: fused norms,
    MLA kernels and MoE routing around the head's block) give the torch draft body's logits: the
    same drafts and rows within the runtime's tolerance, past index_topk (the head's DSA selection
    on) as below it."""
    from exl3tools.kernels import fused_decode as fk

    from exl3tools.runtime import fused_step

    if not fk.INTERPRET:
        pytest.skip("needs TRITON_INTERPRET=1 (make test sets it) to run Triton on the CPU")
    path = fixture_dir(name) / "model"
    got, calls = {}, []
    real = fused_step.FusedMlaStep.draft
    monkeypatch.setattr(fused_step.FusedMlaStep, "draft", lambda self, *a: calls.append(1) or real(self, *a))
    for fused in ("0", "1"):
        monkeypatch.setenv("EXL3TOOLS_FUSED", fused)
        monkeypatch.setenv("EXL3TOOLS_FUSED_MLA", fused)
        with load_runner(path, max_cache_tokens=256, block_size=4, speculative_tokens=2, decode="static",
                         max_num_seqs=48) as r:
            assert (r.paged.decoder._fused is not None) == (fused == "1")
            out = []
            for sid, prompt in ((0, PROMPTS["a"]), (1, PROMPTS["c"])):     # past index_topk (32), below
                r.add_sequence(sid)
                first = r.step([(sid, prompt)])
                drafts, rows = r.draft(sid, int(first[0].argmax()), 2, lambda row: int(row.argmax()))
                out.append((drafts, torch.stack(rows).float().cpu()))
            got[fused] = out
    assert calls, "the fused decoder did not draft through FusedMlaStep.draft"
    for (d0, r0), (d1, r1) in zip(got["0"], got["1"], strict=True):
        assert d1 == d0 and _rel(r1, r0) < REL, (d0, d1, _rel(r1, r0))


def test_a_verify_past_max_num_seqs_rows_takes_the_decode_step():
    """An MTP verify is 1 + k rows a sequence, so the step takes max_num_seqs x (1 + k) rows: at
    --max-num-seqs 2 and k = 2 both sequences' 3 rows replay the step (on the H200, 32 streams'
    64 rows fell to the eager forward: 158 tok/s against 1749 without MTP), with the eager
    forward's logits."""
    path = fixture_dir("glm5_moe_dsa-3.0bpw-mul1") / "model"
    got = {}
    for decode in ("eager", "static"):
        with load_runner(path, max_cache_tokens=512, block_size=4, speculative_tokens=2, decode=decode,
                         max_num_seqs=2) as r:
            calls, fwd = [], r.paged.forward
            r.paged.forward = lambda items, fwd=fwd, calls=calls, **k: calls.append(
                sum(len(t) for *_, t in items)) or fwd(items, **k)
            for s in (0, 1):
                r.add_sequence(s)
                r.step([(s, PROMPTS["ab"[s]])])
            assert calls == [40, 29]                       # prompts past 6 rows: the eager forward
            got[decode] = r.verify([(0, [7, 5, 9]), (1, [11, 3, 2])]).float().cpu()
            assert calls == ([40, 29, 6] if decode == "eager" else [40, 29])
            assert decode == "eager" or r.paged.decoder.max_rows == 6
    assert got["static"].shape == (6, got["eager"].shape[1]) and _rel(got["static"], got["eager"]) < REL


def test_rows_of_one_sequence_across_index_topk():
    """A step of several new tokens of one sequence runs the static step, one row per token sharing
    its block-table row: rows at positions 29..36 see 30..37 keys, so the first three attend densely
    and the rest select index_topk (32) keys each, causally, as the eager chunk does."""
    name = "glm5_moe_dsa-3.0bpw-mul1"
    model = _model(name)
    outs = []
    for decode in ("eager", "static"):
        r = Runner(model, fixture_dir(name) / "model", name, decode=decode, max_cache_tokens=256, block_size=4,
                   max_num_seqs=8)
        calls = []
        if r.paged.decoder is not None:
            step = r.paged.decoder.step
            r.paged.decoder.step = lambda *a, step=step, calls=calls: calls.append(len(a[0])) or step(*a)
        r.add_sequence("b")
        r.add_sequence("c")
        r.step([("b", PROMPTS["b"])])
        r.step([("c", PROMPTS["c"][:2])])
        outs.append(r.step([("b", list(range(100, 106))), ("c", [12, 13])], all_logits=True))
        outs.append(r.step([("b", [200, 201])], all_logits=True))
        assert calls == ([] if decode == "eager" else [2, 8, 2])
    for x, y in zip(outs[2:], outs[:2], strict=True):
        assert x.shape == y.shape and _rel(x, y) < REL, _rel(x, y)


def test_speculative_decoding_through_the_static_step_is_greedy():
    """--speculative-tokens with the fixed-shape step: verify steps ([last] + drafts) and rows with
    draft state take the step (their final states feed the head), drafts stay eager, no chaining;
    the emitted tokens are plain greedy decoding."""
    name = "glm5_moe_dsa-3.0bpw-mul1"
    path = fixture_dir(name) / "model"
    prompt = PROMPTS["b"]                              # 29 tokens: the drafts cross index_topk
    kw = dict(max_cache_tokens=256, block_size=4, max_num_seqs=4)
    with load_runner(path, decode="eager", **kw) as r:
        r.add_sequence(0)
        want, new = [], prompt
        for _ in range(10):
            want.append(int(r.step([(0, new)])[0].argmax()))
            new = [want[-1]]
    with load_runner(path, speculative_tokens=2, decode="static", **kw) as r:
        assert r.decode_mode == "static" and not r.can_chain
        calls = []
        step = r.paged.decoder.step
        r.paged.decoder.step = lambda *a: calls.append(len(a[0])) or step(*a)
        out, plain = speculate_beside_plain(r, prompt, 10)
        assert out[:10] == want and plain == want[:len(plain)]
        assert 3 in calls and 1 in calls                # verifies and plain decodes took the step


# the opt-outs of the launch cuts (router_one_gemm, dsa_fused_select) on a DSA fixture
@pytest.mark.parametrize("name,cuts", [(n, "1") for n in MLA] + [(MLA[1], "0")])
def test_fused_glue_around_mla_equals_eager(name, cuts, monkeypatch):
    """EXL3TOOLS_FUSED_MLA: the fused step's residual/norm and MoE kernels (interpreter) around
    MLAttention.decode_static give the eager path's logits over the same schedule, and every
    routing call picks Fp16ChoiceMoE.route's experts (fp16-rounded choice, centred fp16 bias);
    the router's two logits come from one GEMM unless EXL3TOOLS_ROUTER_ONE_GEMM=0 (the DSA
    selection's head weights from the key GEMM unless EXL3TOOLS_DSA_FUSED_SELECT=0)."""
    pytest.importorskip("triton")
    from exl3tools.kernels import fused_decode as fk

    from exl3tools.runtime import fused_step

    if not fk.INTERPRET:
        pytest.skip("needs TRITON_INTERPRET=1 (make test sets it) to run Triton on the CPU")
    real, calls = fk.route, []

    def checked(logits, top_k, routing, norm, scaling=1.0, bias=None, lut=None, n_held=None, shared=False,
                choice_logits=None):
        out = real(logits, top_k, routing, norm, scaling, bias, lut, n_held, shared, choice_logits)
        ref = fk.route_reference(logits, top_k, routing, norm, scaling, bias, lut, n_held, shared, choice_logits)
        T = logits.shape[0]
        assert torch.equal(out["loc"].view(T, -1).sort(1).values, ref["loc"].view(T, -1).sort(1).values)
        torch.testing.assert_close(out["wk"].view(T, -1).sort(1).values, ref["wk"].view(T, -1).sort(1).values)
        calls.append(choice_logits is not None)
        return out
    monkeypatch.setattr(fk, "route", checked)
    real_route, inputs = fused_step.FusedGqaStep._route, []

    def route_inputs(self, mlp, x, logits, lut, shared=False, choice=None):
        # the router's two GEMMs, made as one over x and its fp16 rows (residual_rmsnorm's with_fp16)
        if choice is not None:
            torch.testing.assert_close(logits, x @ mlp.router.t(), rtol=1e-4, atol=2e-5)
            torch.testing.assert_close(choice, x.half().float() @ mlp.router.t(), rtol=1e-4, atol=2e-5)
        inputs.append(choice is not None)
        return real_route(self, mlp, x, logits, lut, shared, choice)
    monkeypatch.setattr(fused_step.FusedGqaStep, "_route", route_inputs)
    monkeypatch.setenv("EXL3TOOLS_ROUTER_ONE_GEMM", cuts)
    monkeypatch.setenv("EXL3TOOLS_DSA_FUSED_SELECT", cuts)
    monkeypatch.setenv("EXL3TOOLS_FUSED", "1")
    monkeypatch.setenv("EXL3TOOLS_FUSED_MLA", "1")
    want = _run(_model(name), name, "eager", steps=FUSED_STEPS)
    model = load_runner(fixture_dir(name) / "model", max_context=64, max_cache_tokens=64).model
    r = Runner(model, fixture_dir(name) / "model", name, decode="static", max_cache_tokens=256, block_size=4,
               max_num_seqs=3)
    assert isinstance(r.paged.decoder._fused, fused_step.FusedMlaStep)
    got = _run(model, name, "static", steps=FUSED_STEPS)
    for s, (x, y) in enumerate(zip(got, want, strict=True)):
        assert _rel(x, y) < REL, (name, s, _rel(x, y))
    assert calls and all(calls)         # every MoE layer routed through the kernel, fp16 choice on
    assert inputs and all(inputs) == (cuts == "1") and any(inputs) == (cuts == "1")   # the one GEMM, or not


# an MLA model's (GLM-5's case ran the same FusedMlaStep around the same routing and shared-expert
# MoE, 8 experts top-2 for 16 top-4; its glue and codebook: test_fused_glue_around_mla_equals_eager)
# and a GQA model's
@pytest.mark.parametrize("name", [MLA[0], "glm4_moe-3.0bpw-mcg"])
def test_fused_step_runs_a_tensor_parallel_ranks_moe(name, monkeypatch):
    """A tensor-parallel rank's MoE (its outputs all-reduced, every expert held: ``--moe tp``)
    through the fused step (EXL3TOOLS_FUSED_TP_MOE: routing kernel, grouped experts, the rows' sum,
    then the reduce and the replicated shared expert after it, as MoE._finish) gives the torch
    loop's logits (MoE.forward_static) over the static-decode schedule. The all-reduce is stood in
    for by a doubling (what it gives over two ranks holding the same partial), so a sum taken after
    the reduce, or the shared expert before it, would differ."""
    from exl3tools.kernels import fused_decode as fk

    from exl3tools.runtime import fused_step
    from exl3tools.runtime.layers import MoE

    if not fk.INTERPRET:
        pytest.skip("needs TRITON_INTERPRET=1 (make test sets it) to run Triton on the CPU")
    calls, real = [], fused_step.FusedGqaStep._moe_reduced
    monkeypatch.setattr(fused_step.FusedGqaStep, "_moe_reduced", lambda self, *a: calls.append(1) or real(self, *a))

    def doubled(model):
        for layer in model.layers:
            if isinstance(layer.mlp, MoE):
                layer.mlp.reduce = lambda t: 2.0 * t
        return model
    monkeypatch.setenv("EXL3TOOLS_FUSED", "0")
    monkeypatch.setenv("EXL3TOOLS_FUSED_MLA", "0")
    want = _run(doubled(load_runner(fixture_dir(name) / "model", max_context=64, max_cache_tokens=64).model),
                name, "static", steps=FUSED_STEPS)
    monkeypatch.setenv("EXL3TOOLS_FUSED", "1")
    monkeypatch.setenv("EXL3TOOLS_FUSED_MLA", "1")
    got = _run(doubled(load_runner(fixture_dir(name) / "model", max_context=64, max_cache_tokens=64).model),
               name, "static", steps=FUSED_STEPS)
    assert calls, "the fused step did not run the reduced MoE"
    for i, (x, y) in enumerate(zip(got, want, strict=True)):
        assert _rel(x, y) < REL, (name, i, _rel(x, y))


def test_fused_mla_step_is_asked_for_off_cuda(monkeypatch):
    """Off CUDA (the interpreter) an MLA model keeps the torch loop, fused kernels or not, unless
    EXL3TOOLS_FUSED_MLA=1 (on CUDA FusedMlaStep is the default: preview.on_cuda)."""
    pytest.importorskip("triton")
    from exl3tools.kernels import fused_decode as fk

    if not fk.INTERPRET:
        pytest.skip("needs TRITON_INTERPRET=1")
    monkeypatch.setenv("EXL3TOOLS_FUSED", "1")
    monkeypatch.delenv("EXL3TOOLS_FUSED_MLA", raising=False)
    name = MLA[0]
    r = Runner(_model(name), fixture_dir(name) / "model", name, decode="static", max_cache_tokens=64, block_size=4,
               max_num_seqs=2)
    assert r.paged.decoder._fused is None

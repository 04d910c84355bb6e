"""MTP head (GLM-5 and DeepSeek-V3 ``model.layers.{N}``) as a speculative-decoding draft.

On the GLM-5 fixtures and on a synthetic DeepSeek-V3 checkpoint (``DSV3_MTP``; no fixture carries
DeepSeek-V3's MTP layer, which exllamav3's converter drops):

- the head is built exactly once, from its own tensors only, and is never one of the target layers;
- greedy with MTP (any draft length) emits exactly the tokens of plain greedy;
- the accept/reject bookkeeping (cache rollback, pending states) is exercised with oracle drafts,
  since the fixtures' random heads are never right (exllamav3 accepted 0 of 64 as well);
- ``exl3tools generate --mtp N`` prints the same completion and reports the acceptance rate;
- under TP=2 (rank-slice output) every rank holds its own copy and runs the loop in lockstep.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from functools import lru_cache
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from exl3tools.cli import main
from safetensors.torch import load_file

from exl3tools.checkpoint.reader import Checkpoint
from exl3tools.runtime.arch import BuildContext, arch_module
from exl3tools.runtime.mtp import greedy, greedy_mtp
from exl3tools.runtime.tp import TPContext
from exl3tools.runtime.weights import WeightSource
from tests.conftest import DSV3_DECISIVE, DSV3_MTP, fixture_dir, golden_prompt, model_dir

GLM5 = "glm5_moe_dsa-3.0bpw-mul1"
GLM5_TP = "glm5_moe_dsa-tp-4.0bpw-mcg"
LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def _build(path: Path, reads: Counter | None = None):
    ck = Checkpoint.open(path)
    ws = WeightSource(ck)
    if reads is not None:
        orig = ws.numpy

        def counting(tname, *a, **kw):
            reads[tname] += 1
            return orig(tname, *a, **kw)

        ws.numpy = counting
    m = arch_module(ck.config["architectures"][0]).build(BuildContext(ck.config, ws, TPContext(), False))
    return m, ck


@lru_cache(maxsize=None)
def _model(path: Path):
    return _build(path)[0]


def _greedy_case(name: str, request) -> tuple:
    """(model, its 16-token prompt)."""
    path = model_dir(name, request)
    return _model(path), golden_prompt(path, "prompt_p16", 16)


# ------------------------------------------------------------------ loading
@pytest.mark.parametrize("name", [GLM5, GLM5_TP, DSV3_MTP])
def test_mtp_layer_loaded_once_and_kept_apart(name, request):
    reads: Counter = Counter()
    m, ck = _build(model_dir(name, request), reads)
    n = int(ck.config["num_hidden_layers"])
    mtp_names = {t for t in ck.tensors if LAYER.match(t) and int(LAYER.match(t).group(1)) == n}
    assert mtp_names                                        # the fixture carries an MTP layer
    assert m.mtp is not None and m.mtp.layer_index == n
    assert len(m.layers) == n and m.mtp.block not in m.layers
    # every tensor (MTP included) read exactly once: one copy, nothing loaded twice
    assert set(reads) >= mtp_names - {t for t in mtp_names if t.endswith((".mcg", ".mul1"))}
    assert max(reads.values()) == 1, [t for t, c in reads.items() if c > 1]
    # target layers carry no MTP weights: their attention/MLP objects are distinct from the head's
    ids = {id(o) for layer in m.layers for o in (layer.attn, layer.mlp)}
    assert id(m.mtp.block.attn) not in ids and id(m.mtp.block.mlp) not in ids
    # the target cache has exactly the target's layers; the head writes slot 0 of its own cache
    assert len(m.new_cache().layers) == n and len(m.mtp.new_cache().layers) == 1
    assert m.mtp.block.attn.layer == 0
    # GLM-5's head has its own DSA indexer, DeepSeek-V3's none (as its target layers)
    assert (m.mtp.block.attn.indexer is not None) == (ck.architecture == "GlmMoeDsaForCausalLM")
    # the draft borrows the target's embedding and head
    assert m.mtp.target is m


def test_no_mtp_when_the_checkpoint_has_none():
    """deepseek_v3 config says num_nextn_predict_layers 1, but no layer 2 exists (fixtures.md ¹)."""
    reads: Counter = Counter()
    m, ck = _build(fixture_dir("deepseek_v3-3.0bpw-3inst") / "model", reads)
    assert m.mtp is None
    assert not any(LAYER.match(t) and int(LAYER.match(t).group(1)) >= 2 for t in reads)


# ------------------------------------------------------------------ exactness
@pytest.mark.parametrize("draft_len", [1, 2, 3])
@pytest.mark.parametrize("name", [GLM5, DSV3_MTP])
def test_mtp_greedy_equals_plain_greedy(name, draft_len, request, capsys):
    m, prompt = _greedy_case(name, request)
    ref = greedy(m, prompt, 24)
    out, st = greedy_mtp(m, prompt, 24, draft_len)
    assert out == ref
    assert st.drafted >= 23 and st.target_forwards <= 24
    with capsys.disabled():
        print(f"\n[{name}] MTP draft {draft_len}: accepted {st.accepted}/{st.drafted} "
              f"({100 * st.acceptance_rate:.1f}%), {st.target_forwards} target forwards for 24 tokens")


def test_decisive_router_leaves_no_routing_tie(request, monkeypatch):
    """DSV3_DECISIVE (synth_checkpoint --decisive-router, the DeepSeek-V3 of tests/gpu's MTP graph
    tests): every MoE call, target and head, picks the top_k experts of largest bias, the next one
    at least 1 below in choice score (so GPU sums cannot flip a pick), and greedy with drafts is
    the plain greedy text."""
    from exl3tools.runtime.arch.deepseek_v3 import Fp16ChoiceMoE

    m, prompt = _greedy_case(DSV3_DECISIVE, request)
    route, seen = Fp16ChoiceMoE.route, []

    def recorded(self, x):
        sel, w = route(self, x)
        choice = torch.sigmoid(x.half().float() @ self.router.t()) + self.choice_bias()[None, :]
        top = torch.sort(choice, -1, descending=True).values
        seen.append(float((top[:, self.top_k - 1] - top[:, self.top_k]).min()))
        best = set(torch.topk(self.bias, self.top_k).indices.tolist())
        assert all(set(row) == best for row in sel.tolist())
        return sel, w

    monkeypatch.setattr(Fp16ChoiceMoE, "route", recorded)
    ref = greedy(m, prompt, 8)
    out, st = greedy_mtp(m, prompt, 8, 2)
    assert out == ref and st.drafted
    assert seen and min(seen) >= 1.0, min(seen)


def test_plain_greedy_reproduces_exllamav3_greedy():
    d = fixture_dir(GLM5_TP)                # no near-tie in its 32 steps (fixtures.md §4)
    g = load_file(str(d / "goldens_logits.safetensors"))
    assert greedy(_model(d / "model"), g["prompt_p16"].tolist(), 32) == g["exl3_greedy_p16"].tolist()


@pytest.mark.parametrize("draft_len,wrong", [(1, set()), (3, set()), (3, {20, 26, 27}), (2, {18, 19, 22})])
@pytest.mark.parametrize("name", [GLM5, DSV3_MTP])
def test_accept_and_reject_paths_with_oracle_drafts(name, draft_len, wrong, request):
    """Drafts forced to the true greedy tokens (except at ``wrong`` positions): the accepted prefix,
    the rollback of both caches and the pending (state, token) pairs must keep the output exact."""
    m, prompt = _greedy_case(name, request)
    max_new = 20
    ref = greedy(m, prompt, max_new)
    full = prompt + ref
    head = m.mtp
    orig = head.forward
    V = m.info.vocab_size

    def oracle(cache, states, tokens):
        p0 = cache.length
        h, logits = orig(cache, states, tokens)
        idx = p0 + len(tokens) + 1                     # the row at position p predicts token p + 2
        tok = full[idx] if idx < len(full) else 0
        if idx in wrong:
            tok = (tok + 1) % V
        logits = logits.clone()
        logits[-1] = torch.nn.functional.one_hot(torch.tensor(tok), V).float() * 100
        return h, logits

    head.forward = oracle
    try:
        out, st = greedy_mtp(m, prompt, max_new, draft_len)
    finally:
        head.forward = orig
    assert out == ref
    if not wrong:
        assert st.accepted == st.drafted and st.acceptance_rate == 1.0
        assert st.target_forwards == 1 + -(-(max_new - 1) // (draft_len + 1))
    else:
        assert 0 < st.accepted < st.drafted


# ------------------------------------------------------------------ CLI
def test_generate_cli_mtp_same_tokens_and_reports_acceptance():
    model = str(fixture_dir(GLM5) / "model")
    args = ["generate", model, "--token-ids", "1,500,600,700", "--max-tokens", "10", "--json"]
    plain = CliRunner().invoke(main, args)
    spec = CliRunner().invoke(main, args + ["--mtp", "2"])
    assert plain.exit_code == 0 and spec.exit_code == 0, (plain.output, spec.output)
    a, b = json.loads(plain.output), json.loads(spec.output)
    assert a["completion_ids"] == b["completion_ids"] and len(b["completion_ids"]) == 10
    assert b["mtp"]["draft_len"] == 2 and b["mtp"]["drafted"] > 0
    assert b["mtp"]["acceptance_rate"] == b["mtp"]["accepted"] / b["mtp"]["drafted"]
    text = CliRunner().invoke(main, args[:-1] + ["--mtp", "1"])
    assert text.exit_code == 0 and "accepted" in text.output


def test_generate_cli_mtp_refusals():
    ds = str(fixture_dir("deepseek_v3-3.0bpw-3inst") / "model")
    r = CliRunner().invoke(main, ["generate", ds, "--token-ids", "1,2,3", "--max-tokens", "2", "--mtp", "1"])
    assert r.exit_code != 0 and "no MTP head" in r.output
    glm = str(fixture_dir(GLM5) / "model")
    r = CliRunner().invoke(main, ["generate", glm, "--token-ids", "1,2", "--mtp", "1", "--logits-out", "x.st"])
    assert r.exit_code != 0 and "--logits-out" in r.output


def test_generate_cli_mtp_samples_reproducibly_with_a_seed():
    """--mtp with --temperature: rejection sampling, the same tokens for the same seed."""
    glm = str(fixture_dir(GLM5) / "model")
    args = ["generate", glm, "--token-ids", "1,500,600,700", "--max-tokens", "8", "--json", "--mtp", "2",
            "--temperature", "0.9", "--seed", "5", "--ignore-eos"]
    a, b = (CliRunner().invoke(main, args) for _ in range(2))
    assert a.exit_code == 0 and b.exit_code == 0, a.output
    ja, jb = json.loads(a.output), json.loads(b.output)
    assert ja["completion_ids"] == jb["completion_ids"] and len(ja["completion_ids"]) == 8
    assert ja["mtp"]["drafted"] > 0


def test_kv_budget_charges_the_paged_heads_blocks_at_their_size():
    """With the MTP head's cache in blocks (mtp_paged, the default) the budget charges each pool
    token the head's one layer in the pool's dtype, which is what PagedState allocates beside the
    pool, and nothing per sequence; the eager head keeps its float32 bound (the test below). The
    H200 run that charged the eager bound with the head paged left 44 of 136 GB unused."""
    import torch

    from exl3tools.runtime.kv_pool import bytes_per_token, layer_specs, mtp_budget, mtp_cache_bytes_per_token
    from exl3tools.runtime.rank_state import PagedState
    from exl3tools.runtime.runner import load_runner
    from tests.conftest import fixture_dir

    r = load_runner(fixture_dir("glm5_moe_dsa-3.0bpw-mul1") / "model", max_cache_tokens=256, speculative_tokens=1)
    try:
        m = r.model
        assert mtp_budget(m, 0, torch.float16, paged=True) == (0, 0)
        m32 = mtp_cache_bytes_per_token(m, 1)
        assert mtp_budget(m, 1, torch.float16, paged=False)[0] == 2 * m32
        for dtype in (torch.float16, torch.float32):
            head_token, head_seq = mtp_budget(m, 1, dtype, paged=True)
            assert head_seq == 0 and 0 < head_token < 2 * m32
            blocks, bs = 5, 16
            st = PagedState(m, num_blocks=blocks, block_size=bs, dtype=str(dtype).removeprefix("torch."),
                            max_seqs=2, max_blocks=4, decode="eager", mtp_paged=True)
            assert st.head_pool is not None
            assert st.nbytes() == blocks * bs * (bytes_per_token(layer_specs(m), dtype) + head_token)
    finally:
        r.close()


def test_kv_budget_counts_the_mtp_heads_cache():
    """With speculative decoding the CUDA KV budget also stands for the MTP head's own cache (one
    layer per sequence, outside the pool, grown by doubling): 2x its bytes per pool token plus
    MIN_CAPACITY tokens per sequence bound what the head really holds."""
    import torch

    from exl3tools.runtime.cache import MIN_CAPACITY
    from exl3tools.runtime.kv_pool import mtp_cache_bytes_per_token
    from exl3tools.runtime.runner import load_runner
    from tests.conftest import fixture_dir

    r = load_runner(fixture_dir("glm5_moe_dsa-3.0bpw-mul1") / "model", max_cache_tokens=256, speculative_tokens=2)
    try:
        assert mtp_cache_bytes_per_token(r.model, 0) == 0
        m = mtp_cache_bytes_per_token(r.model, 2)
        head = r.model.mtp
        for n in (1, 64, 65, 100, 300):
            cache = head.new_cache()
            head.forward(cache, torch.randn(n, head.hnorm.weight.shape[0]), list(range(3, 3 + n)))
            assert m * n <= cache.nbytes() <= 2 * m * n + m * MIN_CAPACITY, n
    finally:
        r.close()

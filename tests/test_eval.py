"""eval: perplexity and KL equal a direct computation from the runtime's logits; KL against the
fixtures' stored HF bf16 logits matches the goldens."""

from __future__ import annotations

import json
from importlib import resources

import jsonschema
import pytest
import torch
from click.testing import CliRunner
from exl3tools.cli import main
from safetensors.numpy import load_file

from exl3tools.errors import UsageError
from exl3tools.runtime.evaluate import evaluate, kl_per_position, windows
from exl3tools.runtime.runner import load_runner
from tests.conftest import FIXTURE_NAMES, fixture_dir

SCHEMA = json.loads(resources.files("exl3tools.schemas").joinpath("eval.v1.json").read_text())
TOKENS = [1] + [(37 * i + 11) % 2040 + 6 for i in range(47)]


def _logits(runner, toks):
    runner.add_sequence("direct")
    try:
        return runner.step([("direct", toks)], all_logits=True)
    finally:
        runner.free_sequence("direct")


def test_windows_score_every_token_once():
    for n, w, s in ((48, 16, 8), (48, 16, 15), (48, 64, 32), (17, 5, 3), (2, 2, 1)):
        spans = windows(n, w, s)
        scored = [t for b, e, first in spans for t in range(first, e)]
        assert scored == list(range(1, n))
        assert all(e - b <= w and b < first for b, e, first in spans)
    with pytest.raises(UsageError):      # stride == window would leave each window's first token unscored
        windows(48, 16, 16)


def test_perplexity_and_kl_equal_a_direct_computation():
    src = fixture_dir("llama-4.0bpw-mul1") / "model"
    with load_runner(src, decode="eager", max_num_seqs=1) as r, load_runner(src, decode="eager") as ref:
        lg = _logits(r, TOKENS).double()
        direct = -torch.log_softmax(lg[:-1], -1).gather(1, torch.tensor(TOKENS[1:])[:, None])[:, 0]
        whole = evaluate(r, TOKENS, window=len(TOKENS), stride=len(TOKENS) - 1)
        assert whole.scored == len(TOKENS) - 1 and whole.windows == 1
        assert whole.perplexity == pytest.approx(direct.mean().exp().item(), rel=1e-12)
        # sliding windows: each window's rows from its own forward
        slid = evaluate(r, TOKENS, window=16, stride=8)
        nll = []
        for b, e, first in windows(len(TOKENS), 16, 8):
            w = torch.log_softmax(_logits(r, TOKENS[b:e]).double(), -1)
            nll += [-w[t - 1 - b, TOKENS[t]].item() for t in range(first, e)]
        assert slid.perplexity == pytest.approx(torch.tensor(nll, dtype=torch.float64).mean().exp().item(), rel=1e-12)
        same = evaluate(r, TOKENS, window=16, stride=8, reference=ref)
        assert same.kl["mean"] == 0.0 and same.kl["max"] == 0.0 and same.kl["top1_agree"] == 1.0


@pytest.mark.parametrize("name", FIXTURE_NAMES[:5])
def test_kl_against_stored_hf_logits_matches_goldens(name):
    d = fixture_dir(name)
    ref = load_file(str(d / "hf_reference.safetensors"))
    gold = json.loads((d / "goldens.json").read_text())["kl_vs_hf_bf16"]["p64"]
    with load_runner(d / "model", decode="eager", max_num_seqs=1) as r:
        lg = _logits(r, ref["prompt_p64"].tolist())[:, :2048]
    kl = kl_per_position(torch.from_numpy(ref["hf_logits_p64"]), lg)
    assert kl.mean().item() == pytest.approx(gold["kl_mean"], rel=1e-2)
    assert kl.max().item() == pytest.approx(gold["kl_max"], rel=1e-2)


def test_cli_eval_json_against_a_bf16_reference(tmp_path):
    from exl3tools.checkpoint import Checkpoint
    from exl3tools.dequantize import apply_dequantize, plan_dequantize

    src = fixture_dir("llama-4.0bpw-mul1") / "model"
    ck = Checkpoint.open(src)
    bf16 = apply_dequantize(plan_dequantize(ck, tmp_path / "bf16", "bf16"), ck)
    text = tmp_path / "t.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 6, encoding="utf-8")
    res = CliRunner().invoke(main, ["eval", str(src), "--text", str(text), "--window", "32",
                                    "--reference", str(bf16), "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    jsonschema.validate(doc, SCHEMA)
    assert doc["kl"]["mean"] > 0 and doc["kl"]["max"] < 1e-3 and doc["kl"]["top1_agree"] > 0.9
    assert doc["scored"] == doc["tokens"] - 1 and doc["perplexity"] > 1


def test_cli_eval_bad_text_is_one_line(tmp_path):
    src = str(fixture_dir("llama-4.0bpw-mul1") / "model")
    bad = tmp_path / "bin.txt"
    bad.write_bytes(b"\xff\xfe\x00abc")
    res = CliRunner().invoke(main, ["eval", src, "--text", str(bad)])
    assert res.exit_code == 2 and res.stderr.strip() == f"error: usage error: {bad}: not UTF-8 text (byte 0)"
    res = CliRunner().invoke(main, ["eval", src, "--text", str(tmp_path / "none.txt")])
    assert res.exit_code == 2 and "none.txt: no such text file" in res.stderr
    empty = tmp_path / "empty.txt"
    empty.write_text("", encoding="utf-8")
    res = CliRunner().invoke(main, ["eval", src, "--text", str(empty)])
    assert res.exit_code == 2 and "eval needs at least 2" in res.stderr and len(res.stderr.splitlines()) == 1


@pytest.mark.slow
def test_longest_fixture_context_chunked_prefill_equals_one_plain_forward():
    """The CPU part of issue 17's long-context check: at the fixtures' longest context (4096), the
    paged runtime fed in 512-token prefill chunks (as serve schedules them) gives the logits of one
    plain forward over the whole prompt, so eval's NLL does not drift with length."""
    src = fixture_dir("llama-4.0bpw-mul1") / "model"
    with load_runner(src, decode="eager", max_num_seqs=1) as r:
        n = r.model.info.max_context
        assert n == 4096
        toks = [1] + [(37 * i + 11) % 2040 + 6 for i in range(n - 1)]
        plain = r.model.forward([(r.model.new_cache(), toks)], all_logits=True)
        r.add_sequence("long")
        paged = torch.cat([r.step([("long", toks[c:c + 512])], all_logits=True) for c in range(0, n, 512)])
    torch.testing.assert_close(paged, plain, rtol=0, atol=1e-5)
    tgt = torch.tensor(toks[1:])[:, None]
    nll = [(-torch.log_softmax(x[:-1].double(), -1).gather(1, tgt)).mean().item() for x in (plain, paged)]
    assert nll[0] == pytest.approx(nll[1], abs=1e-9)

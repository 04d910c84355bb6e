"""bench/gpu_long_context.py on the CPU: its comparison with our runtime as both sides, at the longest
context the fixtures allow (llama-4.0bpw-mul1: 4096 tokens), and its command line with --sides ours.
The H200 run (ours vs exllamav3 at 4k/16k/32k) is the real check; docs/gpu.md has its table."""

from __future__ import annotations

import argparse
import json
import sys

import pytest
import torch

from tests.conftest import REPO, fixture_dir

sys.path.insert(0, str(REPO / "bench"))
import gpu_long_context as lc  # noqa: E402

NAME = "llama-4.0bpw-mul1"


@pytest.fixture(scope="module")
def runner():
    from exl3tools.runtime.runner import load_runner

    r = load_runner(fixture_dir(NAME) / "model", max_cache_tokens=4096, max_num_seqs=1, prefix_caching=False)
    yield r
    r.close()


def _side(runner, prompt, positions, chunk):
    fwd, release = lc.ours_forward(runner)
    try:
        return lc.run_side(fwd, prompt, positions, chunk)
    finally:
        release()


def test_ours_vs_ours_at_the_longest_fixture_context(runner):
    """Two chunkings of the same 4096-token prompt (2048 as serve does, 1000 across block and chunk
    edges): KL 0 up to float32 rounding (the CPU BLAS may block a 2048-row and a 1000-row product
    differently: CI saw 1e-14), top-1 all equal, the same NLL; near-flat random logits give NLL ~
    log(vocab)."""
    L = runner.max_context
    assert L == 4096
    prompt = lc.make_prompt(L, runner.vocab_size, 0)
    positions = lc.sample_positions(L, 64, 0)
    a = _side(runner, prompt, positions, 2048)
    b = _side(runner, prompt, positions, 1000)
    assert a.logits.shape == (len(positions), runner.vocab_size)
    row = lc.compare(a, b, positions, L)
    assert row["kl_mean"] < 1e-10 and row["kl_max"] < 1e-9 and row["kl_mean_last_quarter"] < 1e-10
    assert row["top1_agree"] == 1.0 and abs(row["nll_gap"]) < 1e-6
    assert abs(a.nll - torch.log(torch.tensor(float(runner.vocab_size))).item()) < 1.0
    # the comparison sees a difference: logits of other positions (as a position bug would give)
    shifted = lc.SideOut(a.logits.roll(1, 0), a.nll, 0.0)
    bad = lc.compare(a, shifted, positions, L)
    assert bad["kl_mean"] > 1e-3 and bad["kl_max"] >= bad["kl_mean"]


def test_nll_and_sampled_rows_equal_a_direct_computation(runner):
    prompt = lc.make_prompt(50, runner.vocab_size, 3)
    positions = [0, 7, 16, 31, 49]
    out = _side(runner, prompt, positions, 16)
    runner.add_sequence("direct")
    try:
        full = runner.step([("direct", prompt)], all_logits=True)
    finally:
        runner.free_sequence("direct")
    logp = torch.log_softmax(full.double(), -1)
    nll = -logp[:-1].gather(1, torch.tensor(prompt[1:])[:, None]).mean().item()
    assert out.nll == pytest.approx(nll, rel=1e-6)
    assert torch.allclose(out.logits, full[positions].float(), atol=1e-4, rtol=1e-4)


def test_pure_helpers():
    p = lc.sample_positions(32768, 64, 0)
    assert p == sorted(set(p)) and p[-1] == 32767 and 60 <= len(p) <= 64 and p[0] < 32768 // 64
    assert p == lc.sample_positions(32768, 64, 0) and lc.sample_positions(5, 64, 0) == [0, 1, 2, 3, 4]
    a = lc.make_prompt(100, 7, 1)
    assert a == lc.make_prompt(100, 7, 1) and a != lc.make_prompt(100, 7, 2) and max(a) < 7 and min(a) >= 0
    assert lc.parse_ckpt("air=/tmp/air6") == ("air", "/tmp/air6")
    assert lc.parse_ckpt("/x/glm5_moe_dsa-3.0bpw-mul1/model") == ("glm5_moe_dsa-3.0bpw-mul1", "/x/glm5_moe_dsa-3.0bpw-mul1/model")
    assert lc.parse_ints("4096,16384") == [4096, 16384]
    for bad in ("", "4k", "1"):
        with pytest.raises(argparse.ArgumentTypeError):
            lc.parse_ints(bad)
    with pytest.raises(argparse.ArgumentTypeError):
        lc.parse_sides("ours,hf")
    table = lc.format_table([{"checkpoint": "x", "tokens": 4096, "kl_mean": 1e-3, "nll_ours": 7.6,
                              "error": "exllamav3: ImportError: no"}])
    assert table.count("\n") == 2 and "1.00e-03" in table and "ImportError" in table


def test_command_line_ours_only_on_the_cpu(tmp_path, capsys):
    out = tmp_path / "lc.json"
    rc = lc.main([f"llama={fixture_dir(NAME) / 'model'}", "--sides", "ours", "--device", "cpu",
                  "--lengths", "64,200", "--chunk", "48", "--positions", "8", "--json", str(out)])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert [r["tokens"] for r in doc["rows"]] == [64, 200]
    assert all(r["nll_ours"] > 0 and r["nll_ref"] is None and "error" not in r for r in doc["rows"])
    assert "| llama" in capsys.readouterr().out
    assert lc.main([str(tmp_path), "--sides", "ours", "--device", "cpu"]) == 2      # no config.json
    assert lc.main([f"llama={fixture_dir(NAME) / 'model'}", "--device", "cpu"]) == 2  # exllamav3 on the CPU


def test_exllamav3_side_glue_with_a_stand_in_model(runner, monkeypatch):
    """run_checkpoint with both sides, exllamav3's loader replaced by a stand-in whose forward is our
    runner (padded vocab, fp16 logits like exllamav3's head): the calls it gets are exllamav3's
    (past_len per chunk, batch_shape (1, cache rounded to its 256-token page)) and the KL is 0."""
    import argparse as ap
    import types

    import gpu_e2e_model

    calls = []

    class Model:
        def __init__(self):
            self.sid = None

        def forward(self, ids, params):
            assert ids.dtype == torch.long and ids.shape[0] == 1 and params["attn_mode"] == "flash_attn"
            calls.append((params["past_len"], ids.shape[1], params["batch_shape"]))
            if params["past_len"] == 0:
                if self.sid is not None:
                    runner.free_sequence(self.sid)
                self.sid = f"x{len(calls)}"
                runner.add_sequence(self.sid)
            assert runner.sequence_length(self.sid) == params["past_len"]
            lg = runner.step([(self.sid, ids[0].tolist())], all_logits=True)
            return torch.nn.functional.pad(lg, (0, 64), value=-1e4).half()[None]

        def unload(self):
            runner.free_sequence(self.sid)

    model = Model()
    config = types.SimpleNamespace(vocab_size=runner.vocab_size)
    monkeypatch.setattr(gpu_e2e_model, "load_exllamav3", lambda path, n, k, dev: (config, model, [object()], None, 0.0))
    monkeypatch.setattr(lc, "run_ours", lambda path, lengths, prompts, positions, a: {
        L: _side(runner, prompts[L], positions[L], a.chunk) for L in lengths})
    a = ap.Namespace(lengths=[40, 300], positions=6, chunk=128, seed=0, sides=["ours", "exllamav3"],
                     device="cpu", backend="auto")
    rows = lc.run_checkpoint("llama", str(fixture_dir(NAME) / "model"), a)
    assert [c[0] for c in calls] == [0, 0, 128, 256] and {c[2] for c in calls} == {(1, 512)}
    assert [r["tokens"] for r in rows] == [40, 300] and all("error" not in r for r in rows)
    for r in rows:    # fp16 logits on one side: tiny, not zero
        assert 0 <= r["kl_max"] < 1e-4 and r["top1_agree"] > 0.8 and abs(r["nll_gap"]) < 1e-2

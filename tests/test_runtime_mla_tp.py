"""MLA/DSA tensor parallelism on CPU (gloo) from `exl3tools rank-slice` outputs of the GLM-5 TP fixture.

TP=2 (``--moe ep``: attention cut by heads, whole experts per rank, MTP layer on every rank) must
give the TP=1 logits within fp32 tolerance, p64 included (DSA active), and the MTP speculative
loop must run in lockstep on both ranks and emit the TP=1 tokens. Spawns processes: one test.
"""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file

from exl3tools.checkpoint.reader import Checkpoint
from exl3tools.runtime.mtp import runner_generate
from exl3tools.runtime.runner import load_runner
from exl3tools.slicing import plan_rank_slices, write_rank_shards
from tests.conftest import fixture_dir

NAME = "glm5_moe_dsa-tp-4.0bpw-mcg"
TP_ATOL = 1e-4          # fp32 summation order differs across ranks; measured ~1.3e-6


def _run(runner, g):
    runner.add_sequence("s")
    prompt = runner.step([("s", g["prompt_p64"].tolist())], all_logits=True)
    rows = torch.stack([runner.step([("s", [t])])[0] for t in g["exl3_greedy_p16"][:3].tolist()])
    runner.free_sequence("s")
    toks, st = runner_generate(runner, g["prompt_p16"].tolist(), 8, 2)
    return prompt, rows, toks, st


@pytest.mark.slow
def test_tp2_rank_slice_equals_tp1_with_mtp(tmp_path, monkeypatch):
    # the eager head with its own cache (the EXL3TOOLS_MTP_PAGED=0 opt-out); the paged head at TP 2:
    # test_serve_speculative.py::test_tp2_drafts_in_lockstep_and_stay_greedy
    monkeypatch.setenv("EXL3TOOLS_MTP_PAGED", "0")
    src = fixture_dir(NAME)
    g = load_file(str(src / "goldens_logits.safetensors"))
    ck = Checkpoint.open(src / "model")
    plan = plan_rank_slices(ck, 2, "ep")
    att = plan.configs[1]["exl3tools"]["attention"]
    assert att["model.layers.1.self_attn"]["cut"] == "heads" and att["model.layers.3.self_attn"]["q_heads"] == [2, 4]
    dst = tmp_path / "tp2"
    write_rank_shards(ck, plan, dst)
    with load_runner(src / "model", speculative_tokens=2) as r:
        p1, rows1, toks1, _ = _run(r, g)
    assert (p1 - g["exl3_logits_p64"]).abs().max() < 0.05
    monkeypatch.setenv("EXL3TOOLS_TRACE_OPENS", "1")
    with load_runner(dst, tp=2, speculative_tokens=2) as r:
        p2, rows2, toks2, st = _run(r, g)
        opened = r.opened_files
        assert r.model.mtp is not None and r.model.mtp.block.attn.nh == 2   # rank 0's half of the heads
    assert (p2 - p1).abs().max().item() < TP_ATOL
    assert (rows2 - rows1).abs().max().item() < TP_ATOL
    assert toks2 == toks1 and st.drafted > 0
    root = str(dst.resolve())
    for rank, files in opened.items():
        mine = [f for f in files if f.startswith(root)]
        assert mine and all(f.startswith(os.path.join(root, f"rank-{rank}-of-2") + os.sep) for f in mine)


def _static_rows(runner, g) -> torch.Tensor:
    """Three decode rows through the fixed-shape step after the 64-token prompt (DSA selection on)."""
    runner.add_sequence("s")
    runner.step([("s", g["prompt_p64"].tolist())])
    return torch.stack([runner.step([("s", [t])])[0] for t in g["exl3_greedy_p16"][:3].tolist()])


@pytest.fixture(scope="module")
def static_tp1():
    """TP 1's torch loop (no fused glue), read by both --moe cases: (goldens, rows)."""
    src = fixture_dir(NAME)
    g = load_file(str(src / "goldens_logits.safetensors"))
    with load_runner(src / "model", decode="static") as r:
        return g, _static_rows(r, g)


@pytest.mark.slow
@pytest.mark.parametrize("moe", ["tp", "ep"])
def test_tp2_moe_through_the_fused_step_equals_tp1(tmp_path, monkeypatch, moe, static_tp1):
    """``--moe tp`` (every rank a slice of every expert) and ``--moe ep`` (whole experts, half
    here) with the fused decode step on both ranks (the interpreter): the reduced MoE through the
    routing kernel, grouped experts and their sum before the all-reduce (fused_step._moe_reduced)
    gives the TP=1 torch loop's decode logits, DSA selection on (the 64-token prompt)."""
    from exl3tools.kernels import fused_decode as fk

    if not fk.INTERPRET:
        pytest.skip("needs TRITON_INTERPRET=1 (make test sets it) to run Triton on the CPU")
    g, want = static_tp1
    ck = Checkpoint.open(fixture_dir(NAME) / "model")
    dst = tmp_path / "tp2"
    write_rank_shards(ck, plan_rank_slices(ck, 2, moe), dst)
    from exl3tools.runtime import fused_step

    calls, real = [], fused_step.FusedGqaStep._moe_reduced        # rank 0 runs in this process
    monkeypatch.setattr(fused_step.FusedGqaStep, "_moe_reduced", lambda self, *a: calls.append(1) or real(self, *a))
    monkeypatch.setenv("EXL3TOOLS_FUSED", "1")
    monkeypatch.setenv("EXL3TOOLS_FUSED_MLA", "1")
    with load_runner(dst, tp=2, decode="static") as r:
        assert r.paged.decoder._fused is not None and r.paged.decoder._fused.mla
        got = _static_rows(r, g)
    assert calls, "rank 0's MoE did not take the fused reduced path"
    assert (got - want).abs().max().item() < TP_ATOL, (got - want).abs().max().item()

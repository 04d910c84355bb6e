"""Tensor parallelism on CPU (gloo, one process per rank) from `exl3tools rank-slice` outputs.

TP=2 (--moe ep) and TP=4 (--moe tp) must give the TP=1 logits within fp32 tolerance, and each
rank must open only files of its own rank directory. Bad layouts fail fast with one line and an
exit code, without leaving ranks hanging. These tests spawn processes: few and small.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from exl3tools.checkpoint.reader import Checkpoint
from exl3tools.runtime.runner import load_runner
from exl3tools.slicing import plan_rank_slices, write_rank_shards
from tests.conftest import fixture_dir

NAME = "glm4_moe-tp-2.0bpw-mul1"
TP_ATOL = 1e-4       # fp32 summation order differs across ranks; measured ~1.3e-6
STEPS = 4


@pytest.fixture(scope="module")
def sliced(tmp_path_factory):
    src = fixture_dir(NAME)
    root = tmp_path_factory.mktemp("tp")
    ck = Checkpoint.open(src / "model")
    out = {}
    for tp, moe in ((2, "ep"), (4, "tp")):
        dst = root / f"tp{tp}-{moe}"
        write_rank_shards(ck, plan_rank_slices(ck, tp, moe), dst)
        out[tp] = dst
    return src, out


def _run(runner, g) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompt logits of p16 and STEPS teacher-forced decode rows."""
    runner.add_sequence("s")
    prompt = runner.step([("s", g["prompt_p16"].tolist())], all_logits=True)
    rows = [runner.step([("s", [t])])[0] for t in g["exl3_greedy_p16"][:STEPS].tolist()]
    runner.free_sequence("s")
    return prompt, torch.stack(rows)


@pytest.fixture(scope="module")
def tp1(sliced):
    src, _ = sliced
    g = load_file(str(src / "goldens_logits.safetensors"))
    with load_runner(src / "model") as r:
        prompt, rows = _run(r, g)
    assert (prompt - g["exl3_logits_p16"]).abs().max() < 0.01
    return g, prompt, rows


@pytest.mark.slow
@pytest.mark.parametrize("tp", [2, 4])
def test_tp_matches_tp1_and_reads_only_own_rank(sliced, tp1, tp, monkeypatch):
    _, dirs = sliced
    g, prompt1, rows1 = tp1
    monkeypatch.setenv("EXL3TOOLS_TRACE_OPENS", "1")
    with load_runner(dirs[tp], tp=tp) as r:
        prompt, rows = _run(r, g)
        opened = r.opened_files
    assert (prompt - prompt1).abs().max().item() < TP_ATOL
    assert (rows - rows1).abs().max().item() < TP_ATOL
    root = str(dirs[tp].resolve())
    assert sorted(opened) == list(range(tp))
    for rank, files in opened.items():
        mine = [f for f in files if f.startswith(root)]
        assert any(f.endswith(".safetensors") for f in mine), (rank, mine)
        own = os.path.join(root, f"rank-{rank}-of-{tp}") + os.sep
        assert all(f.startswith(own) for f in mine), (rank, [f for f in mine if not f.startswith(own)])


@pytest.mark.slow
def test_tp2_static_decode_step_and_prefix_hits(sliced, tp1, monkeypatch):
    """The paged engine at TP 2: rank 0's block tables drive every rank's pool, decode steps take the
    fixed-shape step (graphs' CPU twin), and a repeated prompt is served from the prefix cache.
    No step runs an object collective (the vocab-cut head's gather took one a step: a host sync
    on NCCL, and no CUDA graph can capture it)."""
    import torch.distributed as dist

    _, dirs = sliced
    g, prompt1, rows1 = tp1
    with load_runner(dirs[2], tp=2, decode="static", block_size=4, max_num_seqs=2) as r:
        assert r.decode_mode == "static" and r.model.head_sharded
        objects = []
        for name in ("all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list"):
            real = getattr(dist, name)
            monkeypatch.setattr(dist, name, lambda *a, _r=real, _n=name, **k: objects.append(_n) or _r(*a, **k))
        prompt, rows = _run(r, g)
        assert set(objects) <= {"broadcast_object_list"}, objects     # the commands' (gloo) group only
        p = g["prompt_p16"].tolist()
        cached = r.add_sequence("t", p)
        last = r.step([("t", p[cached:])])
        r.free_sequence("t")
    assert cached == 12
    assert (prompt - prompt1).abs().max().item() < TP_ATOL
    assert (rows - rows1).abs().max().item() < TP_ATOL
    assert (last[0] - prompt1[-1]).abs().max().item() < TP_ATOL


@pytest.mark.slow
def test_tp2_prompt_steps(sliced, tp1, monkeypatch):
    """Prompt steps (the prompt_graphs preview's larger buckets; the fixed-shape step is their CPU
    twin) at TP 2: every rank runs the same bucket, rank 0 gets the sequence's last-row logits."""
    _, dirs = sliced
    g, prompt1, rows1 = tp1
    monkeypatch.setenv("EXL3TOOLS_PROMPT_GRAPHS", "1")
    with load_runner(dirs[2], tp=2, decode="static", block_size=4, max_num_seqs=2,
                     max_num_batched_tokens=30) as r:
        assert r.paged.decoder.prompt_buckets == [4, 8, 16, 24, 32]
        r.add_sequence("s")
        last = r.step([("s", g["prompt_p16"].tolist())])
        assert r.last_path == "prompt"
        rows = [r.step([("s", [t])])[0] for t in g["exl3_greedy_p16"][:STEPS].tolist()]
    assert (last[0] - prompt1[-1]).abs().max().item() < TP_ATOL
    assert (torch.stack(rows) - rows1).abs().max().item() < TP_ATOL


def _cli(*args, timeout=180):
    return subprocess.run([sys.executable, "-m", "exl3tools.cli", "generate", *map(str, args)],
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "EXL3TOOLS_TP_TIMEOUT": "60"})


def _cli_here(*args):
    """``_cli`` in this process (click's runner): for errors found before any rank is spawned, without
    a fresh interpreter's torch import per case (4 cases: 15 s -> ~1 s)."""
    from click.testing import CliRunner
    from exl3tools.cli import main

    r = CliRunner().invoke(main, ["generate", *map(str, args)])
    return subprocess.CompletedProcess(args, r.exit_code, r.stdout, r.stderr)


def test_wrong_tp_and_missing_rank_dirs(sliced, tmp_path):
    _, dirs = sliced
    p = _cli_here(dirs[2], "--tp", "4", "--token-ids", "1,2")
    assert p.returncode == 2 and p.stderr.strip().count("\n") == 0
    assert "--tp 2" in p.stderr and "--tp 4" in p.stderr
    p = _cli_here(dirs[2] / "rank-1-of-2", "--token-ids", "1,2")          # one rank dir, default --tp 1
    assert p.returncode == 2 and "--tp 2" in p.stderr and p.stderr.strip().count("\n") == 0
    broken = tmp_path / "missing"
    shutil.copytree(dirs[4], broken)
    shutil.rmtree(broken / "rank-2-of-4")
    p = _cli_here(broken, "--tp", "4", "--token-ids", "1,2")
    assert p.returncode == 2 and "rank-2-of-4" in p.stderr and p.stderr.strip().count("\n") == 0
    (broken / "manifest.json").unlink()
    shutil.copytree(dirs[4] / "rank-2-of-4", broken / "rank-2-of-4")
    p = _cli_here(broken, "--tp", "4", "--token-ids", "1,2")
    assert p.returncode == 1 and "manifest.json" in p.stderr


@pytest.mark.slow
def test_broken_rank_fails_every_rank_cleanly(sliced, tmp_path):
    """Rank 1 cannot load its shard: rank 0 reports it in one line, every process exits, no hang."""
    _, dirs = sliced
    broken = tmp_path / "corrupt"
    shutil.copytree(dirs[2], broken)
    shard = next((broken / "rank-1-of-2").glob("model-*.safetensors"))
    shard.write_bytes(shard.read_bytes()[:1000])
    p = _cli(broken, "--tp", "2", "--token-ids", "1,2")
    assert p.returncode == 1, p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert lines[-1].startswith("error:") and "rank 1" in lines[-1]


_IDLE_RANK0 = """
import sys, time
from exl3tools.runtime.runner import load_runner
r = load_runner(sys.argv[1], tp=2)
r.add_sequence("s")
a = r.step([("s", [1, 2, 3])])[0]
time.sleep(float(sys.argv[2]))          # idle past EXL3TOOLS_TP_TIMEOUT
b = r.step([("s", [4])])[0]
print("stepped", float(a.abs().sum()), float(b.abs().sum()), r._procs[0].pid, flush=True)
time.sleep(600)                          # killed here by the test
"""


@pytest.mark.slow
def test_workers_outlive_an_idle_spell_and_not_rank_0(sliced):
    """A server idles for longer than EXL3TOOLS_TP_TIMEOUT between requests: its workers, waiting
    for the next command, must still be there (they died after the timeout while the commands
    shared the model's group); and when rank 0 is killed they exit within seconds, not linger."""
    _, dirs = sliced
    env = {**os.environ, "EXL3TOOLS_TP_TIMEOUT": "2"}
    p = subprocess.Popen([sys.executable, "-c", _IDLE_RANK0, str(dirs[2]), "4"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = p.stdout.readline()
        if not line:                          # rank 0 ended: its stderr says why
            p.wait(30)
        assert line.startswith("stepped"), p.stderr.read() if not line else line
        worker = int(line.split()[-1])
        os.kill(worker, 0)                   # alive
    finally:
        p.kill()
        p.wait()
    for _ in range(100):
        try:
            os.kill(worker, 0)
        except ProcessLookupError:
            break
        time.sleep(0.2)
    else:
        os.kill(worker, 9)
        pytest.fail("a worker outlived its killed rank 0 by 20 s")

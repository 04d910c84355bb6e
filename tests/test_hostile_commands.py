"""Hostile inputs to the commands that decode, slice or rewrite a checkpoint, and their outputs
when killed midway (the 2026-12-08 CLI audit; the helpers are tests/test_hostile.py's):
inspect --tensor and diff on an undecodable linear or Inf in a scale, plan / rank-slice with a
stray tensor under a linear, a killed normalize or dequantize --overwrite, a closed stdout, and
dequantize's memory on a large dense tensor."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from exl3tools.checkpoint import Checkpoint
from exl3tools.checkpoint.header import header_bytes
from tests.conftest import DEMO
from tests.test_hostile import (
    INDEX,
    L0,
    ST,
    TIMEOUT,
    assert_clean,
    cli,
    cli_guarded,
    demo_copy,
    entries,
    output,
    write_st,
)

Q = f"{L0}.self_attn.q_proj"


def _replace(model: Path, name: str, dtype: str, shape: list[int], data: bytes | None = None) -> None:
    es = entries(model / ST)
    for e in es:
        if e[0] == name:
            e[1], e[2] = dtype, shape
            e[3] = data if data is not None else bytes(int(np.prod(shape)) * {"F16": 2, "I16": 2}[dtype])
    write_st(model / ST, es)


@pytest.mark.parametrize("name,dtype,shape,code", [
    (f"{Q}.trellis", "I16", [16, 16, 7], "E209"),      # illegal K
    (f"{Q}.suh", "F16", [16, 16], "E205"),              # sign vector of rank 2
    (f"{Q}.suh", "F16", [0], "E206"),                   # empty sign vector
])
def test_inspect_tensor_and_diff_refuse_an_undecodable_linear(tmp_path, name, dtype, shape, code):
    """The reference decoder's bare ValueError ("illegal trellis width 7", "W is 256 x 256, but suh
    (0,)") reached the CLI as exit 70 from inspect --tensor and diff; dequantize already refused."""
    model = demo_copy(tmp_path)
    _replace(model, name, dtype, shape)
    for args in (("inspect", str(model), "--tensor", Q), ("diff", str(model), str(DEMO / "model")),
                 ("diff", str(DEMO / "model"), str(model), "--json")):
        res = cli(*args)
        assert_clean(res, 1, code, Q)
        assert len(res.output.strip().splitlines()) == 1, res.output


def test_diff_and_inspect_tensor_with_inf_in_a_scale(tmp_path):
    """diff died with 'math domain error' (exit 70) when A held an Inf, and wrote NaN into its --json
    when B did; inspect --tensor --json wrote NaN and Infinity, which no JSON parser takes."""
    model = demo_copy(tmp_path)
    svh = np.frombuffer(next(e[3] for e in entries(model / ST) if e[0] == f"{Q}.svh"), "<f2").copy()
    svh[0] = np.inf
    _replace(model, f"{Q}.svh", "F16", [256], svh.tobytes())
    assert_clean(cli("diff", str(model), str(DEMO / "model")), 1, str(model), Q, "NaN or Inf")
    assert_clean(cli("diff", str(DEMO / "model"), str(model), "--json"), 1, str(model), Q, "NaN or Inf")
    res = cli("inspect", str(model), "--tensor", Q, "--json")
    assert_clean(res, 0)
    stats = json.loads(res.output, parse_constant=lambda c: pytest.fail(f"{c} in --json"))["stats"]
    assert stats["finite"] == 0 and stats["nonfinite"] > 0 and np.isfinite(stats["abs_max"])


@pytest.mark.parametrize("stray", [
    [f"{Q}.weight", "F16", [256, 256], bytes(256 * 256 * 2)],   # a dense weight beside the trellis
    [f"{Q}.qweight", "I32", [4], bytes(16)],                     # a suffix no loader knows
])
def test_rank_slice_copies_a_stray_tensor_under_an_exl3_linear(tmp_path, stray):
    """validate calls it W302 (no loader reads it), but plan and rank-slice stopped with
    'RuntimeError: tensors without a module' (exit 70): the stray tensor belonged to no module."""
    model = demo_copy(tmp_path)
    write_st(model / ST, entries(model / ST) + [stray])
    assert_clean(cli("validate", str(model)), 0, "W302")
    assert_clean(cli("plan", str(model), "--gpu", "h100", "--tp", "2", "--moe", "ep"), 0)
    out = tmp_path / "out"
    assert_clean(cli("rank-slice", str(model), str(out), "--tp", "2", "--moe", "ep"), 0)
    assert_clean(cli("verify", str(model), str(out)), 0)
    for r in range(2):
        ck = Checkpoint.open(out / f"rank-{r}-of-2")
        assert ck.read_bytes(stray[0]) == stray[3] and f"{Q}.trellis" in ck


def test_rank_slice_refuses_a_tensor_of_a_dense_linear_it_cannot_cut(tmp_path):
    """Beside a dense q_proj.weight (split over the ranks), a q_proj.weight_scale_inv stopped rank-slice
    with 'tensors without a module' (exit 70); copied whole it would not match its rank's weight."""
    model = demo_copy(tmp_path)
    es = [e for e in entries(model / ST) if not e[0].startswith(f"{Q}.")]
    write_st(model / ST, es + [[f"{Q}.weight", "F16", [256, 256], bytes(256 * 256 * 2)],
                               [f"{Q}.weight_scale_inv", "F32", [2, 2], bytes(16)]])
    out = tmp_path / "out"
    assert_clean(cli("rank-slice", str(model), str(out), "--tp", "2", "--moe", "ep"), 3,
                 f"{Q}.weight_scale_inv", "cannot slice")
    assert not out.exists()


# the real CLI, SIGKILLed when the Nth file of the run has been renamed into place
KILL_AFTER_NTH_FILE = """
import os, signal, sys
import exl3tools.checkpoint.writer as W
n = [int(os.environ["KILL_AT"])]

def dying(real):
    def f(*a, **k):
        out = real(*a, **k)
        n[0] -= 1
        if n[0] == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        return out
    return f

for mod in (W, __import__("exl3tools.normalize").normalize, __import__("exl3tools.dequantize").dequantize):
    for name in ("write_atomic", "copy_atomic"):
        if hasattr(mod, name):
            setattr(mod, name, dying(getattr(mod, name)))
W.ShardWriter.close = dying(W.ShardWriter.close)
from exl3tools.cli import main
sys.argv = ["exl3tools", *sys.argv[1:]]
main()
"""


def _files(d: Path) -> set[str]:
    return {p.name for p in d.iterdir()}


@pytest.mark.parametrize("kill_at", [1, 2, 3, 4])
def test_killed_normalize_never_looks_complete(tmp_path, kill_at):
    """Killed after its shard and config.json but before tokenizer.json and the index, normalize left a
    folder that validate passed (readers glob the shards of a folder without an index)."""
    out = tmp_path / "out"
    res = cli_guarded("normalize", str(DEMO / "model"), str(out), env={"KILL_AT": str(kill_at)},
                      code=KILL_AFTER_NTH_FILE)
    assert res.returncode == -9, output(res)
    assert "tokenizer.json" not in _files(out) or INDEX not in _files(out)
    res = cli("validate", str(out))
    assert res.exit_code != 0 and "OK" not in res.output.splitlines()[-1], res.output


def test_dequantize_overwrite_killed_midway_is_not_a_mixed_checkpoint(tmp_path):
    """--overwrite replaced the shards one by one under the old config.json and index: killed after
    the second, the folder opened as a checkpoint of fp32 and bf16 shards; and a rerun with
    --overwrite was refused (a folder of shards without config.json was 'not a checkpoint')."""
    dst = tmp_path / "dq"
    assert_clean(cli("dequantize", str(DEMO / "model"), str(dst), "--dtype", "bf16", "--device", "cpu"), 0)
    res = cli_guarded("dequantize", str(DEMO / "model"), str(dst), "--dtype", "fp32", "--overwrite",
                      "--device", "cpu", env={"KILL_AT": "2"}, code=KILL_AFTER_NTH_FILE)
    assert res.returncode == -9, output(res)
    assert_clean(cli("inspect", str(dst)), 2, "no config.json")
    assert_clean(cli("dequantize", str(DEMO / "model"), str(dst), "--dtype", "fp32", "--device", "cpu"), 2,
                 "unfinished", "--overwrite")
    assert_clean(cli("dequantize", str(DEMO / "model"), str(dst), "--dtype", "fp32", "--device", "cpu",
                     "--overwrite"), 0)
    ck = Checkpoint.open(dst)
    assert {r.dtype for n, r in ck.tensors.items() if n.endswith("_proj.weight")} == {"F32"}


@pytest.mark.parametrize("args", [("inspect",), ("validate",), ("inspect", "--json"), ("validate", "--json")])
def test_closed_stdout_exits_quietly_with_141(args):
    """`exl3tools validate X | head -1`: rich's broken-pipe handler exited 1 ("validate found errors",
    of a clean checkpoint), --json exited 2 with "I/O error: Broken pipe"; now both exit 141, as
    SIGPIPE ends a shell filter, and print nothing."""
    p = subprocess.Popen([sys.executable, "-m", "exl3tools.cli", args[0], str(DEMO / "model"), *args[1:]],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "COLUMNS": "200"})
    p.stdout.close()  # before the child (still importing) writes a byte
    err = p.stderr.read().decode()
    assert p.wait(timeout=TIMEOUT) == 141, err
    assert err == "", err


def test_dequantize_copies_a_large_dense_tensor_in_chunks(tmp_path):
    """A dense tensor (GLM-5's 1.9 GB embedding) was copied by one read_bytes: the whole tensor in
    memory at once (a 400 MB one took dequantize to 436 MB RSS, 79 MB now)."""
    model = demo_copy(tmp_path)
    big = 200 << 20
    es = entries(model / ST)
    hb, _ = header_bytes([(n, d, tuple(s)) for n, d, s, _ in es] + [(f"{L0}.mlp.extra.weight", "F16", (big // 2048, 1024))])
    with open(model / ST, "wb") as f:
        f.write(hb)
        for e in es:
            f.write(e[3])
        f.truncate(f.tell() + big)  # zeros, sparse
    code = ("import sys; from exl3tools.cli import main\n"
            "try:\n    main()\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
            "print(next(l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM')))")
    res = cli_guarded("dequantize", str(model), str(tmp_path / "dq"), "--device", "cpu", code=code)
    assert res.returncode == 0, output(res)
    assert int(res.stdout.split()[-1]) < (big >> 10) // 2, res.stdout   # well under the tensor's size
    out = Checkpoint.open(tmp_path / "dq")
    assert out.tensors[f"{L0}.mlp.extra.weight"].info.nbytes == big

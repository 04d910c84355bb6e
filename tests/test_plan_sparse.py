"""bench/synth_checkpoint.py --sparse: a GLM-4.5-Air-shaped checkpoint larger than an H200 that takes no
disk (headers only, the data a hole), which plan refuses from its headers; tests/gpu/test_plan_gpu.py
runs generate/serve on it on the GPU to see the preflight refuse before a weight is read."""

from __future__ import annotations

import sys

from click.testing import CliRunner
from exl3tools.cli import main

from exl3tools.checkpoint import Checkpoint
from tests.conftest import REPO

sys.path.insert(0, str(REPO / "bench"))
import synth_checkpoint as sc  # noqa: E402
import synth_configs  # noqa: E402


def write_huge(out):
    """10 layers, 128 experts of 4096 x 11264 at 8 bits: 164 GB of tensor data, ~11 MB on disk."""
    return sc.write_checkpoint(out, layers=10, dims={**synth_configs.AIR, "moe_intermediate_size": 1408 * 8}, bits=8,
                               head_bits=8, sparse=True)


def test_sparse_checkpoint_is_bigger_than_an_h200_and_plan_refuses(tmp_path):
    out = tmp_path / "huge"
    s = write_huge(out)
    assert s["bytes"] > 160e9
    on_disk = sum(f.stat().st_blocks * 512 for f in out.iterdir())
    assert on_disk < 100e6
    ck = Checkpoint.open(out)
    assert sum(ref.info.nbytes for ref in ck.tensors.values()) == s["bytes"]
    res = CliRunner().invoke(main, ["plan", str(out), "--gpu", "h200"])
    assert res.exit_code == 3
    line = [x for x in res.stderr.splitlines() if "does not fit" in x]
    assert len(line) == 1 and "does not fit on h200 (140.40 GiB)" in line[0] and "weights 152.65 GiB" in line[0]

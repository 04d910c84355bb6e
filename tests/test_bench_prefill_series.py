"""bench/gpu_prefill_series.py --device cpu: the series runs on the CPU through the static step, the
eager forward and the decoder's long step taking turns (--paths eager,long), each forward's row
naming the path the runner really took, and a median per path (a smoke run of the GPU diagnostic,
whose device calls are scarce)."""

from __future__ import annotations

import sys

from tests.conftest import REPO, fixture_dir
from tests.test_fused_decode import _interpret

sys.path.insert(0, str(REPO / "bench"))
import gpu_prefill_series  # noqa: E402


def test_series_on_the_cpu_alternates_the_paths(monkeypatch, capsys):
    _interpret()
    monkeypatch.setenv("EXL3TOOLS_FUSED", "1")       # the static step's fused glue (long_step's)
    ckpt = fixture_dir("glm4_moe-3.0bpw-mcg") / "model"
    assert gpu_prefill_series.main([str(ckpt), "--device", "cpu", "--tokens", "40", "--n", "2", "--sleeps", "0",
                                    "--paths", "eager,long", "--max-cache-tokens", "512"]) == 0
    out = capsys.readouterr().out
    rows = [line.split(" | ")[2] for line in out.splitlines() if line.startswith("| 0 | ")]
    assert rows == ["eager", "long"] * 2               # 40 rows > the 32 decode rows: neither is "decode"
    assert "idle 0 s, eager: median" in out and "idle 0 s, long: median" in out

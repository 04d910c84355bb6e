"""bench/gpu_prefill_series.py --device cpu: the series runs on the CPU through the static step, the
eager forward, the decoder's long step, the eager forward with the fused glue and the long step's
graph path taking turns (--paths eager,long,fused,graph), each forward's row naming its path, and a median per path (a smoke run of the GPU diagnostic,
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
    import exl3tools.runtime.long_steps as P
    from exl3tools.runtime import fused_step

    calls, padded = [], []
    real = fused_step.FusedGqaStep.eager
    monkeypatch.setattr(fused_step.FusedGqaStep, "eager", lambda self, t, b: calls.append(len(t)) or real(self, t, b))
    real_pad = P.LongSteps._long_padded
    monkeypatch.setattr(P.LongSteps, "_long_padded", lambda self, R, *a: padded.append((R, len(a[0])))
                        or real_pad(self, R, *a))
    monkeypatch.setattr(P, "LONG_GRAPH_ROWS", (16,))   # the graph path's bucket (its body eagerly here)
    # the script's 32 decode rows as 8 here: a 12-token forward is past them as its 2048 are on the
    # GPU, at a third of the interpreter's rows (40 tokens past 32 rows: 28 s of the CPU suite)
    import exl3tools.runtime.runner as R

    real_load = R.load_runner
    monkeypatch.setattr(R, "load_runner", lambda *a, **k: real_load(*a, **{**k, "max_num_seqs": 8}))
    # the dense llama fixture: the paths, their order and the warm-ups are the script's and the
    # decoder's whatever the glue (glm4_moe's routed glue through these paths: ~11 s here against
    # ~7; checked against the plain cache in test_long_steps.py and test_fused_eager.py)
    ckpt = fixture_dir("llama-4.0bpw-mul1") / "model"
    assert gpu_prefill_series.main([str(ckpt), "--device", "cpu", "--tokens", "12", "--n", "1", "--sleeps", "0",
                                    "--paths", "eager,long,fused,graph", "--max-cache-tokens", "512"]) == 0
    out = capsys.readouterr().out
    rows = [line.split(" | ")[2] for line in out.splitlines() if line.startswith("| 0 | ")]
    assert rows == ["eager", "long", "fused", "graph"]    # 12 rows > the 8 decode rows: none is "decode"
    assert calls == [12] * 2                           # the fused path's warm-up and its forward
    assert padded == [(16, 12)] * 2                    # the graph path's, padded to its bucket
    assert all(f"idle 0 s, {p}: median" in out for p in ("eager", "long", "fused", "graph"))

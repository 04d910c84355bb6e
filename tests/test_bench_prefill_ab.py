"""bench/gpu_prefill.py --ab on the CPU: each variant's variables hold while (and only while) its
own calls run, the variants take turns round by round, and the medians are each variant's own."""

from __future__ import annotations

import os
import sys

from tests.conftest import REPO

sys.path.insert(0, str(REPO / "bench"))
import gpu_prefill  # noqa: E402


def test_variants_parse_with_commas_inside_values():
    assert gpu_prefill.parse_variants("a:X=1;b:X=0,T=32,64,8") == {"a": {"X": "1"}, "b": {"X": "0", "T": "32,64,8"}}
    assert gpu_prefill.parse_variants("") == {"defaults": {}}


def test_interleaved_switches_the_variables_per_call_and_takes_turns(monkeypatch, capsys):
    monkeypatch.delenv("EXL3_AB_PROBE", raising=False)
    seen = []
    times = {"1": 10.0, "0": 20.0}

    def fn():
        seen.append(os.environ.get("EXL3_AB_PROBE"))

    def timer(f):
        f()
        return times[seen[-1]]

    out = gpu_prefill.interleaved(fn, {"on": {"EXL3_AB_PROBE": "1"}, "off": {"EXL3_AB_PROBE": "0"}}, 3, 2048,
                                  timer=timer)
    assert seen == ["1", "0"] + ["1", "0"] * 3          # a warm-up each, then turns
    assert "EXL3_AB_PROBE" not in os.environ
    assert out["on"]["median_ms"] == 10.0 and out["off"]["median_ms"] == 20.0
    assert "| off | 20.00 | 102400 | 20.00-20.00 | 2.000 |" in capsys.readouterr().out

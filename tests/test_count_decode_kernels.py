"""bench/count_decode_kernels.py on the fixtures (Triton's interpreter): the fused step launches
fewer kernels than the torch loop, for a GQA model (FusedGqaStep) and an MLA one (FusedMlaStep,
EXL3TOOLS_FUSED_MLA), and the MLA attention is counted as its two kernels per layer."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from tests.conftest import fixture_dir

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))


@pytest.fixture
def counter(monkeypatch):
    pytest.importorskip("triton")
    from exl3tools.kernels import fused_decode

    if not fused_decode.INTERPRET:
        pytest.skip("needs TRITON_INTERPRET=1 (make test sets it) to run Triton on the CPU")
    for v in ("EXL3TOOLS_FUSED", "EXL3TOOLS_FUSED_MLA", "EXL3TOOLS_GROUPED_PROJ"):   # count() sets them
        monkeypatch.setenv(v, os.environ.get(v, ""))
    import count_decode_kernels

    return count_decode_kernels


@pytest.mark.parametrize("name,moe_cut", [("glm4_moe-3.0bpw-mcg", 50), ("deepseek_v3-3.0bpw-3inst", 70)])
def test_the_fused_step_launches_fewer_kernels(counter, name, moe_cut):
    model = fixture_dir(name) / "model"
    torch_loop, fused = (counter.summary(counter.count(model, f, 1)) for f in (False, True))
    assert set(torch_loop) == set(fused) == {"embed", "head", "layer0:dense", "layer1:moe"}
    assert torch_loop["layer1:moe"] - fused["layer1:moe"] >= moe_cut, (torch_loop, fused)
    assert sum(fused.values()) < sum(torch_loop.values())
    if name.startswith("deepseek"):
        ops = counter.count(model, True, 1)
        assert ops[("layer0:dense", "mla_attention")] == ops[("layer1:moe", "mla_attention")] == 2

"""--device for dequantize and validate --deep on a machine without CUDA: auto means cpu (and,
without an NVIDIA driver, never imports torch); an explicit cuda is a one-line usage error (exit 2).
The GPU decode itself: tests/gpu/test_gpu_dequantize.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from click.testing import CliRunner
from exl3tools.cli import main
from exl3tools.cli._device import _nvidia_driver

from tests.conftest import DEMO, cuda_available

no_cuda = pytest.mark.skipif(cuda_available(), reason="checks the answer on a machine without CUDA")


@no_cuda
@pytest.mark.parametrize("args", [["dequantize", str(DEMO / "model"), "OUT"],
                                  ["validate", str(DEMO / "model"), "--deep"]])
def test_device_cuda_without_cuda_is_one_line_exit_2(tmp_path, args):
    args = [a.replace("OUT", str(tmp_path / "o")) for a in args]
    r = CliRunner().invoke(main, [*args, "--device", "cuda"])
    assert r.exit_code == 2, r.output
    assert len(r.output.strip().splitlines()) == 1 and "cuda" in r.output and "Traceback" not in r.output
    assert not (tmp_path / "o").exists()


def test_bad_device_is_usage_error(tmp_path):
    r = CliRunner().invoke(main, ["dequantize", str(DEMO / "model"), str(tmp_path / "o"), "--device", "tpu"])
    assert r.exit_code == 2 and "--device" in r.output


@no_cuda
def test_auto_decodes_on_cpu(tmp_path):
    r = CliRunner().invoke(main, ["dequantize", str(DEMO / "model"), str(tmp_path / "o"), "--json",
                                  "--tensor", "model.layers.0.self_attn.q_proj"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["device"] == "cpu"


@pytest.mark.skipif(_nvidia_driver(), reason="an NVIDIA driver is here: auto may import torch")
def test_auto_without_driver_never_imports_torch():
    code = ("import sys\nfrom exl3tools.cli._device import decode_device\n"
            "assert decode_device('auto') == 'cpu'\nprint('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# ------------------------------------------------------------------ serve, generate, eval, diff
@no_cuda
def test_commands_that_run_the_model_default_to_auto_and_run_on_cpu_here():
    """Without --device, generate and eval run on this machine's CPU (auto); generate says where."""
    r = CliRunner().invoke(main, ["generate", str(DEMO / "model"), "--token-ids", "1,2", "--max-tokens", "2"])
    assert r.exit_code == 0, r.output
    assert r.output.rstrip().endswith("on cpu")
    import click

    ctx = click.Context(main)
    for cmd in ("serve", "generate", "eval", "diff"):
        opt = next(o for o in main.get_command(ctx, cmd).params if o.name == "device")
        assert opt.default == "auto", cmd


def test_auto_wants_a_gpu_for_every_rank(monkeypatch):
    """auto -> cuda only when this machine's GPUs cover --tp's ranks; else the CPU reference path.
    (Here torch's answers are set: the rule, not the hardware, is under test.)"""
    import torch
    from exl3tools.cli import _device

    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.setattr(_device, "_nvidia_driver", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert [_device.run_device("auto", n) for n in (1, 2, 4)] == ["cuda", "cuda", "cpu"]
    assert _device.run_device("cpu", 4) == "cpu"
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"   # set before CUDA starts
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert _device.run_device("auto") == "cpu"
    monkeypatch.setattr(_device, "_nvidia_driver", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert _device.run_device("auto") == "cpu"          # no driver: torch is not asked

"""The CUDA kernels' bit logic on the host: every lane's 8 trellis windows, every trellis width.

kernels/csrc/exl3_gemv.cu compiled with -DEXL3_HOST_TEST checks its own lane_origin/lane_states
(the part of the kernel that turns tile words into states) against the ring-bit definition of
exl3-format.md §5.3 on random tiles. Needs nvcc only (no GPU); skipped without it.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "kernels" / "csrc" / "exl3_gemv.cu"


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (host-side check, no GPU)")
@pytest.mark.parametrize("k2", range(2, 17))
def test_host_bit_logic(tmp_path, k2):
    exe = tmp_path / "bits"
    subprocess.run(["nvcc", "-std=c++17", "-DEXL3_HOST_TEST", f"-DK2={k2}", "-x", "cu", str(SRC), "-o", str(exe)],
                   check=True, capture_output=True)
    res = subprocess.run([str(exe)], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout

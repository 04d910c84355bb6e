"""kernels/mla_cuda.py's host-side choices (no GPU): which planes and devices the CUDA MLA kernel
takes, and whether it builds."""

from __future__ import annotations

import pytest
import torch
from exl3tools.kernels import mla_cuda


def test_the_kernel_is_never_taken_off_cuda():
    q = torch.zeros(1, 128, 512)
    ckv, kpe = torch.zeros(4, 16, 512, dtype=torch.float16), torch.zeros(4, 16, 64, dtype=torch.float16)
    assert not mla_cuda.fits(q, ckv, kpe)


def test_blocks_with_gaps_cannot_share_one_tensor_map():
    plane = torch.zeros(4, 32, 512, dtype=torch.float16)
    assert mla_cuda._blocks_contiguous(plane) and mla_cuda._blocks_contiguous(plane[..., :256])
    assert not mla_cuda._blocks_contiguous(plane[:, :16])


def test_a_toolchain_that_cannot_build_it_leaves_triton_serving(monkeypatch):
    """An nvcc that fails on the kernel (an older toolkit) is asked once, warns once, and fits()
    answers False after it, so mla_decode keeps the Triton kernel instead of failing a step."""
    from exl3tools.kernels import cuda_build

    def broken():
        raise RuntimeError("nvcc failed for mla_decode_x.cubin:\nerror: unknown instruction")
    monkeypatch.setattr(mla_cuda, "_can_build", None)
    monkeypatch.setattr(cuda_build, "can_build_mla", lambda: True)
    monkeypatch.setattr(cuda_build, "build_mla", broken)
    with pytest.warns(RuntimeWarning, match="did not build .*nvcc failed"):
        assert mla_cuda._buildable() is False
    assert mla_cuda._buildable() is False          # asked once

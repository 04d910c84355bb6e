"""kernels/mla_cuda.py's host-side choices (no GPU): which planes and devices the CUDA MLA kernel
takes, and how the clustered launch (the EXL3TOOLS_MLA_CLUSTER preview) sizes its splits."""

from __future__ import annotations

import pytest
import torch
from exl3tools.kernels import mla_cuda


def test_the_kernel_is_never_taken_off_cuda():
    q = torch.zeros(1, 128, 512)
    ckv, kpe = torch.zeros(4, 16, 512, dtype=torch.float16), torch.zeros(4, 16, 64, dtype=torch.float16)
    assert not mla_cuda.fits(q, ckv, kpe)


def test_cluster_sizes_divide_the_splits():
    assert [mla_cuda.cluster_size(s) for s in (1, 2, 3, 6, 8, 12, 24, 64)] == [1, 2, 1, 2, 8, 4, 8, 8]


def test_only_splits_chosen_here_are_rounded_down_to_a_cluster():
    """mla_decode's own split counts of 8 or more round down to a multiple of 8 (never a wave
    more); fewer keep their count and cluster where a power of two divides it; a caller's count is
    kept."""
    assert mla_cuda.clustered_splits(57, True) == (56, 8)
    assert mla_cuda.clustered_splits(66, True) == (64, 8)
    assert mla_cuda.clustered_splits(57, False) == (57, 1)
    assert mla_cuda.clustered_splits(6, True) == (6, 2)
    assert mla_cuda.clustered_splits(24, False) == (24, 8)
    assert mla_cuda.clustered_splits(1, True) == (1, 1)


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


def test_only_two_head_blocks_multicast():
    """The multicast kernel's cluster is a split's two head blocks (DeepSeek-V3's 128 heads);
    GLM-5's 64 heads are one block and take the ping-pong kernel alone."""
    assert mla_cuda.multicasts(128)
    assert not mla_cuda.multicasts(64) and not mla_cuda.multicasts(256)

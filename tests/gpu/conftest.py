"""GPU tests: on CUDA, or on the Triton CPU interpreter when TRITON_INTERPRET=1 (slow, small shapes)."""

from __future__ import annotations

import os

import pytest

from tests.conftest import cuda_available

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def kernel_device() -> str:
    if cuda_available():
        return "cuda"
    if INTERPRET:
        return "cpu"
    pytest.skip("needs CUDA (or TRITON_INTERPRET=1 for the Triton CPU interpreter)")


@pytest.fixture
def dev() -> str:
    pytest.importorskip("triton")
    return kernel_device()


def cuda_backend() -> str:
    """"cuda" (our CUDA kernels), or skip where they cannot be built or loaded here."""
    from exl3tools.kernels import dispatch

    try:
        dispatch.get_backend("cuda")
    except Exception as exc:  # noqa: BLE001 - not built here
        pytest.skip(f"cuda backend unavailable: {exc}")
    return "cuda"


@pytest.fixture(autouse=True)
def _release_cuda_cache():
    """Hand each test's cached CUDA blocks back after it: the workers (-n 8) share one GPU, and one
    worker's allocator holding 115 GiB after a wide test made another's 4 GiB allocation fail
    (H200, 2026-12-02)."""
    yield
    import sys

    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


@pytest.fixture(scope="module")
def cx():
    """kernels/cuda_exl3 with every (K, codebook) module built (skips without CUDA)."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from exl3tools.kernels import cuda_build, cuda_exl3

    # all modules in parallel up front (nvcc is single-threaded; ~2 s each)
    cuda_build.prebuild()
    return cuda_exl3

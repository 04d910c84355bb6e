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

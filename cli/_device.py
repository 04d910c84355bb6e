"""``--device`` for the commands that decode whole checkpoints (dequantize, validate --deep)."""

from __future__ import annotations

import os

from exl3tools.cli._runtime import check_device


def _nvidia_driver() -> bool:
    """A loaded NVIDIA kernel driver; without one, auto means cpu and torch is never imported."""
    return os.path.exists("/proc/driver/nvidia/version") or os.path.exists("/dev/nvidiactl")


def decode_device(device: str) -> str:
    """``auto`` -> ``cuda`` when a CUDA device, torch and triton are here, else ``cpu``; ``cpu``,
    ``cuda``, ``cuda:N`` are checked (UsageError, exit 2, when this machine has no such device)."""
    if device != "auto":
        device = check_device(device)
        if device != "cpu":
            import triton  # noqa: F401  (missing: exit 2 naming the extra that brings it)
        return device
    if not _nvidia_driver():
        return "cpu"
    try:
        import torch
        import triton  # noqa: F401
    except ImportError:
        return "cpu"
    return "cuda" if torch.cuda.is_available() else "cpu"


def decoder(device: str):
    """None for the CPU reference, else a GpuDecoder (the kernels load here, after the checks)."""
    if device == "cpu":
        return None
    from exl3tools.kernels.gpu_decode import GpuDecoder

    return GpuDecoder(device)

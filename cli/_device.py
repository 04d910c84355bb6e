"""``--device auto``: for the commands that decode whole checkpoints (dequantize, validate --deep,
``decode_device``) and for those that run the model (serve, generate, eval, diff: ``run_device``)."""

from __future__ import annotations

import os

import click
from exl3tools.cli._runtime import check_device, cuda_alloc_conf


def run_options(f):
    """--device and --backend of the commands that run the model (serve, generate, eval)."""
    f = click.option("--backend", default="auto", show_default=True,
                     help="Kernel backend: auto (cuda kernels on a CUDA device, reference on the CPU), cuda, "
                          "triton, exllamav3, reference.")(f)
    return click.option("--device", default="auto", show_default=True,
                        help="auto (cuda when this machine has a GPU for every rank, else cpu), cpu, cuda, "
                             "cuda:N.")(f)


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


def run_device(device: str, ranks: int = 1) -> str:
    """``auto`` -> ``cuda`` when this machine has a CUDA GPU for each of ``ranks`` (the GPU path:
    trellis kernels, graphs, the paged engine), else ``cpu`` (the reference path), which a GPU
    machine with fewer GPUs than ranks also gets; ``cpu``, ``cuda``, ``cuda:N`` as check_device."""
    if device != "auto":
        return check_device(device)
    if not _nvidia_driver():
        return "cpu"
    cuda_alloc_conf()       # before torch looks at the GPUs
    try:
        import torch
    except ImportError:
        return "cpu"
    if torch.cuda.is_available() and torch.cuda.device_count() >= ranks:
        return check_device("cuda")
    return "cpu"


def decoder(device: str):
    """None for the CPU reference, else a GpuDecoder (the kernels load here, after the checks)."""
    if device == "cpu":
        return None
    from exl3tools.kernels.gpu_decode import GpuDecoder

    return GpuDecoder(device)

"""exl3tools: inspect, validate, normalize, rank-slice and serve EXL3 checkpoints.

The core package (everything outside ``exl3tools.runtime``, ``exl3tools.server`` and the
GPU parts of ``exl3tools.kernels``) is pure Python + numpy and never imports torch.
"""

__version__ = "0.1.0"

"""Backend ``exllamav3``: the same dispatch contract served by exllamav3 1.6.5's CUDA extension.

Optional extra ``gpu``. Importing exllamav3 JIT-builds its extension (~4 min cold on an H200 with
TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16; exl3-format.md §10.1-10.2), so this module imports it only
when a linear is first built, and only on a CUDA device. The wrapper is ``LinearEXL3``
(modules/quant/exl3.py): ≤ 144 rows go through the fused ``BC_LinearEXL3`` kernels, more rows
through reconstruct + hgemm, exactly as exllamav3 serves them.
"""

from __future__ import annotations

from exl3tools.errors import UsageError


def _linear_cls():
    try:
        from exllamav3.modules.quant.exl3 import LinearEXL3
    except ImportError as exc:  # not installed, or its extension failed to build
        raise UsageError(f"exllamav3 is not importable here ({exc}); install the 'gpu' extra") from None
    return LinearEXL3


class Exl3Linear:
    """``__call__(x) -> x @ W + bias`` at padded dims, through exllamav3's LinearEXL3."""

    def __init__(self, tensors: dict, codebook: str, device):
        import torch

        dev = torch.device(device)
        if dev.type != "cuda":
            raise UsageError("backend 'exllamav3' needs a CUDA device")
        tr = tensors["trellis"].to(dev, torch.int16).contiguous()
        k, n = tr.shape[0] * 16, tr.shape[1] * 16
        marker = torch.zeros((), dtype=torch.int32, device=dev)   # only presence is read
        bias = tensors.get("bias")
        self.inner = _linear_cls()(
            None, k, n,
            suh=tensors["suh"].to(dev, torch.float16).contiguous(),
            svh=tensors["svh"].to(dev, torch.float16).contiguous(),
            trellis=tr,
            mcg=marker if codebook == "mcg" else None,
            mul1=marker if codebook == "mul1" else None,
            bias=None if bias is None else bias.to(dev, torch.float16).contiguous(),
        )
        self.k, self.n = k, n
        self.params: dict = {}

    def __call__(self, x):
        shape = x.shape
        x2 = x.reshape(-1, self.k).to(dtype=self.inner.svh.dtype).contiguous()
        y = self.inner.forward(x2, self.params)
        return y.to(x.dtype).reshape(*shape[:-1], self.n)


def _exllamav3_factory(tensors: dict, codebook: str, k_bits: float, device):
    return Exl3Linear(tensors, codebook, device)


def _register() -> None:
    from exl3tools.kernels.dispatch import register_backend

    register_backend("exllamav3", _exllamav3_factory)


_register()

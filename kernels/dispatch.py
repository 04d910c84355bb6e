"""One call for every EXL3 linear: pick a backend by name, get ``f(x) -> x @ W + bias``.

A backend is a factory registered under a name::

    factory(tensors: dict[str, torch.Tensor], codebook: str, k_bits: float, device) -> callable(x) -> y

``tensors`` holds the linear's stored fields exactly as named on disk (``trellis`` int16
``[k/16, n/16, 16K]``, ``suh`` fp16 ``[k]``, ``svh`` fp16 ``[n]``, optional ``bias`` fp16 ``[n]``);
``codebook`` is ``"3inst" | "mcg" | "mul1"``. The callable works on **padded** dims: ``x`` is
``(rows, k)`` and ``y`` is ``(rows, n)``; the runtime zero-extends inputs and trims outputs
(exl3-format.md §4). It must return ``x.dtype``.

Built in: ``reference`` (decode once with kernels/reference.py to a dense fp32 W, cached) and
``reference-otf`` (decode on every call; for when dense weights do not fit). GPU backends
(``triton``, ``exllamav3``) register themselves when their module is imported: the hook is
``LAZY_BACKENDS`` below, name -> module path; the module must call ``register_backend``.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable

from exl3tools.errors import UsageError

Factory = Callable[..., Callable[[Any], Any]]

_BACKENDS: dict[str, Factory] = {}

# GPU backends live in their own modules, imported on first use so CPU users never pay for them.
LAZY_BACKENDS: dict[str, str] = {
    "triton": "exl3tools.kernels.triton_exl3",
    "exllamav3": "exl3tools.kernels.exllamav3_backend",
}


def register_backend(name: str, factory: Factory) -> None:
    """Make ``factory`` available as backend ``name`` (re-registering replaces it)."""
    _BACKENDS[name] = factory


def get_backend(name: str) -> Factory:
    if name not in _BACKENDS and name in LAZY_BACKENDS:
        try:
            importlib.import_module(LAZY_BACKENDS[name])
        except ImportError as exc:
            raise UsageError(f"backend {name!r} is not available here ({exc})") from None
    try:
        return _BACKENDS[name]
    except KeyError:
        known = sorted(set(_BACKENDS) | set(LAZY_BACKENDS))
        raise UsageError(f"unknown kernel backend {name!r} (known: {', '.join(known)})") from None


def backend_names() -> list[str]:
    return sorted(set(_BACKENDS) | set(LAZY_BACKENDS))


def make_linear(tensors: dict, codebook: str, k_bits: float, device, backend: str = "reference"):
    """The callable for one EXL3 linear on ``device`` from backend ``backend``."""
    return get_backend(backend)(tensors, codebook, k_bits, device)


# ------------------------------------------------------------------ reference (CPU) backend
def _dense_weight(tensors: dict):
    import torch
    from exl3tools.kernels.reference import decode_linear

    w = decode_linear(tensors["trellis"].cpu().numpy(), tensors["suh"].cpu().numpy(),
                      tensors["svh"].cpu().numpy(), _codebook_of(tensors))
    return torch.from_numpy(w)


def _codebook_of(tensors: dict) -> str:
    return tensors["__codebook__"]


def _reference_factory(tensors: dict, codebook: str, k_bits: float, device, *, cache: bool = True):
    import torch

    fields = dict(tensors)
    fields["__codebook__"] = codebook
    bias = tensors.get("bias")
    bias = None if bias is None else bias.to(device=device, dtype=torch.float32)
    weight = _dense_weight(fields).to(device) if cache else None

    def forward(x):
        w = weight if weight is not None else _dense_weight(fields).to(x.device)
        y = x.to(torch.float32) @ w
        if bias is not None:
            y = y + bias
        return y.to(x.dtype)

    forward.weight = weight  # lets tests and callers reuse the dense W
    return forward


register_backend("reference", _reference_factory)
register_backend("reference-otf", lambda t, cb, k, dev: _reference_factory(t, cb, k, dev, cache=False))

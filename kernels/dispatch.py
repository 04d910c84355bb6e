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

Grouped experts (one projection of many experts, for MoE decode without host syncs)::

    experts_factory(list_of_tensor_dicts, codebook, k_bits, device) -> obj
    obj.slots(x, tok, exp) -> y      # y[s] = x[tok[s]] @ W_{exp[s]} + bias_{exp[s]}

``x`` is ``(T, k)``, ``tok``/``exp`` int64 device tensors ``(S,)``, ``y`` ``(S, n)`` in
``x.dtype``, padded dims as above. ``slots`` must not synchronise with the host and its launch
shapes may depend only on ``S`` (CUDA-graph capturable). Optionally, rows grouped by expert::

    obj.tiles(x, src, row_exp, tile_exp, rows, out_dtype=None, counts=None) -> y
                                                       # y[o] = x[src[o]] @ W_{row_exp[o]} + bias
                                                       # (src None: x[o]); tile t = rows
                                                       # [t*rows, (t+1)*rows), all of expert
                                                       # tile_exp[t]; -1: skipped (rows unspecified);
                                                       # counts[t]: its real rows (a backend may
                                                       # leave the others unspecified)

so a backend decodes each expert's weights once per tile, not once per row (runtime.layers
builds the tiles). A backend registers one with
``register_experts`` (from its module, like ``register_backend``); ``make_experts`` falls back to
``LoopExperts`` over the backend's per-expert linears (correct, slow: every expert sees every slot).
"""

from __future__ import annotations

import importlib
from typing import Any, Callable

from exl3tools.errors import UsageError

Factory = Callable[..., Callable[[Any], Any]]

_BACKENDS: dict[str, Factory] = {}
_EXPERTS: dict[str, Callable[..., Any]] = {}

# GPU backends live in their own modules, imported on first use so CPU users never pay for them.
LAZY_BACKENDS: dict[str, str] = {
    "cuda": "exl3tools.kernels.cuda_exl3",
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


AUTO_GPU_ORDER = ("cuda", "triton")     # what "auto" tries on a CUDA device, fastest first


def resolve_backend(name: str, device) -> str:
    """``"auto"``: the fastest backend that loads for ``device`` -- on CUDA our CUDA kernels (when
    nvcc or prebuilt cubins are there), else Triton; ``reference`` elsewhere. Other names pass."""
    if name != "auto":
        return name
    if str(device).startswith("cuda"):
        for cand in AUTO_GPU_ORDER:
            try:
                get_backend(cand)
            except UsageError:
                continue
            if cand == "cuda":
                from exl3tools.kernels.cuda_build import can_build

                if not can_build():
                    continue
            return cand
    return "reference"


def backend_names() -> list[str]:
    return sorted(set(_BACKENDS) | set(LAZY_BACKENDS))


def make_linear(tensors: dict, codebook: str, k_bits: float, device, backend: str = "reference"):
    """The callable for one EXL3 linear on ``device`` from backend ``backend``."""
    return get_backend(backend)(tensors, codebook, k_bits, device)


def make_group(fns: list) -> Callable[[Any], list]:
    """``g(x) -> [f(x) for f in fns]`` for linears that read the same x (q, k and v): one grouped
    call where their type has a ``grouped(fns)`` static method that returns one (our CUDA backend:
    one gemv launch and one output pass for all), else each in turn."""
    grouped = getattr(type(fns[0]), "grouped", None) if fns else None
    g = grouped(fns) if grouped is not None else None
    return g if g is not None else (lambda x: [f(x) for f in fns])


def register_experts(name: str, factory: Callable[..., Any]) -> None:
    """Make ``factory`` the grouped-experts factory of backend ``name`` (see module doc)."""
    _EXPERTS[name] = factory


def make_experts(tensors: list[dict], codebook: str, k_bits: float, device, backend: str = "reference"):
    """One projection of ``len(tensors)`` experts (same codebook and K) with a sync-free ``slots``."""
    linear = get_backend(backend)        # imports a lazy backend, which may register its experts
    factory = _EXPERTS.get(backend)
    if factory is not None:
        return factory(tensors, codebook, k_bits, device)
    return LoopExperts([linear(t, codebook, k_bits, device) for t in tensors])


class LoopExperts:
    """Sync-free experts from per-expert callables: every expert runs on all S slots and keeps its
    own rows (``torch.where``), so the work is E x S rows; correct everywhere, fast nowhere."""

    def __init__(self, fns: list):
        self.fns = list(fns)

    def slots(self, x, tok, exp):
        import torch

        xs = x.index_select(0, tok)
        y = None
        for e, f in enumerate(self.fns):
            ye = f(xs)
            y = torch.zeros_like(ye) if y is None else y
            y = torch.where((exp == e)[:, None], ye, y)
        return y


class DenseExperts:
    """Experts as one dense fp32 stack ``(E, k, n)``: per tile a gathered W and a batched GEMM
    (``slots``: one row per tile). Tiles run in chunks so the gathered weights stay near
    ``CHUNK_ELEMS`` floats."""

    CHUNK_ELEMS = 1 << 26

    def __init__(self, weight, bias=None):
        self.weight, self.bias = weight, bias            # (E, k, n) fp32, (E, n) fp32 or None

    def slots(self, x, tok, exp):
        return self.tiles(x, tok, exp, exp, 1)

    def tiles(self, x, src, row_exp, tile_exp, rows, out_dtype=None, counts=None):
        """Each tile's rows times its expert's W (the dispatch module doc's contract; every row
        computed, ``counts`` unused)."""
        import torch

        xs = (x if src is None else x.index_select(0, src)).to(torch.float32)
        nt = tile_exp.shape[0]
        _, k, n = self.weight.shape
        step = max(1, self.CHUNK_ELEMS // (k * n))
        xt, te = xs.view(nt, rows, -1), tile_exp.clamp(min=0)
        parts = [torch.bmm(xt[a:a + step], self.weight.index_select(0, te[a:a + step])) for a in range(0, nt, step)]
        y = (torch.cat(parts) if len(parts) != 1 else parts[0]).reshape(nt * rows, n)
        if self.bias is not None:
            y = y + self.bias.index_select(0, row_exp)
        return y.to(out_dtype or x.dtype)


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
    # the stored fields as given (grouped experts build from them instead of re-reading the file)
    forward.device_tensors = {k: v for k, v in tensors.items() if k != "__codebook__"}
    return forward


def _reference_experts(tensors: list[dict], codebook: str, k_bits: float, device):
    import torch

    ws = [_dense_weight({**t, "__codebook__": codebook}) for t in tensors]
    w = torch.stack(ws).to(device) if ws else torch.zeros(0, 0, 0, device=device)
    bias = None
    if any(t.get("bias") is not None for t in tensors):   # a row-cut rank may hold no bias: zeros
        bias = torch.stack([t["bias"].float() if t.get("bias") is not None else torch.zeros(w.shape[2])
                            for t in tensors]).to(device)
    return DenseExperts(w, bias)


register_backend("reference", _reference_factory)
register_backend("reference-otf", lambda t, cb, k, dev: _reference_factory(t, cb, k, dev, cache=False))
register_experts("reference", _reference_experts)
# reference-otf keeps no dense W by design: it gets the LoopExperts fallback (decodes per call)

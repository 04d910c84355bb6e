"""--layout vllm-hybrid (docs/rank-slice.md §6): one directory for the vLLM EXL3 backend, with
rank-cut routed experts and every other EXL3 linear dequantized to BF16 while it is written.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import numpy as np

from exl3tools import __version__
from exl3tools.checkpoint.reader import Checkpoint
from exl3tools.errors import IncompatibleSliceError
from exl3tools.exl3 import BLOCK
from exl3tools.layout import real_dims
from exl3tools.slicing.cuts import collect_modules, decide_cuts, role_of, tensor_slice
from exl3tools.slicing.plan import OutTensor, RankPlan, ShardPlan, _plan_fingerprint, source_info
from exl3tools.slicing.write import CHUNK_BYTES

# ---------------------------------------------------------------------------- layout vllm-hybrid
HYBRID_SCHEMA = "model.layers.{L}.mlp.experts.{E}.{proj}.rank{r}.{trellis|suh|svh|mcg}"
_EXPERT_T = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.\d+\.(gate_proj|up_proj|down_proj)\.(\w+)$")


def plan_hybrid(ck: Checkpoint, tp: int, moe: str) -> RankPlan:
    """docs/rank-slice.md §6: one directory for the local-inference-lab vLLM EXL3 backend.

    Routed experts become ``….{proj}.rank{r}.{field}`` (tp cut); every other EXL3 linear is
    dequantized to a full-size BF16 ``.weight`` (that backend runs non-expert linears unquantized).
    Everything the backend would reject is refused here, before anything is written.
    """
    def refuse(msg: str) -> IncompatibleSliceError:
        return IncompatibleSliceError(f"--layout vllm-hybrid: {msg}")

    if moe != "tp":
        raise refuse("the vLLM EXL3 backend has no expert parallelism (use --moe tp)")
    if not ck.is_exl3:
        raise refuse(f"{ck.root} is not an EXL3 checkpoint")
    mods = collect_modules(ck)
    cuts, _attn, experts, _notes = decide_cuts(ck, mods, tp, "tp")  # raises on I % (128*tp)
    experts_lin = [m for p, m in mods.items() if role_of(p) in ("expert_col", "expert_row")]
    if not experts_lin:
        raise refuse("no routed experts: nothing for that backend to load as rank-sliced EXL3")
    widths = set()
    for m in experts_lin:
        if m.kind != "exl3":
            raise refuse(f"{m.prefix} is not EXL3")
        if f"{m.prefix}.mcg" not in ck:
            raise refuse(f"{m.prefix}: the backend requires the mcg codebook (convert with -cb mcg)")
        if f"{m.prefix}.bias" in ck:
            raise refuse(f"{m.prefix}: expert biases are not supported by the backend")
        if f"{m.prefix}.suh" not in ck or f"{m.prefix}.svh" not in ck:
            raise refuse(f"{m.prefix}: legacy su/sv; run exl3tools normalize first")
        widths.add(ck.ref(f"{m.prefix}.trellis").shape[2])
    if len(widths) != 1 or (next(iter(widths)) // 16) not in (3, 4, 5, 6) or next(iter(widths)) % 16:
        raise refuse(f"expert bitrates {sorted(w / 16 for w in widths)}: the backend needs one integral K in 3..6")
    bits = next(iter(widths)) // 16
    rd = real_dims(ck.config, ck.tensors)
    owner = {t: m for m in mods.values() for t in m.tensors}
    source = source_info(ck)
    moe_layers = sorted({int(_EXPERT_T.match(f"{m.prefix}.trellis").group(1)) for m in experts_lin})
    files = sorted(ck.headers)
    shards = []
    for i, fname in enumerate(files):
        outs: list[OutTensor] = []
        for info in sorted(ck.headers[fname].tensors.values(), key=lambda t: t.begin):
            m = owner[info.name]
            leaf = info.name.rsplit(".", 1)[1]
            if role_of(m.prefix) in ("expert_col", "expert_row"):
                if leaf not in ("trellis", "suh", "svh", "mcg"):
                    raise refuse(f"{info.name}: field {leaf!r} is not in the backend's tensor schema")
                for r in range(tp):
                    sl = tensor_slice(m, info.name, cuts[r][m.prefix], info.shape)
                    dim, a, b = sl
                    shape = info.shape if dim is None else tuple(b - a if d == dim else x
                                                                 for d, x in enumerate(info.shape))
                    outs.append(OutTensor(f"{m.prefix}.rank{r}.{leaf}", info.name, info.dtype, shape, dim, a, b))
            elif m.kind == "exl3":
                in_r, out_r = rd.get(m.prefix, (m.k, m.n))
                if leaf == "trellis":
                    outs.append(OutTensor(f"{m.prefix}.weight", m.prefix, "BF16", (out_r, in_r), "dequantize"))
                elif leaf == "bias":
                    outs.append(OutTensor(info.name, info.name, info.dtype, (out_r,),
                                          None if out_r == info.shape[0] else 0, *((None, None) if out_r == info.shape[0]
                                                                                   else (0, out_r))))
            else:
                outs.append(OutTensor(info.name, info.name, info.dtype, info.shape, None))
        shards.append(ShardPlan(fname, f"model-{i + 1:05d}-of-{len(files):05d}.safetensors", (tuple(outs),)))
    cfg = dict(ck.config)
    cfg["hybrid_tr3_tail"] = {
        "format": "exl3-trellis", "bits": float(bits), "codebook": "mcg",
        "experts_per_layer": len({m.prefix.split(".mlp.experts.")[1].split(".")[0] for m in experts_lin
                                  if m.prefix.startswith(f"model.layers.{moe_layers[0]}.")}),
        "moe_layers": [moe_layers[0], moe_layers[-1]], "tensor_schema": HYBRID_SCHEMA, "tp": tp,
        "exllamav3_version": str((ck.quantization_config or {}).get("version", "rank-sliced")),
        "producer": f"exl3tools {__version__}", "source_fingerprint": source.fingerprint,
    }
    notes = [f"{len([m for m in mods.values() if m.kind == 'exl3' and m not in experts_lin])} non-expert EXL3 "
             "linears are dequantized to BF16 .weight (the backend runs them unquantized)"]
    fp = _plan_fingerprint(source, tp, "tp", "vllm-hybrid", (".",), shards, [cfg])
    return RankPlan(tp, "tp", "vllm-hybrid", source, (".",), tuple(shards), (cfg,), tuple(notes), fp,
                    ({"rank": None, "attention": {}, "modules": {k: v for k, v in experts[0].items()}},))


def _bf16(x: np.ndarray) -> bytes:
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    return ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype("<u2").tobytes()


def dequantize_to_writer(ck: Checkpoint, t: OutTensor, w: Any, progress: Callable[[int], None]) -> None:
    """Write ``t`` = BF16 HF (out_real, in_real) weight of the EXL3 linear ``t.src``, in column bands."""
    from exl3tools.exl3 import unpack_signs
    from exl3tools.kernels.reference import decode_rotated, rotate_out

    p = t.src
    out_r, in_r = t.shape
    kt, nt, _ = ck.ref(f"{p}.trellis").shape
    k = kt * 16
    suh = ck.read_numpy(f"{p}.suh") if f"{p}.suh" in ck else unpack_signs(ck.read_numpy(f"{p}.su"))
    svh = ck.read_numpy(f"{p}.svh") if f"{p}.svh" in ck else unpack_signs(ck.read_numpy(f"{p}.sv"))
    cb = "mcg" if f"{p}.mcg" in ck else "mul1" if f"{p}.mul1" in ck else "3inst"
    band = max(BLOCK, (CHUNK_BYTES // 8 // (k * 4)) // BLOCK * BLOCK)
    for c0 in range(0, out_r, band):
        c1 = min(nt * 16, c0 + band)
        c1 = -(-c1 // BLOCK) * BLOCK
        tr = ck.read_numpy_slice(f"{p}.trellis", 1, c0 // 16, c1 // 16)
        wband = rotate_out(decode_rotated(tr, cb), suh, svh[c0:c1])      # (k, c1-c0)
        rows = wband[:in_r, : min(c1, out_r) - c0].T                      # HF (out, in)
        data = _bf16(rows)
        w.write(data)
        progress(len(data))

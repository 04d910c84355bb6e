"""inspect: what is in a checkpoint, as one versioned, JSON-ready record (schemas/inspect.v1.json)."""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from typing import Any

from exl3tools.checkpoint import Checkpoint
from exl3tools.errors import NotExl3Error
from exl3tools.exl3 import fmt_k
from exl3tools.layout import Exl3Linear, Scan, layer_of, real_dims, scan, scan_refs

SCHEMA_ID = "https://exl3tools.dev/schemas/inspect.v1.json"
FAMILIES = ("attention", "dense_mlp", "experts", "shared_experts", "head", "mtp", "other")


@dataclass(frozen=True, slots=True)
class BitsRow:
    family: str
    bits: str
    linears: int
    weights: int


@dataclass(frozen=True, slots=True)
class Summary:
    path: str
    source: str                        # "local" | "hub-cache" | "hub-headers"
    architecture: str
    model_type: str
    dims: dict[str, Any]
    quantization: dict[str, Any]
    layers: dict[str, int]             # kind -> count
    layer_list: list[dict[str, Any]]
    experts: dict[str, Any]
    bits: list[BitsRow]
    codebooks: dict[str, int]          # codebook -> number of linears
    storage_bpw: dict[str, float]      # "layers" (all but the head, incl. MTP), "head", per family
    totals: dict[str, int]
    per_rank_bytes: dict[str, int] | None
    issues: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        return {"$schema": SCHEMA_ID, "schema_version": 1, **d}


DIM_KEYS = ("hidden_size", "num_hidden_layers", "vocab_size", "num_attention_heads", "num_key_value_heads",
            "head_dim", "intermediate_size", "moe_intermediate_size", "q_lora_rank", "kv_lora_rank",
            "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "index_n_heads", "index_head_dim",
            "index_topk", "max_position_embeddings", "num_nextn_predict_layers", "tie_word_embeddings")


def _bpw(lins: list[Exl3Linear]) -> float:
    w = sum(lin.weights for lin in lins)
    bits = sum(lin.trellis_bytes * 8 + 16 * (lin.k + lin.n) + 32 * (lin.codebook != "3inst") for lin in lins)
    return round(bits / w, 9) if w else 0.0


# unquantized fp16 Linear modules of a decoder layer that exllamav3's storage count includes
# (MLA's kv_b_proj is not one: exllamav3 keeps it as a plain tensor)
_FP16_LINEARS = (".mlp.gate.weight", ".self_attn.indexer.wk.weight", ".self_attn.indexer.weights_proj.weight")


def layers_bpw(ck: Checkpoint, sc: Scan) -> float:
    """Storage bpw of the decoder layers as exllamav3's get_storage_info counts it: every stored bit
    of the EXL3 linears (trellis, sign vectors, markers, bias) plus the fp16 Linear modules (routers,
    DSA indexer projections), over their weights; MTP layers excluded. Matches goldens.json
    `storage.bpw_layers` of every fixture."""
    L = ck.config.get("num_hidden_layers")
    L = L if isinstance(L, int) else 1 << 30
    bits = weights = 0
    for p, lin in sc.linears.items():
        if lin.layer is not None and lin.layer < L:
            bits += sum(ck.tensors[f"{p}.{s}"].info.nbytes * 8 for s in lin.suffixes)
            weights += lin.weights
    for n, ref in ck.tensors.items():
        if n.endswith(_FP16_LINEARS) and (layer_of(n) or 0) < L and n.startswith("model.layers."):
            bits += ref.info.nbytes * 8
            weights += ref.info.numel
    return round(bits / weights, 9) if weights else 0.0


def per_rank_estimate(sc: Scan, ck_bytes: dict[str, int], tp: int) -> dict[str, int]:
    """Bytes one rank holds at --tp N: linears cut 1/N (sign vectors of the cut dim too), rest replicated.

    An estimate for planning; `rank-slice --dry-run` prints the exact plan.
    """
    split = 0
    for lin in sc.linears.values():
        if lin.family in ("head", "other") and lin.prefix != "lm_head":
            continue
        split += lin.trellis_bytes + 2 * (lin.k + lin.n)
    linear_names = {f"{p}.{s}" for p, lin in sc.linears.items() for s in lin.suffixes}
    replicated = sum(b for n, b in ck_bytes.items() if n not in linear_names)
    replicated += sum(ck_bytes[f"{p}.{s}"] for p, lin in sc.linears.items() for s in lin.suffixes
                      if s not in ("trellis", "suh", "svh"))
    per = split // tp + replicated
    return {"tp": tp, "bytes_per_rank": per, "replicated_bytes": replicated, "split_bytes": split}


def require_exl3(ck: Checkpoint) -> None:
    """EXL3 is detected per tensor (a 3-D trellis), not from the config (exl3-format.md §6.1)."""
    if not any(n.endswith(".trellis") and len(r.shape) == 3 for n, r in ck.tensors.items()):
        qm = (ck.quantization_config or {}).get("quant_method", "none")
        raise NotExl3Error(f"{ck.root}: not an EXL3 checkpoint (no trellis tensors; quant_method={qm})")


def summarize(ck: Checkpoint, *, tp: int | None = None, source: str = "local") -> Summary:
    cfg = ck.config
    L = cfg.get("num_hidden_layers")
    require_exl3(ck)
    sc = scan_refs(ck.tensors, L if isinstance(L, int) else None)
    q = dict(ck.quantization_config or {})
    quant = {k: q.get(k) for k in ("quant_method", "version", "bits", "head_bits", "mtp_bits", "codebook",
                                   "out_scales") if k in q}

    kinds = Counter(s.kind for s in sc.layers.values())
    layer_list = [{"index": s.index, "kind": s.kind, "attention": s.attention, "experts": len(s.experts),
                   "shared_experts": s.has_shared_experts} for s in sc.layers.values()]
    n_routed = cfg.get("n_routed_experts", cfg.get("num_experts"))
    experts = {"routed": n_routed, "shared": cfg.get("n_shared_experts", 0) or 0,
               "top_k": cfg.get("num_experts_per_tok"),
               "present_per_moe_layer": sorted({len(s.experts) for s in sc.layers.values() if s.kind == "moe"})}

    hist: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
    by_family: dict[str, list[Exl3Linear]] = defaultdict(list)
    for lin in sc.linears.values():
        key = (lin.family, fmt_k(lin.bits) if lin.bits is not None else "illegal")
        hist[key][0] += 1
        hist[key][1] += lin.weights
        by_family[lin.family].append(lin)
    bits = [BitsRow(f, b, c, w) for (f, b), (c, w) in
            sorted(hist.items(), key=lambda kv: (FAMILIES.index(kv[0][0]) if kv[0][0] in FAMILIES else 99, kv[0][1]))]
    storage = {"layers": layers_bpw(ck, sc), "head": _bpw(by_family.get("head", []))}
    storage.update({f: _bpw(v) for f, v in by_family.items()})

    tensor_bytes = {n: r.info.nbytes for n, r in ck.tensors.items()}
    totals = {"tensors": len(ck.tensors), "files": len(ck.headers), "tensor_bytes": sum(tensor_bytes.values()),
              "file_bytes": ck.file_bytes, "exl3_linears": len(sc.linears),
              "exl3_weights": sum(lin.weights for lin in sc.linears.values()),
              "dense_tensors": len(sc.dense)}
    dims = {k: cfg[k] for k in DIM_KEYS if k in cfg}
    return Summary(
        path=str(ck.root), source=source, architecture=ck.architecture, model_type=str(cfg.get("model_type", "")),
        dims=dims, quantization=quant, layers=dict(kinds), layer_list=layer_list, experts=experts, bits=bits,
        codebooks=dict(Counter(lin.codebook for lin in sc.linears.values())), storage_bpw=storage,
        totals=totals, per_rank_bytes=per_rank_estimate(sc, tensor_bytes, tp) if tp else None,
        issues=[m for _, m in ck.issues])


@dataclass(frozen=True, slots=True)
class TensorReport:
    prefix: str
    family: str
    k_padded: int
    n_padded: int
    in_real: int | None
    out_real: int | None
    bits: str
    codebook: str
    tensors: dict[str, dict[str, Any]]
    stats: dict[str, float | int | None]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def inspect_tensor(ck: Checkpoint, key: str) -> TensorReport:
    """One EXL3 linear: shapes, K, codebook and statistics of its decoded (original-basis) weight."""
    import numpy as np

    from exl3tools.errors import MissingTensorError
    from exl3tools.kernels.reference import decode_linear

    prefix = key
    for suf in (".trellis", ".suh", ".svh", ".su", ".sv", ".weight"):
        if key.endswith(suf):
            prefix = key[: -len(suf)]
    L = ck.config.get("num_hidden_layers")
    sc = scan({n: (r.dtype, r.shape) for n, r in ck.tensors.items() if n.startswith(prefix + ".")},
              L if isinstance(L, int) else None)
    lin = sc.linears.get(prefix)
    if lin is None:
        raise MissingTensorError(f"{ck.root}: no EXL3 linear {prefix!r} (it needs {prefix}.trellis)")
    from exl3tools.dequantize import refuse_undecodable

    refuse_undecodable(ck, {prefix})
    dims = real_dims(ck.config, ck.tensors).get(prefix, (None, None))
    tensors = {s: {"dtype": ck.tensors[f"{prefix}.{s}"].dtype, "shape": list(ck.tensors[f"{prefix}.{s}"].shape)}
               for s in lin.suffixes}
    from exl3tools.exl3 import unpack_signs

    tr = ck.read_numpy(f"{prefix}.trellis")
    suh = ck.read_numpy(f"{prefix}.suh") if "suh" in lin.suffixes else unpack_signs(ck.read_numpy(f"{prefix}.su"))
    svh = ck.read_numpy(f"{prefix}.svh") if "svh" in lin.suffixes else unpack_signs(ck.read_numpy(f"{prefix}.sv"))
    w = decode_linear(tr, suh, svh, lin.codebook if lin.codebook != "both" else "mcg")
    i_r, o_r = dims
    real = w[: i_r or w.shape[0], : o_r or w.shape[1]]
    # NaN/Inf (from a damaged suh/svh) are counted, and the other stats taken over the finite values:
    # JSON has no NaN or Infinity, and --json must stay parseable
    ok = np.isfinite(real)
    fin = real[ok]
    pad = w[:, o_r:] if o_r and o_r < w.shape[1] else w[:, :0]
    stats = {"mean": float(fin.mean()) if fin.size else None, "std": float(fin.std()) if fin.size else None,
             "abs_max": float(np.abs(fin).max()) if fin.size else None, "finite": float(ok.all()),
             "nonfinite": int(real.size - fin.size),
             "padding_abs_max": float(np.abs(pad[np.isfinite(pad)]).max(initial=0.0))}
    return TensorReport(prefix, lin.family, lin.k, lin.n, i_r, o_r,
                        fmt_k(lin.bits) if lin.bits else "illegal", lin.codebook, tensors, stats)

"""What a checkpoint holds, by module: EXL3 linears, dense tensors, layers, experts, MTP.

Two views that validate, inspect, dequantize, rank-slice and the runtime share:
- ``scan(names_and_shapes)``: what IS in the file (grouped from tensor names and shapes);
- ``expected_modules(config)``: what SHOULD be there for the five known architectures, with the
  real (unpadded) dims of every linear (exl3-format.md §4, §7).
Pure Python: works from headers only.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from exl3tools.checkpoint.header import gc_paused
from exl3tools.errors import CheckpointError, UnsupportedArchitectureError
from exl3tools.exl3 import BLOCK, HALF_WIDTHS, k_from_width

ARCHITECTURES = ("LlamaForCausalLM", "Qwen3MoeForCausalLM", "Glm4MoeForCausalLM",
                 "DeepseekV3ForCausalLM", "GlmMoeDsaForCausalLM")
MLA_ARCHS = ("DeepseekV3ForCausalLM", "GlmMoeDsaForCausalLM")

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.mlp\.experts\.(\d+)\.")


def pad128(x: int) -> int:
    return -(-x // BLOCK) * BLOCK


def layer_of(name: str) -> int | None:
    if not name.startswith("model.layers."):  # fast path: called for every tensor of 240k
        return None
    m = _LAYER.match(name)
    return int(m.group(1)) if m else None


def expert_of(name: str) -> int | None:
    if ".mlp.experts." not in name:
        return None
    m = _EXPERT.search(name)
    return int(m.group(1)) if m else None


def family_of(prefix: str, num_hidden_layers: int | None) -> str:
    """Tensor family used in bit histograms: attention, experts, shared_experts, dense_mlp, head, mtp, other."""
    return _family(prefix, layer_of(prefix), num_hidden_layers)


def _family(prefix: str, layer: int | None, num_hidden_layers: int | None) -> str:
    if prefix.startswith("lm_head"):
        return "head"
    if layer is not None and num_hidden_layers is not None and layer >= num_hidden_layers:
        return "mtp"
    if ".mlp.experts." in prefix:
        return "experts"
    if ".mlp.shared_experts." in prefix:
        return "shared_experts"
    if ".self_attn." in prefix:
        return "attention"
    if ".mlp." in prefix:
        return "dense_mlp"
    return "other"


# ---------------------------------------------------------------------------- what is there
@dataclass(frozen=True, slots=True)
class Exl3Linear:
    prefix: str
    k: int                  # padded in_features (16 * trellis.shape[0])
    n: int                  # padded out_features
    width: int              # trellis last dim, int16 words per tile
    bits: float | None      # None when the width is illegal
    codebook: str           # "3inst" | "mcg" | "mul1" | "both" (invalid)
    signs: str              # "suh" (suh/svh) | "su" (legacy packed) | "mixed" | "missing"
    has_bias: bool
    suffixes: tuple[str, ...]  # which of the EXL3 suffixes are present
    family: str
    layer: int | None
    expert: int | None

    @property
    def trellis_bytes(self) -> int:
        return (self.k // 16) * (self.n // 16) * self.width * 2

    @property
    def weights(self) -> int:
        return self.k * self.n


@dataclass(frozen=True, slots=True)
class LayerSummary:
    index: int
    kind: str                 # "dense" | "moe" | "mtp"
    experts: tuple[int, ...]  # routed expert ids present
    has_shared_experts: bool
    attention: str            # "gqa" | "mla" | "mla+dsa" | "none"


@dataclass(frozen=True, slots=True)
class Scan:
    linears: dict[str, Exl3Linear]
    dense: dict[str, tuple[str, tuple[int, ...]]]   # name -> (dtype, shape) of non-EXL3 tensors
    layers: dict[int, LayerSummary]


_SUFFIX_ORDER = ("trellis", "suh", "svh", "su", "sv", "bias", "mcg", "mul1", "scale")
_SUFFIXES = frozenset(_SUFFIX_ORDER)


def scan(tensors: Mapping[str, tuple[str, tuple[int, ...]]], num_hidden_layers: int | None = None) -> Scan:
    """Group ``name -> (dtype, shape)`` into EXL3 linears and dense tensors.

    A module P is an EXL3 linear iff it has a rank-3 ``P.trellis`` (exl3-format.md §3.1); a 2-D
    trellis next to ``P.signs`` is a quantized embedding and stays "dense".
    """
    with gc_paused():
        return _scan(tensors, tensors.__getitem__, num_hidden_layers)


def scan_refs(tensors: Mapping[str, Any], num_hidden_layers: int | None = None) -> Scan:
    """scan() of ``name -> TensorRef`` (anything with ``.info.dtype`` / ``.info.shape``), without
    first building a (dtype, shape) pair for each of the 240k tensors of a GLM-5 checkpoint."""
    def meta(name: str) -> tuple[str, tuple[int, ...]]:
        i = tensors[name].info
        return i.dtype, i.shape

    with gc_paused():
        return _scan(tensors, meta, num_hidden_layers)


def _linear_parts(sufs: list[str]) -> tuple[tuple[str, ...], str, str, bool]:
    """(present suffixes in _SUFFIX_ORDER, codebook, signs, has_bias) of one module's EXL3 suffixes."""
    present = tuple(s for s in _SUFFIX_ORDER if s in sufs)
    has_mcg, has_mul1 = "mcg" in present, "mul1" in present
    codebook = "both" if has_mcg and has_mul1 else "mcg" if has_mcg else "mul1" if has_mul1 else "3inst"
    new = "suh" in present and "svh" in present
    old = "su" in present and "sv" in present
    signs = ("suh" if new and not ("su" in present or "sv" in present) else "su" if old and not
             ("suh" in present or "svh" in present) else "mixed" if (new or old) else "missing")
    return present, codebook, signs, "bias" in present


def _scan(tensors: Iterable[str], meta: Callable[[str], tuple[str, tuple[int, ...]]],
          num_hidden_layers: int | None) -> Scan:
    # One pass over the names: EXL3 suffixes by module, and names by layer. A name's layer is
    # layer_of(head + "."), so it is computed once per module, not once per tensor.
    names: list[str] = []
    heads: list[str | None] = []            # the module of each name with an EXL3 suffix, else None
    by_prefix: dict[str, list[str]] = {}
    by_layer: dict[int, list[str]] = {}
    layer_by_head: dict[str, int | None] = {}
    for n in tensors:
        names.append(n)
        head, dot, suffix = n.rpartition(".")
        if suffix in _SUFFIXES:
            heads.append(head)
            sufs = by_prefix.get(head)
            if sufs is None:
                by_prefix[head] = [suffix]
            else:
                sufs.append(suffix)
        else:
            heads.append(None)
        if not dot:
            continue
        li = layer_by_head.get(head, -1)
        if li == -1:
            li = layer_by_head[head] = layer_of(head + ".")
        if li is not None:
            names_of = by_layer.get(li)
            if names_of is None:
                by_layer[li] = [n]
            else:
                names_of.append(n)

    prefixes = [p for p, sufs in by_prefix.items() if "trellis" in sufs and len(meta(f"{p}.trellis")[1]) == 3]
    parts: dict[tuple[str, ...], tuple[tuple[str, ...], str, str, bool]] = {}  # a few suffix sets in all
    linears: dict[str, Exl3Linear] = {}
    for p in sorted(prefixes):
        sufs = by_prefix[p]
        key = tuple(sufs)
        got = parts.get(key)
        if got is None:
            got = parts[key] = _linear_parts(sufs)
        present, codebook, signs, has_bias = got
        shape = meta(f"{p}.trellis")[1]
        width = shape[2]
        layer = layer_of(p)
        linears[p] = Exl3Linear(
            prefix=p, k=16 * shape[0], n=16 * shape[1], width=width, bits=k_from_width(width),
            codebook=codebook, signs=signs, has_bias=has_bias, suffixes=present,
            family=_family(p, layer, num_hidden_layers), layer=layer, expert=expert_of(p))
    # a name is owned by a linear iff it has an EXL3 suffix and its module is that linear
    dense = {n: meta(n) for n, h in zip(names, heads, strict=True) if h not in linears}

    layers: dict[int, LayerSummary] = {}
    experts_of: dict[int, set[int]] = {}
    for lin in linears.values():  # expert ids from the linears: one regex per linear, not per tensor
        if lin.layer is not None and lin.expert is not None:
            experts_of.setdefault(lin.layer, set()).add(lin.expert)
    for li, names_of in sorted(by_layer.items()):
        experts = sorted(experts_of.get(li, ()))
        text = "\n".join(names_of)  # one C-speed substring search per pattern (no pattern holds a newline)
        shared = ".mlp.shared_experts." in text
        mla = ".self_attn.kv_a_proj_with_mqa." in text
        dsa = ".self_attn.indexer." in text
        gqa = ".self_attn.q_proj." in text or ".self_attn.k_proj." in text
        attention = "mla+dsa" if mla and dsa else "mla" if mla else "gqa" if gqa else "none"
        is_mtp = num_hidden_layers is not None and li >= num_hidden_layers
        kind = "mtp" if is_mtp else "moe" if experts or ".mlp.gate.weight" in text else "dense"
        layers[li] = LayerSummary(li, kind, tuple(experts), shared, attention)
    return Scan(linears, dense, layers)


def half_k_without_mul1(lin: Exl3Linear) -> bool:
    return lin.width in HALF_WIDTHS and lin.codebook != "mul1"


# ---------------------------------------------------------------------------- what should be there
@dataclass(frozen=True, slots=True)
class Expected:
    name: str                       # linear prefix, or full tensor name for dense tensors
    kind: str                       # "linear" | "dense"
    in_real: int = 0                # linears: real dims
    out_real: int = 0
    shape: tuple[int, ...] = ()     # dense: expected shape ([] = not checked)
    bias: bool = False              # linear carries a bias
    optional: bool = False          # present in some quants only (e.g. lm_head.weight at head_bits 16)
    mtp: bool = False


def _num(cfg: Mapping, key: str, default: int | None = None) -> int:
    v = cfg.get(key, default)
    if v is None:
        raise UnsupportedArchitectureError(f"config.json lacks {key!r}")
    return int(v)


def mtp_layers_present(names: Iterable[str], num_hidden_layers: int) -> list[int]:
    return sorted({li for li in (layer_of(n) for n in names) if li is not None and li >= num_hidden_layers})


def expected_modules(config: Mapping, mtp_layers: Iterable[int] = ()) -> list[Expected]:
    """Every module the five known architectures must have, with real dims (exl3-format.md §7).

    ``mtp_layers``: the MTP layer indices actually present (MTP is optional: exllamav3 drops it for
    glm4_moe/deepseek_v3 and keeps it for GLM-5); their modules are listed with ``mtp=True``.
    """
    archs = config.get("architectures")
    arch = archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else None
    if arch not in ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"architecture {arch!r} is not one of {', '.join(ARCHITECTURES)}")
    try:
        return _expected(config, arch, mtp_layers)
    except UnsupportedArchitectureError:
        raise
    except (TypeError, ValueError, LookupError, AttributeError) as exc:  # a key of the wrong JSON type
        raise CheckpointError(f"config.json: values unusable for {arch} ({type(exc).__name__}: {exc})") from None


def _expected(config: Mapping, arch: str, mtp_layers: Iterable[int]) -> list[Expected]:
    H, V, L = _num(config, "hidden_size"), _num(config, "vocab_size"), _num(config, "num_hidden_layers")
    out: list[Expected] = [Expected("model.embed_tokens.weight", "dense", shape=(V, H)),
                           Expected("model.norm.weight", "dense", shape=(H,))]
    head_bits = (config.get("quantization_config") or {}).get("head_bits", 6)
    if head_bits == 16:
        out.append(Expected("lm_head.weight", "dense", shape=(V, H)))
    else:
        out.append(Expected("lm_head", "linear", H, V))

    def lin(name: str, i: int, o: int, bias: bool = False, mtp: bool = False) -> None:
        out.append(Expected(name, "linear", i, o, bias=bias, mtp=mtp))

    def dense(name: str, shape: tuple[int, ...], mtp: bool = False) -> None:
        out.append(Expected(name, "dense", shape=shape, mtp=mtp))

    def mlp_dense(p: str, inter: int, mtp: bool) -> None:
        lin(f"{p}.mlp.gate_proj", H, inter, mtp=mtp)
        lin(f"{p}.mlp.up_proj", H, inter, mtp=mtp)
        lin(f"{p}.mlp.down_proj", inter, H, mtp=mtp)

    def mlp_moe(p: str, mtp: bool, *, n_exp: int, inter: int, shared: int, bias: bool) -> None:
        dense(f"{p}.mlp.gate.weight", (n_exp, H), mtp)
        if bias:
            dense(f"{p}.mlp.gate.e_score_correction_bias", (n_exp,), mtp)
        for e in range(n_exp):
            lin(f"{p}.mlp.experts.{e}.gate_proj", H, inter, mtp=mtp)
            lin(f"{p}.mlp.experts.{e}.up_proj", H, inter, mtp=mtp)
            lin(f"{p}.mlp.experts.{e}.down_proj", inter, H, mtp=mtp)
        if shared:
            lin(f"{p}.mlp.shared_experts.gate_proj", H, inter * shared, mtp=mtp)
            lin(f"{p}.mlp.shared_experts.up_proj", H, inter * shared, mtp=mtp)
            lin(f"{p}.mlp.shared_experts.down_proj", inter * shared, H, mtp=mtp)

    def gqa(p: str, mtp: bool) -> None:
        nh, nkv = _num(config, "num_attention_heads"), _num(config, "num_key_value_heads", config.get("num_attention_heads"))
        hd = int(config.get("head_dim") or H // nh)
        bias = bool(config.get("attention_bias", False))
        lin(f"{p}.self_attn.q_proj", H, nh * hd, bias, mtp)
        lin(f"{p}.self_attn.k_proj", H, nkv * hd, bias, mtp)
        lin(f"{p}.self_attn.v_proj", H, nkv * hd, bias, mtp)
        lin(f"{p}.self_attn.o_proj", nh * hd, H, mtp=mtp)
        if arch == "Qwen3MoeForCausalLM" or config.get("use_qk_norm"):
            dense(f"{p}.self_attn.q_norm.weight", (hd,), mtp)
            dense(f"{p}.self_attn.k_norm.weight", (hd,), mtp)

    def mla(p: str, mtp: bool, indexer: bool) -> None:
        nh = _num(config, "num_attention_heads")
        nope, rope, vd = _num(config, "qk_nope_head_dim"), _num(config, "qk_rope_head_dim"), _num(config, "v_head_dim")
        kv_lora = _num(config, "kv_lora_rank")
        q_lora = config.get("q_lora_rank")
        if q_lora:
            lin(f"{p}.self_attn.q_a_proj", H, int(q_lora), mtp=mtp)
            dense(f"{p}.self_attn.q_a_layernorm.weight", (int(q_lora),), mtp)
            lin(f"{p}.self_attn.q_b_proj", int(q_lora), nh * (nope + rope), mtp=mtp)
        else:
            lin(f"{p}.self_attn.q_proj", H, nh * (nope + rope), mtp=mtp)
        lin(f"{p}.self_attn.kv_a_proj_with_mqa", H, kv_lora + rope, mtp=mtp)
        dense(f"{p}.self_attn.kv_a_layernorm.weight", (kv_lora,), mtp)
        dense(f"{p}.self_attn.kv_b_proj.weight", (nh * (nope + vd), kv_lora), mtp)
        lin(f"{p}.self_attn.o_proj", nh * vd, H, mtp=mtp)
        if indexer:
            ih, ihd = _num(config, "index_n_heads"), _num(config, "index_head_dim")
            lin(f"{p}.self_attn.indexer.wq_b", int(q_lora or H), ih * ihd, mtp=mtp)
            dense(f"{p}.self_attn.indexer.wk.weight", (ihd, H), mtp)
            dense(f"{p}.self_attn.indexer.weights_proj.weight", (ih, H), mtp)
            dense(f"{p}.self_attn.indexer.k_norm.weight", (ihd,), mtp)
            dense(f"{p}.self_attn.indexer.k_norm.bias", (ihd,), mtp)

    def moe_kind(li: int) -> bool:
        if arch == "LlamaForCausalLM":
            return False
        if arch == "Qwen3MoeForCausalLM":
            step = int(config.get("decoder_sparse_step", 1) or 1)
            return (li not in (config.get("mlp_only_layers") or []) and _num(config, "num_experts", 0) > 0
                    and (li + 1) % step == 0)
        types = config.get("mlp_layer_types")
        if isinstance(types, list) and li < len(types):
            return types[li] == "sparse"
        return li >= int(config.get("first_k_dense_replace", 0) or 0)

    def block(li: int, mtp: bool) -> None:
        p = f"model.layers.{li}"
        dense(f"{p}.input_layernorm.weight", (H,), mtp)
        dense(f"{p}.post_attention_layernorm.weight", (H,), mtp)
        if arch in MLA_ARCHS:
            types = config.get("indexer_types") or []
            has_indexer = arch == "GlmMoeDsaForCausalLM" and (mtp or (li < len(types) and types[li] == "full"))
            mla(p, mtp, has_indexer)
        else:
            gqa(p, mtp)
        if mtp or moe_kind(li):
            if arch == "Qwen3MoeForCausalLM":
                mlp_moe(p, mtp, n_exp=_num(config, "num_experts"), inter=_num(config, "moe_intermediate_size"),
                        shared=0, bias=False)
            else:
                mlp_moe(p, mtp, n_exp=_num(config, "n_routed_experts"), inter=_num(config, "moe_intermediate_size"),
                        shared=int(config.get("n_shared_experts", 0) or 0), bias=True)
        else:
            mlp_dense(p, _num(config, "intermediate_size"), mtp)

    for li in range(L):
        block(li, False)
    for li in mtp_layers:
        p = f"model.layers.{li}"
        lin(f"{p}.eh_proj", 2 * H, H, mtp=True)
        dense(f"{p}.enorm.weight", (H,), True)
        dense(f"{p}.hnorm.weight", (H,), True)
        dense(f"{p}.shared_head.norm.weight", (H,), True)
        block(li, True)
    return out


def real_dims(config: Mapping, names: Iterable[str]) -> dict[str, tuple[int, int]]:
    """prefix -> (in_real, out_real) for every expected linear; {} for an unknown architecture."""
    L = config.get("num_hidden_layers")
    L = L if isinstance(L, int) and not isinstance(L, bool) else 0
    try:
        exp = expected_modules(config, mtp_layers_present(names, L))
    except UnsupportedArchitectureError:
        return {}
    return {e.name: (e.in_real, e.out_real) for e in exp if e.kind == "linear"}

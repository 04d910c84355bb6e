"""The GQA decoder family (Llama, Qwen3-MoE, GLM-4 MoE) built from config.json + tensors.

``GqaSpec`` holds what differs between the three; ``build_gqa`` reads the tensors. Under TP the
local sizes (heads, expert ranges, intermediate slices) come from this rank's ``exl3tools`` block
(docs/rank-slice.md §4): read from a rank directory's config.json, or planned in memory with the
same rules (exl3tools.slicing) when an unsliced checkpoint is run with TP > 1, in which case
the cuts are applied while reading.
"""

from __future__ import annotations

from dataclasses import dataclass

from exl3tools.errors import CheckpointError, MissingTensorError
from exl3tools.runtime.arch import BuildContext
from exl3tools.runtime.layers import (
    Attention,
    DecoderLayer,
    GatedMLP,
    MoE,
    RMSNorm,
    load_linear,
    rope_settings,
)
from exl3tools.runtime.model import CausalLM, ModelInfo
from exl3tools.runtime.weights import Cut


@dataclass(frozen=True, slots=True)
class GqaSpec:
    qk_norm: bool = False              # per-head RMSNorm on q and k before RoPE (Qwen3)
    routing: str | None = None         # None: dense MLP everywhere; "softmax" | "sigmoid"
    num_experts_key: str = "num_experts"
    dense_layers: tuple[int, ...] = ()  # layers with a dense MLP even when routing is set
    shared_expert: bool = False


def _cut(ctx: BuildContext, prefix: str, cut: Cut | None) -> Cut | None:
    """``cut`` (or the block's cut) when the source is unsliced; a sliced source is read whole."""
    if cut is None:
        return ctx.module_cut(prefix)
    return cut if ctx.cut_in_memory else None


def _lin(ctx: BuildContext, prefix: str, cut: Cut | None = None, **kw):
    """Load linear ``prefix``; ``cut`` (or the block's cut) is applied only to an unsliced source."""
    return load_linear(ctx.weights, prefix, _cut(ctx, prefix, cut), backend=ctx.backend, device=ctx.device, **kw)


def build_mlp(ctx: BuildContext, prefix: str) -> GatedMLP:
    sharded = ctx.is_cut(f"{prefix}.gate_proj")
    return GatedMLP(_lin(ctx, f"{prefix}.gate_proj"), _lin(ctx, f"{prefix}.up_proj"),
                    _lin(ctx, f"{prefix}.down_proj"), reduce=ctx.tp.all_reduce if sharded else None,
                    sharded=sharded)


def build_attention(ctx: BuildContext, spec: GqaSpec, prefix: str, idx: int, rope) -> Attention:
    cfg, ws = ctx.config, ctx.weights
    nq, nkv = int(cfg["num_attention_heads"]), int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"])
    hd = int(cfg.get("head_dim") or cfg["hidden_size"] // nq)
    entry = ctx.attention_entry(prefix)
    sharded = entry.get("cut") == "heads"
    if sharded:
        (q0, q1), (k0, k1) = entry["q_heads"], entry["kv_heads"]
        nq_l, nkv_l = q1 - q0, k1 - k0
        if nkv_l < 1 or nq_l % nkv_l:
            raise CheckpointError(f"{prefix}: q heads {entry['q_heads']} do not fit kv heads {entry['kv_heads']}")
    else:
        nq_l, nkv_l = nq, nkv
    q = _lin(ctx, f"{prefix}.q_proj", out_real=nq_l * hd)
    k = _lin(ctx, f"{prefix}.k_proj", out_real=nkv_l * hd)
    v = _lin(ctx, f"{prefix}.v_proj", out_real=nkv_l * hd)
    o = _lin(ctx, f"{prefix}.o_proj", in_real=nq_l * hd, out_real=int(cfg["hidden_size"]))
    eps = float(cfg["rms_norm_eps"])
    qn = kn = None
    if spec.qk_norm:
        qn = RMSNorm(ws.tensor(f"{prefix}.q_norm.weight"), eps)
        kn = RMSNorm(ws.tensor(f"{prefix}.k_norm.weight"), eps)
    return Attention(q=q, k=k, v=v, o=o, head_dim=hd, n_q=nq_l, n_kv=nkv_l, rope=rope, layer_idx=idx,
                     q_norm=qn, k_norm=kn, reduce=ctx.tp.all_reduce if sharded else None)


def build_moe(ctx: BuildContext, spec: GqaSpec, prefix: str) -> MoE:
    cfg, ws = ctx.config, ctx.weights
    n_exp = int(cfg[spec.num_experts_key])
    entry = ctx.cut_entry(f"{prefix}.experts")
    kind = entry.get("cut")
    owned = range(int(entry["first"]), int(entry["last"])) if kind == "experts" else range(n_exp)
    cuts = {"gate_proj": None, "up_proj": None, "down_proj": None}
    if kind == "tp":  # every expert's intermediate is cut at [first, last)
        a, b = int(entry["first"]), int(entry["last"])
        cuts = {"gate_proj": Cut("col", a, b), "up_proj": Cut("col", a, b),
                "down_proj": Cut("row", a, b, bias_here=a == 0)}
    experts = {}
    for e in owned:
        p = f"{prefix}.experts.{e}"
        if not ws.is_linear(f"{p}.gate_proj"):
            raise MissingTensorError(f"{ws.ckpt.root}: expert {e} of {prefix} is missing ({p}.gate_proj)")
        experts[e] = GatedMLP(*(_lin(ctx, f"{p}.{proj}", cuts[proj]) for proj in cuts))

    def expert_fields(proj: str):  # re-read on demand: MoE.forward_static builds grouped experts
        return [ws.linear(f"{prefix}.experts.{e}.{proj}", _cut(ctx, f"{prefix}.experts.{e}.{proj}", cuts[proj]))
                for e in owned]
    shared = None
    if spec.shared_expert and int(cfg.get("n_shared_experts") or 0) > 0:
        shared = build_mlp(ctx, f"{prefix}.shared_experts")
        shared.reduce = None
    bias_name = f"{prefix}.gate.e_score_correction_bias"
    return MoE(router=ws.tensor(f"{prefix}.gate.weight"), experts=experts,
               top_k=int(cfg["num_experts_per_tok"]), routing=spec.routing,
               norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
               scaling=float(cfg.get("routed_scaling_factor") or 1.0) if spec.routing == "sigmoid" else 1.0,
               score_bias=ws.tensor(bias_name) if ws.has(bias_name) else None, shared=shared,
               reduce=ctx.tp.all_reduce if kind in ("experts", "tp") else None,
               expert_fields=expert_fields, backend=ctx.backend, device=ctx.device)


def build_gqa(ctx: BuildContext, spec: GqaSpec) -> CausalLM:
    cfg, ws = ctx.config, ctx.weights
    nq = int(cfg["num_attention_heads"])
    hd = int(cfg.get("head_dim") or cfg["hidden_size"] // nq)
    rope = rope_settings(cfg, hd)
    eps = float(cfg["rms_norm_eps"])
    n_layers = int(cfg["num_hidden_layers"])
    layers = []
    for i in range(n_layers):
        p = f"model.layers.{i}"
        attn = build_attention(ctx, spec, f"{p}.self_attn", i, rope)
        moe = spec.routing is not None and i not in spec.dense_layers
        mlp = build_moe(ctx, spec, f"{p}.mlp") if moe else build_mlp(ctx, f"{p}.mlp")
        layers.append(DecoderLayer(RMSNorm(ws.tensor(f"{p}.input_layernorm.weight"), eps), attn,
                                   RMSNorm(ws.tensor(f"{p}.post_attention_layernorm.weight"), eps), mlp))
    return build_causal_lm(ctx, layers)


def build_causal_lm(ctx: BuildContext, layers: list) -> CausalLM:
    """Embedding, decoder layers, final norm and the (possibly vocab-sharded) head: every architecture."""
    cfg, ws = ctx.config, ctx.weights
    vocab = int(cfg["vocab_size"])
    head_name = "lm_head" if ws.is_linear("lm_head") else "model.embed_tokens"
    head = _lin(ctx, head_name)
    head_sharded = ctx.is_cut(head_name)
    if not head_sharded:
        head.out_real = min(head.out_real, vocab)
    info = ModelInfo(cfg["architectures"][0], vocab, int(cfg["hidden_size"]), len(layers),
                     int(ctx.max_context or cfg.get("max_position_embeddings") or 4096))
    embed = ws.tensor("model.embed_tokens.weight").to(ctx.device)
    return CausalLM(info=info, embed=embed, layers=layers,
                    norm=RMSNorm(ws.tensor("model.norm.weight"), float(cfg["rms_norm_eps"])),
                    head=head, tp=ctx.tp, head_sharded=head_sharded)

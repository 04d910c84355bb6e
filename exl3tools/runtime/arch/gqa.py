"""The GQA decoder family (Llama, Qwen3-MoE, GLM-4 MoE) built from config.json + tensors.

``GqaSpec`` holds what differs between the three; ``build_gqa`` reads the tensors. Local sizes
(heads, experts) come from the tensors this rank holds: a rank-slice output already carries
sliced shapes and only its own experts; with ``cut_in_memory`` the same cut is made while reading.
"""

from __future__ import annotations

from dataclasses import dataclass

from exl3tools.errors import IncompatibleSliceError, MissingTensorError
from exl3tools.exl3 import BLOCK
from exl3tools.runtime.arch import BuildContext
from exl3tools.runtime.layers import (Attention, DecoderLayer, GatedMLP, MoE, RMSNorm,
                                      load_linear, rope_settings)
from exl3tools.runtime.model import CausalLM, ModelInfo
from exl3tools.runtime.tp import even_split
from exl3tools.runtime.weights import Cut


@dataclass(frozen=True, slots=True)
class GqaSpec:
    qk_norm: bool = False              # per-head RMSNorm on q and k before RoPE (Qwen3)
    routing: str | None = None         # None: dense MLP everywhere; "softmax" | "sigmoid"
    num_experts_key: str = "num_experts"
    dense_layers: tuple[int, ...] = ()  # layers with a dense MLP even when routing is set
    shared_expert: bool = False


def _padded_out(ctx: BuildContext, prefix: str) -> int:
    ws = ctx.weights
    if ws.has(f"{prefix}.trellis"):
        return ws.shape(f"{prefix}.trellis")[1] * 16
    return ws.shape(f"{prefix}.weight")[0]


def _col_row_cuts(ctx: BuildContext, width: int, what: str) -> tuple[Cut, Cut]:
    if width % BLOCK:
        raise IncompatibleSliceError(f"{what}: width {width} is not a multiple of {BLOCK}")
    first, last = even_split(width, ctx.tp.world, BLOCK)[ctx.tp.rank]
    return Cut("col", first, last), Cut("row", first, last, bias_here=first == 0)


def build_mlp(ctx: BuildContext, prefix: str) -> GatedMLP:
    col = row = None
    if ctx.cut_in_memory:
        col, row = _col_row_cuts(ctx, _padded_out(ctx, f"{prefix}.gate_proj"), f"{prefix} intermediate")
    kw = dict(backend=ctx.backend, device=ctx.device)
    return GatedMLP(load_linear(ctx.weights, f"{prefix}.gate_proj", col, **kw),
                    load_linear(ctx.weights, f"{prefix}.up_proj", col, **kw),
                    load_linear(ctx.weights, f"{prefix}.down_proj", row, **kw))


def build_attention(ctx: BuildContext, spec: GqaSpec, prefix: str, idx: int, rope) -> Attention:
    cfg, ws = ctx.config, ctx.weights
    nq, nkv = int(cfg["num_attention_heads"]), int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"])
    hd = int(cfg.get("head_dim") or cfg["hidden_size"] // nq)
    groups = nq // nkv
    kw = dict(backend=ctx.backend, device=ctx.device)
    qc = kc = oc = None
    if ctx.cut_in_memory:
        k0, k1 = even_split(nkv, ctx.tp.world, 1)[ctx.tp.rank]
        if k1 == k0 or (k1 - k0) * hd % BLOCK:
            raise IncompatibleSliceError(
                f"{prefix}: {nkv} KV heads of {hd} channels cannot be cut into {ctx.tp.world} "
                f"slices of whole heads and {BLOCK}-multiples")
        kc = Cut("col", k0 * hd, k1 * hd)
        qc = Cut("col", k0 * groups * hd, k1 * groups * hd)
        oc = Cut("row", qc.first, qc.last, bias_here=ctx.tp.rank == 0)
        nq_l, nkv_l = (k1 - k0) * groups, k1 - k0
    elif ctx.tp.world > 1:  # a rank-slice output: local head counts from the sliced shapes
        nkv_l = _padded_out(ctx, f"{prefix}.k_proj") // hd
        nq_l = nkv_l * groups
    else:
        nq_l, nkv_l = nq, nkv
    q = load_linear(ws, f"{prefix}.q_proj", qc, out_real=nq_l * hd, **kw)
    k = load_linear(ws, f"{prefix}.k_proj", kc, out_real=nkv_l * hd, **kw)
    v = load_linear(ws, f"{prefix}.v_proj", kc, out_real=nkv_l * hd, **kw)
    o = load_linear(ws, f"{prefix}.o_proj", oc, in_real=nq_l * hd, out_real=int(cfg["hidden_size"]), **kw)
    eps = float(cfg["rms_norm_eps"])
    qn = kn = None
    if spec.qk_norm:
        qn = RMSNorm(ws.tensor(f"{prefix}.q_norm.weight"), eps)
        kn = RMSNorm(ws.tensor(f"{prefix}.k_norm.weight"), eps)
    return Attention(q=q, k=k, v=v, o=o, head_dim=hd, n_q=nq_l, n_kv=nkv_l, rope=rope, layer_idx=idx,
                     q_norm=qn, k_norm=kn)


def build_moe(ctx: BuildContext, spec: GqaSpec, prefix: str) -> MoE:
    cfg, ws = ctx.config, ctx.weights
    n_exp = int(cfg[spec.num_experts_key])
    if ctx.cut_in_memory:
        e0, e1 = even_split(n_exp, ctx.tp.world, 1)[ctx.tp.rank]
        owned = range(e0, e1)
    else:  # a rank directory holds only its own experts; an unsliced one all of them
        owned = [e for e in range(n_exp) if ws.is_linear(f"{prefix}.experts.{e}.gate_proj")]
    if ctx.tp.world == 1 and len(owned) != n_exp:
        missing = sorted(set(range(n_exp)) - set(owned))[:4]
        raise MissingTensorError(f"{ws.ckpt.root}: {prefix}: experts {missing} missing")
    # each expert is whole on one rank: load without cutting
    whole = BuildContext(ctx.config, ws, ctx.tp, False, ctx.backend, ctx.device)
    experts = {e: build_mlp(whole, f"{prefix}.experts.{e}") for e in owned}
    bias_name = f"{prefix}.gate.e_score_correction_bias"
    shared = None
    if spec.shared_expert and int(cfg.get("n_shared_experts") or 0) > 0:
        sp = f"{prefix}.shared_experts"
        if ctx.cut_in_memory or ws.is_linear(f"{sp}.gate_proj"):
            shared = build_mlp(ctx, sp)
    return MoE(router=ws.tensor(f"{prefix}.gate.weight"), experts=experts,
               top_k=int(cfg["num_experts_per_tok"]), routing=spec.routing,
               norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
               scaling=float(cfg.get("routed_scaling_factor") or 1.0) if spec.routing == "sigmoid" else 1.0,
               score_bias=ws.tensor(bias_name) if ws.has(bias_name) else None, shared=shared)


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
                                   RMSNorm(ws.tensor(f"{p}.post_attention_layernorm.weight"), eps), mlp, ctx.tp))
    vocab = int(cfg["vocab_size"])
    head_cut = None
    if ctx.cut_in_memory:
        head_cut, _ = _col_row_cuts(ctx, _padded_out(ctx, "lm_head"), "lm_head vocab")
    head_name = "lm_head" if ws.is_linear("lm_head") else "model.embed_tokens"
    head = load_linear(ws, head_name, head_cut, backend=ctx.backend, device=ctx.device)
    if head_cut is None and ctx.tp.world == 1:
        head.out_real = min(head.out_real, vocab)
    info = ModelInfo(cfg["architectures"][0], vocab, int(cfg["hidden_size"]), n_layers,
                     int(ctx.max_context or cfg.get("max_position_embeddings") or 4096))
    embed = ws.tensor("model.embed_tokens.weight").to(ctx.device)
    return CausalLM(info=info, embed=embed, layers=layers, norm=RMSNorm(ws.tensor("model.norm.weight"), eps),
                    head=head, tp=ctx.tp)

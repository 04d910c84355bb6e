"""DeepseekV3ForCausalLM (exllamav3 1.6.5: architecture/deepseek_v3.py) and the shared MLA body.

MLA attention (runtime/mla.py); layers ``< first_k_dense_replace`` (or ``mlp_layer_types ==
"dense"``) a dense gated MLP, the rest MoE: sigmoid scores, ``e_score_correction_bias`` for the
choice only, weights normalised and times ``routed_scaling_factor``, plus the shared experts.
Group-limited routing (n_group > 1) is refused, as exllamav3 1.6.5 refuses it.

Tensor parallelism follows this rank's ``exl3tools`` block (docs/rank-slice.md §3.3-4, from a rank
directory or planned in memory): attention ``"cut": "heads"`` gives this rank q heads [h0, h1):
q_b_proj column-cut, the fp16 kv_b_proj rows of those heads, o_proj row-cut, one all-reduce; the
latent side (q_a, kv_a_proj_with_mqa 576->640, norms, the latent cache, the DSA indexer) is
replicated. ``"cut": "replicate"`` (illegal head cut) runs the whole attention on every rank with
no reduce (exllamav3 instead keeps an MLA layer whole on one device). MLPs and experts use the
GQA family's builders (runtime/arch/gqa.py): ``--moe ep`` whole experts, ``--moe tp`` cut experts.

The MTP head (``model.layers.{num_hidden_layers}``: GLM-5's without the DSA indexer), when the
checkpoint carries it, is built once per rank by runtime/mtp.py and attached as ``model.mtp``.
exllamav3's converter drops DeepSeek-V3's; other converters and bench/synth_checkpoint.py keep it.
"""

from __future__ import annotations

import torch

from exl3tools.errors import CheckpointError, UnsupportedArchitectureError
from exl3tools.runtime.arch import BuildContext
from exl3tools.runtime.arch.gqa import GqaSpec, _lin, build_causal_lm, build_mlp, build_moe
from exl3tools.runtime.dsa import Indexer
from exl3tools.runtime.layers import DecoderLayer, MoE, RMSNorm
from exl3tools.runtime.mla import MLAttention
from exl3tools.runtime.mla_rope import mla_rope
from exl3tools.runtime.model import CausalLM
from exl3tools.runtime.mtp import load_mtp

MOE_SPEC = GqaSpec(routing="sigmoid", num_experts_key="n_routed_experts", shared_expert=True)


def check_routing(cfg: dict) -> None:
    if int(cfg.get("n_group") or 1) != 1 or int(cfg.get("topk_group") or 1) != 1:
        raise UnsupportedArchitectureError(
            f"{cfg['architectures'][0]} with group-limited routing (n_group {cfg.get('n_group')}, "
            f"topk_group {cfg.get('topk_group')}) is not supported (exllamav3 1.6.5 refuses it too)")
    for key, want in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
        if cfg.get(key, want) != want:
            raise UnsupportedArchitectureError(f"{key} {cfg[key]!r} is not supported (only {want!r})")


def is_dense_layer(cfg: dict, idx: int) -> bool:
    types = cfg.get("mlp_layer_types")
    if isinstance(types, list) and idx < len(types):
        return types[idx] == "dense"
    k = cfg.get("first_k_dense_replace")
    return idx < (3 if k is None else int(k))  # exllamav3's default


def build_attention(ctx: BuildContext, prefix: str, idx: int, rope, *, indexer_mode: str | None) -> MLAttention:
    """The MLA attention of ``prefix`` on this rank: its heads (``"cut": "heads"``), or all of them."""
    cfg, ws = ctx.config, ctx.weights
    nh = int(cfg["num_attention_heads"])
    H = int(cfg["hidden_size"])
    nope, rdim, vd = int(cfg["qk_nope_head_dim"]), int(cfg["qk_rope_head_dim"]), int(cfg["v_head_dim"])
    kv_lora = int(cfg["kv_lora_rank"])
    q_lora = cfg.get("q_lora_rank")
    eps = float(cfg["rms_norm_eps"])
    qk, kvb = nope + rdim, nope + vd
    entry = ctx.attention_entry(prefix)
    sharded = entry.get("cut") == "heads"
    h0, h1 = (int(entry["q_heads"][0]), int(entry["q_heads"][1])) if sharded else (0, nh)
    nl = h1 - h0
    q_a = q_a_norm = q_b = q_proj = None
    if q_lora:
        q_a = _lin(ctx, f"{prefix}.q_a_proj", out_real=int(q_lora))
        q_a_norm = RMSNorm(ws.tensor(f"{prefix}.q_a_layernorm.weight"), eps)
        q_b = _lin(ctx, f"{prefix}.q_b_proj", out_real=nl * qk)
    else:
        q_proj = _lin(ctx, f"{prefix}.q_proj", out_real=nl * qk)
    kv_a = _lin(ctx, f"{prefix}.kv_a_proj_with_mqa", out_real=kv_lora + rdim)
    kv_a_norm = RMSNorm(ws.tensor(f"{prefix}.kv_a_layernorm.weight"), eps)
    name = f"{prefix}.kv_b_proj.weight"
    if sharded and ctx.cut_in_memory:      # fp16 HF (out, in): this rank's heads are rows
        kv_b = ws.tensor(name, dim=0, first=h0 * kvb, last=h1 * kvb)
    else:
        kv_b = ws.tensor(name)
    if tuple(kv_b.shape) != (nl * kvb, kv_lora):
        raise CheckpointError(f"{name} has shape {tuple(kv_b.shape)}, expected {(nl * kvb, kv_lora)} "
                              f"for heads [{h0}, {h1})")
    o = _lin(ctx, f"{prefix}.o_proj", in_real=nl * vd, out_real=H)
    indexer = None
    topk = int(cfg.get("index_topk") or 0)
    if indexer_mode == "full":
        ip = f"{prefix}.indexer"
        ih, ihd = int(cfg["index_n_heads"]), int(cfg["index_head_dim"])
        indexer = Indexer(
            wq_b=_lin(ctx, f"{ip}.wq_b", out_real=ih * ihd),
            wk=ws.tensor(f"{ip}.wk.weight"), k_norm_w=ws.tensor(f"{ip}.k_norm.weight"),
            k_norm_b=ws.tensor(f"{ip}.k_norm.bias"), weights_proj=ws.tensor(f"{ip}.weights_proj.weight"),
            n_heads=ih, head_dim=ihd, rope_dim=rdim, topk=topk, rope_params=rope)
    return MLAttention(layer_idx=idx, n_heads=nl, nope=nope, rope=rdim, v_dim=vd, kv_lora=kv_lora,
                       q_a=q_a, q_a_norm=q_a_norm, q_b=q_b, q_proj=q_proj, kv_a=kv_a, kv_a_norm=kv_a_norm,
                       kv_b=kv_b, o=o, rope_params=rope, indexer=indexer,
                       dsa_shared=indexer_mode == "shared", index_topk=topk,
                       reduce=ctx.tp.all_reduce if sharded else None)


class Fp16ChoiceMoE(MoE):
    """Sigmoid routing as exllamav3 runs it: the expert *choice* from fp16 activations and the
    mean-centred fp16 ``e_score_correction_bias`` (block_sparse_mlp_routing.py ``_esb_h``); the
    weights stay the float32 unbiased scores. On near-ties (1e-4 apart in the GLM-5 fixture, p64
    row 8) this picks the expert exllamav3 picks."""

    fp16_choice = True      # runtime.fused_step routes it through kernels.fused_decode.route's choice_logits

    def choice_bias(self) -> torch.Tensor | None:
        """The bias added to the choice scores: mean-centred, rounded to fp16, as fp32."""
        return None if self.bias is None else (self.bias - self.bias.mean()).half().float()

    @classmethod
    def of(cls, moe: MoE) -> Fp16ChoiceMoE:
        new = cls.__new__(cls)
        new.__dict__.update(moe.__dict__)
        return new

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.router.device != x.device:
            self.router = self.router.to(x.device)
            self.bias = None if self.bias is None else self.bias.to(x.device)
        scores = torch.sigmoid(x @ self.router.t())
        choice = torch.sigmoid(x.half().float() @ self.router.t())
        if self.bias is not None:
            choice = choice + self.choice_bias()[None, :]
        sel = torch.topk(choice, self.top_k, dim=-1).indices
        w = scores.gather(1, sel)
        if self.norm:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return sel, w * self.scaling


def build_block(ctx: BuildContext, idx: int, rope, *, indexer_mode: str | None, moe: bool,
                cache_idx: int | None = None) -> DecoderLayer:
    """Decoder block ``model.layers.{idx}``; ``cache_idx`` is its cache slot (defaults to idx)."""
    ws = ctx.weights
    eps = float(ctx.config["rms_norm_eps"])
    p = f"model.layers.{idx}"
    slot = idx if cache_idx is None else cache_idx
    attn = build_attention(ctx, f"{p}.self_attn", slot, rope, indexer_mode=indexer_mode)
    mlp = Fp16ChoiceMoE.of(build_moe(ctx, MOE_SPEC, f"{p}.mlp")) if moe else build_mlp(ctx, f"{p}.mlp")
    return DecoderLayer(RMSNorm(ws.tensor(f"{p}.input_layernorm.weight"), eps), attn,
                        RMSNorm(ws.tensor(f"{p}.post_attention_layernorm.weight"), eps), mlp)


def build_mla_model(ctx: BuildContext, *, indexer_types: list[str] | None) -> CausalLM:
    cfg = ctx.config
    check_routing(cfg)
    rope = mla_rope(cfg)
    n_layers = int(cfg["num_hidden_layers"])
    layers = [build_block(ctx, i, rope, indexer_mode=None if indexer_types is None else indexer_types[i],
                          moe=not is_dense_layer(cfg, i)) for i in range(n_layers)]
    model = build_causal_lm(ctx, layers)
    model.rope = rope
    return model


def build(ctx: BuildContext) -> CausalLM:
    model = build_mla_model(ctx, indexer_types=None)
    model.mtp = load_mtp(ctx, model, indexer_mode=None)
    return model

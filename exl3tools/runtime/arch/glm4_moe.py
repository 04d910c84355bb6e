"""Glm4MoeForCausalLM (exllamav3 1.6.5: architecture/glm4_moe.py).

q/k/v bias, partial NeoX RoPE (``partial_rotary_factor`` of head_dim, leading channels), optional
q/k norm (``use_qk_norm``); layers < ``first_k_dense_replace`` dense, the rest MoE with sigmoid
routing + ``e_score_correction_bias`` for selection, normalised weights x ``routed_scaling_factor``,
plus ``n_shared_experts`` shared experts (one gated MLP of width moe_intermediate x n_shared).
"""

from exl3tools.errors import UnsupportedArchitectureError
from exl3tools.runtime.arch import BuildContext
from exl3tools.runtime.arch.gqa import GqaSpec, build_gqa


def build(ctx: BuildContext):
    cfg = ctx.config
    if int(cfg.get("n_group") or 1) != 1 or int(cfg.get("topk_group") or 1) != 1:
        raise UnsupportedArchitectureError("Glm4Moe with grouped routing (n_group > 1) is not supported")
    n = int(cfg["num_hidden_layers"])
    dense = tuple(range(min(n, int(cfg.get("first_k_dense_replace", 0)))))
    return build_gqa(ctx, GqaSpec(qk_norm=bool(cfg.get("use_qk_norm", False)), routing="sigmoid",
                                  num_experts_key="n_routed_experts", dense_layers=dense, shared_expert=True))

"""Qwen3MoeForCausalLM (exllamav3 1.6.5: architecture/qwen3_moe.py).

Per-head q/k RMSNorm before RoPE; every layer MoE (except ``mlp_only_layers`` and layers off
``decoder_sparse_step``); softmax routing over the top-k logits (norm_topk_prob); no shared expert.
"""

from exl3tools.runtime.arch import BuildContext
from exl3tools.runtime.arch.gqa import GqaSpec, build_gqa


def build(ctx: BuildContext):
    cfg = ctx.config
    n = int(cfg["num_hidden_layers"])
    step = int(cfg.get("decoder_sparse_step") or 1)
    only = set(cfg.get("mlp_only_layers") or [])
    dense = tuple(i for i in range(n) if i in only or (i + 1) % step != 0)
    return build_gqa(ctx, GqaSpec(qk_norm=True, routing="softmax", num_experts_key="num_experts",
                                  dense_layers=dense))

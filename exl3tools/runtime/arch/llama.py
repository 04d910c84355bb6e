"""LlamaForCausalLM (exllamav3 1.6.5: architecture/llama.py): GQA, NeoX RoPE, dense gated MLP."""

from exl3tools.runtime.arch import BuildContext
from exl3tools.runtime.arch.gqa import GqaSpec, build_gqa


def build(ctx: BuildContext):
    return build_gqa(ctx, GqaSpec())

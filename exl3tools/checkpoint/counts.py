"""Plausibility of the counts and sizes config.json declares.

Every loop the tools run over a model (layers, experts, heads) takes its bound from config.json:
``n_routed_experts: 1e9`` made validate and dequantize run forever, ``num_hidden_layers: -5``
passed validate, ``num_attention_heads: 0`` divided by zero. Each key is checked on its own (an
integer in a plausible range), then together against what is stored: the modules the counts imply
may not exceed a generous multiple of the tensors the checkpoint actually holds.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# key -> (smallest legal value, largest plausible value). The ceilings are far above any real model
# (GLM-5: 78 layers, 256 experts, hidden 6144, vocab 154k) and far below what a loop cannot finish.
COUNT_LIMITS: dict[str, tuple[int, int]] = {
    "num_hidden_layers": (1, 4096),
    "hidden_size": (1, 1 << 20),
    "intermediate_size": (1, 1 << 22),
    "moe_intermediate_size": (1, 1 << 22),
    "vocab_size": (1, 1 << 24),
    "num_attention_heads": (1, 1 << 14),
    "num_key_value_heads": (1, 1 << 14),
    "head_dim": (1, 1 << 16),
    "n_routed_experts": (1, 1 << 16),
    "num_experts": (0, 1 << 16),
    "num_experts_per_tok": (1, 1 << 16),
    "n_shared_experts": (0, 1 << 10),
    "num_nextn_predict_layers": (0, 64),
    "first_k_dense_replace": (0, 4096),
    "decoder_sparse_step": (1, 4096),
    "kv_lora_rank": (1, 1 << 20),
    "q_lora_rank": (1, 1 << 20),
    "qk_nope_head_dim": (1, 1 << 16),
    "qk_rope_head_dim": (0, 1 << 16),
    "v_head_dim": (1, 1 << 16),
    "index_n_heads": (1, 1 << 14),
    "index_head_dim": (1, 1 << 16),
    "max_position_embeddings": (1, 1 << 31),
}
MODULES_PER_TENSOR = 8      # implied modules allowed per stored (or indexed) tensor ...
MODULES_SLACK = 1 << 16     # ... plus this many, so a checkpoint missing most shards still validates


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def implied_modules(config: Mapping[str, Any]) -> int:
    """An upper estimate of the modules expected_modules would list for ``config`` (counts already checked)."""
    layers = (config.get("num_hidden_layers") or 0) + (config.get("num_nextn_predict_layers") or 0)
    experts = config.get("n_routed_experts") or config.get("num_experts") or 0
    return layers * (16 + 3 * experts) + 4


def config_problems(config: Mapping[str, Any], stored: int) -> list[str]:
    """What is implausible about ``config``'s counts, one message per problem ([] = plausible).

    ``stored``: how many tensors the checkpoint holds (or its index lists), whichever is larger.
    """
    problems = []
    for key, (lo, hi) in COUNT_LIMITS.items():
        v = config.get(key)
        if v is None:
            continue
        if not _int(v) or not lo <= v <= hi:
            problems.append(f"{key} {v!r} is not plausible (an integer in [{lo}, {hi}])")
    if problems:
        return problems
    implied = implied_modules(config)
    budget = MODULES_PER_TENSOR * stored + MODULES_SLACK
    if implied > budget:
        keys = [k for k in ("num_hidden_layers", "num_nextn_predict_layers", "n_routed_experts", "num_experts")
                if config.get(k)]
        problems.append(f"{' x '.join(f'{k} {config[k]}' for k in keys)} imply ~{implied:,} modules, but the "
                        f"checkpoint holds only {stored:,} tensors")
    return problems

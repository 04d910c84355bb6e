"""GlmMoeDsaForCausalLM (GLM-5.x; exllamav3 1.6.5: architecture/glm_moe_dsa.py, glm_moe_dsa_mtp.py).

The DeepSeek-V3 body (runtime/arch/deepseek_v3.py) with the DSA lightning indexer
(runtime/dsa.py) on "full" layers of ``indexer_types``; "shared" layers reuse the selection of
the nearest preceding full layer. ``mlp_layer_types`` picks dense/sparse MLPs. RoPE is interleaved
(``rope_interleave`` / ``indexer_rope_interleave`` must not be false, as in exllamav3).

The MTP head (``model.layers.{num_hidden_layers}``, with its own "full" indexer), when the
checkpoint carries it, is built once per rank by runtime/mtp.py and attached as ``model.mtp``; it is
never one of ``model.layers``. DeepSeek-V3's is built the same way, without the indexer.
"""

from __future__ import annotations

from exl3tools.errors import UnsupportedArchitectureError
from exl3tools.runtime.arch import BuildContext
from exl3tools.runtime.arch.deepseek_v3 import build_mla_model
from exl3tools.runtime.model import CausalLM
from exl3tools.runtime.mtp import load_mtp


def indexer_schedule(cfg: dict) -> list[str]:
    n = int(cfg["num_hidden_layers"])
    types = list(cfg.get("indexer_types") or [])
    if len(types) < n or any(t not in ("full", "shared") for t in types[:n]) or types[0] != "full":
        raise UnsupportedArchitectureError(f"unexpected indexer_types {types!r} for {n} layers")
    return types[:n]


def build(ctx: BuildContext) -> CausalLM:
    cfg = ctx.config
    for key in ("rope_interleave", "indexer_rope_interleave"):
        if cfg.get(key, True) is not True:
            raise UnsupportedArchitectureError(f"GlmMoeDsa with {key} = {cfg[key]!r} is not supported")
    model = build_mla_model(ctx, indexer_types=indexer_schedule(cfg))
    model.mtp = load_mtp(ctx, model, indexer_mode="full")    # its block has its own indexer
    return model

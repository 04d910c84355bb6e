"""Architecture registry: ``config.json`` ``architectures[0]`` -> the module that builds it.

An architecture module exposes ``build(ctx: BuildContext) -> CausalLM``. Modules are imported
lazily. To add one (e.g. MLA models: ``deepseek_v3.py``, ``glm_moe_dsa.py``), write the module
and add one row here; attention kinds other than GQA bring their own attention class that keeps
its own per-layer cache entries (see runtime/cache.py) and plug it into runtime/layers.DecoderLayer.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from exl3tools.errors import UnsupportedArchitectureError
from exl3tools.runtime.tp import TPContext
from exl3tools.runtime.weights import Cut, WeightSource

ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "exl3tools.runtime.arch.llama",
    "Qwen3MoeForCausalLM": "exl3tools.runtime.arch.qwen3_moe",
    "Glm4MoeForCausalLM": "exl3tools.runtime.arch.glm4_moe",
    "DeepseekV3ForCausalLM": "exl3tools.runtime.arch.deepseek_v3",
    "GlmMoeDsaForCausalLM": "exl3tools.runtime.arch.glm_moe_dsa",
}


@dataclass(slots=True)
class BuildContext:
    config: dict
    weights: WeightSource
    tp: TPContext                      # world/rank of this process
    cut_in_memory: bool                # True: the checkpoint is unsliced and this rank cuts its part
    block: dict | None = None          # this rank's "exl3tools" block (docs/rank-slice.md §4); None: TP=1
    backend: str = "reference"
    device: str = "cpu"
    max_context: int | None = None

    def module_cut(self, prefix: str):
        """The Cut to apply while reading ``prefix`` (only for an unsliced checkpoint), else None."""
        c = self.cut_entry(prefix)
        if not self.cut_in_memory or c.get("cut") not in ("column", "row"):
            return None
        return Cut("col" if c["cut"] == "column" else "row", int(c["first"]), int(c["last"]),
                   bias_here=bool(c.get("bias", int(c["first"]) == 0)))

    def cut_entry(self, prefix: str) -> dict:
        if self.block is None:
            return {"cut": "replicate"}
        return self.block.get("modules", {}).get(prefix, {"cut": "replicate"})

    def is_cut(self, prefix: str) -> bool:
        return self.cut_entry(prefix).get("cut") in ("column", "row", "experts", "tp")

    def attention_entry(self, prefix: str) -> dict:
        if self.block is None:
            return {"cut": "replicate"}
        return self.block.get("attention", {}).get(prefix, {"cut": "replicate"})


def arch_module(architecture: str):
    """The builder module for ``architecture``, or UnsupportedArchitectureError."""
    modname = ARCHITECTURES.get(architecture)
    if modname is not None:
        try:
            return importlib.import_module(modname)
        except ModuleNotFoundError as exc:
            if exc.name != modname:
                raise
    known = ", ".join(k for k in ARCHITECTURES if _importable(ARCHITECTURES[k]))
    raise UnsupportedArchitectureError(
        f"architecture {architecture!r} is not supported by the runtime (supported: {known})")


def _importable(modname: str) -> bool:
    return importlib.util.find_spec(modname) is not None


def supported() -> list[str]:
    return [k for k, m in ARCHITECTURES.items() if _importable(m)]

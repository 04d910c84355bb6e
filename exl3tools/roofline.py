"""Weight bytes a decode step reads, from headers and config.json only (no torch).

serving-expectations.md §8: a decode step of B tokens streams every non-expert tensor on the token's
path once (attention, dense MLP, shared experts, router, norms, lm_head) plus, per MoE layer, the
distinct routed experts its tokens pick: ``E·(1 − (1 − k/E)^B)`` of E under uniform routing. Left
out: the embedding table (one row per token, negligible), the MTP layers (not on a plain decode
step) and the KV cache (depends on the context). Per tensor-parallel rank: rank 0's own tensors
(a rank-slice directory as stored; an unsliced checkpoint cut as the runtime cuts it).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from exl3tools.checkpoint import Checkpoint
from exl3tools.layout import layer_of


@dataclass(frozen=True, slots=True)
class DecodeReads:
    fixed_bytes: int          # read once per step whatever B is
    per_expert_bytes: float   # one routed expert's bytes, summed over the MoE layers
    experts: int              # E, routed experts per MoE layer (0: no MoE)
    top_k: int                # k, num_experts_per_tok

    def distinct_experts(self, batch: int) -> float:
        """Expected distinct routed experts per MoE layer that ``batch`` tokens touch (uniform routing)."""
        if not self.experts:
            return 0.0
        return self.experts * (1 - (1 - self.top_k / self.experts) ** max(batch, 0))

    def bytes_for(self, batch: int) -> int:
        return self.fixed_bytes + round(self.per_expert_bytes * self.distinct_experts(batch))


def reads_of(tensors: Iterable[tuple[str, int]], config: dict) -> DecodeReads:
    """``(name, nbytes)`` of the tensors one rank holds -> what its decode step reads."""
    n_layers = int(config.get("num_hidden_layers") or 0)
    fixed = expert = embed = 0
    has_head = False
    for name, nbytes in tensors:
        layer = layer_of(name)
        if layer is not None and layer >= n_layers:
            continue                                   # MTP layer
        if name.startswith("model.embed_tokens."):
            embed += nbytes
        elif ".mlp.experts." in name:
            expert += nbytes
        else:
            fixed += nbytes
            has_head |= name.startswith("lm_head.")
    if not has_head:
        fixed += embed       # tied embeddings: the table is the head, read whole
    E = int(config.get("n_routed_experts") or config.get("num_experts") or 0)
    k = min(int(config.get("num_experts_per_tok") or 0), E)
    if expert and not k:     # experts with no routing in the config: count them all
        return DecodeReads(fixed + expert, 0.0, 0, 0)
    # (a rank holding E/tp whole experts (EP) or a slice of each (TP) reads the same share of them)
    return DecodeReads(fixed, expert / E if E else 0.0, E, k)


def decode_reads(ck: Checkpoint, tp: int = 1, moe: str = "tp") -> DecodeReads:
    """Rank 0's decode-step reads of ``ck`` served at ``tp`` ranks (``moe``: how an unsliced
    checkpoint's experts are cut; a rank-slice directory already holds only its rank's tensors)."""
    if tp > 1 and (ck.config.get("exl3tools") or {}).get("layout") != "ranks":
        from exl3tools.slicing.plan import rank_holdings

        held = ((t.name, t.nbytes) for t in rank_holdings(ck, tp, moe)[0][0])
    else:
        held = ((n, r.info.nbytes) for n, r in ck.tensors.items())
    return reads_of(held, ck.config)

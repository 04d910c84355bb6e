"""plan: will a checkpoint fit, per GPU, before a byte of weights is read (schemas/plan.v1.json).

Headers and config only, no torch. Per rank:

- ``weight_bytes``: exactly the tensors the rank holds, as the rank-slice planner cuts them
  (slicing.plan.rank_holdings; at ``--tp 1`` every tensor; an MTP layer only where the runtime
  builds its head, GLM-5 and DeepSeek-V3): what the runtime reads for that rank.
- ``kv_bytes_per_token``: what the runtime's paged pool stores per token (runtime/kv_pool.py over
  each attention's ``cache_spec()``): GQA ``2 x kv_heads_local x head_dim x dtype`` per layer; MLA
  ``(kv_lora_rank + qk_rope_head_dim) x dtype`` per layer, plus the DSA indexer key
  ``index_head_dim x dtype`` on "full" indexer layers, where ``--kv-cache-dtype auto`` is fp32 for MLA
  (4 bytes; fp16/bf16: 2). The MTP layer is not in the pool.
- ``scratch_bytes`` (an estimate; the runtime measures its own at startup):
  ``GRAPH_RESERVE`` (512 MiB, the runtime's reserve for CUDA graphs, logits and sampling)
  + ``CUDA_CONTEXT`` (512 MiB, in use before any tensor)
  + activation peak of one eager step of ``max_num_batched_tokens`` tokens, estimated as
  ``4 x T x (4 x hidden + 3 x intermediate + 2 x vocab)`` bytes (fp32 residual/norm copies, the
  gated MLP's widest intermediate, ``moe_intermediate_size x num_experts_per_tok`` for MoE,
  logits and their softmax)
  + ``fp32_copies``: the runtime keeps the non-EXL3 16-bit tensors (embedding, norms, routers,
  MLA ``kv_b_proj``, DSA indexer projections) in fp32, 2 extra bytes per element.
- ``kv_tokens``: the pool the runtime's budget gives, ``blocks = floor((util x gpu - weights -
  scratch) / (kv_bytes_per_token x block_size))``, less the block manager's scratch block:
  ``(blocks - 1) x block_size`` tokens; the least over ranks (rank 0 decides for all).
- ``max_context``: ``min(--max-model-len or max_position_embeddings, kv_tokens)``.

It does not fit (``DoesNotFitError``, exit 3) when a rank has fewer than two blocks, or fewer KV
tokens than ``--max-model-len`` asks for.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Any

from exl3tools.checkpoint import Checkpoint
from exl3tools.errors import DoesNotFitError, UnsupportedArchitectureError, UsageError
from exl3tools.slicing.plan import rank_holdings

SCHEMA_ID = "https://exl3tools.dev/schemas/plan.v1.json"
GIB = 2**30
GRAPH_RESERVE = 512 * 2**20     # kept free beside the KV cache: graph pool, logits, sampling (the runtime's too)
CUDA_CONTEXT = 512 * 2**20
DEFAULT_BATCHED_TOKENS = 2048   # serve's --max-prefill-tokens on CUDA
# serve's --max-num-seqs: 32 until 2026-12-03, when 64 served 64 streams 1.3-1.6x faster on the H200
# with 8 and 32 streams alike (docs/serve.md)
DEFAULT_MAX_NUM_SEQS = 64

# total memory as nvidia-smi / torch.cuda.mem_get_info report it
GPUS: dict[str, int] = {
    "h200": 143771 * 2**20, "h100": 81559 * 2**20, "h100-nvl": 95830 * 2**20, "a100-80g": 81920 * 2**20,
    "a100-40g": 40960 * 2**20, "l40s": 46068 * 2**20, "a6000": 49140 * 2**20, "rtx4090": 24564 * 2**20,
    "rtx3090": 24576 * 2**20, "rtx5090": 32607 * 2**20,
}
MLA_ARCHS = {"DeepseekV3ForCausalLM", "GlmMoeDsaForCausalLM"}
GQA_ARCHS = {"LlamaForCausalLM", "Qwen3MoeForCausalLM", "Glm4MoeForCausalLM"}
KV_DTYPE_BYTES = {"auto": 2, "bf16": 2, "fp16": 2, "fp32": 4}   # auto on CUDA: bf16, fp16 for MLA (kv_pool.kv_dtype_for)
_LINEAR_FIELDS = ("trellis", "suh", "svh", "su", "sv", "mcg", "mul1", "bias")
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """'141GiB', '80 GB', '24000MiB', '1.5TB' or a plain number of bytes."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", text or "")
    if not m or m.group(2).lower() not in _UNITS:
        raise UsageError(f"--gpu-memory: cannot read {text!r} (examples: 141GiB, 80GB, 24000MiB)")
    n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if n <= 0:
        raise UsageError(f"--gpu-memory must be positive, got {text!r}")
    return n


def gpu_bytes(name: str) -> int:
    try:
        return GPUS[name.lower()]
    except KeyError:
        raise UsageError(f"--gpu: unknown GPU {name!r}; known: {', '.join(sorted(GPUS))} "
                         "(or give --gpu-memory)") from None


@dataclass(frozen=True, slots=True)
class RankMemory:
    rank: int
    weight_bytes: int
    kv_bytes_per_token: int
    activation_bytes: int
    fp32_copy_bytes: int
    scratch_bytes: int          # GRAPH_RESERVE + CUDA_CONTEXT + activation + fp32 copies
    kv_budget_bytes: int        # util x gpu - weights - scratch (may be negative)
    kv_blocks: int              # whole blocks of the budget (the runtime's num_blocks)
    kv_tokens: int              # (kv_blocks - 1) x block_size: the block manager keeps one block


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    path: str
    architecture: str
    gpu: str
    gpu_bytes: int
    gpu_memory_utilization: float
    tp: int
    moe: str
    block_size: int
    kv_cache_dtype: str
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int | None
    model_max_context: int
    ranks: list[RankMemory]
    kv_tokens: int
    max_context: int
    fits: bool
    message: str

    def to_json(self) -> dict[str, Any]:
        return {"$schema": SCHEMA_ID, "schema_version": 1, **asdict(self)}

    def raise_unless_fits(self) -> None:
        if not self.fits:
            raise DoesNotFitError(self.message)


def kv_bytes_per_token(cfg: dict, architecture: str, attention: dict[str, dict], kv_dtype: str) -> int:
    """Bytes one token takes in the runtime's KV pool on one rank (see module doc)."""
    n_layers = int(cfg["num_hidden_layers"])
    dtype_bytes = KV_DTYPE_BYTES[kv_dtype]
    if architecture in MLA_ARCHS:
        per = (int(cfg["kv_lora_rank"]) + int(cfg["qk_rope_head_dim"])) * dtype_bytes
        total = per * n_layers
        if architecture == "GlmMoeDsaForCausalLM":
            types = list(cfg.get("indexer_types") or [])[:n_layers]   # as runtime/arch/glm_moe_dsa.py
            if len(types) < n_layers or any(t not in ("full", "shared") for t in types) or types[0] != "full":
                raise UnsupportedArchitectureError(f"unexpected indexer_types {types!r} for {n_layers} layers")
            total += types.count("full") * int(cfg["index_head_dim"]) * dtype_bytes
        return total
    if architecture not in GQA_ARCHS:
        raise UnsupportedArchitectureError(f"plan does not know the KV cache of {architecture}")
    nq = int(cfg["num_attention_heads"])
    nkv = int(cfg.get("num_key_value_heads") or nq)
    hd = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // nq)
    total = 0
    for i in range(n_layers):
        e = attention.get(f"model.layers.{i}.self_attn", {})
        kv = e["kv_heads"][1] - e["kv_heads"][0] if e.get("cut") == "heads" else nkv
        total += 2 * kv * hd * dtype_bytes
    return total


def activation_estimate(cfg: dict, tokens: int) -> int:
    """4 x T x (4 x hidden + 3 x widest intermediate + 2 x vocab): see module doc."""
    hidden, vocab = int(cfg["hidden_size"]), int(cfg["vocab_size"])
    inter = int(cfg.get("intermediate_size") or 0)
    if cfg.get("moe_intermediate_size"):
        inter = max(inter, int(cfg["moe_intermediate_size"]) * int(cfg.get("num_experts_per_tok") or 1))
    return 4 * tokens * (4 * hidden + 3 * inter + 2 * vocab)


# architectures whose runtime loads the MTP layer (runtime/mtp.py)
MTP_BUILT = ("DeepseekV3ForCausalLM", "GlmMoeDsaForCausalLM")


def _mtp_tensor(name: str, n_layers: int) -> bool:
    """A tensor of an MTP layer (``model.layers.{i}.*`` with i >= num_hidden_layers)."""
    parts = name.split(".")
    return len(parts) > 2 and parts[0] == "model" and parts[1] == "layers" and parts[2].isdigit() \
        and int(parts[2]) >= n_layers


def _fp32_copies(tensors) -> int:
    return sum(2 * (t.nbytes // 2) for t in tensors
               if t.dtype in ("BF16", "F16") and t.name.rsplit(".", 1)[-1] not in _LINEAR_FIELDS)


def fmt_bytes(n: int) -> str:
    return f"{n / GIB:.2f} GiB" if abs(n) >= GIB else f"{n / 2**20:.1f} MiB"


def plan_memory(ck: Checkpoint, *, gpu: str, gpu_total: int, tp: int = 1, moe: str = "tp",
                util: float = 0.9, block_size: int = 16, kv_dtype: str = "auto", max_model_len: int | None = None,
                max_num_seqs: int = DEFAULT_MAX_NUM_SEQS, batched_tokens: int = DEFAULT_BATCHED_TOKENS, in_use: int = 0) -> MemoryPlan:
    """The plan (a value). ``in_use``: bytes of the GPU already taken by others (serve's preflight
    passes ``total - free`` from torch.cuda.mem_get_info); the runtime subtracts them too."""
    if not 0 < util <= 1:
        raise UsageError(f"--gpu-memory-utilization must be in (0, 1], got {util}")
    if kv_dtype not in KV_DTYPE_BYTES:
        raise UsageError(f"--kv-cache-dtype must be auto, bf16, fp16 or fp32, got {kv_dtype!r}")
    if block_size < 1 or tp < 1:
        raise UsageError("--block-size and --tp must be >= 1")
    cfg = ck.config
    arch = ck.architecture
    holdings, attention = rank_holdings(ck, tp, moe)
    if arch not in MTP_BUILT:           # the runtime builds no MTP head here: those tensors stay on disk
        n_layers = int(cfg.get("num_hidden_layers") or 0)
        holdings = [[t for t in h if not _mtp_tensor(t.name, n_layers)] for h in holdings]
    usable = int(util * gpu_total) - in_use
    act = activation_estimate(cfg, batched_tokens)
    ranks = []
    for r in range(tp):
        w = sum(t.nbytes for t in holdings[r])
        per_tok = kv_bytes_per_token(cfg, arch, attention[r], kv_dtype)
        copies = _fp32_copies(holdings[r])
        scratch = GRAPH_RESERVE + CUDA_CONTEXT + act + copies
        budget = usable - w - scratch
        blocks = max(budget, 0) // (per_tok * block_size)
        ranks.append(RankMemory(r, w, per_tok, act, copies, scratch, budget, blocks,
                                max(blocks - 1, 0) * block_size))
    model_ctx = int(cfg.get("max_position_embeddings") or 4096)
    tokens = min(rk.kv_tokens for rk in ranks)
    want = max_model_len or model_ctx
    worst = min(ranks, key=lambda rk: rk.kv_tokens)
    need_tokens = max(max_model_len or 0, block_size)
    fits = worst.kv_blocks >= 2 and (max_model_len is None or tokens >= max_model_len)
    need = worst.weight_bytes + worst.scratch_bytes + (need_tokens + block_size) * worst.kv_bytes_per_token
    where = f"{gpu} ({fmt_bytes(gpu_total)})" + (f" x {tp}" if tp > 1 else "")
    if fits:
        message = f"fits on {where}: {tokens} KV tokens in the pool, longest context {min(want, tokens)}"
    else:
        message = (f"{ck.root}: does not fit on {where}: rank {worst.rank} needs {fmt_bytes(need)} "
                   f"(weights {fmt_bytes(worst.weight_bytes)} + scratch {fmt_bytes(worst.scratch_bytes)} + KV for "
                   f"{need_tokens} tokens), {fmt_bytes(usable)} free at --gpu-memory-utilization {util}")
    return MemoryPlan(str(ck.root), arch, gpu, gpu_total, util, tp, moe, block_size, kv_dtype, max_num_seqs,
                      batched_tokens, max_model_len, model_ctx, ranks, tokens, min(want, tokens), fits, message)

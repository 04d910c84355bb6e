"""Write a synthetic EXL3 checkpoint with real MoE model dimensions (random trellis, valid structure).

    python3 bench/synth_checkpoint.py OUT_DIR [--arch glm4_moe|glm5|deepseek_v3] [--layers N]
        [--dense-layers N] [--experts N] [--bits 3] [--head-bits 6] [--mtp-bits 4] [--no-mtp]
        [--index-share] [--grouped-routing] [--codebook mul1] [--shard-mb 2048] [--seed 0]
        [--jobs N] [--small] [--sparse] [--flat-logits] [--decisive-router] [--dry-run]

Any int16 bit pattern is a valid trellis (exl3-format.md §3.5), so random bytes decode to valid
weights: these are the models the decode and serving benchmarks (bench/gpu_e2e_model.py,
bench/gpu_serve.py) load into exllamav3 1.6.5 and into our runtime. Three shapes (`--arch`; their
dimensions and config.json in bench/synth_configs.py):

- `glm4_moe` (default): GLM-4.5-Air (zai-org/GLM-4.5-Air config.json), 6 layers (1 dense) by
  default, 6.2 GB at 3 bpw. Layout copies fixture glm4_moe-3.0bpw-mcg.
- `glm5` (glm_moe_dsa): GLM-5 (zai-org/GLM-5 config.json: hidden 6144, 64 heads, q_lora 2048,
  kv_lora 512, nope 192 / rope 64 / v 256, DSA indexer 32 x 128 with index_topk 2048, 256 routed
  experts top-8 + 1 shared of 2048, dense 12288, vocab 154880), 6 layers (3 dense + 3 MoE) + the
  MTP layer by default: 19.4 GB at 3 bpw (of it the MTP layer at 4 bpw, 5.0 GB). Layout copies
  fixture glm5_moe_dsa-3.0bpw-mul1 (MTP included): every layer's indexer_types is "full"
  (GLM-5/5.1); `--index-share` writes GLM-5.2's IndexShare schedule instead ("full" on layers 0-2
  and every 4th layer from 2; "shared" layers carry no indexer tensors; exllamav3 1.6.5's converter
  cannot make these, its loader and ours read them).
- `deepseek_v3`: DeepSeek-V3 (hidden 7168, 128 heads, q_lora 1536, kv_lora 512, nope 128 / rope 64
  / v 128, 256 routed experts top-8 + 1 shared of 2048, dense 18432, vocab 129280, YaRN x40), 6
  layers (3 dense + 3 MoE) + an MTP layer by default: 22.2 GB at 3 bpw (MTP layer 5.8 GB). Layout
  copies fixture deepseek_v3-3.0bpw-3inst; its MTP layer is named like GLM-5's (exllamav3 drops
  DeepSeek's MTP when converting; our runtime loads it as GLM-5's, without the indexer). Routing is
  written flat (n_group 1, topk_group 1) because our runtime and exllamav3 1.6.5 both refuse
  group-limited routing; `--grouped-routing` writes DeepSeek-V3's n_group 8 / topk_group 4 (same
  tensors; for header-only tools such as plan and validate).

Layout, as exllamav3 1.6.5's converter writes it: tensor names, dtypes and shapes, the tensor_storage
map of quantization_config.json (MLA kv_b_proj and the MTP layer stored but not listed there),
module-granular shards (`model-0000i-of-0000N.safetensors` + index).

- EXL3 linears: trellis I16 [k/16, n/16, 16K], suh/svh F16, marker I32 0-d (none for 3inst),
  q/k/v bias F16 (glm4_moe). suh = ±1, svh = ±1/sqrt(k) (the quantizer folds every scale into
  these; this keeps activations O(1) so exllamav3's fp16 path neither overflows nor flattens);
  svh = 0 on padded output columns (dense intermediate 10944 -> 11008, MLA kv_a 576 -> 640).
- embed_tokens / norms BF16, router F16 [E, H], e_score_correction_bias F32 [E]; MLA kv_b_proj F16
  [heads x (nope + v), kv_lora]; DSA indexer wk F16 [index_head_dim, H], weights_proj F16
  [index_n_heads, H], k_norm weight/bias F16 [index_head_dim] (wq_b is EXL3).
- MTP layer (`model.layers.{num_hidden_layers}`, as the GLM-5 fixture): enorm, hnorm, eh_proj
  (EXL3 2H -> H), a full decoder block (MLA, indexer for GLM-5, MoE), shared_head.norm; all EXL3
  at `--mtp-bits` (the converter's default 4); no copy of the embedding or lm_head.
- Memory is bounded: tensors are generated per linear and streamed through ShardWriter; nothing
  is held per shard. Random bytes come from numpy SFC64, one stream per shard, so `--jobs`
  processes (default min(8, cores)) write shards side by side and the bytes never depend on it.
- `--small`: a tiny same-architecture variant for CPU tests. `--sparse`: headers only, data left
  as holes. `--dry-run`: print the plan (bytes per family, files) and write nothing.
- tokenizer.json / tokenizer_config.json / generation_config.json come from the fixture; its
  2048-entry vocabulary is padded with `<|synth_i|>` tokens up to vocab_size so every sampled id
  decodes (exllamav3's Generator streams text).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from exl3tools.checkpoint.header import header_bytes  # noqa: E402
from exl3tools.checkpoint.writer import ShardWriter, fsync_dir, index_json, json_bytes, write_atomic  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from synth_configs import ARCHS, make_config, make_mla_config  # noqa: E402

# tokenizer source: the shared fixture (EXL3TOOLS_FIXTURES honoured, as tests/conftest.py), else the
# byte-identical copy tracked under demo/ (the device machine has no ../shared)
_FIXTURES = Path(os.environ.get("EXL3TOOLS_FIXTURES", REPO.parent / "shared" / "fixtures"))
TOKENIZER_SOURCES = (_FIXTURES / "glm4_moe-3.0bpw-mcg" / "model", REPO / "demo" / "glm4_moe-3.0bpw-mcg" / "model")
MARKERS = {"mul1": 0x83DCD12D, "mcg": 0xCBAC1FED}          # exl3-format.md §3.3
MULTIPLIER_KEY = {"mul1": "mul1_multiplier", "mcg": "mcg_multiplier"}
VERSION = "1.6.5"


def pad128(x: int) -> int:
    return -(-x // 128) * 128


# ------------------------------------------------------------------ plan
@dataclass(frozen=True, slots=True)
class Tensor:
    name: str
    dtype: str                 # safetensors dtype
    shape: tuple[int, ...]
    kind: str                  # trellis | suh | svh | bias | marker | embed | norm | norm16 | normal | router | score_bias | score_rank | zero
    real: int = 0              # svh: real out width (columns past it are 0)
    std: float = 0.0           # normal: F16 N(0, std^2)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * {"I16": 2, "F16": 2, "BF16": 2, "I32": 4, "F32": 4}[self.dtype]


@dataclass(frozen=True, slots=True)
class Module:
    key: str                   # tensor_storage leaf key
    top: str                   # top-level module (shard packing unit)
    tensors: tuple[Tensor, ...]
    bits: float | None = None  # EXL3 leaves only
    codebook: str = ""
    listed: bool = True        # in tensor_storage (the converter leaves out MLA kv_b_proj and the MTP layer)
    mtp: bool = False


def exl3_module(key: str, top: str, k_real: int, n_real: int, bits: float, codebook: str, bias: bool,
                mtp: bool = False) -> Module:
    k, n = pad128(k_real), pad128(n_real)
    width = int(round(16 * bits)) if bits == int(bits) else 16 * int(bits) + 8
    ts = [Tensor(f"{key}.suh", "F16", (k,), "suh"), Tensor(f"{key}.svh", "F16", (n,), "svh", real=n_real)]
    if bias:
        ts.append(Tensor(f"{key}.bias", "F16", (n,), "bias", real=n_real))
    if codebook in MARKERS:
        ts.append(Tensor(f"{key}.{codebook}", "I32", (), "marker"))
    ts.append(Tensor(f"{key}.trellis", "I16", (k // 16, n // 16, width), "trellis"))
    return Module(key, top, tuple(ts), bits, codebook, listed=not mtp, mtp=mtp)


def moe_modules(p: str, lin, cfg: dict, H: int, Im: int, Is: int, mtp: bool = False) -> list[Module]:
    """A MoE block in the converter's order: router (score bias + weight), routed experts, shared."""
    E = cfg["n_routed_experts"]
    mods = [Module(f"{p}.mlp.gate", p, (Tensor(f"{p}.mlp.gate.e_score_correction_bias", "F32", (E,), "score_bias"),
                                        Tensor(f"{p}.mlp.gate.weight", "F16", (E, H), "router")),
                   listed=not mtp, mtp=mtp)]
    for e in range(E):
        mods += [lin(f"mlp.experts.{e}.up_proj", H, Im), lin(f"mlp.experts.{e}.gate_proj", H, Im),
                 lin(f"mlp.experts.{e}.down_proj", Im, H)]
    if cfg["n_shared_experts"]:
        mods += [lin("mlp.shared_experts.up_proj", H, Is), lin("mlp.shared_experts.gate_proj", H, Is),
                 lin("mlp.shared_experts.down_proj", Is, H)]
    return mods


def plan(cfg: dict, bits: float, head_bits: float, codebook: str, mtp_bits: float = 4) -> list[Module]:
    """Every leaf module in the converter's order (fixture tensor_storage order)."""
    if cfg["model_type"] != "glm4_moe":
        return plan_mla(cfg, bits, head_bits, codebook, mtp_bits)
    H, V = cfg["hidden_size"], cfg["vocab_size"]
    nq, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    Im, Id = cfg["moe_intermediate_size"], cfg["intermediate_size"]
    Is = Im * cfg["n_shared_experts"]
    mods = [Module("model.embed_tokens", "model.embed_tokens",
                   (Tensor("model.embed_tokens.weight", "BF16", (V, H), "embed"),))]
    for li in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{li}"
        def norm(name, p=p):
            return Module(f"{p}.{name}", p, (Tensor(f"{p}.{name}.weight", "BF16", (H,), "norm"),))

        def lin(name, k, n, b=False, p=p):
            return exl3_module(f"{p}.{name}", p, k, n, bits, codebook, b)
        mods += [norm("input_layernorm"),
                 lin("self_attn.q_proj", H, nq * hd, True), lin("self_attn.k_proj", H, nkv * hd, True),
                 lin("self_attn.v_proj", H, nkv * hd, True), lin("self_attn.o_proj", nq * hd, H),
                 norm("post_attention_layernorm")]
        if li < cfg["first_k_dense_replace"]:
            mods += [lin("mlp.up_proj", H, Id), lin("mlp.gate_proj", H, Id), lin("mlp.down_proj", Id, H)]
            continue
        mods += moe_modules(p, lin, cfg, H, Im, Is)
    mods.append(Module("model.norm", "model.norm", (Tensor("model.norm.weight", "BF16", (H,), "norm"),)))
    mods.append(exl3_module("lm_head", "lm_head", H, V, head_bits, codebook, False))
    return mods


def plan_mla(cfg: dict, bits: float, head_bits: float, codebook: str, mtp_bits: float) -> list[Module]:
    """glm_moe_dsa / deepseek_v3: leaf modules in the converter's tensor_storage order (fixtures
    glm5_moe_dsa-3.0bpw-mul1, deepseek_v3-3.0bpw-3inst); the MTP layer, unlisted, after lm_head."""
    H, V, L = cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    nh, ql, kvl = cfg["num_attention_heads"], cfg["q_lora_rank"], cfg["kv_lora_rank"]
    nope, rope, vd = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    Im, Id = cfg["moe_intermediate_size"], cfg["intermediate_size"]
    Is = Im * cfg["n_shared_experts"]
    dsa = cfg["model_type"] == "glm_moe_dsa"
    indexer = cfg.get("indexer_types") or []

    def layer(li: int, mtp: bool) -> list[Module]:
        p = f"model.layers.{li}"
        b = mtp_bits if mtp else bits

        def dense(name, shape, kind, dtype="BF16", std=0.0, listed=True):
            return Module(f"{p}.{name}", p, (Tensor(f"{p}.{name}.weight", dtype, shape, kind, std=std),),
                          listed=listed and not mtp, mtp=mtp)

        def lin(name, k, n):
            return exl3_module(f"{p}.{name}", p, k, n, b, codebook, False, mtp)

        mods = []
        if mtp:
            mods += [dense("enorm", (H,), "norm"), dense("hnorm", (H,), "norm"), lin("eh_proj", 2 * H, H)]
        mods += [dense("input_layernorm", (H,), "norm"),
                 lin("self_attn.q_a_proj", H, ql), dense("self_attn.q_a_layernorm", (ql,), "norm"),
                 lin("self_attn.q_b_proj", ql, nh * (nope + rope)),
                 lin("self_attn.kv_a_proj_with_mqa", H, kvl + rope), dense("self_attn.kv_a_layernorm", (kvl,), "norm"),
                 dense("self_attn.kv_b_proj", (nh * (nope + vd), kvl), "normal", "F16", kvl ** -0.5, listed=False),
                 lin("self_attn.o_proj", nh * vd, H)]
        if dsa and (mtp or indexer[li] == "full"):      # "shared" layers reuse an earlier top-k: no indexer
            ih, ihd = cfg["index_n_heads"], cfg["index_head_dim"]
            ip = f"{p}.self_attn.indexer"
            mods += [lin("self_attn.indexer.wq_b", ql, ih * ihd),
                     dense("self_attn.indexer.wk", (ihd, H), "normal", "F16", H ** -0.5),
                     Module(f"{ip}.k_norm", p, (Tensor(f"{ip}.k_norm.bias", "F16", (ihd,), "normal", std=0.02),
                                                Tensor(f"{ip}.k_norm.weight", "F16", (ihd,), "norm16")),
                            listed=not mtp, mtp=mtp),
                     dense("self_attn.indexer.weights_proj", (ih, H), "normal", "F16", H ** -0.5)]
        mods.append(dense("post_attention_layernorm", (H,), "norm"))
        if not mtp and li < cfg["first_k_dense_replace"]:
            mods += [lin("mlp.up_proj", H, Id), lin("mlp.gate_proj", H, Id), lin("mlp.down_proj", Id, H)]
        else:
            mods += moe_modules(p, lin, cfg, H, Im, Is, mtp=mtp)
        if mtp:
            mods.append(dense("shared_head.norm", (H,), "norm"))
        return mods

    mods = [Module("model.embed_tokens", "model.embed_tokens", (Tensor("model.embed_tokens.weight", "BF16", (V, H), "embed"),))]
    for li in range(L):
        mods += layer(li, False)
    mods.append(Module("model.norm", "model.norm", (Tensor("model.norm.weight", "BF16", (H,), "norm"),)))
    mods.append(exl3_module("lm_head", "lm_head", H, V, head_bits, codebook, False))
    for li in range(L, L + int(cfg.get("num_nextn_predict_layers") or 0)):
        mods += layer(li, True)
    return mods


FAMILY_ORDER = ("embed", "attention", "dense_mlp", "experts", "shared_experts", "router", "norms", "head", "mtp")


def family_bytes(mods: list[Module]) -> dict[str, int]:
    """Tensor bytes per family (the --dry-run breakdown)."""
    out = dict.fromkeys(FAMILY_ORDER, 0)
    for m in mods:
        n = sum(t.nbytes for t in m.tensors)
        fam = ("mtp" if m.mtp else "embed" if m.key == "model.embed_tokens" else "head" if m.key == "lm_head"
               else "experts" if ".mlp.experts." in m.key else "shared_experts" if ".shared_experts." in m.key
               else "router" if m.key.endswith(".mlp.gate") else "attention" if ".self_attn." in m.key
               and m.tensors[0].kind != "norm" else "dense_mlp" if ".mlp." in m.key else "norms")
        out[fam] += n
    return out


def shard_plan(mods: list[Module], shard_bytes: int) -> list[list[Module]]:
    """Pack whole top-level modules in order into shards of at most shard_bytes (an oversized
    module gets its own shard), as exllamav3's compile does."""
    tops: list[list[Module]] = []
    for m in mods:
        if tops and tops[-1][0].top == m.top:
            tops[-1].append(m)
        else:
            tops.append([m])
    shards: list[list[Module]] = [[]]
    size = 0
    for group in tops:
        gb = sum(t.nbytes for m in group for t in m.tensors)
        if shards[-1] and size + gb > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].extend(group)
        size += gb
    return shards


def tensor_storage(mods: list[Module]) -> dict:
    torch_dtype = {"I16": "torch.int16", "F16": "torch.float16", "BF16": "torch.bfloat16", "I32": "torch.int32",
                   "F32": "torch.float32"}
    out = {}
    for m in mods:
        if not m.listed:
            continue
        entry: dict = {"stored_tensors": {t.name: {"shape": list(t.shape), "n_bytes": t.nbytes,
                                                    "dtype": torch_dtype[t.dtype]} for t in m.tensors}}
        if m.bits is not None:
            entry["quant_format"] = "exl3"
            entry["bits_per_weight"] = int(m.bits) if m.bits == int(m.bits) else m.bits
            if m.codebook in MARKERS:
                entry[MULTIPLIER_KEY[m.codebook]] = MARKERS[m.codebook]
        out[m.key] = entry
    return out


# ------------------------------------------------------------------ data
class Source:
    """Random tensor bytes: SFC64 (~3 GB/s per core), chunked so memory stays bounded."""

    CHUNK = 64 << 20

    def __init__(self, seed):
        self.rng = np.random.Generator(np.random.SFC64(seed))   # an int or a sequence: (seed, shard)

    def u16(self, n: int) -> np.ndarray:
        return self.rng.integers(0, 1 << 16, size=n, dtype=np.uint16)

    def chunks(self, t: Tensor, k_in: int = 0):
        n = math.prod(t.shape)
        if t.kind == "trellis":
            done = 0
            while done < n:                 # raw random bits: every pattern is a valid trellis
                m = min(self.CHUNK // 2, n - done)
                yield self.u16(m)
                done += m
        elif t.kind == "embed":             # bf16 ±[2^-7, 2^-5): sign, exponent 120/121, random mantissa
            done = 0
            while done < n:
                m = min(self.CHUNK // 2, n - done)
                r = self.u16(m)
                yield (r & 0x807F) | ((120 + ((r >> 7) & 1)).astype(np.uint16) << 7)
                done += m
        elif t.kind == "norm":              # bf16 1.0 .. 1.12
            yield (0x3F80 | (self.u16(n) & 0x000F)).astype(np.uint16)
        elif t.kind == "zero":              # --flat-logits: the norms before lm_head
            yield np.zeros(n, dtype=np.uint16)
        elif t.kind == "norm16":            # fp16 1.0 .. 1.12 (DSA indexer k_norm, a LayerNorm)
            yield (1.0 + (self.u16(n) & 0x000F) / 128).astype(np.float16)
        elif t.kind == "normal":            # fp16 N(0, std^2): kv_b_proj, indexer wk / weights_proj / k_norm bias
            yield (self.rng.standard_normal(n, dtype=np.float32) * t.std).astype(np.float16)
        elif t.kind == "suh":               # ±1
            yield np.where(self.u16(n) & 1, 1.0, -1.0).astype(np.float16)
        elif t.kind == "svh":               # ±1/sqrt(k); exactly 0 on padded output columns
            v = np.where(self.u16(n) & 1, 1.0, -1.0) / math.sqrt(k_in)
            v[t.real:] = 0.0
            yield v.astype(np.float16)
        elif t.kind == "bias":
            v = self.rng.standard_normal(n, dtype=np.float32) * 0.02
            v[t.real:] = 0.0
            yield v.astype(np.float16)
        elif t.kind == "marker":
            yield np.array(MARKERS[t.name.rsplit(".", 1)[1]], dtype=np.uint32).view(np.int32)
        elif t.kind == "router":
            yield (self.rng.standard_normal(n, dtype=np.float32) * 0.02).astype(np.float16)
        elif t.kind == "score_bias":
            yield self.rng.standard_normal(n, dtype=np.float32) * 0.01
        elif t.kind == "score_rank":        # --decisive-router: 2 x a permutation of the experts
            yield (2.0 * self.rng.permutation(n)).astype(np.float32)
        else:  # pragma: no cover
            raise ValueError(t.kind)


def build_plan(*, arch: str = "glm4_moe", layers: int | None = None, dense_layers: int | None = None,
               experts: int | None = None, bits: float = 3, head_bits: float = 6, mtp_bits: float = 4,
               mtp: bool = True, index_share: bool = False, grouped_routing: bool = False, codebook: str = "mul1",
               small: bool = False, dims: dict | None = None, flat_logits: bool = False,
               decisive_router: bool = False, heads: int | None = None) -> tuple[dict, dict, list[Module]]:
    """(config.json, quantization_config, leaf modules): the checkpoint as a value, nothing written.
    ``mtp``, ``mtp_bits``: glm5 / deepseek_v3 only (glm4_moe gets no MTP layer, as the fixture).
    ``flat_logits``: the norms before lm_head (``model.norm``, the MTP head's ``shared_head.norm``)
    are zero, so every logit is exactly 0: greedy decoding yields token 0 from the model and its MTP
    head alike and sampling is uniform under both, so every draft is accepted. The weights and the
    work per token are as without it: the upper bound of what MTP drafts can buy in serve, where a
    random head accepts nothing. ``decisive_router``: each MoE layer's score-correction bias is 2 x
    a permutation of its experts, so the choice (sigmoid scores in (0, 1) plus the bias) is always
    the top_k experts of largest bias, at least 1 apart from the next: no routing near-ties for GPU
    sums to flip (the --small DeepSeek-V3's 4th and 5th expert were 2.4e-5 apart on the CPU; GPU
    tests comparing two loads token by token failed on it). The combine weights stay the sigmoid
    scores, unbiased. ``heads``: glm5 / deepseek_v3 attention heads instead of the model's (a
    tensor-parallel rank's share, e.g. GLM-5's 64 / 4 = 16: its attention shapes on one GPU)."""
    if arch not in ARCHS:
        raise SystemExit(f"unknown --arch {arch!r} (one of {', '.join(ARCHS)})")
    a = ARCHS[arch]
    if codebook not in ("mul1", "mcg", "3inst"):
        raise SystemExit(f"unknown codebook {codebook!r}")
    for b in (bits, head_bits, mtp_bits):
        if b not in (1, 2, 3, 4, 5, 6, 7, 8, 1.5, 2.5, 3.5) or (b != int(b) and codebook != "mul1"):
            raise SystemExit(f"bits {b}: need 1..8, or 1.5/2.5/3.5 with mul1")
    if index_share and arch != "glm5":
        raise SystemExit("--index-share is a glm5 option (GLM-5.2's shared DSA indexers)")
    if grouped_routing and arch != "deepseek_v3":
        raise SystemExit("--grouped-routing is a deepseek_v3 option (GLM-5 routes with n_group 1)")
    layers = a.layers if layers is None else layers
    dense_layers = (a.small_dense if small else a.dense_layers) if dense_layers is None else dense_layers
    if layers < 1 or not 0 <= dense_layers <= layers:
        raise SystemExit("--layers must be >= 1 and --dense-layers within 0..--layers")
    d = dims or (a.small if small else a.full)
    if heads is not None:
        if arch == "glm4_moe" or heads < 1:
            raise SystemExit("--heads is a glm5 / deepseek_v3 option (MLA heads, >= 1)")
        d = {**d, "num_attention_heads": heads}
    qcfg = {"quant_method": "exl3", "version": VERSION, "bits": float(bits), "head_bits": head_bits,
            "calibration": {"rows": 250, "cols": 2048}, "out_scales": "auto", "codebook": codebook}
    if arch == "glm4_moe":
        cfg = make_config(d, layers, dense_layers, experts)
    else:
        cfg = make_mla_config(arch, d, layers, dense_layers, experts, mtp=mtp, index_share=index_share,
                              grouped_routing=grouped_routing)
        if mtp:
            qcfg["mtp_bits"] = mtp_bits         # compile.py writes it whenever an MTP model is converted
    mods = plan(cfg, bits, head_bits, codebook, mtp_bits)
    if decisive_router:
        mods = _retag(mods, lambda t: t.kind == "score_bias", "score_rank")
    if flat_logits:
        heads = ("model.norm.weight", "shared_head.norm.weight")
        mods = _retag(mods, lambda t: t.name.endswith(heads), "zero")
    return cfg, qcfg, mods


def _retag(mods: list[Module], pick, kind: str) -> list[Module]:
    """``mods`` with every tensor ``pick(t)`` selects generated as ``kind`` instead."""
    return [dataclasses.replace(m, tensors=tuple(dataclasses.replace(t, kind=kind) if pick(t) else t
                                                 for t in m.tensors)) for m in mods]


def write_checkpoint(out: Path, *, shard_mb: int = 2048, seed: int = 0, progress: bool = False,
                     sparse: bool = False, dry_run: bool = False, jobs: int = 1, **opts) -> dict:
    """Write the checkpoint into ``out``; returns a summary (files, bytes, bytes per family, seconds).
    ``opts`` are build_plan's; ``dims`` overrides the arch's full / small dimension set (tests rebuild
    the fixtures' dims with it). ``sparse``: headers only, the tensor data a hole (zeros, no disk): a
    checkpoint larger than any GPU for the plan/preflight tests, which read headers only; not one to
    run. ``dry_run``: the summary only, nothing written. ``jobs``: shards written in parallel processes
    (the bytes are the same for any value)."""
    t0 = time.time()
    cfg, qcfg, mods = build_plan(**opts)
    shards = shard_plan(mods, shard_mb << 20)
    n = len(shards)
    names = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05}-of-{n:05}.safetensors" for i in range(n)]
    summary = {"path": str(out), "architecture": cfg["architectures"][0], "files": names,
               "bytes": sum(t.nbytes for m in mods for t in m.tensors), "families": family_bytes(mods),
               "linears": sum(m.bits is not None for m in mods),
               "mtp_layers": len({m.top for m in mods if m.mtp})}
    if dry_run:
        return {**summary, "seconds": 0.0, "dry_run": True}
    out.mkdir(parents=True, exist_ok=True)
    for old in list(out.glob("model*.safetensors")) + [out / "model.safetensors.index.json"]:
        old.unlink(missing_ok=True)
    weight_map, total = {}, 0
    work = [(out / fname, shard, (seed, i), sparse) for i, (fname, shard) in enumerate(zip(names, shards, strict=True))]
    jobs = max(1, min(int(jobs or 1), n))
    # shards are independent (each has its own random stream, seeded by (seed, shard index)): the
    # bytes do not depend on --jobs, and processes write them side by side (RNG + sha256 + disk per core)
    if jobs == 1:
        done = map(_write_shard, work)
    else:
        import concurrent.futures as cf
        import multiprocessing as mp

        pool = cf.ProcessPoolExecutor(jobs, mp_context=mp.get_context("fork"))
        done = pool.map(_write_shard, work)
    try:
        for (path, shard, _, _), size in zip(work, done, strict=True):
            weight_map.update((t.name, path.name) for m in shard for t in m.tensors)
            total += sum(t.nbytes for m in shard for t in m.tensors)
            if progress and not sparse:
                print(f"  {path.name}: {size / 1e9:.2f} GB ({time.time() - t0:.1f} s)", flush=True)
    finally:
        if jobs > 1:
            pool.shutdown(cancel_futures=True)
    _write_tokenizer(out, cfg["vocab_size"])
    write_atomic(out / "quantization_config.json", json_bytes({**qcfg, "tensor_storage": tensor_storage(mods)}, 4))
    if n > 1:
        write_atomic(out / "model.safetensors.index.json", index_json(weight_map, total))
    write_atomic(out / "config.json", json_bytes({**cfg, "quantization_config": qcfg}, 4))  # last: the manifest
    fsync_dir(out)
    assert total == summary["bytes"]
    return {**summary, "seconds": round(time.time() - t0, 2)}


def _write_shard(job: tuple) -> int:
    """One shard file: (path, modules, seed, sparse) -> its size in bytes (temp name, then rename)."""
    path, shard, seed, sparse = job
    tensors = [t for m in shard for t in m.tensors]
    if sparse:
        head, offsets = header_bytes([(t.name, t.dtype, t.shape) for t in tensors])
        with open(path, "wb") as f:
            f.write(head)
            f.truncate(len(head) + (offsets[-1][1] if offsets else 0))
        return len(head) + (offsets[-1][1] if offsets else 0)
    src = Source(seed)
    w = ShardWriter(path, [(t.name, t.dtype, t.shape) for t in tensors])
    try:
        for m in shard:
            k_in = next((t.shape[0] for t in m.tensors if t.kind == "suh"), 0)
            for t in m.tensors:
                for arr in src.chunks(t, k_in):
                    w.write(arr.tobytes() if arr.ndim == 0 else memoryview(np.ascontiguousarray(arr)))
    except BaseException:
        w.abort()
        raise
    return w.close()[0]


def _write_tokenizer(out: Path, vocab_size: int) -> None:
    src = next((d for d in TOKENIZER_SOURCES if (d / "tokenizer.json").is_file()), None)
    if src is None:
        raise SystemExit(f"no tokenizer source found (looked in {', '.join(map(str, TOKENIZER_SOURCES))})")
    for f in ("tokenizer_config.json", "generation_config.json"):
        shutil.copyfile(src / f, out / f)
    tok = json.loads((src / "tokenizer.json").read_text(encoding="utf-8"))
    vocab = tok["model"]["vocab"]
    for i in range(len(vocab), vocab_size):
        vocab[f"<|synth_{i}|>"] = i
    write_atomic(out / "tokenizer.json", json.dumps(tok, ensure_ascii=False).encode())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--arch", default="glm4_moe", choices=tuple(ARCHS),
                    help="glm4_moe (GLM-4.5-Air), glm5 (glm_moe_dsa), deepseek_v3")
    ap.add_argument("--layers", type=int, default=None,
                    help="decoder layers, MTP layer not counted (default 6; --small: 3, or 4 for glm5/deepseek_v3)")
    ap.add_argument("--dense-layers", type=int, default=None,
                    help="first_k_dense_replace (default 1; 3 for glm5/deepseek_v3, 1 with --small)")
    ap.add_argument("--experts", type=int, default=None, help="routed experts (default 128 / 256; 16 with --small)")
    ap.add_argument("--bits", type=float, default=3)
    ap.add_argument("--head-bits", type=float, default=6)
    ap.add_argument("--mtp-bits", type=float, default=4, help="MTP layer K (glm5/deepseek_v3; converter default 4)")
    ap.add_argument("--no-mtp", action="store_true", help="glm5/deepseek_v3: write no MTP layer")
    ap.add_argument("--index-share", action="store_true",
                    help="glm5: GLM-5.2's IndexShare indexer_types (full/shared) instead of all full")
    ap.add_argument("--grouped-routing", action="store_true",
                    help="deepseek_v3: n_group 8 / topk_group 4 as DeepSeek-V3 (our runtime and exllamav3 refuse it)")
    ap.add_argument("--flat-logits", action="store_true",
                    help="zero norms before lm_head: every logit 0, every MTP draft accepted (MTP's upper bound)")
    ap.add_argument("--decisive-router", action="store_true",
                    help="score-correction bias 2 x a permutation of the experts: a fixed top-k a layer, no routing ties")
    ap.add_argument("--codebook", default="mul1", choices=("mul1", "mcg", "3inst"))
    ap.add_argument("--heads", type=int, default=None,
                    help="glm5/deepseek_v3: attention heads instead of the model's (a tensor-parallel rank's "
                         "share on one GPU, e.g. 16 = GLM-5 at TP 4)")
    ap.add_argument("--shard-mb", type=int, default=2048, help="max shard size in MiB (whole layers per shard)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jobs", type=int, default=min(8, os.cpu_count() or 1),
                    help="shards written in parallel processes (default: min(8, cores)); same bytes for any value")
    ap.add_argument("--small", action="store_true", help="tiny same-architecture variant for CPU tests")
    ap.add_argument("--sparse", action="store_true", help="headers only, data left as holes (plan tests)")
    ap.add_argument("--dry-run", action="store_true", help="print the sizes and write nothing")
    a = ap.parse_args(argv)
    num = lambda x: int(x) if x == int(x) else x  # noqa: E731
    arch = ARCHS[a.arch]
    s = write_checkpoint(a.out, arch=a.arch, layers=a.layers or (arch.small_layers if a.small else arch.layers),
                         dense_layers=a.dense_layers, experts=a.experts, bits=num(a.bits), head_bits=num(a.head_bits),
                         mtp_bits=num(a.mtp_bits), mtp=not a.no_mtp, index_share=a.index_share,
                         grouped_routing=a.grouped_routing, codebook=a.codebook, small=a.small, shard_mb=a.shard_mb,
                         flat_logits=a.flat_logits, decisive_router=a.decisive_router, heads=a.heads,
                         seed=a.seed, progress=True, sparse=a.sparse, dry_run=a.dry_run, jobs=a.jobs)
    fams = ", ".join(f"{k} {v / 1e9:.3f}" for k, v in s["families"].items() if v)
    verb = "would write" if a.dry_run else "wrote"
    print(f"{verb} {s['path']}: {s['architecture']}, {len(s['files'])} file(s), {s['bytes'] / 1e9:.3f} GB tensor data "
          f"({fams} GB), {s['linears']} EXL3 linears, {s['mtp_layers']} MTP layer(s), {s['seconds']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

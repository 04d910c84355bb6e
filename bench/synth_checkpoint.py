"""Write a synthetic EXL3 checkpoint with GLM-4.5-Air dimensions (random trellis, valid structure).

    python3 bench/synth_checkpoint.py OUT_DIR [--layers 6] [--dense-layers 1] [--experts 128]
        [--bits 3] [--head-bits 6] [--codebook mul1] [--shard-mb 2048] [--seed 0] [--small]

Any int16 bit pattern is a valid trellis (exl3-format.md §3.5), so random bytes decode to valid
weights: this is the model the end-to-end decode benchmark (bench/gpu_e2e_model.py) loads into
exllamav3 1.6.5 and into our runtime. Layout copies fixture glm4_moe-3.0bpw-mcg, written by
exllamav3 1.6.5's converter: tensor names, dtypes and shapes, the tensor_storage map of
quantization_config.json, module-granular shards (`model-0000i-of-0000N.safetensors` + index).

- EXL3 linears: trellis I16 [k/16, n/16, 16K], suh/svh F16, marker I32 0-d (none for 3inst),
  q/k/v bias F16. suh = ±1, svh = ±1/sqrt(k) (the quantizer folds every scale into these; this
  keeps activations O(1) so exllamav3's fp16 path neither overflows nor flattens); svh = 0 on
  padded output columns (dense intermediate 10944 -> 11008).
- embed_tokens / norms BF16, router F16 [E, H], e_score_correction_bias F32 [E].
- Memory is bounded: tensors are generated per linear (largest: lm_head, ~470 MB at K=6) and
  streamed through ShardWriter; nothing is held per shard. Random bytes come from numpy SFC64.
- tokenizer.json / tokenizer_config.json / generation_config.json come from the fixture; its
  2048-entry vocabulary is padded with `<|synth_i|>` tokens up to vocab_size so every sampled id
  decodes (exllamav3's Generator streams text).
"""

from __future__ import annotations

import argparse
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

# tokenizer source: the shared fixture (EXL3TOOLS_FIXTURES honoured, as tests/conftest.py), else the
# byte-identical copy tracked under demo/ (the device machine has no ../shared)
_FIXTURES = Path(os.environ.get("EXL3TOOLS_FIXTURES", REPO.parent / "shared" / "fixtures"))
TOKENIZER_SOURCES = (_FIXTURES / "glm4_moe-3.0bpw-mcg" / "model", REPO / "demo" / "glm4_moe-3.0bpw-mcg" / "model")
MARKERS = {"mul1": 0x83DCD12D, "mcg": 0xCBAC1FED}          # exl3-format.md §3.3
MULTIPLIER_KEY = {"mul1": "mul1_multiplier", "mcg": "mcg_multiplier"}
VERSION = "1.6.5"

# GLM-4.5-Air (zai-org/GLM-4.5-Air config.json), trunk only
AIR = dict(hidden_size=4096, num_attention_heads=96, num_key_value_heads=8, head_dim=128,
           intermediate_size=10944, moe_intermediate_size=1408, n_routed_experts=128,
           num_experts_per_tok=8, n_shared_experts=1, vocab_size=151552, rope_theta=1000000.0,
           routed_scaling_factor=1.0, max_position_embeddings=131072)
# tiny same-architecture variant for CPU tests (vocab = the fixture tokenizer's 2048;
# dense width 320 pads to 384, so the padded-column path is exercised like 10944 -> 11008)
SMALL = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
             intermediate_size=320, moe_intermediate_size=128, n_routed_experts=16,
             num_experts_per_tok=4, n_shared_experts=1, vocab_size=2048, rope_theta=10000.0,
             routed_scaling_factor=2.5, max_position_embeddings=4096)


def pad128(x: int) -> int:
    return -(-x // 128) * 128


def make_config(dims: dict, layers: int, dense_layers: int, experts: int | None) -> dict:
    """config.json (before quantization_config), in the fixture's transformers-5 form."""
    d = dict(dims)
    if experts is not None:
        d["n_routed_experts"] = experts
    d["num_experts_per_tok"] = min(d["num_experts_per_tok"], d["n_routed_experts"])
    return {
        "architectures": ["Glm4MoeForCausalLM"],
        "attention_bias": True,
        "attention_dropout": 0.0,
        "bos_token_id": 1,
        "dtype": "bfloat16",
        "eos_token_id": 2,
        "first_k_dense_replace": dense_layers,
        "head_dim": d["head_dim"],
        "hidden_act": "silu",
        "hidden_size": d["hidden_size"],
        "initializer_range": 0.02,
        "intermediate_size": d["intermediate_size"],
        "max_position_embeddings": d["max_position_embeddings"],
        "model_type": "glm4_moe",
        "moe_intermediate_size": d["moe_intermediate_size"],
        "n_group": 1,
        "n_routed_experts": d["n_routed_experts"],
        "n_shared_experts": d["n_shared_experts"],
        "norm_topk_prob": True,
        "num_attention_heads": d["num_attention_heads"],
        "num_experts_per_tok": d["num_experts_per_tok"],
        "num_hidden_layers": layers,
        "num_key_value_heads": d["num_key_value_heads"],
        "num_nextn_predict_layers": 0,   # no MTP layer is written
        "pad_token_id": 0,
        "partial_rotary_factor": 0.5,
        "rms_norm_eps": 1e-05,
        "rope_parameters": {"partial_rotary_factor": 0.5, "rope_theta": d["rope_theta"], "rope_type": "default"},
        "routed_scaling_factor": d["routed_scaling_factor"],
        "tie_word_embeddings": False,
        "topk_group": 1,
        "transformers_version": "5.17.0",
        "use_cache": True,
        "use_qk_norm": False,
        "vocab_size": d["vocab_size"],
    }


# ------------------------------------------------------------------ plan
@dataclass(frozen=True, slots=True)
class Tensor:
    name: str
    dtype: str                 # safetensors dtype
    shape: tuple[int, ...]
    kind: str                  # trellis | suh | svh | bias | marker | embed | norm | router | score_bias
    real: int = 0              # svh: real out width (columns past it are 0)

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


def exl3_module(key: str, top: str, k_real: int, n_real: int, bits: float, codebook: str, bias: bool) -> Module:
    k, n = pad128(k_real), pad128(n_real)
    width = int(round(16 * bits)) if bits == int(bits) else 16 * int(bits) + 8
    ts = [Tensor(f"{key}.suh", "F16", (k,), "suh"), Tensor(f"{key}.svh", "F16", (n,), "svh", real=n_real)]
    if bias:
        ts.append(Tensor(f"{key}.bias", "F16", (n,), "bias", real=n_real))
    if codebook in MARKERS:
        ts.append(Tensor(f"{key}.{codebook}", "I32", (), "marker"))
    ts.append(Tensor(f"{key}.trellis", "I16", (k // 16, n // 16, width), "trellis"))
    return Module(key, top, tuple(ts), bits, codebook)


def plan(cfg: dict, bits: float, head_bits: float, codebook: str) -> list[Module]:
    """Every leaf module in the converter's order (fixture tensor_storage order)."""
    H, V = cfg["hidden_size"], cfg["vocab_size"]
    nq, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    E, Im, Id = cfg["n_routed_experts"], cfg["moe_intermediate_size"], cfg["intermediate_size"]
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
        mods.append(Module(f"{p}.mlp.gate", p, (Tensor(f"{p}.mlp.gate.e_score_correction_bias", "F32", (E,), "score_bias"),
                                                Tensor(f"{p}.mlp.gate.weight", "F16", (E, H), "router"))))
        for e in range(E):
            mods += [lin(f"mlp.experts.{e}.up_proj", H, Im), lin(f"mlp.experts.{e}.gate_proj", H, Im),
                     lin(f"mlp.experts.{e}.down_proj", Im, H)]
        if cfg["n_shared_experts"]:
            mods += [lin("mlp.shared_experts.up_proj", H, Is), lin("mlp.shared_experts.gate_proj", H, Is),
                     lin("mlp.shared_experts.down_proj", Is, H)]
    mods.append(Module("model.norm", "model.norm", (Tensor("model.norm.weight", "BF16", (H,), "norm"),)))
    mods.append(exl3_module("lm_head", "lm_head", H, V, head_bits, codebook, False))
    return mods


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

    def __init__(self, seed: int):
        self.rng = np.random.Generator(np.random.SFC64(seed))

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
        else:  # pragma: no cover
            raise ValueError(t.kind)


def write_checkpoint(out: Path, *, layers: int = 6, dense_layers: int = 1, experts: int | None = None,
                     bits: float = 3, head_bits: float = 6, codebook: str = "mul1", small: bool = False,
                     shard_mb: int = 2048, seed: int = 0, progress: bool = False, dims: dict | None = None,
                     sparse: bool = False) -> dict:
    """Write the checkpoint into ``out``; returns a summary (files, bytes, seconds). ``dims``
    overrides the AIR / SMALL dimension set (tests rebuild the fixture's dims with it). ``sparse``:
    headers only, the tensor data a hole (zeros, no disk): a checkpoint larger than any GPU for the
    plan/preflight tests, which read headers only; not one to run."""
    if codebook not in ("mul1", "mcg", "3inst"):
        raise SystemExit(f"unknown codebook {codebook!r}")
    for b in (bits, head_bits):
        if b not in (1, 2, 3, 4, 5, 6, 7, 8, 1.5, 2.5, 3.5) or (b != int(b) and codebook != "mul1"):
            raise SystemExit(f"bits {b}: need 1..8, or 1.5/2.5/3.5 with mul1")
    if not 0 <= dense_layers <= layers:
        raise SystemExit("--dense-layers must be within 0..--layers")
    t0 = time.time()
    cfg = make_config(dims or (SMALL if small else AIR), layers, dense_layers, experts)
    qcfg = {"quant_method": "exl3", "version": VERSION, "bits": float(bits), "head_bits": head_bits,
            "calibration": {"rows": 250, "cols": 2048}, "out_scales": "auto", "codebook": codebook}
    mods = plan(cfg, bits, head_bits, codebook)
    shards = shard_plan(mods, shard_mb << 20)
    out.mkdir(parents=True, exist_ok=True)
    for old in list(out.glob("model*.safetensors")) + [out / "model.safetensors.index.json"]:
        old.unlink(missing_ok=True)
    src = Source(seed)
    n = len(shards)
    names = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05}-of-{n:05}.safetensors" for i in range(n)]
    weight_map, total = {}, 0
    for fname, shard in zip(names, shards, strict=True):
        tensors = [t for m in shard for t in m.tensors]
        if sparse:
            head, offsets = header_bytes([(t.name, t.dtype, t.shape) for t in tensors])
            with open(out / fname, "wb") as f:
                f.write(head)
                f.truncate(len(head) + (offsets[-1][1] if offsets else 0))
            weight_map.update((t.name, fname) for t in tensors)
            total += sum(t.nbytes for t in tensors)
            continue
        w = ShardWriter(out / fname, [(t.name, t.dtype, t.shape) for t in tensors])
        try:
            for m in shard:
                k_in = next((t.shape[0] for t in m.tensors if t.kind == "suh"), 0)
                for t in m.tensors:
                    for arr in src.chunks(t, k_in):
                        w.write(arr.tobytes() if arr.ndim == 0 else memoryview(np.ascontiguousarray(arr)))
                    weight_map[t.name] = fname
        except BaseException:
            w.abort()
            raise
        size, _ = w.close()
        total += sum(t.nbytes for t in tensors)
        if progress:
            print(f"  {fname}: {size / 1e9:.2f} GB ({time.time() - t0:.1f} s)", flush=True)
    _write_tokenizer(out, cfg["vocab_size"])
    write_atomic(out / "quantization_config.json", json_bytes({**qcfg, "tensor_storage": tensor_storage(mods)}, 4))
    if n > 1:
        write_atomic(out / "model.safetensors.index.json", index_json(weight_map, total))
    write_atomic(out / "config.json", json_bytes({**cfg, "quantization_config": qcfg}, 4))  # last: the manifest
    fsync_dir(out)
    return {"path": str(out), "files": names, "bytes": total, "seconds": round(time.time() - t0, 2),
            "linears": sum(m.bits is not None for m in mods)}


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
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default 6; 3 with --small)")
    ap.add_argument("--dense-layers", type=int, default=1)
    ap.add_argument("--experts", type=int, default=None, help="routed experts (default 128; 16 with --small)")
    ap.add_argument("--bits", type=float, default=3)
    ap.add_argument("--head-bits", type=float, default=6)
    ap.add_argument("--codebook", default="mul1", choices=("mul1", "mcg", "3inst"))
    ap.add_argument("--shard-mb", type=int, default=2048, help="max shard size in MiB (whole layers per shard)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--small", action="store_true", help="tiny same-architecture variant for CPU tests")
    ap.add_argument("--sparse", action="store_true", help="headers only, data left as holes (plan tests)")
    a = ap.parse_args(argv)
    num = lambda x: int(x) if x == int(x) else x  # noqa: E731
    s = write_checkpoint(a.out, layers=a.layers or (3 if a.small else 6), dense_layers=a.dense_layers,
                         experts=a.experts, bits=num(a.bits), head_bits=num(a.head_bits), codebook=a.codebook,
                         small=a.small, shard_mb=a.shard_mb, seed=a.seed, progress=True, sparse=a.sparse)
    print(f"wrote {s['path']}: {len(s['files'])} file(s), {s['bytes'] / 1e9:.3f} GB tensor data, "
          f"{s['linears']} EXL3 linears, {s['seconds']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

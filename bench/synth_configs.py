"""The model shapes bench/synth_checkpoint.py writes: the real configs' dimensions (GLM-4.5-Air,
GLM-5, DeepSeek-V3) and tiny same-architecture variants for CPU tests, per --arch, and the
config.json each checkpoint gets."""

from __future__ import annotations

from dataclasses import dataclass

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

# GLM-5 (zai-org/GLM-5 config.json, as mirrored by unsloth/GLM-5 and NeMo's GlmMoeDsaConfig
# defaults; GLM-5.1 and GLM-5.2 have the same shapes). Keys are config.json's.
GLM5 = dict(hidden_size=6144, num_attention_heads=64, q_lora_rank=2048, kv_lora_rank=512, qk_nope_head_dim=192,
            qk_rope_head_dim=64, v_head_dim=256, intermediate_size=12288, moe_intermediate_size=2048,
            n_routed_experts=256, num_experts_per_tok=8, n_shared_experts=1, index_n_heads=32, index_head_dim=128,
            index_topk=2048, vocab_size=154880, max_position_embeddings=202752, rms_norm_eps=1e-05,
            routed_scaling_factor=2.5, rope_parameters={"rope_theta": 1000000.0, "rope_type": "default"})
# the fixture's attention widths (latent 512, head dims 192/64/256, indexer 4 x 128) on a tiny body;
# index_topk 32 so a 40-token prompt already takes the sparse path
GLM5_SMALL = dict(GLM5, hidden_size=256, num_attention_heads=4, q_lora_rank=256, intermediate_size=256,
                  moe_intermediate_size=128, n_routed_experts=16, num_experts_per_tok=4, index_n_heads=4,
                  index_topk=32, vocab_size=2048, max_position_embeddings=4096)
# DeepSeek-V3 (deepseek-ai/DeepSeek-V3 config.json; rope_scaling in transformers-5 form)
DSV3 = dict(hidden_size=7168, num_attention_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
            qk_rope_head_dim=64, v_head_dim=128, intermediate_size=18432, moe_intermediate_size=2048,
            n_routed_experts=256, num_experts_per_tok=8, n_shared_experts=1, n_group=8, topk_group=4,
            vocab_size=129280, max_position_embeddings=163840, rms_norm_eps=1e-06, routed_scaling_factor=2.5,
            rope_parameters={"rope_theta": 10000.0, "rope_type": "yarn", "factor": 40.0,
                             "original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0,
                             "mscale": 1.0, "mscale_all_dim": 1.0})
DSV3_SMALL = dict(DSV3, hidden_size=256, num_attention_heads=4, q_lora_rank=256, intermediate_size=512,
                  moe_intermediate_size=128, n_routed_experts=16, num_experts_per_tok=4, vocab_size=2048)


@dataclass(frozen=True, slots=True)
class Arch:
    model_type: str
    full: dict
    small: dict
    layers: int            # default num_hidden_layers (MTP layer not counted)
    dense_layers: int      # default first_k_dense_replace
    small_layers: int
    small_dense: int
    codebook: str = "mul1"


ARCHS = {
    "glm4_moe": Arch("glm4_moe", AIR, SMALL, 6, 1, 3, 1),
    "glm5": Arch("glm_moe_dsa", GLM5, GLM5_SMALL, 6, 3, 4, 1),
    "deepseek_v3": Arch("deepseek_v3", DSV3, DSV3_SMALL, 6, 3, 4, 1),
}


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


def index_share_types(n: int) -> list[str]:
    """GLM-5.2's IndexShare schedule (config.json indexer_types): "full" on layers 0-2 and on every
    4th layer from 2; the 3 layers after each reuse its top-k ("shared")."""
    return ["full" if i < 3 or i % 4 == 2 else "shared" for i in range(n)]


def make_mla_config(arch: str, dims: dict, layers: int, dense_layers: int, experts: int | None, *,
                    mtp: bool = True, index_share: bool = False, grouped_routing: bool = False) -> dict:
    """config.json (before quantization_config) for glm5 / deepseek_v3, in the fixtures' transformers-5
    form (same keys as glm5_moe_dsa-3.0bpw-mul1 / deepseek_v3-3.0bpw-3inst), real values from dims."""
    d = dict(dims)
    if experts is not None:
        d["n_routed_experts"] = experts
    d["num_experts_per_tok"] = min(d["num_experts_per_tok"], d["n_routed_experts"])
    nope, rope, nh = d["qk_nope_head_dim"], d["qk_rope_head_dim"], d["num_attention_heads"]
    groups = (d.get("n_group", 1), d.get("topk_group", 1)) if grouped_routing else (1, 1)
    if groups[0] > 1 and d["n_routed_experts"] % groups[0]:
        raise SystemExit(f"--experts {d['n_routed_experts']} is not a multiple of n_group {groups[0]}")
    cfg = {
        "architectures": ["GlmMoeDsaForCausalLM" if arch == "glm5" else "DeepseekV3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 1,                  # the fixture tokenizer's ids, not the real model's
        "dtype": "bfloat16",
        "eos_token_id": 2,
        "first_k_dense_replace": dense_layers,
        "head_dim": rope,                   # transformers: head_dim = qk_rope_head_dim for MLA
        "hidden_act": "silu",
        "hidden_size": d["hidden_size"],
        "initializer_range": 0.02,
        "intermediate_size": d["intermediate_size"],
        "kv_lora_rank": d["kv_lora_rank"],
        "max_position_embeddings": d["max_position_embeddings"],
        "model_type": ARCHS[arch].model_type,
        "moe_intermediate_size": d["moe_intermediate_size"],
        "n_group": groups[0],
        "n_routed_experts": d["n_routed_experts"],
        "n_shared_experts": d["n_shared_experts"],
        "norm_topk_prob": True,
        "num_attention_heads": nh,
        "num_experts_per_tok": d["num_experts_per_tok"],
        "num_hidden_layers": layers,
        "num_key_value_heads": nh,
        "num_nextn_predict_layers": 1 if mtp else 0,
        "pad_token_id": 0,
        "q_lora_rank": d["q_lora_rank"],
        "qk_head_dim": nope + rope,
        "qk_nope_head_dim": nope,
        "qk_rope_head_dim": rope,
        "rms_norm_eps": d["rms_norm_eps"],
        "rope_parameters": dict(d["rope_parameters"]),
        "routed_scaling_factor": d["routed_scaling_factor"],
        "tie_word_embeddings": False,
        "topk_group": groups[1],
        "transformers_version": "5.17.0",
        "use_cache": True,
        "v_head_dim": d["v_head_dim"],
        "vocab_size": d["vocab_size"],
    }
    if arch == "glm5":
        cfg |= {"index_head_dim": d["index_head_dim"], "index_n_heads": d["index_n_heads"],
                "index_topk": d["index_topk"],
                "indexer_types": index_share_types(layers) if index_share else ["full"] * layers,
                "layer_types": ["deepseek_sparse_attention"] * layers, "mlp_bias": False,
                "mlp_layer_types": ["dense" if i < dense_layers else "sparse" for i in range(layers)]}
    else:
        cfg |= {"pretraining_tp": 1, "rope_interleave": True}
    return dict(sorted(cfg.items()))

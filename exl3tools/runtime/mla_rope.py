"""RoPE of the MLA models (DeepSeek-V3, GLM-5): the inverse frequencies and YaRN factors from
config.json as exllamav3 reads them, and the interleaved (GPT-J) rotation the attention, its
latent cache and the DSA indexer apply (runtime/mla.py, runtime/dsa.py)."""

from __future__ import annotations

import math

import torch

from exl3tools.errors import UnsupportedArchitectureError


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def mla_rope(cfg: dict) -> tuple[torch.Tensor, float, float]:
    """(inv_freq over qk_rope_head_dim, cos/sin factor, softmax-scale factor) from config.json.

    Default rope, or YaRN as exllamav3 reads it for DeepSeek (util/rope.py: factor from
    max/original max positions when the latter is given; attn factor = the mscale ratio).
    """
    dim = int(cfg["qk_rope_head_dim"])
    rp = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    base = float(rp.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rtype = rp.get("rope_type", rp.get("type", "default")) or "default"
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    inv = 1.0 / pos_freqs
    if rtype == "default":
        return inv, 1.0, 1.0
    if rtype != "yarn":
        raise UnsupportedArchitectureError(f"MLA rope_type {rtype!r} is not supported")
    max_pos = int(cfg.get("max_position_embeddings") or 0)
    orig = rp.get("original_max_position_embeddings")
    factor = max_pos / int(orig) if orig is not None else float(rp["factor"])
    orig = int(orig) if orig is not None else max_pos
    beta_fast, beta_slow = float(rp.get("beta_fast", 32)), float(rp.get("beta_slow", 1))

    def corr(rot: float) -> float:
        return (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(base))

    lo, hi = corr(beta_fast), corr(beta_slow)
    if rp.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    if lo == hi:
        hi += 0.001
    ramp = (torch.arange(dim // 2, dtype=torch.float32) - lo) / (hi - lo)
    extrap = 1 - ramp.clamp(0, 1)
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrap) + inv * extrap
    ms, ms_all = rp.get("mscale"), rp.get("mscale_all_dim")
    if rp.get("attention_factor") is not None:
        attn = float(rp["attention_factor"])
    elif ms and ms_all:
        attn = yarn_get_mscale(factor, float(ms)) / yarn_get_mscale(factor, float(ms_all))
    else:
        attn = yarn_get_mscale(factor)
    sm = yarn_get_mscale(float(rp.get("factor", factor)), float(ms_all)) ** 2 if ms_all else 1.0
    return inv, attn, sm


def rope_gptj(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, attn: float = 1.0) -> torch.Tensor:
    """Interleaved rotation of the last dim of ``x`` (T, ..., d): pairs (2i, 2i+1) by pos*inv_freq[i]."""
    freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]          # (T, d/2)
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (freqs.shape[1],)
    return rotate_gptj(x, (freqs.cos() * attn).view(shape), (freqs.sin() * attn).view(shape))


def rotate_gptj(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``rope_gptj``'s rotation by given tables (broadcast against ``x``'s pairs): what
    kernels/fused_mla.py's references compute from the step's table."""
    x0, x1 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x0 * cos - x1 * sin, x1 * cos + x0 * sin), dim=-1).flatten(-2)

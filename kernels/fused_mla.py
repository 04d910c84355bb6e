"""Fused glue of the MLA attention in the fixed-shape decode step (DeepSeek-V3, GLM-5;
runtime/fused_step.py FusedMlaStep, the default on CUDA, EXL3TOOLS_FUSED_MLA=0 opts out): Triton
kernels plus torch references.

``MLAttention.decode_static`` spends ~52 small torch ops a layer at one row around its projections
and its attention kernel. Two kernels take most of them:

- ``latent_store``: the new rows' compressed KV ``lat[:, :C]`` through the kv_a RMSNorm and their
  rope key ``lat[:, C:C+R]`` through the interleaved (GPT-J) RoPE, both written into the paged
  planes at their slots (torch: a norm of 6 ops, a RoPE of ~11, two casts and two index_copy).
- ``rope_heads``: the queries' rope channels ``q[:, h, nope:nope+R]`` of every head, rotated, into
  a contiguous (T, H, R) fp32 tensor (torch: ~11 ops and a copy).
- ``index_key_store`` (DSA layers, GLM-5): the indexer key of each new row from its projection
  ``x @ wk.T``: fp16-rounded, LayerNorm (weight, bias), fp16-rounded, RoPE on its first R channels,
  fp16-rounded (runtime.dsa.Indexer.keys's roundings, which its top-k depends on), written into
  the ``kidx`` plane at its slot (torch: ~20 ops).
- ``index_queries`` (DSA layers past index_topk): the indexer's queries from their projection,
  fp16-rounded, each head's first R channels rotated and rounded again (Indexer.queries; ~10 ops).

Both take the step's rotation tables ``cos``/``sin`` (T, R / 2) already scaled by the attention
factor: ``kernels.fused_decode.rope_tables`` times ``attn_factor``, once per step for every layer
(the torch path computes them in every RoPE call, from the same torch ops: the angles are equal).
Rounding differs from the torch ops by fp32 ulps (the norm's sum in another order).
"""

from __future__ import annotations

import torch
from exl3tools.kernels.fused_decode import _pow2, _rows

try:
    import triton
    import triton.language as tl
except ImportError:   # runtime-only installs: the references still work
    triton = tl = None


if triton is not None:
    @triton.jit
    def _latent_store_kernel(lat_ptr, w_ptr, cos_ptr, sin_ptr, slot_ptr, ckv_ptr, kpe_ptr, C, eps,
                             slat, scs, sckv, skpe,
                             BC: tl.constexpr, RH: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        c = tl.arange(0, BC)
        m = c < C
        x = tl.load(lat_ptr + t * slat + c, mask=m, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, 0) / C + eps)
        w = tl.load(w_ptr + c, mask=m, other=0.0).to(tl.float32)
        tl.store(ckv_ptr + slot * sckv + c, (x * rstd * w).to(ckv_ptr.dtype.element_ty), mask=m)
        i = tl.arange(0, RH)
        x0 = tl.load(lat_ptr + t * slat + C + 2 * i).to(tl.float32)
        x1 = tl.load(lat_ptr + t * slat + C + 2 * i + 1).to(tl.float32)
        co = tl.load(cos_ptr + t * scs + i)
        si = tl.load(sin_ptr + t * scs + i)
        tl.store(kpe_ptr + slot * skpe + 2 * i, (x0 * co - x1 * si).to(kpe_ptr.dtype.element_ty))
        tl.store(kpe_ptr + slot * skpe + 2 * i + 1, (x1 * co + x0 * si).to(kpe_ptr.dtype.element_ty))

    @triton.jit
    def _rope_heads_kernel(q_ptr, cos_ptr, sin_ptr, o_ptr, nope, sq, sh, scs, so, soh, RH: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1).to(tl.int64)
        i = tl.arange(0, RH)
        base = q_ptr + t * sq + h * sh + nope
        x0 = tl.load(base + 2 * i).to(tl.float32)
        x1 = tl.load(base + 2 * i + 1).to(tl.float32)
        co = tl.load(cos_ptr + t * scs + i)
        si = tl.load(sin_ptr + t * scs + i)
        tl.store(o_ptr + t * so + h * soh + 2 * i, x0 * co - x1 * si)
        tl.store(o_ptr + t * so + h * soh + 2 * i + 1, x1 * co + x0 * si)


    @triton.jit
    def _index_key_kernel(k_ptr, w_ptr, b_ptr, cos_ptr, sin_ptr, slot_ptr, o_ptr, D, eps, sk, scs, so,
                          BD: tl.constexpr, RH: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        c = tl.arange(0, BD)
        m = c < D
        k = tl.load(k_ptr + t * sk + c, mask=m, other=0.0).to(tl.float32).to(tl.float16).to(tl.float32)
        mean = tl.sum(k, 0) / D
        d = tl.where(m, k - mean, 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(d * d, 0) / D + eps)
        w = tl.load(w_ptr + c, mask=m, other=0.0)
        b = tl.load(b_ptr + c, mask=m, other=0.0)
        y = (d * rstd * w + b).to(tl.float16).to(tl.float32)
        tl.store(o_ptr + slot * so + c, y.to(o_ptr.dtype.element_ty), mask=m & (c >= 2 * RH))
        # the rotated pairs: their normed values again from the loads (the same ops, element by element)
        i = tl.arange(0, RH)
        e0 = tl.load(k_ptr + t * sk + 2 * i).to(tl.float32).to(tl.float16).to(tl.float32)
        e1 = tl.load(k_ptr + t * sk + 2 * i + 1).to(tl.float32).to(tl.float16).to(tl.float32)
        y0 = ((e0 - mean) * rstd * tl.load(w_ptr + 2 * i) + tl.load(b_ptr + 2 * i)).to(tl.float16).to(tl.float32)
        y1 = ((e1 - mean) * rstd * tl.load(w_ptr + 2 * i + 1) + tl.load(b_ptr + 2 * i + 1)).to(tl.float16).to(tl.float32)
        co = tl.load(cos_ptr + t * scs + i)
        si = tl.load(sin_ptr + t * scs + i)
        r0 = (y0 * co - y1 * si).to(tl.float16).to(tl.float32)
        r1 = (y1 * co + y0 * si).to(tl.float16).to(tl.float32)
        tl.store(o_ptr + slot * so + 2 * i, r0.to(o_ptr.dtype.element_ty))
        tl.store(o_ptr + slot * so + 2 * i + 1, r1.to(o_ptr.dtype.element_ty))


    @triton.jit
    def _index_queries_kernel(q_ptr, cos_ptr, sin_ptr, o_ptr, D, sq, scs, so, soh,
                              BD: tl.constexpr, RH: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1).to(tl.int64)
        c = tl.arange(0, BD)
        m = (c < D) & (c >= 2 * RH)
        q = tl.load(q_ptr + t * sq + h * D + c, mask=m, other=0.0).to(tl.float32).to(tl.float16).to(tl.float32)
        tl.store(o_ptr + t * so + h * soh + c, q, mask=m)
        i = tl.arange(0, RH)
        x0 = tl.load(q_ptr + t * sq + h * D + 2 * i).to(tl.float32).to(tl.float16).to(tl.float32)
        x1 = tl.load(q_ptr + t * sq + h * D + 2 * i + 1).to(tl.float32).to(tl.float16).to(tl.float32)
        co = tl.load(cos_ptr + t * scs + i)
        si = tl.load(sin_ptr + t * scs + i)
        tl.store(o_ptr + t * so + h * soh + 2 * i, (x0 * co - x1 * si).to(tl.float16).to(tl.float32))
        tl.store(o_ptr + t * so + h * soh + 2 * i + 1, (x1 * co + x0 * si).to(tl.float16).to(tl.float32))


def _tables(cos: torch.Tensor, sin: torch.Tensor, T: int, R: int) -> None:
    if R % 2 or R // 2 != _pow2(R // 2):
        raise ValueError(f"the rope width must be an even power of two, got {R}")
    if cos.shape != (T, R // 2) or sin.shape != cos.shape or cos.stride() != sin.stride() or cos.stride(1) != 1 \
            or cos.dtype != torch.float32 or sin.dtype != torch.float32:
        raise ValueError(f"cos/sin must be fp32 ({T}, {R // 2}) of one layout, got {tuple(cos.shape)}")


def latent_store(lat: torch.Tensor, C: int, R: int, norm_w: torch.Tensor, eps: float, cos: torch.Tensor,
                 sin: torch.Tensor, slots: torch.Tensor, ckv_plane: torch.Tensor, kpe_plane: torch.Tensor) -> None:
    """``ckv_plane[slots[t]] = rmsnorm(lat[t, :C]) * norm_w`` and ``kpe_plane[slots[t]]`` = the
    GPT-J rotation of ``lat[t, C:C+R]`` by ``cos``/``sin`` (T, R / 2), each cast to its plane's dtype;
    lat (T, >= C + R) rows, planes (slots, C) and (slots, R) contiguous."""
    T = _rows(lat, "lat").shape[0]
    if lat.shape[1] < C + R:
        raise ValueError(f"lat {tuple(lat.shape)} is narrower than {C} + {R}")
    _tables(cos, sin, T, R)
    if ckv_plane.shape[1:] != (C,) or kpe_plane.shape[1:] != (R,) or not (ckv_plane.is_contiguous()
                                                                           and kpe_plane.is_contiguous()):
        raise ValueError(f"planes must be contiguous (slots, {C}) and (slots, {R})")
    if T == 0:
        return
    _latent_store_kernel[(T,)](lat, norm_w, cos, sin, slots, ckv_plane, kpe_plane, C, float(eps), lat.stride(0),
                               cos.stride(0), ckv_plane.stride(0), kpe_plane.stride(0), BC=_pow2(C), RH=R // 2,
                               num_warps=max(1, min(4, _pow2(C) // 256)))


def latent_store_reference(lat, C, R, norm_w, eps, cos, sin, slots, ckv_plane, kpe_plane) -> None:
    x = lat[:, :C].float()
    ckv_plane.index_copy_(0, slots, (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * norm_w).to(ckv_plane.dtype))
    kpe_plane.index_copy_(0, slots, _gptj(lat[:, C:C + R].float(), cos, sin).to(kpe_plane.dtype))


def rope_heads(q: torch.Tensor, nope: int, R: int, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """(T, H, R) fp32: every head's ``q[t, h, nope:nope+R]`` rotated (GPT-J pairs) by ``cos``/``sin``
    (T, R / 2); q (T, H, >= nope + R) with unit stride in its last dim."""
    if q.dim() != 3 or q.stride(2) != 1 or q.shape[2] < nope + R:
        raise ValueError(f"q must be (T, H, >= {nope} + {R}) with unit stride in its last dim, got {tuple(q.shape)}")
    T, H = q.shape[0], q.shape[1]
    _tables(cos, sin, T, R)
    out = torch.empty(T, H, R, dtype=torch.float32, device=q.device)
    if T and H:
        _rope_heads_kernel[(T, H)](q, cos, sin, out, nope, q.stride(0), q.stride(1), cos.stride(0), out.stride(0),
                                   out.stride(1), RH=R // 2, num_warps=1)
    return out


def rope_heads_reference(q, nope, R, cos, sin) -> torch.Tensor:
    return _gptj(q[..., nope:nope + R].float(), cos[:, None, :], sin[:, None, :]).contiguous()


def _gptj(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    from exl3tools.runtime.mla_rope import rotate_gptj  # lazily, as fused_decode's references

    return rotate_gptj(x, cos, sin)


def _fp16(x: torch.Tensor) -> torch.Tensor:
    from exl3tools.runtime.dsa import _fp16 as indexer_rounding  # the indexer's own, lazily as _gptj

    return indexer_rounding(x)


def index_key_store(kraw: torch.Tensor, ln_w: torch.Tensor, ln_b: torch.Tensor, eps: float, R: int, cos: torch.Tensor,
                    sin: torch.Tensor, slots: torch.Tensor, kidx_plane: torch.Tensor) -> None:
    """``kidx_plane[slots[t]]`` = Indexer.keys of row t from its projection ``kraw`` (T, D):
    fp16(rope_front(fp16(layer_norm(fp16(kraw))))), RoPE on the first R channels by ``cos``/``sin``
    (T, R / 2), cast to the plane's dtype; the plane (slots, D) contiguous, ln_w / ln_b fp32 (D,)."""
    T, D = _rows(kraw, "kraw").shape
    _tables(cos, sin, T, R)
    if kidx_plane.shape[1:] != (D,) or not kidx_plane.is_contiguous() or R > D:
        raise ValueError(f"the kidx plane must be contiguous (slots, {D}), rope width {R} <= {D}")
    if T:
        _index_key_kernel[(T,)](kraw, ln_w, ln_b, cos, sin, slots, kidx_plane, D, float(eps), kraw.stride(0),
                                cos.stride(0), kidx_plane.stride(0), BD=_pow2(D), RH=R // 2, num_warps=1)


def index_key_store_reference(kraw, ln_w, ln_b, eps, R, cos, sin, slots, kidx_plane) -> None:
    from torch.nn import functional as F

    D = kraw.shape[1]
    k = _fp16(F.layer_norm(_fp16(kraw.float()), (D,), ln_w, ln_b, eps))
    k = _fp16(torch.cat([_gptj(k[:, :R], cos, sin), k[:, R:]], dim=-1))
    kidx_plane.index_copy_(0, slots, k.to(kidx_plane.dtype))


def index_queries(qraw: torch.Tensor, H: int, D: int, R: int, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """(T, H, D) fp32: Indexer.queries's roped queries from their projection ``qraw`` (T, H * D):
    fp16(rope_front(fp16(qraw))), each head's first R channels rotated by ``cos``/``sin`` (T, R / 2)."""
    T = _rows(qraw, "qraw").shape[0]
    if qraw.shape[1] < H * D or R > D:
        raise ValueError(f"qraw {tuple(qraw.shape)} does not hold {H} heads of {D} (rope width {R})")
    _tables(cos, sin, T, R)
    out = torch.empty(T, H, D, dtype=torch.float32, device=qraw.device)
    if T and H:
        _index_queries_kernel[(T, H)](qraw, cos, sin, out, D, qraw.stride(0), cos.stride(0), out.stride(0),
                                      out.stride(1), BD=_pow2(D), RH=R // 2, num_warps=1)
    return out


def index_queries_reference(qraw, H, D, R, cos, sin) -> torch.Tensor:
    q = _fp16(qraw[:, :H * D].float()).view(-1, H, D)
    return _fp16(torch.cat([_gptj(q[..., :R], cos[:, None, :], sin[:, None, :]), q[..., R:]], dim=-1))

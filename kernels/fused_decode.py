"""Fused glue kernels of the GQA decode step (issue 15): Triton kernels plus their torch references.

A decode step at batch 1-8 is about half trellis GEMV time and half ~250 small torch kernels (norms,
residual adds, q/k norm + RoPE, the K/V writes, routing, SiLU*mul, the expert sum), each 2-4 us of
GPU time even inside a CUDA graph. These kernels do that glue in a few launches per layer:

- ``residual_rmsnorm``: ``h += delta (+ sum_j wk[j] * y[t*K + j])``; ``x = rmsnorm(h) * w``. One
  launch per norm: the residual add of the previous block, the MoE's weighted expert sum and the
  next norm (attn_norm, mlp_norm or the final norm) together; ``embed_rmsnorm``: the same kernel
  gathering the embedding rows of the step's tokens (layer 0's norm).
- ``qk_rope_store``: per-head q/k RMSNorm (optional), NeoX RoPE on the leading ``rdim`` channels,
  q out (T, nq, hd) and the new K and V written into the paged planes at their slots; the cos/sin
  tables come from ``rope_tables`` (torch, once per step for all layers).
- ``route``: softmax / sigmoid (+ score-correction bias for the choice only), top-k (lowest index
  on ties), renormalisation, ``routed_scaling_factor``, and the index arrays the grouped expert
  calls take (int32, so no cast launches): one program per token row.
- ``silu_mul``: ``silu(a) * b``.

Each kernel has a ``*_reference`` twin in plain torch with the same contract (the CPU path and the
test oracle). Rounding differs from the torch ops by fp32 ulps (sums in another order, Triton's
exp); expert choices are the reference's unless two candidates tie within an ulp.
Every launch grid depends only on shapes: graph-capturable. Under ``TRITON_INTERPRET=1`` they run
on CPU tensors (tests).
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:   # runtime-only installs: the references still work
    triton = tl = None

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def available(device) -> bool:
    """Whether the Triton kernels run on ``device`` (CUDA, or the CPU under TRITON_INTERPRET=1)."""
    return triton is not None and (torch.device(device).type == "cuda" or INTERPRET)


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _warps(block: int) -> int:
    return max(1, min(16, block // 256))


if triton is not None:
    # ------------------------------------------------------------------ residual + RMSNorm
    @triton.jit
    def _residual_rmsnorm_kernel(h_ptr, d_ptr, y_ptr, wk_ptr, w_ptr, x_ptr, tok_ptr, H, K, eps,
                                 sh, sd, sy, sx,
                                 HAS_D: tl.constexpr, HAS_Y: tl.constexpr, WRITE_H: tl.constexpr,
                                 GATHER: tl.constexpr, BLOCK: tl.constexpr, Y_ROWS: tl.constexpr = False,
                                 s16=0, COPY16: tl.constexpr = False):
        r = tl.program_id(0).to(tl.int64)
        c = tl.arange(0, BLOCK)
        m = c < H
        if GATHER:   # h = embedding row of token r (d_ptr: the table, sd its row stride)
            tok = tl.load(tok_ptr + r).to(tl.int64)
            h = tl.load(d_ptr + tok * sd + c, mask=m, other=0.0).to(tl.float32)
        else:
            h = tl.load(h_ptr + r * sh + c, mask=m, other=0.0).to(tl.float32)
        if HAS_Y:    # the routed experts' rows of token r, weighted, summed in k order
            acc = tl.zeros([BLOCK], tl.float32)
            for j in range(K):
                wj = tl.load(wk_ptr + r * K + j)
                if Y_ROWS:   # y in expert-grouped order: the pair's row (tok_ptr: y_rows)
                    yr = tl.load(tok_ptr + r * K + j).to(tl.int64)
                else:
                    yr = r * K + j
                acc += tl.load(y_ptr + yr * sy + c, mask=m, other=0.0).to(tl.float32) * wj
            if HAS_D:
                acc += tl.load(d_ptr + r * sd + c, mask=m, other=0.0).to(tl.float32)
            h = h + acc
        elif HAS_D:
            h = h + tl.load(d_ptr + r * sd + c, mask=m, other=0.0).to(tl.float32)
        if WRITE_H:
            tl.store(h_ptr + r * sh + c, h, mask=m)
        rstd = 1.0 / tl.sqrt(tl.sum(h * h, 0) / H + eps)
        w = tl.load(w_ptr + c, mask=m, other=0.0).to(tl.float32)
        x = h * rstd * w
        tl.store(x_ptr + r * sx + c, x, mask=m)
        if COPY16:   # the fp16-rounded rows too, s16 elements on (an MLA model's router choice)
            tl.store(x_ptr + s16 + r * sx + c, x.to(tl.float16).to(tl.float32), mask=m)

    # ------------------------------------------------------------------ q/k norm + RoPE + K/V store
    @triton.jit
    def _norm_rope(src, w_ptr, cos_row, sin_row, eps, HD, RDIM, HAS_NORM: tl.constexpr, DP: tl.constexpr):
        d = tl.arange(0, DP)
        dm = d < HD
        half = RDIM // 2
        rot = d < RDIM
        p = tl.where(d < half, d + half, tl.where(rot, d - half, d))     # NeoX partner channel
        x = tl.load(src + d, mask=dm, other=0.0).to(tl.float32)
        xp = tl.load(src + p, mask=dm, other=0.0).to(tl.float32)
        if HAS_NORM:
            rstd = 1.0 / tl.sqrt(tl.sum(x * x, 0) / HD + eps)
            x = x * rstd * tl.load(w_ptr + d, mask=dm, other=0.0).to(tl.float32)
            xp = xp * rstd * tl.load(w_ptr + p, mask=dm, other=0.0).to(tl.float32)
        f = tl.where(d < half, d, d - half)
        cs = tl.load(cos_row + f, mask=rot, other=1.0)
        sn = tl.load(sin_row + f, mask=rot, other=0.0)
        out = tl.where(d < half, x * cs - xp * sn, x * cs + xp * sn)
        return tl.where(rot, out, x), d, dm

    @triton.jit
    def _qk_rope_store_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, slot_ptr, qn_ptr, kn_ptr,
                              qo_ptr, kp_ptr, vp_ptr, NQ, HD, RDIM, eps, sq, sk, sv, skp, svp, scs,
                              HAS_NORM: tl.constexpr, DP: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        hid = tl.program_id(1)
        cos_row = cos_ptr + t * scs
        sin_row = sin_ptr + t * scs
        if hid < NQ:
            out, d, dm = _norm_rope(q_ptr + t * sq + hid * HD, qn_ptr, cos_row, sin_row, eps, HD, RDIM, HAS_NORM, DP)
            tl.store(qo_ptr + (t * NQ + hid) * HD + d, out, mask=dm)
        else:
            kh = hid - NQ
            slot = tl.load(slot_ptr + t).to(tl.int64)
            out, d, dm = _norm_rope(k_ptr + t * sk + kh * HD, kn_ptr, cos_row, sin_row, eps, HD, RDIM, HAS_NORM, DP)
            tl.store(kp_ptr + slot * skp + kh * HD + d, out.to(kp_ptr.dtype.element_ty), mask=dm)
            v = tl.load(v_ptr + t * sv + kh * HD + d, mask=dm, other=0.0)
            tl.store(vp_ptr + slot * svp + kh * HD + d, v.to(vp_ptr.dtype.element_ty), mask=dm)

    # ------------------------------------------------------------------ routing
    @triton.jit
    def _route_kernel(lg_ptr, ch_ptr, bias_ptr, lut_ptr, w_ptr, loc_ptr, gsrc_ptr, gexp_ptr, dexp_ptr, wk_ptr,
                      E, NE, S, scaling, slg, sch,
                      K: tl.constexpr, KP: tl.constexpr, EP: tl.constexpr, SIGMOID: tl.constexpr,
                      NORM: tl.constexpr, HAS_BIAS: tl.constexpr, SHARED: tl.constexpr, CHOICE: tl.constexpr = False):
        t = tl.program_id(0).to(tl.int64)
        e = tl.arange(0, EP)
        em = e < E
        lg = tl.load(lg_ptr + t * slg + e, mask=em, other=float("-inf")).to(tl.float32)
        if SIGMOID:
            base = 1.0 / (1.0 + tl.exp(-lg))
            choice = base
            if CHOICE:       # the pick from other logits (Fp16ChoiceMoE: fp16-rounded activations)
                cl = tl.load(ch_ptr + t * sch + e, mask=em, other=float("-inf")).to(tl.float32)
                choice = 1.0 / (1.0 + tl.exp(-cl))
            if HAS_BIAS:
                choice = choice + tl.load(bias_ptr + e, mask=em, other=0.0).to(tl.float32)
        elif NORM:           # top-k of the logits, softmax over them
            base = lg
            choice = lg
        else:                # top-k of the full softmax
            ex = tl.exp(lg - tl.max(lg, 0))
            base = ex / tl.sum(ex, 0)
            choice = base
        choice = tl.where(em, choice, float("-inf"))
        kk = tl.arange(0, KP)
        sel = tl.zeros([KP], tl.int32)
        vals = tl.zeros([KP], tl.float32)
        for j in tl.static_range(K):
            mx = tl.max(choice, 0)
            idx = tl.min(tl.where(choice == mx, e, EP), 0)            # lowest index among equals
            idx = tl.minimum(idx, E - 1)      # an all-NaN row matches nothing: never read lut[EP]
            v = tl.sum(tl.where(e == idx, base, 0.0), 0)
            sel = tl.where(kk == j, idx, sel)
            vals = tl.where(kk == j, v, vals)
            choice = tl.where(e == idx, float("-inf"), choice)
        km = kk < K
        if SIGMOID:
            w = vals
            if NORM:
                w = w / (tl.sum(tl.where(km, w, 0.0), 0) + 1e-20)
        elif NORM:
            ex = tl.where(km, tl.exp(vals - tl.max(tl.where(km, vals, float("-inf")), 0)), 0.0)
            w = ex / tl.sum(ex, 0)
        else:
            w = vals
        w = w * scaling
        loc = tl.load(lut_ptr + sel, mask=km, other=-1).to(tl.int32)   # local expert, -1: not held
        keep = loc >= 0
        locc = tl.where(keep, loc, 0)
        tl.store(w_ptr + t * K + kk, w, mask=km)
        tl.store(loc_ptr + t * K + kk, loc.to(tl.int64), mask=km)
        wk = tl.where(keep, w, 0.0)
        if SHARED:          # pair K of each token: the shared expert, index NE - 1, weight 1
            km = kk <= K
            locc = tl.where(kk == K, NE - 1, locc)
            wk = tl.where(kk == K, 1.0, wk)
        o = t * (K + SHARED) + kk
        tl.store(gsrc_ptr + o, t.to(tl.int32) + 0 * kk, mask=km)
        tl.store(gsrc_ptr + S + o, t.to(tl.int32) + 0 * kk, mask=km)
        tl.store(gexp_ptr + o, locc, mask=km)
        tl.store(gexp_ptr + S + o, locc + NE, mask=km)
        tl.store(dexp_ptr + o, locc, mask=km)
        tl.store(wk_ptr + o, wk, mask=km)

    # ------------------------------------------------------------------ SiLU(a) * b
    @triton.jit
    def _silu_mul_kernel(a_ptr, b_ptr, o_ptr, N, sa, sb, so, BLOCK: tl.constexpr):
        r = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = c < N
        a = tl.load(a_ptr + r * sa + c, mask=m, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + r * sb + c, mask=m, other=0.0).to(tl.float32)
        tl.store(o_ptr + r * so + c, (a / (1.0 + tl.exp(-a)) * b).to(o_ptr.dtype.element_ty), mask=m)


def _rows(t: torch.Tensor, name: str) -> torch.Tensor:
    if t.dim() != 2 or t.stride(1) != 1:
        raise ValueError(f"{name} must be 2-D with contiguous rows, got {tuple(t.shape)} strides {t.stride()}")
    return t


# ------------------------------------------------------------------ residual + RMSNorm
def residual_rmsnorm(h: torch.Tensor, weight: torch.Tensor, eps: float, delta: torch.Tensor | None = None,
                     y: torch.Tensor | None = None, wk: torch.Tensor | None = None,
                     y_rows: torch.Tensor | None = None, with_fp16: bool = False):
    """In place ``h += delta + sum_j wk[t*K+j] * y[t*K+j, :H]`` (terms optional), then return
    ``rmsnorm(h) * weight`` (T, H) fp32. h (T, H) fp32; y (T*K, >= H) rows of the routed experts,
    or with ``y_rows`` (T*K,) int32 any rows, pair t*K+j's at y[y_rows[t*K+j]] (expert-grouped
    tiles: kernels.expert_groups; every index must be a row of y). ``with_fp16``: (x, both), both
    (2T, H) = x over its fp16-rounded values (x a view of its first T rows), so that one GEMM
    gives an MLA model's router logits and its choice logits."""
    T, H = _rows(h, "h").shape
    if h.dtype != torch.float32:
        raise ValueError(f"h must be float32, got {h.dtype}")
    both = torch.empty(2 * T, H, dtype=h.dtype, device=h.device) if with_fp16 else None
    x = torch.empty_like(h) if both is None else both[:T]
    if T == 0:
        return (x, both) if with_fp16 else x
    K = 0
    if y is not None:
        _rows(y, "y")
        K = (y.shape[0] if y_rows is None else y_rows.numel()) // T
        pairs_ok = y.shape[0] == T * K if y_rows is None else y_rows.numel() == T * K and y_rows.dtype == torch.int32
        if not pairs_ok or wk is None or wk.numel() != T * K or y.shape[1] < H:
            raise ValueError(f"y {tuple(y.shape)} / wk / y_rows do not fit {T} rows of {H}")
    if delta is not None:
        _rows(delta, "delta")
    block = _pow2(H)
    rows = y is not None and y_rows is not None
    _residual_rmsnorm_kernel[(T,)](
        h, h if delta is None else delta, h if y is None else y, h if wk is None else wk.contiguous(),
        weight, x, y_rows.contiguous() if rows else h, H, K, float(eps), h.stride(0),
        0 if delta is None else delta.stride(0), 0 if y is None else y.stride(0), x.stride(0),
        HAS_D=delta is not None, HAS_Y=y is not None, WRITE_H=delta is not None or y is not None,
        GATHER=False, BLOCK=block, Y_ROWS=rows, s16=T * H if with_fp16 else 0, COPY16=with_fp16, num_warps=_warps(block))
    return (x, both) if with_fp16 else x


def embed_rmsnorm(embed: torch.Tensor, tokens: torch.Tensor, weight: torch.Tensor,
                  eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, x): h = embed[tokens] as fp32 (T, H), x = rmsnorm(h) * weight: the step's first
    residual state and layer 0's normed input in one launch (no gather, no cast kernels)."""
    _rows(embed, "embed")
    T, H = tokens.shape[0], embed.shape[1]
    h = torch.empty(T, H, dtype=torch.float32, device=embed.device)
    x = torch.empty_like(h)
    if T == 0:
        return h, x
    block = _pow2(H)
    _residual_rmsnorm_kernel[(T,)](
        h, embed, h, h, weight, x, tokens, H, 0, float(eps), h.stride(0), embed.stride(0), 0, x.stride(0),
        HAS_D=False, HAS_Y=False, WRITE_H=True, GATHER=True, BLOCK=block, num_warps=_warps(block))
    return h, x


def embed_rmsnorm_reference(embed, tokens, weight, eps):
    h = embed.index_select(0, tokens).float()
    return h, h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight


def residual_rmsnorm_reference(h, weight, eps, delta=None, y=None, wk=None, y_rows=None):
    T, H = h.shape
    if y is not None:
        if y_rows is not None:
            y = y.index_select(0, y_rows.long())
        K = y.shape[0] // T
        routed = (y[:, :H].float() * wk.reshape(-1, 1)).view(T, K, H).sum(1)
        delta = routed if delta is None else routed + delta
    if delta is not None:
        h += delta
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight


# ------------------------------------------------------------------ q/k norm + RoPE + K/V store
def rope_tables(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin (T, rdim / 2) fp32 of ``positions`` x ``inv_freq``: the torch ops of
    Attention.qkv (bit-identical angles; Triton's cos/sin may be approximate at 1e4+ radians),
    once per step for every layer that shares ``inv_freq``."""
    freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    return freqs.cos(), freqs.sin()


def qk_rope_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  slots: torch.Tensor, rdim: int, k_plane: torch.Tensor,
                  v_plane: torch.Tensor, q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
                  eps: float = 1e-6) -> torch.Tensor:
    """q, k, v (T, heads * hd) as the projections return them (rows may be wider, padded):
    q/k RMSNorm per head (when both weights are given), NeoX RoPE on the first ``rdim`` channels
    with ``cos``/``sin`` (T, rdim / 2) (``rope_tables``); K and V written to
    ``k_plane/v_plane[slots[t]]`` (planes (slots, nkv, hd), cast to their dtype); returns q
    (T, nq, hd) fp32."""
    nkv, hd = k_plane.shape[1], k_plane.shape[2]
    T = q.shape[0]
    nq = (q.shape[1] // hd) if q.dim() == 2 else q.shape[1]
    q2, k2, v2 = (_rows(t.reshape(T, -1) if t.dim() == 3 else t, n) for t, n in ((q, "q"), (k, "k"), (v, "v")))
    if not (k_plane.is_contiguous() and v_plane.is_contiguous() and v_plane.shape == k_plane.shape):
        raise ValueError("k/v planes must be contiguous (slots, nkv, hd) of one shape")
    if (q_norm is None) != (k_norm is None):
        raise ValueError("q_norm and k_norm come together")
    qo = torch.empty(T, nq, hd, dtype=torch.float32, device=q.device)
    if T == 0:
        return qo
    has_norm = q_norm is not None
    if cos.shape != (T, rdim // 2) or sin.shape != cos.shape or cos.stride(1) != 1 or sin.stride() != cos.stride():
        raise ValueError(f"cos/sin must be ({T}, {rdim // 2}) of one layout, got {tuple(cos.shape)}")
    _qk_rope_store_kernel[(T, nq + nkv)](
        q2, k2, v2, cos, sin, slots, q_norm if has_norm else cos,
        k_norm if has_norm else cos, qo, k_plane, v_plane, nq, hd, int(rdim), float(eps),
        q2.stride(0), k2.stride(0), v2.stride(0), k_plane.stride(0), v_plane.stride(0), cos.stride(0),
        HAS_NORM=has_norm, DP=_pow2(hd), num_warps=1 if hd <= 128 else 2)
    return qo


def qk_rope_store_reference(q, k, v, cos, sin, slots, rdim, k_plane, v_plane, q_norm=None,
                            k_norm=None, eps=1e-6):
    from exl3tools.runtime.layers import apply_rope_neox

    nkv, hd = k_plane.shape[1], k_plane.shape[2]
    T = q.shape[0]
    q = q.reshape(T, -1)[:, :q.reshape(T, -1).shape[1] // hd * hd].float().reshape(T, -1, hd)
    k = k.reshape(T, -1)[:, :nkv * hd].float().reshape(T, nkv, hd)
    v = v.reshape(T, -1)[:, :nkv * hd].float().reshape(T, nkv, hd)

    def norm(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w
    if q_norm is not None:
        q, k = norm(q, q_norm), norm(k, k_norm)
    q, k = apply_rope_neox(q, cos, sin, rdim), apply_rope_neox(k, cos, sin, rdim)
    k_plane.index_copy_(0, slots, k.to(k_plane.dtype))
    v_plane.index_copy_(0, slots, v.to(v_plane.dtype))
    return q.contiguous()


# ------------------------------------------------------------------ routing
def route(logits: torch.Tensor, top_k: int, routing: str, norm: bool, scaling: float = 1.0,
          bias: torch.Tensor | None = None, lut: torch.Tensor | None = None, n_held: int | None = None,
          shared: bool = False, choice_logits: torch.Tensor | None = None) -> dict:
    """MoE.route's choice and weights for each row of router ``logits`` (T, E) fp32, plus what the
    grouped expert calls take. Returns ``w`` (T, k) weights (scaling applied), ``loc`` (T*k,) int64
    local expert of each pick (``lut``; -1: not held), and per pair (k per token, plus one for the
    shared expert with ``shared``: P = k + shared pairs per token, S = T * P, pair s of token
    s // P): ``gate_src``/``gate_exp`` (2S,) int32, token and expert index of a gate+up call over
    2 x NE experts (NE = n_held + shared; up at +NE; the shared expert is index n_held),
    ``down_exp`` (S,) int32, ``wk`` (S,) fp32: w (0 where not held; 1 for the shared expert).
    ``choice_logits`` (sigmoid routing only): the experts are picked by sigmoid(choice_logits) +
    bias, the weights still read sigmoid(logits) (arch.deepseek_v3.Fp16ChoiceMoE's rule)."""
    T, E = _rows(logits, "logits").shape
    if routing not in ("softmax", "sigmoid"):
        raise ValueError(f"routing {routing!r}")
    if choice_logits is not None and (routing != "sigmoid" or _rows(choice_logits, "choice_logits").shape != (T, E)):
        raise ValueError(f"choice_logits {tuple(choice_logits.shape)} need sigmoid routing and logits' shape {(T, E)}")
    dev = logits.device
    if lut is None:
        lut = torch.arange(E, dtype=torch.int32, device=dev)
    n_held = E if n_held is None else int(n_held)
    S = T * (top_k + int(shared))
    out = _route_out(T, top_k, S, dev)
    if T == 0:
        return out
    ch = logits if choice_logits is None else choice_logits
    _route_kernel[(T,)](
        logits, ch, logits if bias is None else bias, lut, out["w"], out["loc"], out["gate_src"], out["gate_exp"],
        out["down_exp"], out["wk"], E, n_held + int(shared), S, float(scaling), logits.stride(0), ch.stride(0),
        K=int(top_k), KP=_pow2(top_k + 1), EP=_pow2(E), SIGMOID=routing == "sigmoid", NORM=bool(norm),
        HAS_BIAS=bias is not None, SHARED=bool(shared), CHOICE=choice_logits is not None,
        num_warps=1 if E <= 256 else 4)
    return out


def _route_out(T: int, k: int, S: int, dev) -> dict:
    return {"w": torch.empty(T, k, dtype=torch.float32, device=dev),
            "loc": torch.empty(T * k, dtype=torch.int64, device=dev),
            "gate_src": torch.empty(2 * S, dtype=torch.int32, device=dev),
            "gate_exp": torch.empty(2 * S, dtype=torch.int32, device=dev),
            "down_exp": torch.empty(S, dtype=torch.int32, device=dev),
            "wk": torch.empty(S, dtype=torch.float32, device=dev)}


def route_reference(logits, top_k, routing, norm, scaling=1.0, bias=None, lut=None, n_held=None,
                    shared=False, choice_logits=None) -> dict:
    """``route`` with MoE.route's torch ops."""
    T, E = logits.shape
    if routing == "softmax":
        if norm:
            top, sel = torch.topk(logits, top_k, dim=-1)
            w = torch.softmax(top, dim=-1)
        else:
            w, sel = torch.topk(torch.softmax(logits, dim=-1), top_k, dim=-1)
    elif routing == "sigmoid":
        scores = torch.sigmoid(logits)
        choice = scores if choice_logits is None else torch.sigmoid(choice_logits)
        choice = choice if bias is None else choice + bias[None, :]
        sel = torch.topk(choice, top_k, dim=-1).indices
        w = scores.gather(1, sel)
        if norm:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
    else:
        raise ValueError(f"routing {routing!r}")
    w = w * scaling
    lut = torch.arange(E, device=logits.device) if lut is None else lut
    n_held = E if n_held is None else n_held
    loc = lut.long()[sel.reshape(-1)]
    wk = w * (loc >= 0).view(T, top_k)
    locc = loc.clamp(min=0).to(torch.int32).view(T, top_k)
    if shared:
        locc = torch.cat([locc, torch.full((T, 1), n_held, dtype=torch.int32, device=logits.device)], 1)
        wk = torch.cat([wk, torch.ones(T, 1, device=logits.device)], 1)
    P = locc.shape[1]
    ne = n_held + int(shared)
    tok = torch.arange(T, device=logits.device, dtype=torch.int32).repeat_interleave(P)
    locc = locc.reshape(-1)
    return {"w": w, "loc": loc, "gate_src": torch.cat([tok, tok]), "gate_exp": torch.cat([locc, locc + ne]),
            "down_exp": locc, "wk": wk.reshape(-1)}


# ------------------------------------------------------------------ SiLU(a) * b
def silu_mul(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """silu(a) * b for (R, N) a and b (contiguous rows, any row strides), computed in fp32."""
    R, N = _rows(a, "a").shape
    if _rows(b, "b").shape != (R, N):
        raise ValueError(f"a {tuple(a.shape)} and b {tuple(b.shape)} differ")
    o = torch.empty(R, N, dtype=out_dtype or a.dtype, device=a.device)
    if R == 0 or N == 0:
        return o
    block = min(1024, _pow2(N))
    _silu_mul_kernel[(R, triton.cdiv(N, block))](a, b, o, N, a.stride(0), b.stride(0), o.stride(0),
                                                 BLOCK=block, num_warps=_warps(block))
    return o


def silu_mul_reference(a, b, out_dtype=None):
    return (torch.nn.functional.silu(a.float()) * b.float()).to(out_dtype or a.dtype)

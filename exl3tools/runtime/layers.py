"""Building blocks shared by the GQA architectures (llama, qwen3_moe, glm4_moe).

Every module computes in float32 on CPU. Linear layers go through ``exl3tools.kernels.dispatch``;
this file only pads inputs to the stored (padded) width and trims outputs to the real width.
Cut (row-parallel / expert-parallel) modules all-reduce their own partial sums, once per module.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from exl3tools.errors import UnsupportedArchitectureError
from exl3tools.kernels import moe_combine
from exl3tools.kernels.dispatch import LoopExperts, make_experts, make_group, make_linear
from exl3tools.runtime import invariance
from exl3tools.runtime.sampling import on_device
from exl3tools.runtime.weights import Cut, LinearFields, WeightSource

QUERY_CHUNK = 512   # prefill queries per attention chunk
STATIC_MOE_SLOTS = 512   # (token, expert) pairs up to which a CUDA MoE call takes the grouped path
# (token, expert) pairs from which the fixed-shape (graph) decode step runs expert-sorted tiles (one
# weight decode per tile) rather than one row per pair. H200, synthetic GLM-4.5-Air (128 experts,
# top 8), bench/gpu_e2e_model.py: batch 32 (256 pairs) 3222 -> 4384 tok/s with tiles, batch 8
# (64 pairs) 1969 -> 1857. Eager calls pay ~0.9 ms of launches for the tiles' bookkeeping and take
# them only above STATIC_MOE_SLOTS (bench/gpu_prefill.py). Env-overridable for measurements.
MOE_TILES_MIN_SLOTS = int(os.environ.get("EXL3TOOLS_MOE_TILES_MIN_SLOTS", "128"))
MOE_CHUNK_ROWS = 8192    # tile rows per chunk of a tiled MoE call (bounds a long prefill's scratch)


# ------------------------------------------------------------------ batch description
@dataclass(slots=True)
class SeqSpan:
    """One sequence's rows in a packed batch: rows [row, row + n) sit at positions [pos, pos + n)."""

    cache: object          # runtime.cache.SeqCache
    row: int
    n: int
    pos: int


@dataclass(slots=True)
class Batch:
    spans: list[SeqSpan]
    positions: torch.Tensor        # (rows,) int64
    extras: dict = field(default_factory=dict)


# ------------------------------------------------------------------ linear
class Linear:
    """An EXL3 (or dense fallback) linear: y = pad(x) @ W + bias, trimmed to ``out_real``."""

    def __init__(self, fields: LinearFields, *, in_real: int | None = None, out_real: int | None = None,
                 backend: str = "reference", device="cpu"):
        self.prefix = fields.prefix
        self.codebook, self.k_bits = fields.codebook, fields.k_bits
        self.in_pad, self.out_pad = fields.in_features, fields.out_features
        self.in_real = self.in_pad if in_real is None else in_real
        self.out_real = self.out_pad if out_real is None else out_real
        if fields.codebook is None:
            w = fields.tensors["weight"].to(device, torch.float32)
            b = fields.tensors.get("bias")
            b = None if b is None else b.to(device, torch.float32)
            if invariance.on():      # batch-invariant runs: a fixed GEMM shape for every row
                self.fn = lambda x: invariance.rows_mm(x.reshape(-1, x.shape[-1]), w, b).reshape(*x.shape[:-1], -1)
            else:
                self.fn = lambda x: F.linear(x, w.t(), b)
        else:
            self.fn = make_linear(fields.tensors, fields.codebook, fields.k_bits, device, backend)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] < self.in_pad:
            x = F.pad(x, (0, self.in_pad - x.shape[-1]))
        y = self.fn(x)
        if self.out_real < y.shape[-1]:
            y = y[..., :self.out_real]
        return y


class LinearGroup:
    """Linears that read the same input (q, k and v; gate and up): ``__call__(x) -> [y_i]``, each
    as its Linear gives it, in one grouped backend call where the backend has one
    (kernels.dispatch.make_group), else each in turn."""

    def __init__(self, linears: list[Linear]):
        self.linears = list(linears)
        self.in_pad = self.linears[0].in_pad
        same = all(m.in_pad == self.in_pad and m.codebook is not None for m in self.linears)
        self.fn = make_group([m.fn for m in self.linears]) if same else None

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        if self.fn is None:
            return [m(x) for m in self.linears]
        if x.shape[-1] < self.in_pad:
            x = F.pad(x, (0, self.in_pad - x.shape[-1]))
        return [y[..., :m.out_real] if m.out_real < y.shape[-1] else y for m, y in zip(self.linears, self.fn(x), strict=True)]


def load_linear(ws: WeightSource, prefix: str, cut: Cut | None = None, *, in_real=None, out_real=None,
                backend="reference", device="cpu") -> Linear:
    return Linear(ws.linear(prefix, cut), in_real=in_real, out_real=out_real, backend=backend, device=device)


# ------------------------------------------------------------------ norms, rope
def _on(t: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    return t if t is None or t.device == device else t.to(device)


class RMSNorm:
    def __init__(self, weight: torch.Tensor, eps: float):
        self.weight, self.eps = weight.float(), eps

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        self.weight = _on(self.weight, x.device)   # follows the activations' device once
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope_settings(cfg: dict, head_dim: int) -> tuple[int, torch.Tensor, float]:
    """(rotary_dim, inv_freq, attention_factor) from config.json (rope_parameters or legacy keys)."""
    rp = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = float(rp.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    partial = float(rp.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
    rdim = int(head_dim * partial)
    rtype = rp.get("rope_type", rp.get("type", "default")) or "default"
    inv = 1.0 / (theta ** (torch.arange(0, rdim, 2, dtype=torch.float64) / rdim))
    if rtype == "linear":
        inv = inv / float(rp["factor"])
    elif rtype == "llama3":
        factor, lo, hi = float(rp["factor"]), float(rp["low_freq_factor"]), float(rp["high_freq_factor"])
        old = float(rp["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        smooth = ((old / wavelen) - lo) / (hi - lo)
        scaled = torch.where(wavelen > old / lo, inv / factor, inv)
        mid = (wavelen <= old / lo) & (wavelen >= old / hi)
        inv = torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
    elif rtype != "default":
        raise UnsupportedArchitectureError(f"rope_type {rtype!r} is not supported by the runtime yet")
    return rdim, inv.float(), 1.0


def apply_rope_neox(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rdim: int) -> torch.Tensor:
    """NeoX layout on the first ``rdim`` channels of each head (rotate halves); x (T, heads, d)."""
    xr, xp = x[..., :rdim], x[..., rdim:]
    h = rdim // 2
    x1, x2 = xr[..., :h], xr[..., h:]
    c, s = cos[:, None, :], sin[:, None, :]
    out = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
    return torch.cat([out, xp], dim=-1) if xp.shape[-1] else out


# ------------------------------------------------------------------ attention (GQA)
class Attention:
    """GQA with optional q/k/v bias, per-head q/k RMSNorm (qwen3) and partial NeoX RoPE.

    Heads are local to this rank (column-cut q/k/v by whole KV-head groups, row-cut o_proj);
    ``reduce`` (the TP all-reduce, or nothing when the attention is replicated) sums the o_proj
    partials, so the result is always the full output.
    """

    def __init__(self, *, q, k, v, o, head_dim: int, n_q: int, n_kv: int, rope: tuple, layer_idx: int,
                 q_norm: RMSNorm | None = None, k_norm: RMSNorm | None = None, sm_scale: float | None = None,
                 reduce=None):
        self.q, self.k, self.v, self.o = q, k, v, o
        self.reduce = reduce or _identity
        self.hd, self.nq, self.nkv, self.layer = head_dim, n_q, n_kv, layer_idx
        self.rdim, self.inv_freq, _ = rope
        self.q_norm, self.k_norm = q_norm, k_norm
        self.scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(head_dim)

    def cache_spec(self) -> list:
        """Per token: K and V of this rank's KV heads (runtime/kv_pool.py)."""
        from exl3tools.runtime.kv_pool import PlaneSpec

        return [PlaneSpec("k", (self.nkv, self.hd)), PlaneSpec("v", (self.nkv, self.hd))]

    def qkv(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k (normed, RoPE at ``positions``) and v of the rows of ``x``, (T, heads, head_dim)."""
        T = x.shape[0]
        q = self.q(x).view(T, self.nq, self.hd)
        k = self.k(x).view(T, self.nkv, self.hd)
        v = self.v(x).view(T, self.nkv, self.hd)
        if self.q_norm is not None:
            q = self.q_norm(q)
        if self.k_norm is not None:
            k = self.k_norm(k)
        self.inv_freq = _on(self.inv_freq, x.device)
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        cos, sin = freqs.cos(), freqs.sin()
        return apply_rope_neox(q, cos, sin, self.rdim), apply_rope_neox(k, cos, sin, self.rdim), v

    def __call__(self, x: torch.Tensor, batch: Batch) -> torch.Tensor:
        T = x.shape[0]
        q, k, v = self.qkv(x, batch.positions)
        pp = paged_prefill_meta(batch, q)
        if pp is not None:      # the GPU: write the new K/V, one kernel over every sequence's blocks
            planes = pp.pool.planes[self.layer]
            kp, vp = planes["k"], planes["v"]
            kp.index_copy_(0, pp.new_slots, k.to(kp.dtype))
            vp.index_copy_(0, pp.new_slots, v.to(vp.dtype))
            for sp in batch.spans:
                sp.cache.lengths[self.layer] += sp.n
            out = pp.attend(q.contiguous(), kp, vp, pp.slot_table, pp.q_start, pp.ctx_lens, self.scale, pp.max_new)
            return self.reduce(self.o(out.reshape(T, self.nq * self.hd)))
        out = torch.empty(T, self.nq, self.hd, dtype=q.dtype, device=q.device)
        groups = self.nq // self.nkv
        for sp in batch.spans:
            kv = sp.cache.extend(self.layer, {"k": k[sp.row:sp.row + sp.n], "v": v[sp.row:sp.row + sp.n]})
            kk, vv = kv["k"], kv["v"]                   # (L, nkv, d), L = pos + n
            L = kk.shape[0]
            if q.device.type == "cuda":                 # flash/mem-efficient kernels; the CPU keeps the plain path
                out[sp.row:sp.row + sp.n] = _sdpa(q[sp.row:sp.row + sp.n], kk, vv, sp.pos, self.scale)
                continue
            kk = kk.transpose(0, 1).repeat_interleave(groups, 0)     # (nq, L, d)
            vv = vv.transpose(0, 1).repeat_interleave(groups, 0)
            for c0 in range(0, sp.n, QUERY_CHUNK):                  # bounds the (nq, n, L) scores
                c1 = min(sp.n, c0 + QUERY_CHUNK)
                qs = q[sp.row + c0:sp.row + c1].transpose(0, 1)      # (nq, c, d)
                # plain matmul-softmax: torch's CPU SDPA costs ~50x more on decode-sized shapes
                scores = torch.matmul(qs, kk.transpose(1, 2)) * self.scale      # (nq, c, L)
                if sp.n > 1:
                    i = torch.arange(c0, c1, device=q.device)[:, None] + sp.pos
                    scores = scores.masked_fill(torch.arange(L, device=q.device)[None, :] > i, float("-inf"))
                o = torch.matmul(torch.softmax(scores, dim=-1), vv)
                out[sp.row + c0:sp.row + c1] = o.transpose(0, 1)
        return self.reduce(self.o(out.reshape(T, self.nq * self.hd)))


# the paged prefill kernel on the CPU too (Triton's interpreter; tests of the GPU path's logic)
PAGED_PREFILL_ON_CPU = os.environ.get("EXL3TOOLS_PAGED_PREFILL_CPU") == "1"


@dataclass(slots=True)
class PagedPrefill:
    """What kernels.paged_attention.paged_prefill needs for one forward, built once per batch."""

    pool: object
    new_slots: torch.Tensor        # (rows,) int64: where each new row's K/V goes
    slot_table: torch.Tensor       # (B, max_len) int32: slot of each position of each sequence
    q_start: torch.Tensor          # (B + 1,) int32
    ctx_lens: torch.Tensor         # (B,) int32
    max_new: int
    attend: object


def paged_prefill_meta(batch: Batch, q: torch.Tensor) -> PagedPrefill | None:
    """The paged prefill metadata of ``batch`` (cached in ``batch.extras``), or None where the
    plain path runs: CPU (unless PAGED_PREFILL_ON_CPU), no Triton, or caches that are not paged
    views of one pool."""
    if "paged_prefill" in batch.extras:
        return batch.extras["paged_prefill"]
    meta = None
    from exl3tools.runtime.kv_pool import PagedSeqView

    caches = [sp.cache for sp in batch.spans]
    if ((q.is_cuda or PAGED_PREFILL_ON_CPU) and caches and all(isinstance(c, PagedSeqView) for c in caches)
            and all(c.pool is caches[0].pool for c in caches)):
        try:
            from exl3tools.kernels.paged_attention import paged_prefill, triton
        except ImportError:
            triton = None
        if triton is not None:
            dev = q.device
            lens = [sp.pos + sp.n for sp in batch.spans]
            width = max(lens)
            table = torch.stack([F.pad(c._slots[:n], (0, width - n)) for c, n in zip(caches, lens, strict=True)])
            new = torch.cat([c._slots[sp.pos:sp.pos + sp.n] for c, sp in zip(caches, batch.spans, strict=True)])
            starts = [0]
            for sp in batch.spans:
                starts.append(starts[-1] + sp.n)
            meta = PagedPrefill(caches[0].pool, new.to(dev), table.to(dev, torch.int32),
                                on_device(starts, dev, torch.int32), on_device(lens, dev, torch.int32),
                                max(sp.n for sp in batch.spans), paged_prefill)
    batch.extras["paged_prefill"] = meta
    return meta


def causal_mask(n: int, pos0: int, L: int, dev: torch.device) -> torch.Tensor:
    """(n, L) bool: query i (at position pos0 + i) sees keys 0 .. pos0 + i."""
    return torch.arange(L, device=dev)[None, :] <= torch.arange(n, device=dev)[:, None] + pos0


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos0: int, scale: float) -> torch.Tensor:
    """Causal attention of n queries at positions pos0.. over L = pos0 + n keys (GQA), (n, nq, d)."""
    n, L = q.shape[0], k.shape[0]
    qh, kh, vh = q.transpose(0, 1)[None], k.transpose(0, 1)[None].to(q.dtype), v.transpose(0, 1)[None].to(q.dtype)
    if n == L:
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=True)
    else:   # a chunk after cached tokens: query i sees keys 0..pos0 + i
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=causal_mask(n, pos0, L, q.device), scale=scale,
                                           enable_gqa=True)
    return o[0].transpose(0, 1)


# ------------------------------------------------------------------ MLPs
def _identity(x):
    return x


class GatedMLP:
    """down(silu(gate(x)) * up(x)); gate/up column-cut, down row-cut. ``reduce`` sums the partials
    when cut (TP all-reduce); ``sharded`` says whether the output is partial before it."""

    def __init__(self, gate, up, down, reduce=None, sharded: bool = False):
        self.gate, self.up, self.down = gate, up, down
        self.reduce, self.sharded = reduce or _identity, sharded

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.reduce(self.partial(x))


class MoE:
    """Routed experts (+ optional shared experts); the router is replicated on every rank.

    routing "softmax" (Qwen3-MoE): top-k of the logits; weights = softmax over the top-k
    (= renormalised softmax when norm_topk_prob) or the plain softmax probabilities.
    routing "sigmoid" (GLM-4 MoE, DeepSeek-V3, n_group 1): scores = sigmoid(logits); select top-k
    of scores + e_score_correction_bias; weights = the unbiased scores, divided by their sum
    (+1e-20) when norm_topk_prob, times routed_scaling_factor.
    Each rank computes the experts (or expert slices) it holds; ``reduce`` sums the routed partials
    together with a cut shared expert in one all-reduce; a replicated shared expert is added after.

    ``__call__`` groups tokens by expert with one host sync (prefill, CPU, TP). ``forward_static``
    is the same sum without any host sync and with shapes fixed by the token count (CUDA-graph
    decode): grouped experts per projection (kernels.dispatch.make_experts, built on first use from
    ``expert_fields(proj) -> [LinearFields of each held expert]``, or, without it, a loop over the
    eager linears).
    """

    def __init__(self, *, router: torch.Tensor, experts: dict[int, GatedMLP], top_k: int, routing: str,
                 norm_topk_prob: bool, scaling: float = 1.0, score_bias: torch.Tensor | None = None,
                 shared: GatedMLP | None = None, reduce=None, expert_fields=None, backend: str = "reference",
                 device="cpu"):
        self.reduce = reduce or _identity
        self.router, self.experts, self.top_k = router.float(), experts, top_k
        self.routing, self.norm, self.scaling = routing, norm_topk_prob, scaling
        self.bias = None if score_bias is None else score_bias.float()
        self.shared = shared
        self.expert_fields, self.backend, self.device = expert_fields, backend, device
        self._grouped = None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.router, self.bias = _on(self.router, x.device), _on(self.bias, x.device)
        logits = x @ self.router.t()
        if self.routing == "softmax":
            if self.norm:
                top, sel = torch.topk(logits, self.top_k, dim=-1)
                w = torch.softmax(top, dim=-1)
            else:
                p = torch.softmax(logits, dim=-1)
                w, sel = torch.topk(p, self.top_k, dim=-1)
        elif self.routing == "sigmoid":
            scores = torch.sigmoid(logits)
            choice = scores if self.bias is None else scores + self.bias[None, :]
            sel = torch.topk(choice, self.top_k, dim=-1).indices
            w = scores.gather(1, sel)
            if self.norm:
                w = w / (w.sum(-1, keepdim=True) + 1e-20)
        else:
            raise UnsupportedArchitectureError(f"routing {self.routing!r}")
        return sel, w * self.scaling

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and (x.shape[0] * self.top_k <= STATIC_MOE_SLOTS or self._tiled()):
            # on the GPU the grouped, sync-free path (a few launches per projection) instead of a
            # Python loop over ~100 touched experts (H200, serve: a 32-token prompt's TTFT was
            # 351 ms through the loop); long prefills go through expert-sorted tiles
            return self.forward_static(x, tiles=x.shape[0] * self.top_k > STATIC_MOE_SLOTS)
        sel, w = self.route(x)
        out = torch.zeros_like(x)
        # group the (token, slot) pairs by expert with one sort and one host sync
        flat = sel.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.router.shape[0]).tolist()
        starts = [0]
        for c in counts:
            starts.append(starts[-1] + c)
        k = sel.shape[1]
        for e, mlp in self.experts.items():
            if counts[e] == 0:
                continue
            pick = order[starts[e]:starts[e + 1]]
            rows = pick // k
            # rows are unique per expert (top-k picks an expert once per token): a plain indexed add
            # (index_add_ stalls for ms in its OpenMP path on small CPU shapes)
            out[rows] += mlp.partial(x[rows]) * w.reshape(-1)[pick][:, None]
        return self._finish(x, out)

    def _finish(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        if self.shared is not None and self.shared.sharded:
            out = out + self.shared.partial(x)
        out = self.reduce(out)
        if self.shared is not None and not self.shared.sharded:
            out = out + self.shared.partial(x)
        return out

    def grouped(self) -> dict:
        """{"lut", "in_pad", "gate_proj", "up_proj", "down_proj"}: the held experts as grouped
        projections; ``lut`` maps a global expert id to its local index (-1: not on this rank)."""
        if self._grouped is None:
            held = sorted(self.experts)
            lut = torch.full((self.router.shape[0],), -1, dtype=torch.int64)
            lut[held] = torch.arange(len(held))
            g = {"lut": lut}
            fields = self._resident_fields(held)
            if fields is None:
                fields = {}
                if self.expert_fields is not None and held:
                    fields = {p: self.expert_fields(p) for p in ("gate_proj", "up_proj", "down_proj")}
            for p, attr in (("gate_proj", "gate"), ("up_proj", "up"), ("down_proj", "down")):
                fs = fields.get(p)
                if fs and len({(f.codebook, f.k_bits) for f in fs}) == 1 and fs[0].codebook is not None:
                    g[p] = make_experts([f.tensors for f in fs], fs[0].codebook, fs[0].k_bits, self.device,
                                        self.backend)
                else:   # mixed K, dense linears or no field source: the eager linears, looped
                    g[p] = LoopExperts([getattr(self.experts[e], attr).fn for e in held])
            gf, uf = fields.get("gate_proj"), fields.get("up_proj")
            if (gf and uf and isinstance(g["gate_proj"], type(g["up_proj"]))
                    and not isinstance(g["gate_proj"], LoopExperts)
                    and {(f.codebook, f.k_bits, tuple(f.tensors["trellis"].shape)) for f in gf + uf} ==
                    {(gf[0].codebook, gf[0].k_bits, tuple(gf[0].tensors["trellis"].shape))}):
                # gate and up read the same input: one grouped call over 2E experts (half the launches)
                g["gate_up"] = make_experts([f.tensors for f in gf + uf], gf[0].codebook, gf[0].k_bits,
                                            self.device, self.backend)
                del g["gate_proj"], g["up_proj"]
            g["in_pad"] = self.experts[held[0]].gate.in_pad if held else 0
            self._grouped = g
        return self._grouped

    def _resident_fields(self, held: list[int]) -> dict | None:
        """The held experts' fields as the eager linears already hold them on the device
        (``fn.device_tensors``), so grouped experts share those tensors instead of re-reading
        the checkpoint and keeping a second copy; None when a backend does not expose them."""
        if not held:
            return None
        out = {}
        for p, attr in (("gate_proj", "gate"), ("up_proj", "up"), ("down_proj", "down")):
            fs = []
            for e in held:
                lin = getattr(self.experts[e], attr)
                tensors = getattr(lin.fn, "device_tensors", None)
                if tensors is None or lin.codebook is None:
                    return None
                fs.append(LinearFields(lin.prefix, tensors, lin.codebook, lin.k_bits, lin.in_pad, lin.out_pad))
            out[p] = fs
        return out

    def _tiled(self) -> bool:
        """Whether every grouped projection can run expert-sorted tiles."""
        if not self.experts:
            return False
        g = self.grouped()
        return all(hasattr(g[p], "tiles") for p in PROJECTIONS if p in g)

    def max_tile_rows(self) -> int:
        """The most rows a tile may have: what every grouped projection's kernels take."""
        g = self.grouped()
        return min(getattr(g[p], "max_tile_rows", 64) for p in PROJECTIONS if p in g)

    def forward_static(self, x: torch.Tensor, tiles: bool | None = None) -> torch.Tensor:
        """``__call__``'s result with device ops only: no host sync, shapes fixed by ``x.shape``.
        ``tiles``: expert-sorted tiles (None: from ``MOE_TILES_MIN_SLOTS`` pairs, where the backend
        has them) or one row per (token, expert) pair."""
        sel, w = self.route(x)
        T, H = x.shape
        if not self.experts:              # an EP rank without experts here: only the reduce
            return self._finish(x, torch.zeros_like(x))
        g = self.grouped()
        g["lut"] = _on(g["lut"], x.device)
        S = T * self.top_k
        loc = g["lut"][sel.reshape(-1)]                        # (S,) local expert, -1 if not held
        if tiles is None:
            tiles = S >= MOE_TILES_MIN_SLOTS and self._tiled()
        if tiles:
            return self._finish(x, self._tiles_sum(x, g, loc, w))
        keep = (loc >= 0).to(w.dtype)
        loc = loc.clamp(min=0)
        tok = torch.arange(T, device=x.device).repeat_interleave(self.top_k)
        xp = F.pad(x, (0, g["in_pad"] - H)) if g["in_pad"] > H else x
        if "gate_up" in g:
            gu = g["gate_up"].slots(xp, torch.cat([tok, tok]), torch.cat([loc, loc + len(self.experts)]))
            act = F.silu(gu[:S]) * gu[S:]
        else:
            act = F.silu(g["gate_proj"].slots(xp, tok, loc)) * g["up_proj"].slots(xp, tok, loc)
        y = g["down_proj"].slots(act, torch.arange(S, device=x.device), loc)[:, :H]
        y = y * (w.reshape(-1) * keep)[:, None]                # a slot on another rank adds zero
        return self._finish(x, y.reshape(T, self.top_k, H).sum(1))


    def _tiles_sum(self, x: torch.Tensor, g: dict, loc: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """The routed sum through expert-sorted tiles (``expert_tiles``): gate/up and down each
        decode an expert's weights once per tile of up to 64 of its rows. Tiles are independent,
        so they run in chunks of about MOE_CHUNK_ROWS rows: a long prefill's intermediates stay
        bounded, at no extra weight decoding."""
        T, H = x.shape
        E, S = len(self.experts), loc.shape[0]
        R = tile_rows(S, E, self.max_tile_rows())
        tile_exp, row_exp, slot, valid = expert_tiles(loc, E, R)
        tok = torch.where(valid, slot, 0) // self.top_k          # source token of each tile row
        xp = F.pad(x, (0, g["in_pad"] - H)) if g["in_pad"] > H else x
        # each chunk's rows added into their tokens' rows in a fixed order (kernels/moe_combine.py),
        # through inv: each pair's row in the chunk, -1 for none (entry S takes the padding rows)
        combine = moe_combine.combine if x.is_cuda else moe_combine.combine_reference
        out = torch.zeros(T, H, dtype=x.dtype, device=x.device)
        inv = torch.empty(S + 1, dtype=torch.int32, device=x.device)
        wk = w.reshape(T, self.top_k)                            # a pair on another rank has no row
        NT = tile_exp.shape[0]
        counts = valid.view(NT, R).sum(1)        # real rows per tile: a backend may skip the padding
        step = max(1, MOE_CHUNK_ROWS // R)
        for c0 in range(0, NT, step):
            c1 = min(NT, c0 + step)
            r0, r1 = c0 * R, c1 * R
            y = self._tiles_chunk(xp, g, E, R, tok[r0:r1], row_exp[r0:r1], tile_exp[c0:c1], counts[c0:c1])
            inv.fill_(-1).index_copy_(0, slot[r0:r1], torch.arange(r1 - r0, dtype=torch.int32, device=x.device))
            combine(out, y, inv[:S].view(T, self.top_k), wk)
        return out

    @staticmethod
    def _tiles_chunk(xp, g: dict, E: int, R: int, tok, row_exp, tile_exp, counts) -> torch.Tensor:
        """Down(silu(gate) * up) of one chunk of tiles: (rows, out) in xp's dtype; padding rows
        (past ``counts``) may come out undefined."""
        N = row_exp.shape[0]
        # on the GPU gate/up come out in fp16: the down projection rounds its input to fp16 anyway
        # (its Hadamard pass feeds fp16 MMAs)
        mid = torch.float16 if xp.is_cuda else xp.dtype
        if "gate_up" in g:
            up_tiles = torch.where(tile_exp >= 0, tile_exp + E, -1)
            gu = g["gate_up"].tiles(xp, torch.cat([tok, tok]), torch.cat([row_exp, row_exp + E]),
                                    torch.cat([tile_exp, up_tiles]), R, out_dtype=mid, counts=counts.repeat(2))
            act = F.silu(gu[:N]).mul_(gu[N:])
            del gu
        else:
            act = F.silu(g["gate_proj"].tiles(xp, tok, row_exp, tile_exp, R, out_dtype=mid, counts=counts))
            act.mul_(g["up_proj"].tiles(xp, tok, row_exp, tile_exp, R, out_dtype=mid, counts=counts))
        return g["down_proj"].tiles(act, None, row_exp, tile_exp, R, out_dtype=xp.dtype, counts=counts)


PROJECTIONS = ("gate_up", "gate_proj", "up_proj", "down_proj")   # the grouped experts' keys (MoE.grouped)


def tile_rows(slots: int, experts: int, max_rows: int = 64) -> int:
    """Rows per tile: about 1.5x the mean rows per expert, 8 to ``max_rows`` (the backend's
    ``max_tile_rows``: 64, or 128 for CUDA experts (EXL3TOOLS_MOE_WGR, the default; "0": 64))."""
    mean = slots / max(1, experts)
    for r in (8, 16, 32, 64, 128):
        if r >= max_rows or 1.5 * mean <= r:
            return min(r, max_rows)
    return max_rows


def expert_tiles(loc: torch.Tensor, n_exp: int, rows: int):
    """(token, expert) pairs grouped by expert into tiles of ``rows`` rows, with device ops only.

    ``loc``: (S,) local expert of each pair, -1 for one this rank does not hold. Returns
    ``tile_exp`` (NT,) (-1: an unused tile), ``row_exp`` (NT*rows,) (a valid expert id for every
    row), ``slot`` (NT*rows,) the pair each row computes (S for padding) and ``valid`` (NT*rows,).
    NT = S // rows + min(E, S) bounds the tiles any routing needs (each expert's last tile is
    the only partial one), so shapes depend on S alone (CUDA-graph capturable)."""
    S, dev = loc.shape[0], loc.device
    key = torch.where(loc >= 0, loc, n_exp)
    order = torch.argsort(key, stable=True)                    # pairs by expert, held ones first
    # not torch.bincount: on CUDA it reads the max back to the host (no graph capture)
    counts = torch.zeros(n_exp + 1, dtype=torch.int64, device=dev).scatter_add_(0, key, torch.ones_like(key))[:n_exp]
    ntiles = (counts + rows - 1) // rows
    tile_end = torch.cumsum(ntiles, 0)
    tile_start = tile_end - ntiles
    pair_start = torch.cumsum(counts, 0) - counts
    NT = S // rows + min(n_exp, S)
    t = torch.arange(NT, device=dev)
    te = torch.searchsorted(tile_end, t, right=True)           # the expert owning tile t (n_exp: none)
    used = te < n_exp
    te = te.clamp(max=n_exp - 1)
    r = (t - tile_start[te])[:, None] * rows + torch.arange(rows, device=dev)   # rank within the expert
    valid = used[:, None] & (r < counts[te][:, None])
    pos = (pair_start[te][:, None] + r).clamp(max=S - 1)
    slot = torch.where(valid, order[pos], S)
    tile_exp = torch.where(used, te, -1)
    return tile_exp, te.repeat_interleave(rows), slot.reshape(-1), valid.reshape(-1)


# ------------------------------------------------------------------ decoder block
class DecoderLayer:
    """Pre-norm residual block; attention and MLP return full (already reduced) outputs."""

    def __init__(self, attn_norm, attn, mlp_norm, mlp):
        self.attn_norm, self.attn, self.mlp_norm, self.mlp = attn_norm, attn, mlp_norm, mlp

    def __call__(self, h: torch.Tensor, batch: Batch) -> torch.Tensor:
        h = h + self.attn(self.attn_norm(h), batch)
        h = h + self.mlp(self.mlp_norm(h))
        return h

"""EXL3 linears on the GPU with our own Triton kernels; registers backend ``triton`` in dispatch.

    y = ((x ⊙ suh) · H_k) · Ŵ · H_n ⊙ svh + bias          (exl3-format.md §5.7, runtime form)

Paths by rows (x is (rows, k) at padded dims):
- 1 row:   ``had`` (x ⊙ suh · H) -> ``fma`` kernel: decode tiles in registers, CUDA-core FMAs,
           output Hadamard + svh + bias fused, split-K partials added into fp32 -> cast.
- 2..16:   same with the ``dot`` kernel (tensor cores, one 16-deep MMA per trellis step group).
- more:    ``decode`` Ŵ to fp16 once per call, cuBLAS GEMM, output ``had`` pass (prefill).
``moe_linear`` runs many experts at once: rows are (token, expert) pairs, grouped by expert.
Kernels come from triton_codegen (see why there); Ŵ from ``decode_rotated`` is bit-exact.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import tempfile
from functools import lru_cache
from pathlib import Path

import torch
import triton
import triton.language as tl
from exl3tools.kernels.triton_codegen import generate

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
SMALL_ROWS = 16                 # above this, decode to fp16 + cuBLAS (BM=32 dot measured slower)
TARGET_PROGRAMS = 8 * 132       # split-K until about this many programs (H200: 132 SMs)


# ------------------------------------------------------------------ generated kernels
@lru_cache(maxsize=None)
def _kernel(width: int, cb: str, mode: str):
    asm = not INTERPRET and os.environ.get("EXL3TOOLS_TRITON_ASM", "1") == "1"
    src = generate(width, cb, mode, asm)
    digest = hashlib.sha1(src.encode()).hexdigest()[:12]
    root = Path(os.environ.get("EXL3TOOLS_KERNEL_CACHE", Path(tempfile.gettempdir()) / "exl3tools_triton"))
    root.mkdir(parents=True, exist_ok=True)
    path = root / f"gen_{mode}_{width}_{cb}_{digest}.py"
    if not path.exists():
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(src)
        os.replace(tmp, path)
    name = f"exl3tools_gen_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return getattr(mod, f"k_{mode}_{width}_{cb}_{int(asm)}")


@lru_cache(maxsize=None)
def _hadamard_pm1(device: str) -> torch.Tensor:
    """Sylvester H128 with entries ±1 (fp16-exact); kernels scale by 1/sqrt(128) in fp32."""
    h = torch.ones(1, 1)
    while h.shape[0] < 128:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h.to(device=device, dtype=torch.float16).contiguous()


# ------------------------------------------------------------------ Hadamard pass
@triton.jit
def _had_kernel(x_ptr, out_ptr, h_ptr, tok_ptr, exp_ptr, pre_ptr, post_ptr, bias_ptr, P, width,
                pre_estride, post_estride,
                HAS_TOK: tl.constexpr, HAS_EXP: tl.constexpr, HAS_PRE: tl.constexpr, HAS_POST: tl.constexpr,
                HAS_BIAS: tl.constexpr, BR: tl.constexpr):
    """out[p, blk] = ((x[tok[p], blk] ⊙ pre[e_p, blk]) · H128 / sqrt(128)) ⊙ post[e_p, blk] + bias."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    rmask = rows < P
    cols = tl.program_id(1) * 128 + tl.arange(0, 128)
    src = tl.load(tok_ptr + rows, mask=rmask, other=0) if HAS_TOK else rows
    ex = tl.load(exp_ptr + rows, mask=rmask, other=0) if HAS_EXP else rows * 0
    x = tl.load(x_ptr + src.to(tl.int64)[:, None] * width + cols[None, :], mask=rmask[:, None], other=0.0)
    x = x.to(tl.float32)
    if HAS_PRE:
        x = x * tl.load(pre_ptr + ex.to(tl.int64)[:, None] * pre_estride + cols[None, :]).to(tl.float32)
    hm = tl.load(h_ptr + tl.arange(0, 128)[:, None] * 128 + tl.arange(0, 128)[None, :])
    hi = x.to(tl.float16)
    lo = (x - hi.to(tl.float32)).to(tl.float16)   # hi + lo carries x to ~2^-22: fp16 MMAs stay exact
    y = (tl.dot(hi, hm) + tl.dot(lo, hm)) * 0.08838834764831845
    if HAS_POST:
        y = y * tl.load(post_ptr + ex.to(tl.int64)[:, None] * post_estride + cols[None, :]).to(tl.float32)
    if HAS_BIAS:
        y = y + tl.load(bias_ptr + ex.to(tl.int64)[:, None] * post_estride + cols[None, :]).to(tl.float32)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * width + cols[None, :], y.to(out_ptr.dtype.element_ty),
             mask=rmask[:, None])


def hadamard(x: torch.Tensor, pre=None, post=None, bias=None, tok=None, exp=None, out=None,
             out_dtype=torch.float16) -> torch.Tensor:
    """Rows of ``x`` (or ``x[tok]``) times per-128-block H, with optional pre/post scales and bias.

    ``pre``/``post``/``bias`` are (E, width) stacks indexed by ``exp`` (or (width,) / (1, width)).
    """
    width = x.shape[-1]
    P = tok.shape[0] if tok is not None else x.shape[0]
    if out is None:
        out = torch.empty(P, width, device=x.device, dtype=out_dtype)
    dummy = x
    pre2 = None if pre is None else pre.reshape(-1, width)
    post2 = None if post is None else post.reshape(-1, width)
    bias2 = None if bias is None else bias.reshape(-1, width)
    grid = (triton.cdiv(P, 16), width // 128)
    _had_kernel[grid](x, out, _hadamard_pm1(str(x.device)), tok if tok is not None else dummy,
                      exp if exp is not None else dummy, pre2 if pre2 is not None else dummy,
                      post2 if post2 is not None else dummy, bias2 if bias2 is not None else dummy,
                      P, width, width, width, HAS_TOK=tok is not None, HAS_EXP=exp is not None,
                      HAS_PRE=pre is not None,
                      HAS_POST=post is not None, HAS_BIAS=bias is not None, BR=16)
    return out


# ------------------------------------------------------------------ decode
def decode_rotated(trellis: torch.Tensor, codebook: str) -> torch.Tensor:
    """Ŵ fp16 (k, n) from an int16 trellis [k/16, n/16, W16]; bit-exact (reference.decode_rotated)."""
    kt, nt, width = trellis.shape
    out = torch.empty(kt * 16, nt * 16, device=trellis.device, dtype=torch.float16)
    tk, tn = 8, min(8, nt)
    while nt % tn:
        tn //= 2
    _kernel(width, codebook, "decode")[(triton.cdiv(kt, tk), nt // tn)](
        trellis, out, kt, nt, nt * 16, TK=tk, TN=tn, num_warps=4)
    return out


# ------------------------------------------------------------------ skinny GEMM / grouped MoE
def _split(kt: int, col_programs: int) -> int:
    """Tile rows per split: multiples of 16 (one loop step), enough programs to fill the GPU."""
    steps = triton.cdiv(kt, 16)
    want = max(1, min(steps, triton.cdiv(TARGET_PROGRAMS, max(col_programs, 1))))
    return 16 * triton.cdiv(steps, want)


def grouped_gemv(xh: torch.Tensor, trellis: torch.Tensor, svh: torch.Tensor, bias, codebook: str,
                 g_row0: torch.Tensor, g_rows: torch.Tensor, g_exp: torch.Tensor, bm: int,
                 row_exp: torch.Tensor | None = None, out_dtype=torch.float16) -> torch.Tensor:
    """y[rows of g] = (xh[rows] @ Ŵ_e) · H ⊙ svh_e + bias_e for each group g of ≤ bm rows.

    ``trellis`` (E, kt, nt, W16), ``svh``/``bias`` (E, n); ``row_exp`` (P,) the expert of every
    row (None: expert 0). Returns (P, n) ``out_dtype``.
    """
    E, kt, nt, width = trellis.shape
    k, n = kt * 16, nt * 16
    P = xh.shape[0]
    y32 = torch.zeros(P, n, device=xh.device, dtype=torch.float32)
    G = g_rows.shape[0]
    tn = 4
    cols = n // (16 * tn)
    split = _split(kt, G * cols if G <= 8 else 4 * cols)
    mode = "fma" if bm == 1 else "dot"
    grid = (G, cols, triton.cdiv(kt, split))
    _kernel(width, codebook, mode)[grid](
        xh, trellis, svh, svh, y32, svh, g_row0, g_rows, g_exp, k, n, kt, nt, kt * nt * width, n, split,
        HAS_BIAS=False, BM=max(bm, 16) if mode == "dot" else 1, TN=tn, num_warps=4)
    return hadamard(y32, post=svh, bias=bias, exp=row_exp, out_dtype=out_dtype)


class TritonLinear:
    """One EXL3 linear on the GPU; ``__call__(x) -> x @ W + bias`` at padded dims."""

    def __init__(self, tensors: dict, codebook: str, device):
        self.device = torch.device(device)
        tr = tensors["trellis"].to(self.device, torch.int16).contiguous()
        self.trellis = tr.unsqueeze(0)
        self.kt, self.nt, self.width = tr.shape
        self.k, self.n = self.kt * 16, self.nt * 16
        self.suh = tensors["suh"].to(self.device, torch.float16).reshape(1, -1).contiguous()
        self.svh = tensors["svh"].to(self.device, torch.float16).reshape(1, -1).contiguous()
        b = tensors.get("bias")
        self.bias = None if b is None else b.to(self.device, torch.float16).reshape(1, -1).contiguous()
        self.codebook = codebook
        z = torch.zeros(1, dtype=torch.int32, device=self.device)
        self._groups = {}
        self._zero = z

    def _group(self, rows: int):
        g = self._groups.get(rows)
        if g is None:
            g = (self._zero, torch.full((1,), rows, dtype=torch.int32, device=self.device), self._zero)
            self._groups[rows] = g
        return g

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.k)
        rows = x2.shape[0]
        if rows > SMALL_ROWS:
            y = self.large(x2)
        else:
            xh = hadamard(x2, pre=self.suh)
            g = self._group(rows)
            bm = 1 if rows == 1 else (16 if rows <= 16 else 32)
            y = grouped_gemv(xh, self.trellis, self.svh, self.bias, self.codebook, *g, bm=bm,
                             out_dtype=x.dtype)
        return y.reshape(*shape[:-1], self.n)

    def large(self, x2: torch.Tensor) -> torch.Tensor:
        xh = hadamard(x2, pre=self.suh)
        w = decode_rotated(self.trellis[0], self.codebook)
        yr = torch.mm(xh, w)
        return hadamard(yr, post=self.svh, bias=self.bias, out_dtype=x2.dtype)


def _triton_factory(tensors: dict, codebook: str, k_bits: float, device):
    return TritonLinear(tensors, codebook, device)


# ------------------------------------------------------------------ MoE
class TritonExperts:
    """One projection (gate, up or down) of many experts with the same K and codebook."""

    def __init__(self, tensors_per_expert: list[dict], codebook: str, device):
        dev = torch.device(device)
        self.trellis = torch.stack([t["trellis"].to(dev, torch.int16) for t in tensors_per_expert]).contiguous()
        self.suh = torch.stack([t["suh"].to(dev, torch.float16) for t in tensors_per_expert]).contiguous()
        self.svh = torch.stack([t["svh"].to(dev, torch.float16) for t in tensors_per_expert]).contiguous()
        bs = [t.get("bias") for t in tensors_per_expert]
        self.bias = None if bs[0] is None else torch.stack([b.to(dev, torch.float16) for b in bs]).contiguous()
        self.codebook = codebook
        self.E, self.kt, self.nt, self.width = self.trellis.shape
        self.k, self.n = self.kt * 16, self.nt * 16

    def __call__(self, x: torch.Tensor, tok: torch.Tensor, exp: torch.Tensor, bm: int = 16) -> torch.Tensor:
        """y[p] = x[tok[p]] @ W_{exp[p]} + bias, (P, n) in x.dtype, without a host sync."""
        plan = route_plan(tok, exp, self.E, bm)
        ys = self.run(x, plan, out_dtype=x.dtype)
        y = torch.empty(tok.shape[0], self.n, device=x.device, dtype=x.dtype)
        y[plan.order] = ys
        return y

    def slots(self, x: torch.Tensor, tok: torch.Tensor, exp: torch.Tensor) -> torch.Tensor:
        """dispatch.make_experts contract (bm 1 for a single slot, else 16)."""
        return self(x, tok, exp, bm=1 if tok.shape[0] == 1 else 16)

    def run(self, x: torch.Tensor, plan: "RoutePlan", tok_sorted: bool = False,
            out_dtype=torch.float32) -> torch.Tensor:
        """(P, n) in the plan's sorted pair order; ``x`` rows are tokens (or, with
        ``tok_sorted``, already the sorted pairs, e.g. the previous projection's output)."""
        if tok_sorted:
            xh = hadamard(x, pre=self.suh, tok=plan.ident, exp=plan.exp_sorted)
        else:
            xh = hadamard(x, pre=self.suh, tok=plan.tok_sorted, exp=plan.exp_sorted)
        return grouped_gemv(xh, self.trellis, self.svh, self.bias, self.codebook,
                            plan.g_row0, plan.g_rows, plan.g_exp, bm=plan.bm, row_exp=plan.exp_sorted,
                            out_dtype=out_dtype)


class RoutePlan:
    """(token, expert) pairs sorted by expert and cut into groups of ≤ bm rows; all on device."""

    def __init__(self, **kw):
        self.__dict__.update(kw)


def route_plan(tok: torch.Tensor, exp: torch.Tensor, n_experts: int, bm: int) -> RoutePlan:
    """Sync-free (CUDA-graph capturable): the grid is P groups, unused ones have 0 rows."""
    P = tok.shape[0]
    dev = tok.device
    exp = exp.to(torch.int64)
    order = torch.argsort(exp, stable=True)
    es = exp[order]
    counts = torch.zeros(n_experts, dtype=torch.int64, device=dev).scatter_add_(0, es, torch.ones_like(es))
    starts = torch.cumsum(counts, 0) - counts
    q = torch.arange(P, device=dev)
    rel = q - starts[es]
    is_start = (rel % bm) == 0
    gid = torch.cumsum(is_start.to(torch.int64), 0) - 1
    slot = torch.where(is_start, gid, torch.full_like(gid, P))
    g = torch.zeros(3, P + 1, dtype=torch.int32, device=dev)
    g[0].scatter_(0, slot, q.to(torch.int32))
    g[1].scatter_(0, slot, torch.clamp(counts[es] - rel, max=bm).to(torch.int32))
    g[2].scatter_(0, slot, es.to(torch.int32))
    return RoutePlan(order=order, tok_sorted=tok.to(torch.int64)[order].to(torch.int32),
                     exp_sorted=es.to(torch.int32), ident=q.to(torch.int32),
                     g_row0=g[0, :P], g_rows=g[1, :P], g_exp=g[2, :P], bm=bm)


def _register() -> None:
    from exl3tools.kernels.dispatch import register_backend, register_experts

    register_backend("triton", _triton_factory)
    register_experts("triton", lambda tensors, codebook, k_bits, device: TritonExperts(tensors, codebook, device))


_register()

"""Compile every Triton kernel variant the GPU paths launch for sm_90 (H200), on a machine without a
GPU: no launch, just Triton's compiler and its bundled ptxas, at real model shapes. Catches what the
CPU interpreter cannot: compile errors, register-allocation failures, shared memory over the H200's
227 KiB, spills, grid dimensions over 65535. Prints one line per variant and a summary; exit 1 if
any variant fails. Use the device image's Triton for parity (3.6):

    pip install --target /tmp/t36 triton==3.6.0
    PYTHONPATH=/tmp/t36 TRITON_INTERPRET=0 python bench/triton_sm90_check.py [fused] [mla] [dsa] [prefill] [absorb]

It replaces triton's JITFunction.run (internal API, checked with 3.6 and 3.9). First found, before
any GPU run: the MLA tf32x3 configuration at 64+ heads needed 488 KiB of shared memory.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.compiler import compile as triton_compile  # noqa: E402
from triton.runtime import jit as _jit  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
BACKEND = make_backend(TARGET)
MAX_SHARED = 232448           # H200 (sm_90) opt-in shared memory per block
PTXAS = Path(triton.__file__).parent / "backends/nvidia/bin/ptxas"
RESULTS: list[tuple[str, bool, str]] = []


def _compile_only(self, *args, grid, warmup, **kwargs):
    kwargs["debug"] = kwargs.get("debug", self.debug)
    binder = _jit.create_function_from_signature(self.signature, self.params, BACKEND)
    bound_args, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = self._pack_args(BACKEND, kwargs, bound_args, specialization, options)
    tag = f"{self.__name__} grid={grid} " + " ".join(
        f"{k}={v}" for k, v in kwargs.items() if k.isupper() or k in ("num_warps", "num_stages"))
    try:
        k = triton_compile(ASTSource(self, signature, constexprs, attrs), target=TARGET, options=options.__dict__)
    except Exception as exc:  # noqa: BLE001 - a failed build is the finding
        RESULTS.append((tag, False, f"{type(exc).__name__}: {str(exc)[:600]}"))
        return None
    info = ""
    if PTXAS.exists():
        with tempfile.TemporaryDirectory() as d:
            p = Path(d) / "k.ptx"
            p.write_text(k.asm["ptx"])
            r = subprocess.run([str(PTXAS), "-v", "--gpu-name=sm_90a", str(p), "-o", str(Path(d) / "k.o")],
                               capture_output=True, text=True)
            info = " ".join(ln.strip() for ln in r.stderr.splitlines() if "Used" in ln or "spill" in ln)
    shared = k.metadata.shared
    dims = grid if isinstance(grid, tuple) else (grid,)
    ok = shared <= MAX_SHARED and all(g <= 65535 for g in dims[1:])
    RESULTS.append((tag, ok, f"shared={shared}{'' if shared <= MAX_SHARED else ' (over 227 KiB)'} {info}"))
    return None


def fused() -> None:
    from exl3tools.kernels import fused_decode as fk

    bf16, f16 = torch.bfloat16, torch.float16
    for T, H in ((1, 4096), (8, 7168), (3, 2880), (1, 5120)):
        h, w, K = torch.zeros(T, H), torch.ones(H), 8
        fk.residual_rmsnorm(h, w, 1e-5)
        fk.residual_rmsnorm(h, w, 1e-5, delta=torch.zeros(T, H))
        fk.residual_rmsnorm(h, w, 1e-5, delta=torch.zeros(T, H), y=torch.zeros(T * K, H + 64, dtype=bf16),
                            wk=torch.zeros(T * K))
        fk.residual_rmsnorm(h, w, 1e-5, y=torch.zeros(T * K + 9, H, dtype=bf16), wk=torch.zeros(T * K),
                            y_rows=torch.zeros(T * K, dtype=torch.int32))
        fk.residual_rmsnorm(h, w, 1e-5, delta=torch.zeros(T, H), with_fp16=True)   # an MLA router's input
        fk.embed_rmsnorm(torch.zeros(1000, H, dtype=bf16), torch.zeros(T, dtype=torch.int64), w, 1e-5)
    for T, nq, nkv, hd, rdim, norm, kvdt in ((1, 32, 8, 128, 128, True, bf16), (4, 64, 8, 128, 64, False, f16),
                                             (2, 16, 2, 256, 64, True, torch.float32), (2, 96, 8, 128, 64, False, bf16)):
        q, k, v = (torch.zeros(T, n * hd, dtype=bf16) for n in (nq, nkv, nkv))
        cos = sin = torch.zeros(T, rdim // 2)
        kp, vp = torch.zeros(64, nkv, hd, dtype=kvdt), torch.zeros(64, nkv, hd, dtype=kvdt)
        qn = torch.ones(hd) if norm else None
        fk.qk_rope_store(q, k, v, cos, sin, torch.zeros(T, dtype=torch.int64), rdim, kp, vp, qn, qn)
    for E, k, routing, norm, bias, shared in ((128, 8, "softmax", True, False, False), (256, 8, "sigmoid", True, True, True),
                                             (160, 6, "softmax", False, False, True), (512, 10, "sigmoid", True, True, True)):
        fk.route(torch.zeros(4, E), k, routing, norm, 2.5, torch.zeros(E) if bias else None,
                 torch.arange(E, dtype=torch.int32), E, shared)
    for E, shared in ((256, True), (16, False)):       # Fp16ChoiceMoE's pick (the MLA models' fused step)
        fk.route(torch.zeros(4, E), 8 if E > 16 else 4, "sigmoid", True, 2.5, torch.zeros(E),
                 torch.arange(E, dtype=torch.int32), E, shared, choice_logits=torch.zeros(4, E))
    from exl3tools.kernels import fused_mla as fm

    for T, H, nope, dt in ((1, 64, 192, f16), (8, 128, 128, f16), (64, 128, 128, bf16), (3, 2, 128, torch.float32)):
        cos = sin = torch.zeros(T, 32)
        fm.latent_store(torch.zeros(T, 576), 512, 64, torch.ones(512), 1e-6, cos, sin, torch.zeros(T, dtype=torch.int64),
                        torch.zeros(64, 512, dtype=dt), torch.zeros(64, 64, dtype=dt))
        fm.rope_heads(torch.zeros(T, H, nope + 64), nope, 64, cos, sin)
        fm.index_key_store(torch.zeros(T, 128), torch.ones(128), torch.zeros(128), 1e-6, 64, cos, sin,
                           torch.zeros(T, dtype=torch.int64), torch.zeros(64, 128, dtype=dt))
        fm.index_queries(torch.zeros(T, 32 * 128, dtype=dt), 32, 128, 64, cos, sin)
    from exl3tools.kernels import expert_groups as eg

    for S, P, NE in ((18, 9, 129), (72, 9, 129), (504, 9, 257), (64, 8, 128)):
        eg.group_pairs(torch.zeros(S, dtype=torch.int32), P, NE)
    for R, N in ((8, 18432), (1, 1536), (72, 768)):
        fk.silu_mul(torch.zeros(R, N, dtype=bf16), torch.zeros(R, N, dtype=bf16))


def mla() -> None:
    from exl3tools.kernels import mla_attention as ma

    B, C, R, bs, W = 4, 512, 64, 64, 32
    for H in (8, 16, 64, 128):
        for prec in ("ieee", "tf32x3"):
            for splits in (1, 8):
                for K in (None, 2048):
                    # fp16 planes at one split too: DSA prompt rows (attend_selected) take it
                    for dt in (torch.float32, torch.float16):
                        sel = None if K is None else torch.zeros(B, K, dtype=torch.int32)
                        ma.mla_decode(torch.zeros(B, H, C), torch.zeros(B, H, R), torch.zeros(16, bs, C, dtype=dt),
                                      torch.zeros(16, bs, R, dtype=dt), torch.zeros(B, W, dtype=torch.int32),
                                      torch.ones(B, dtype=torch.int32), 0.1, sel=sel, num_splits=splits,
                                      precision=prec)
        if H >= 32:      # fp16 planes at other tiles: DSA prompt rows (attend_selected: 32 x 32) and the
            # EXL3TOOLS_MLA_TILE candidates bench/gpu_mla_attention.py --sweep times
            # 64-head blocks take fp16 queries (mla_attention.Q16_MIN_HB): no spills at TN 16 / 32
            for hb, tn in ((32, 64), (32, 32), (32, 16), (16, 32), (16, 64)) + (((64, 16), (64, 32)) if H >= 64 else ()):
                for splits in (1, 8):
                    for K in (None, 2048):
                        ma.mla_decode(torch.zeros(B, H, C), torch.zeros(B, H, R),
                                      torch.zeros(16, bs, C, dtype=torch.float16), torch.zeros(16, bs, R, dtype=torch.float16),
                                      torch.zeros(B, W, dtype=torch.int32), torch.ones(B, dtype=torch.int32), 0.1,
                                      sel=None if K is None else torch.zeros(B, K, dtype=torch.int32),
                                      num_splits=splits, head_block=hb, tile_n=tn, num_warps=8)
                ma.mla_decode(torch.zeros(B, H, C), torch.zeros(B, H, R),      # the split-dots probe
                              torch.zeros(16, bs, C, dtype=torch.float16), torch.zeros(16, bs, R, dtype=torch.float16),
                              torch.zeros(B, W, dtype=torch.int32), torch.ones(B, dtype=torch.int32), 0.1,
                              num_splits=splits, head_block=hb, tile_n=tn, num_warps=8, split_dots=True)


def dsa() -> None:
    from exl3tools.kernels import dsa_indexer as di

    for NH, D, bs, dt in ((64, 128, 64, torch.float32), (32, 128, 16, torch.float32), (64, 128, 256, torch.float32),
                          (64, 128, 64, torch.float16), (32, 128, 64, torch.float16), (64, 128, 64, torch.bfloat16)):
        for tc in ((False, True) if dt == torch.float16 else (False,)):
            for hist in (None, torch.zeros(4, 256, dtype=torch.int32)):   # the chunked top-k's pass 1 inside
                # head weights as the decode step passes them: columns of the key projection
                di.paged_scores(torch.zeros(4, NH, D), torch.zeros(4, D + NH)[:, D:], torch.zeros(16, bs, D, dtype=dt),
                                torch.zeros(4, 32, dtype=torch.int32), torch.ones(4, dtype=torch.int32), 0.1,
                                tensor_cores=tc, hist=hist)
    for T in (4352, 131072):       # the top-k kernels (one program a row; chunks in parallel)
        for fn in (di.topk_select, di.topk_select_chunked):
            fn(torch.zeros(8, T), torch.ones(8, dtype=torch.int32), 2048)
        di.topk_select_chunked(torch.zeros(8, T), torch.ones(8, dtype=torch.int32), 2048,
                               hist=torch.zeros(8, 256, dtype=torch.int32))


def prefill() -> None:
    from exl3tools.kernels import paged_attention as pa

    for nq, nkv, D, dt in ((96, 8, 128, torch.float16), (32, 8, 128, torch.bfloat16), (64, 4, 64, torch.float16),
                           (16, 2, 256, torch.float16), (8, 2, 64, torch.float32)):
        for tiles in (None, torch.zeros(2 * 40, dtype=torch.int32)):     # long_graphs' fixed grid of tiles
            pa.paged_prefill(torch.zeros(100, nq, D, dtype=torch.float16 if dt == torch.float32 else dt),
                             torch.zeros(64, nkv, D, dtype=dt), torch.zeros(64, nkv, D, dtype=dt),
                             torch.zeros(2, 64, dtype=torch.int32), torch.tensor([0, 50, 100], dtype=torch.int32),
                             torch.tensor([50, 60], dtype=torch.int32), 0.1, 50, tiles=tiles)


def absorb() -> None:
    from exl3tools.kernels import mla_absorb as mb

    # DeepSeek-V3's 128 heads (nope 128, latent 512, v 128), GLM-5's 64 (nope 192, v 256): one decode
    # row (the row kernel), decode rows (the small row block) and a prompt chunk's, both products
    # (W_UV read transposed)
    for H, N, V in ((128, 128, 128), (64, 192, 256)):
        for T in (1, 8, 16, 2048):
            mb.absorb(torch.zeros(T, H, N + 64)[..., :N], torch.zeros(H, N, 512, dtype=torch.float16))
            mb.absorb(torch.zeros(T, H, 512), torch.zeros(H, V, 512, dtype=torch.float16), transpose=True)
        # the dot kernel's k splits at decode rows, IEEE and tf32x3 (bench/gpu_mla_absorb.py --sweep)
        for tile in ((32, 64, 4, 4), (128, 32, 8, 2)):
            for prec in ("ieee", "tf32x3"):
                mb.absorb(torch.zeros(8, H, 512), torch.zeros(H, V, 512, dtype=torch.float16), transpose=True,
                          tile=tile, precision=prec)
        mb.absorb(torch.zeros(2048, H, 512), torch.zeros(H, V, 512, dtype=torch.float16), transpose=True,
                  precision="tf32x3")
        # a prompt's rows on tensor cores: every wide tile of bench/gpu_mla_absorb.py --sweep-rows 2048,
        # tf32x2 (W_UK, and W_UV stored (H, latent, v)); tf32x3 at the default's
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from gpu_mla_absorb import sweep_tiles
        for wt in sweep_tiles(2048, False):
            mb.absorb(torch.zeros(2048, H, N), torch.zeros(H, N, 512, dtype=torch.float16), precision="tf32x2",
                      wide_rows=2048, wide_tile=wt)
            mb.absorb(torch.zeros(2048, H, 512), torch.zeros(H, 512, V, dtype=torch.float16), precision="tf32x2",
                      wide_rows=2048, wide_tile=wt)
        # W_UV stored (H, latent, v) (the mla_w16_vt preview): read transposed with v contiguous
        for T in (1, 8):
            mb.absorb(torch.zeros(T, H, 512), torch.zeros(H, 512, V, dtype=torch.float16).transpose(1, 2),
                      transpose=True)
        # the row kernel at decode rows (a program per row; bench/gpu_mla_absorb.py --sweep)
        mb.absorb(torch.zeros(8, H, N), torch.zeros(H, N, 512, dtype=torch.float16), row_rows=16)
        mb.absorb(torch.zeros(8, H, 512), torch.zeros(H, V, 512, dtype=torch.float16), transpose=True, row_rows=16)


def main(argv: list[str]) -> int:
    parts = {"fused": fused, "mla": mla, "dsa": dsa, "prefill": prefill, "absorb": absorb}
    which = argv or list(parts)
    bad = [w for w in which if w not in parts]
    if bad:
        print(f"unknown part {bad[0]!r}; choose from {', '.join(parts)}", file=sys.stderr)
        return 2
    _jit.JITFunction.run = _compile_only
    for w in which:
        try:
            parts[w]()
        except Exception as exc:  # noqa: BLE001 - a wrapper that cannot even reach its launch
            RESULTS.append((f"{w} wrapper", False, f"{type(exc).__name__}: {exc}"))
    for tag, ok, info in RESULTS:
        print("ok  " if ok else "FAIL", tag, info[:300])
    fails = sum(not ok for _, ok, _ in RESULTS)
    print(f"triton {triton.__version__}, sm_90: {len(RESULTS) - fails} ok, {fails} failed")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Decode-step benchmark on a GLM-4.5-Air-shaped layer: our kernels vs exllamav3's, CUDA graphs.

    python3 bench/gpu_e2e.py [--layers 6] [--json OUT.json]

Part 1 (always): one MoE decoder layer's linears with GLM-4.5-Air dims (hidden 4096, q 96x128 with
bias, k/v 8x128 with bias, o 12288->4096, 128 routed experts of width 1408 top-8 sigmoid + 1 shared
expert), every linear K=3 MUL1, random trellis, built on the device. The attention core (RoPE,
softmax over the cache) is NOT included; a step is: q,k,v -> o (fed with q) -> router -> experts
(gate, up, silu*up, down, weighted sum) + shared expert. Batch 1 and 8, captured in a CUDA graph,
median of replays with cold L2.
- ours: grouped MoE (one launch per projection over all routed experts), dynamic routing.
- exllamav3: the same step from exllamav3's LinearEXL3 (its fused <=144-row kernels), one call per
  routed (token, expert) pair; routing fixed at capture time (its own fused MoE kernel needs its
  model classes; the exllamav3 model-forward figure for this layer is quoted in docs/gpu.md).
Reports µs per layer step, the weight bytes the step must read, and the fraction of the HBM
roofline (bytes / 4.26 TB/s over the time).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F
from triton.testing import do_bench

HBM = 4.26e12
H, NQ, NKV, HD, E, TOPK, I_MOE = 4096, 96, 8, 128, 128, 8, 1408
K = 3


def rand_lin(k, n, bias, gen):
    t = dict(trellis=torch.randint(-32768, 32768, (k // 16, n // 16, 16 * K), dtype=torch.int16, device="cuda",
                                   generator=gen),
             suh=((torch.randint(0, 2, (k,), device="cuda", generator=gen) * 2 - 1) * 0.5).half(),
             svh=((torch.randint(0, 2, (n,), device="cuda", generator=gen) * 2 - 1) * 0.02).half())
    if bias:
        t["bias"] = (torch.randn(n, device="cuda", generator=gen) * 0.01).half()
    return t


def lin_bytes(t):
    return t["trellis"].numel() * 2 + 2 * (t["suh"].numel() + t["svh"].numel())


class Layer:
    def __init__(self, gen):
        self.attn = {n: rand_lin(H, o, b, gen) for n, o, b in
                     (("q", NQ * HD, True), ("k", NKV * HD, True), ("v", NKV * HD, True))}
        self.attn["o"] = rand_lin(NQ * HD, H, False, gen)
        self.experts = {p: [rand_lin(H if p != "down" else I_MOE, I_MOE if p != "down" else H, False, gen)
                            for _ in range(E)] for p in ("gate", "up", "down")}
        self.shared = {p: rand_lin(H if p != "down" else I_MOE, I_MOE if p != "down" else H, False, gen)
                       for p in ("gate", "up", "down")}
        self.router = (torch.randn(E, H, device="cuda", generator=gen) * 0.02).half()
        self.score_bias = torch.zeros(E, device="cuda")

    def bytes_per_step(self, n_experts_touched):
        b = sum(lin_bytes(t) for t in self.attn.values()) + sum(lin_bytes(t) for t in self.shared.values())
        b += n_experts_touched * sum(lin_bytes(self.experts[p][0]) for p in ("gate", "up", "down"))
        return b + self.router.numel() * 2

    def route(self, h):
        scores = torch.sigmoid(h.float() @ self.router.float().t())
        sel = torch.topk(scores + self.score_bias, TOPK, dim=-1).indices
        w = scores.gather(1, sel)
        return sel, w / (w.sum(-1, keepdim=True) + 1e-20)


def ours_step(layer):
    from exl3tools.kernels.triton_exl3 import TritonExperts, TritonLinear, route_plan

    attn = {n: TritonLinear(t, "mul1", "cuda") for n, t in layer.attn.items()}
    shared = {n: TritonLinear(t, "mul1", "cuda") for n, t in layer.shared.items()}
    ex = {p: TritonExperts(layer.experts[p], "mul1", "cuda") for p in ("gate", "up", "down")}

    def step(h):
        q = attn["q"](h)
        attn["k"](h)
        attn["v"](h)
        h2 = h + attn["o"](q)
        sel, w = layer.route(h2)
        B = h.shape[0]
        tok = torch.arange(B, device="cuda", dtype=torch.int32).repeat_interleave(TOPK)
        plan = route_plan(tok, sel.flatten().to(torch.int32), E, bm=1 if B == 1 else 16)
        g = ex["gate"].run(h2, plan)
        u = ex["up"].run(h2, plan)
        a = (F.silu(g) * u).half()
        d = ex["down"].run(a, plan, tok_sorted=True)
        out = torch.zeros(B, H, device="cuda", dtype=torch.float32)
        out.index_add_(0, plan.tok_sorted.long(), d * w.flatten()[plan.order][:, None])
        s = shared["down"]((F.silu(shared["gate"](h2).float()) * shared["up"](h2).float()).half())
        return (h2.float() + out + s.float()).half()

    return step


def exl3_step(layer, sel_fixed):
    from exl3tools.kernels.exllamav3_backend import Exl3Linear

    attn = {n: Exl3Linear(t, "mul1", "cuda") for n, t in layer.attn.items()}
    shared = {n: Exl3Linear(t, "mul1", "cuda") for n, t in layer.shared.items()}
    used = sorted({int(e) for e in sel_fixed.flatten().tolist()})
    ex = {p: {e: Exl3Linear(layer.experts[p][e], "mul1", "cuda") for e in used} for p in ("gate", "up", "down")}
    pairs = [(b, int(e), j) for b in range(sel_fixed.shape[0]) for j, e in enumerate(sel_fixed[b].tolist())]

    def step(h):
        q = attn["q"](h)
        attn["k"](h)
        attn["v"](h)
        h2 = h + attn["o"](q)
        sel, w = layer.route(h2)          # computed (same cost) but the pairs are fixed
        out = torch.zeros(h.shape[0], H, device="cuda", dtype=torch.float32)
        for b, e, j in pairs:
            x = h2[b:b + 1]
            a = F.silu(ex["gate"][e](x)) * ex["up"][e](x)
            out[b] += ex["down"][e](a)[0].float() * w[b, j]
        s = shared["down"](F.silu(shared["gate"](h2)) * shared["up"](h2))
        return (h2.float() + out + s.float()).half()

    return step


def graph_time(step, h):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            step(h)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = step(h)
    g.replay()
    torch.cuda.synchronize()
    t_graph = do_bench(g.replay, warmup=25, rep=200, return_mode="median") * 1e3
    t_eager = do_bench(lambda: step(h), warmup=10, rep=100, return_mode="median") * 1e3
    return t_graph, t_eager, out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--no-exl3", action="store_true")
    a = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    layer = Layer(gen)
    results = []
    impls = [("ours", None)]
    if not a.no_exl3:
        try:
            import exllamav3.ext  # noqa: F401
            impls.append(("exllamav3", None))
        except Exception as exc:  # noqa: BLE001
            print(f"exllamav3 unavailable: {exc}", file=sys.stderr)
    for B in (1, 8):
        h = (torch.randn(B, H, device="cuda", generator=gen) * 0.5).half()
        sel, _ = layer.route(h + 0)
        touched = len({int(e) for e in sel.flatten().tolist()})
        nbytes = layer.bytes_per_step(touched)
        row = dict(batch=B, experts_touched=touched, bytes=nbytes, floor_us=nbytes / HBM * 1e6)
        outs = {}
        for name, _ in impls:
            step = ours_step(layer) if name == "ours" else exl3_step(layer, sel)
            tg, te, out = graph_time(step, h)
            row[f"{name}_graph_us"], row[f"{name}_eager_us"] = tg, te
            outs[name] = out.float()
        if len(outs) == 2:
            row["rel_diff"] = float((outs["ours"] - outs["exllamav3"]).norm() / outs["exllamav3"].norm())
        results.append(row)
        print(json.dumps(row), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    print(f"{'batch':>5} {'experts':>7} {'MB':>7} {'floor':>7} | {'ours graph':>10} {'eager':>8} | "
          f"{'exl3 graph':>10} {'eager':>8} | {'ours/exl3':>9} {'%roofline ours':>14}")
    for r in results:
        o, e = r["ours_graph_us"], r.get("exllamav3_graph_us")
        print(f"{r['batch']:>5} {r['experts_touched']:>7} {r['bytes'] / 1e6:7.1f} {r['floor_us']:7.1f} | {o:10.1f} "
              f"{r['ours_eager_us']:8.1f} | {e if e else float('nan'):10.1f} "
              f"{r.get('exllamav3_eager_us', float('nan')):8.1f} | {(o / e) if e else float('nan'):9.2f} "
              f"{100 * r['floor_us'] / o:13.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())

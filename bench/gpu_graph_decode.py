"""GPU decode step time: eager runtime vs GraphDecoder without and with CUDA graphs (same run).

Per GQA fixture and GPU backend: ms per decode step of ``batch`` rows for CausalLM.forward (packed
eager step), GraphDecoder(graphs=False) (static cache, sync-free step) and GraphDecoder(graphs=True)
(replayed CUDA graph), with the graph's speed-up over eager. Needs CUDA:
``python bench/gpu_graph_decode.py [--batch 3] [--max-len 512] [--backends triton,cuda]``.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch

from exl3tools.runtime.graph_decode import GraphDecoder
from exl3tools.runtime.runner import load_runner

REPO = Path(__file__).resolve().parent.parent
FIXTURES = Path(os.environ.get("EXL3TOOLS_FIXTURES", REPO.parent / "shared" / "fixtures"))
GQA = ["llama-4.0bpw-mul1", "qwen3_moe-2.5bpw-mul1", "glm4_moe-3.0bpw-mcg"]
STEPS = 100


def per_step(fn) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(STEPS):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / STEPS * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=3)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--backends", default="triton,cuda")
    a = ap.parse_args()
    prompts = [[1 + (7 * i + j) % 1000 for j in range(4 + 3 * i)] for i in range(a.batch)]
    print(f"batch {a.batch}, max_len {a.max_len}, ms per decode step (mean of {STEPS} after 3 warm-ups)")
    print(f"{'backend':8} {'model':24} {'eager':>8} {'static':>8} {'graph':>8} {'eager/graph':>12}")
    for backend in a.backends.split(","):
        for name in GQA:
            model = load_runner(FIXTURES / name / "model", device="cuda", backend=backend).model
            toks = torch.full((a.batch,), 3, device="cuda")
            row = {}
            for graphs in (False, True):
                gd = GraphDecoder(model, a.batch, a.max_len, graphs=graphs)
                gd.prefill(prompts)
                row[graphs] = per_step(lambda gd=gd, toks=toks: gd.step(toks))
            caches = [model.new_cache() for _ in prompts]
            model.forward(list(zip(caches, prompts, strict=True)))
            eager = per_step(lambda m=model, cs=caches: m.forward([(c, [3]) for c in cs]))
            print(f"{backend:8} {name:24} {eager:8.2f} {row[False]:8.2f} {row[True]:8.2f} {eager / row[True]:11.1f}x")


if __name__ == "__main__":
    main()

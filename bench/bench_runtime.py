"""CPU runtime throughput on the fixtures: prefill tok/s, decode tok/s (1 and 8 sequences).

Side-by-side ratio: batched decode (8 sequences, one packed forward per step) vs single-sequence
decode, measured in the same run. Run with `make bench` or `python bench/bench_runtime.py`.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
from _timing import best_of

from exl3tools.runtime.runner import load_runner

REPO = Path(__file__).resolve().parent.parent
FIXTURES = Path(os.environ.get("EXL3TOOLS_FIXTURES", REPO.parent / "shared" / "fixtures"))
MODELS = [("demo glm4_moe-3.0bpw-mcg", REPO / "demo" / "glm4_moe-3.0bpw-mcg" / "model")] + [
    (n, FIXTURES / n / "model") for n in ("llama-4.0bpw-mul1", "qwen3_moe-2.5bpw-mul1", "glm4_moe-3.0bpw-mcg",
                                          "glm4_moe-tp-2.0bpw-mul1")]
PREFILL, DECODE, BATCH = 256, 32, 8


def bench(path: Path) -> dict:
    t0 = time.perf_counter()
    r = load_runner(path)
    load = time.perf_counter() - t0
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, r.vocab_size, (PREFILL,), generator=g).tolist()
    seq = iter(range(10_000))

    def prefill_once():
        s = f"p{next(seq)}"
        r.add_sequence(s)
        r.step([(s, prompt)])
        r.free_sequence(s)

    prefill_once()  # warm-up: first-call allocations and kernel selection at this length
    prefill = PREFILL / best_of(prefill_once, warmup=False)
    r.add_sequence(0)
    r.step([(0, prompt[:64])])
    dec1 = DECODE / best_of(lambda: [r.step([(0, [prompt[i]])]) for i in range(DECODE)], warmup=False)
    for s in range(1, BATCH):
        r.add_sequence(s)
        r.step([(s, prompt[:64])])
    decb = BATCH * DECODE / best_of(lambda: [r.step([(s, [prompt[i]]) for s in range(BATCH)]) for i in range(DECODE)], warmup=False)
    r.close()
    return {"load_s": load, "prefill": prefill, "dec1": dec1, "decb": decb}


def main() -> int:
    print(f"CPU runtime, reference backend, {torch.get_num_threads()} threads; prefill {PREFILL} tokens, "
          f"decode {DECODE} steps (best of 3)")
    print(f"{'model':30} {'load s':>7} {'prefill tok/s':>14} {'decode tok/s':>13} "
          f"{f'decode x{BATCH} tok/s':>17} {'batch ratio':>12}")
    for name, path in MODELS:
        if not (path / "config.json").is_file():
            print(f"{name:30} (not found, skipped)")
            continue
        m = bench(path)
        print(f"{name:30} {m['load_s']:7.2f} {m['prefill']:14.1f} {m['dec1']:13.1f} {m['decb']:17.1f} "
              f"{m['decb'] / m['dec1']:11.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())

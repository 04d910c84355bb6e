"""Issue 9: tensor-parallel runs over NCCL on several GPUs, checked against TP=1.

For each fixture: rank-slice it (tp N, --moe tp and ep), then run the prompt p16 and 4
teacher-forced decode steps with TP=1 on one GPU and with TP=N over NCCL; print the max abs logit
difference (goal: fp16 tolerance) and the load time of the sliced layout vs the unsliced checkpoint
cut in memory. Runs on CPU/gloo too (--device cpu) so the logic is checked without a GPU.

    python bench/multigpu_tp.py --fixtures DIR --tp 2 [--device cuda]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from exl3tools.runtime.runner import load_runner

FIXTURES = ("glm4_moe-tp-2.0bpw-mul1", "glm5_moe_dsa-tp-4.0bpw-mcg")


def run(path: Path, tp: int, device: str, moe: str, prompt: list[int], steps: list[int]):
    t0 = time.perf_counter()
    r = load_runner(path, tp=tp, device=device, moe=moe)
    load_s = time.perf_counter() - t0
    try:
        r.add_sequence(0)
        prompt_logits = r.step([(0, prompt)], all_logits=True).float().cpu()
        rows = torch.stack([r.step([(0, [t])])[0].float().cpu() for t in steps])
    finally:
        r.close()
    return load_s, prompt_logits, rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fixtures", type=Path, required=True)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--names", default=",".join(FIXTURES))
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="tp_"))
    rows_out = []
    try:
        for name in a.names.split(","):
            src = a.fixtures / name / "model"
            g = load_file(str(a.fixtures / name / "goldens_logits.safetensors"))
            prompt, steps = g["prompt_p16"].tolist(), g["exl3_greedy_p16"][:4].tolist()
            _, p1, s1 = run(src, 1, a.device, "tp", prompt, steps)
            gold = (p1 - g["exl3_logits_p16"]).abs().max().item()
            for moe in ("tp", "ep"):
                dst = work / f"{name}-{moe}"
                t0 = time.perf_counter()
                subprocess.run([sys.executable, "-m", "exl3tools.cli", "rank-slice", str(src), str(dst),
                                "--tp", str(a.tp), "--moe", moe], check=True, capture_output=True)
                slice_s = time.perf_counter() - t0
                load_sliced, pn, sn = run(dst, a.tp, a.device, moe, prompt, steps)
                load_unsliced, _, _ = run(src, a.tp, a.device, moe, prompt[:2], steps[:1])
                d = max((pn - p1).abs().max().item(), (sn - s1).abs().max().item())
                rows_out.append((name, moe, gold, d, slice_s, load_sliced, load_unsliced))
                print(f"{name} moe={moe}: TP{a.tp} vs TP1 max|dlogit| {d:.2e}; TP1 vs exl3 golden {gold:.2e}; "
                      f"slice {slice_s:.1f}s load sliced {load_sliced:.2f}s unsliced {load_unsliced:.2f}s", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"\n| fixture | moe | TP1 vs golden | TP{a.tp} vs TP1 | load sliced s | load unsliced (cut in memory) s |")
    print("|---|---|---|---|---|---|")
    for name, moe, gold, d, _, ls, lu in rows_out:
        print(f"| {name} | {moe} | {gold:.2e} | {d:.2e} | {ls:.2f} | {lu:.2f} |")
    bad = [r for r in rows_out if r[3] > 2e-2]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

"""The DSA top-k on the GPU (kernels/dsa_indexer.py): where a GLM-5 decode step's long-context cost goes.

    python3 bench/gpu_topk.py [--batches 1,8,32] [--widths 4096,32768,131072,202752] [--tbs 512,1024,2048,4096]
        [--warps 4,8] [--profile] [--json OUT.json]

Scores as the indexer writes them (fp16 values in float32, every row at the table's full length,
index_topk 2048), timed as CUDA-graph replays (median µs, gpu_bench.bench_graph): topk_select (one
program a row), topk_select_chunked at its defaults and at every chunk size x warps of the sweep,
each checked against runtime.dsa.topk_positions (the same set of positions a row). --profile: the
chunked kernels' launches one by one (torch.profiler) at batch 1, so a fixed cost per launch shows
apart from the work. The scores kernel is not timed here (bench/gpu_mla_attention.py's indexer
columns time scores + top-k together).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_bench import bench_graph  # noqa: E402  (bench/ is not a package)

TOPK = 2048


def scores(B: int, T: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(B, T, device="cuda", generator=gen).to(torch.float16).float()


def same_sets(got: torch.Tensor, want: torch.Tensor) -> bool:
    return bool(torch.equal(got.sort(1).values, want.sort(1).values))


def parse_ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def profile_launches(fn) -> list[tuple[str, float]]:
    """(kernel, µs) of one call, by torch.profiler's CUDA activity."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    out = []
    for e in prof.events():
        if e.device_type.name == "CUDA":
            out.append((e.name[:60], e.device_time if hasattr(e, "device_time") else e.cuda_time))
    return out


def measure(di, topk_positions, B: int, T: int, tbs: list[int], warps: list[int], gen) -> dict:
    """One (batch, width): both kernels and the chunked sweep, timed and checked."""
    s = scores(B, T, gen)
    lens = torch.full((B,), T, dtype=torch.int32, device="cuda")
    want = topk_positions(s, lens, TOPK)
    r = {"B": B, "width": T, "ok": True, "sweep": {}}
    calls = {"one_per_row": lambda: di.topk_select(s, lens, TOPK),
             "chunked": lambda: di.topk_select_chunked(s, lens, TOPK)}
    calls.update({f"{tb}x{w}": (lambda tb=tb, w=w: di.topk_select_chunked(s, lens, TOPK, tb=tb, warps=w))
                  for tb in tbs for w in warps})
    for name, fn in calls.items():
        r["ok"] &= same_sets(fn(), want)
        us = bench_graph(fn)
        if name in ("one_per_row", "chunked"):
            r[name] = us
        else:
            r["sweep"][name] = us
    return r


def profile_chunked(di, T: int, gen) -> list[tuple[str, float]]:
    s = scores(1, T, gen)
    lens = torch.full((1,), T, dtype=torch.int32, device="cuda")
    return profile_launches(lambda: di.topk_select_chunked(s, lens, TOPK))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=parse_ints, default=[1, 8, 32])
    ap.add_argument("--widths", type=parse_ints, default=[4096, 32768, 131072, 202752])
    ap.add_argument("--tbs", type=parse_ints, default=[512, 1024, 2048, 4096])
    ap.add_argument("--warps", type=parse_ints, default=[4, 8])
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    from exl3tools.kernels import dsa_indexer as di

    from exl3tools.runtime.dsa import topk_positions

    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    print(f"{'B':>3} {'width':>7} | {'one/row':>8} {'chunked':>8} | best chunk x warps (µs) | all ok")
    for B in a.batches:
        for T in a.widths:
            r = measure(di, topk_positions, B, T, a.tbs, a.warps, gen)
            best = min(r["sweep"].items(), key=lambda kv: kv[1])
            print(f"{B:>3} {T:>7} | {r['one_per_row']:8.1f} {r['chunked']:8.1f} | {best[0]:>9} {best[1]:7.1f} | "
                  f"{r['ok']}   " + " ".join(f"{k}:{v:.1f}" for k, v in r["sweep"].items()), flush=True)
            rows.append(r)
    if a.profile:
        for T in a.widths:
            print(f"--- profile: topk_select_chunked, batch 1, width {T}")
            for name, us in profile_chunked(di, T, gen):
                print(f"  {us:8.1f} us  {name}")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())

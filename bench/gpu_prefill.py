"""Prefill on the GPU, piece by piece: the MoE layer's paths and whole eager forwards.

    python3 bench/gpu_prefill.py CKPT [--tokens 1,8,32,256,2048] [--long 30000] [--json OUT.json]
    python3 bench/gpu_prefill.py CKPT --long 30000 --long-only --long-variants "default:;dense:EXL3TOOLS_DSA_SPARSE_PREFILL=0"

On the synthetic GLM-4.5-Air-shaped checkpoint (bench/synth_checkpoint.py), one run prints:
- one MoE layer at T tokens (T x top_k (token, expert) pairs): ``pairs`` (one row per pair, each
  decodes its expert), ``tiles`` (expert-sorted tiles, runtime.layers.expert_tiles), and ``loop``
  (host-grouped loop over experts) where T x top_k > 512; CUDA events, median of 5;
- whole eager forwards through the paged pool as serve runs them (``Runner.step`` of one new
  sequence: T-token prompt; and 8 sequences x 32 tokens), ms and tok/s, with the peak of
  ``torch.cuda.max_memory_allocated`` above the weights and KV pool;
- a torch.profiler table (top CUDA kernels) of the 2048-token forward;
- the eager step a new 32-token prompt makes beside 8 sequences decoding at a 4096-token history
  (ms, the path the runner took, top kernels by CUDA and CPU time);
- ``--long N``: one N-token prompt in 2048-token chunks as serve runs it (``--max-prefill-tokens``
  on CUDA), each chunk's ms, and the profile of the last chunk (the one with the longest history),
  cold, warm and profiled, once per ``--long-variants`` entry, then a summary table (a 30000-token
  GLM-5 prompt: 5.6 s dense under the DSA mask, 1.74 s warm over the selected keys, H200);
  ``--long-only`` skips everything else.
Nothing here runs in CI.
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def cuda_time(fn, reps: int = 5) -> float:
    import torch

    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("ckpt")
    ap.add_argument("--tokens", default="1,8,16,32,64,256,2048")
    ap.add_argument("--long", type=int, default=0, help="also one prompt of this many tokens in 2048-token chunks")
    ap.add_argument("--long-only", action="store_true", help="only the --long prompt (no MoE, forwards, profiles)")
    ap.add_argument("--long-variants", default="",
                    help='the --long prompt once per "NAME:VAR=1,VAR2=0;NAME2:..." (variables set for that '
                         "variant only; preview switches are read per call), each cold then warm")
    ap.add_argument("--forwards-only", action="store_true",
                    help="the MoE layer and forward tables only (no profiles, no mixed step): one variant a process")
    ap.add_argument("--ab", default="",
                    help='the 1 x --ab-tokens forward once per "NAME:VAR=1;NAME2:VAR=0" variant, the variants '
                         "interleaved in --ab-rounds rounds (an A/B in one process: this machine's "
                         "process-to-process spread is 5-10 %%), medians and ratios to the first")
    ap.add_argument("--ab-rounds", type=int, default=7)
    ap.add_argument("--ab-tokens", type=int, default=2048, help="the A/B's prompt length (256: the dense linears "
                    "of 65-256 rows)")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    import torch

    from exl3tools.runtime.layers import MoE, tile_rows
    from exl3tools.runtime.runner import load_runner

    torch.manual_seed(0)
    runner = load_runner(a.ckpt, device="cuda", max_cache_tokens=40000, max_num_seqs=32)
    model = runner.model
    moe = next(layer.mlp for layer in model.layers if isinstance(layer.mlp, MoE))
    H = model.info.hidden_size
    res: dict = {"moe": [], "forward": []}
    if a.long_only:
        res["long"] = long_variants(runner, a.long, a.long_variants)
        if a.json:
            a.json.write_text(json.dumps(res, indent=1))
        runner.close()
        return 0
    print("| tokens | pairs | tile rows | pairs ms | tiles ms | loop ms | tiles/pairs |")
    print("|---|---|---|---|---|---|---|")
    with torch.inference_mode():
        for T in [int(t) for t in a.tokens.split(",")]:
            x = torch.randn(T, H, device="cuda")
            S = T * moe.top_k
            row = {"tokens": T, "pairs": S, "tile_rows": tile_rows(S, len(moe.experts), moe.max_tile_rows())}
            if S <= 4096:
                row["pairs_ms"] = cuda_time(lambda x=x: moe.forward_static(x, tiles=False))
            row["tiles_ms"] = cuda_time(lambda x=x: moe.forward_static(x, tiles=True))
            if S > 512:
                import exl3tools.runtime.layers as L

                keep = L.MoE._tiled
                L.MoE._tiled = lambda self: False       # the host-grouped loop
                try:
                    row["loop_ms"] = cuda_time(lambda x=x: moe(x), reps=3)
                finally:
                    L.MoE._tiled = keep
            if "pairs_ms" in row:
                row["tiles_over_pairs"] = row["tiles_ms"] / row["pairs_ms"]
            res["moe"].append(row)
            f = lambda k, row=row: f"{row[k]:.3f}" if k in row else "-"   # noqa: E731
            print(f"| {T} | {S} | {row['tile_rows']} | {f('pairs_ms')} | {f('tiles_ms')} | {f('loop_ms')} | "
                  f"{f('tiles_over_pairs')} |", flush=True)

    print("\n| forward | ms | tok/s | activation peak GiB |")
    print("|---|---|---|---|")
    sid = iter(range(10**6))

    def prefill(lengths: list[int]) -> None:
        ids = []
        for n in lengths:
            s = next(sid)
            runner.add_sequence(s)
            ids.append((s, [(7 * i + s) % 1000 + 3 for i in range(n)]))
        runner.step(ids, device_logits=True)
        for s, _ in ids:
            runner.free_sequence(s)

    for name, lengths in (("1 x 32", [32]), ("8 x 32", [32] * 8), ("1 x 512", [512]), ("1 x 2048", [2048])):
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        ms = cuda_time(lambda lengths=lengths: prefill(lengths), reps=3)
        peak = (torch.cuda.max_memory_allocated() - base) / 2**30
        n = sum(lengths)
        res["forward"].append({"case": name, "ms": ms, "tok_s": n / ms * 1e3, "peak_gib": peak})
        print(f"| {name} | {ms:.2f} | {n / ms * 1e3:.0f} | {peak:.2f} |", flush=True)
    if a.ab:
        res["ab"] = interleaved(lambda: prefill([a.ab_tokens]), parse_variants(a.ab), a.ab_rounds, a.ab_tokens)
    if a.forwards_only:
        if a.json:
            a.json.write_text(json.dumps(res, indent=1))
        runner.close()
        return 0

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        prefill([2048])
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=20)
    print(table)
    # 8 x 32 took 68 ms on the GLM-5 shape where 1 x 512 took 53 (H200, 2026-12-02): where it goes
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        prefill([32] * 8)
        torch.cuda.synchronize()
    print("--- profile 8 x 32 by CUDA time")
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=15))
    print("--- profile 8 x 32 by CPU time")
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=15))
    res["mixed"] = mixed_step(runner, sid)
    if a.long:
        res["long"] = long_variants(runner, a.long, a.long_variants)
    res["memory"] = {"allocated": torch.cuda.memory_allocated(), "reserved": torch.cuda.memory_reserved()}
    if a.json:
        a.json.write_text(json.dumps(res, indent=1))
    runner.close()
    return 0


def mixed_step(runner, sid, running: int = 8, history: int = 4096, prompt: int = 32) -> dict:
    """The eager step a new request makes beside running streams (serve's burst and join steps):
    ``running`` sequences with ``history`` tokens each decode one token while a ``prompt``-token
    prompt prefills, ms (median of 3) and the top kernels by CUDA and by CPU time (on the GLM-5
    shape such steps took 84-99 ms on the H200 whatever their rows: /v1/engine/steps)."""
    import time

    import torch
    from torch.profiler import ProfilerActivity, profile

    seqs = [next(sid) for _ in range(running)]
    for s in seqs:
        runner.add_sequence(s)
        for c0 in range(0, history, 2048):
            runner.step([(s, [(7 * i + s) % 1000 + 3 for i in range(c0, min(history, c0 + 2048))])], device_logits=True)
    ms, prof = [], None
    try:
        for rep in range(4):
            new = next(sid)
            runner.add_sequence(new)
            batch = [(s, [5 + rep]) for s in seqs] + [(new, [(3 * i + rep) % 1000 + 3 for i in range(prompt)])]
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            if rep == 3:
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    runner.step(batch, device_logits=True)
                    torch.cuda.synchronize()
            else:
                runner.step(batch, device_logits=True)
                torch.cuda.synchronize()
            ms.append((time.perf_counter() - t0) * 1e3)
            runner.free_sequence(new)
            path = runner.last_path
    finally:
        for s in seqs:
            runner.free_sequence(s)
    med = statistics.median(ms[1:3])
    print(f"\n| mixed step: {running} decoding at {history} + one {prompt}-token prompt | {path} | {med:.1f} ms "
          f"(first {ms[0]:.1f}, profiled {ms[3]:.1f}) |")
    print("--- profile of the mixed step by CUDA time")
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=15))
    print("--- profile of the mixed step by CPU time")
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=15))
    return {"running": running, "history": history, "prompt": prompt, "path": path, "ms": ms}


_RUNS = itertools.count(1)


def parse_variants(spec: str) -> dict[str, dict[str, str]]:
    """ "NAME:VAR=1,VAR2=0;NAME2:..." -> {NAME: {VAR: "1", ...}} (empty: the defaults alone)."""
    out = {}
    for entry in [e for e in spec.split(";") if e.strip()] or ["defaults:"]:
        name, _, assigns = entry.partition(":")
        # VAR=value pairs split at the commas before a name (a value may hold commas: "32,64,8")
        out[name] = dict(kv.split("=", 1) for kv in re.split(r",(?=[A-Za-z_]\w*=)", assigns) if kv.strip())
    return out


def interleaved(fn, variants: dict[str, dict[str, str]], rounds: int, tokens: int, timer=None) -> dict:
    """``fn`` timed under each variant's variables (preview switches are read per call), the
    variants taking turns in every round so drifts of clock and heat fall on all of them alike:
    median ms per variant and its ratio to the first. ``timer(fn) -> ms``: cuda_time's one rep."""
    import os
    from unittest import mock

    timer = timer or (lambda f: cuda_time(f, reps=1))
    ms: dict[str, list[float]] = {name: [] for name in variants}
    for env in variants.values():      # a warm-up each (a variant's own kernels load)
        with mock.patch.dict(os.environ, env):
            fn()
    for _ in range(rounds):
        for name, env in variants.items():
            with mock.patch.dict(os.environ, env):
                ms[name].append(timer(fn))
    first = statistics.median(next(iter(ms.values())))
    print(f"\n| A/B, {tokens}-token forward, {rounds} interleaved rounds: variant | median ms | tok/s | "
          f"min-max ms | x first |\n|---|---|---|---|---|")
    out = {}
    for name, ts in ms.items():
        med = statistics.median(ts)
        out[name] = {"env": variants[name], "ms": ts, "median_ms": med}
        print(f"| {name} | {med:.2f} | {tokens / med * 1e3:.0f} | {min(ts):.2f}-{max(ts):.2f} | {med / first:.3f} |")
    return out


def long_variants(runner, n: int, spec: str) -> dict:
    """The n-token prompt once per variant of ``spec`` ("NAME:VAR=1,VAR2=0;..."; empty: the
    defaults alone), each three times: cold (Triton compiles of new shapes included, what the first
    long prompt a server sees pays), warm, and once more with its last chunk profiled. A summary
    table of the cold and warm runs last."""
    import os
    from unittest import mock

    out = {}
    for name, env in parse_variants(spec).items():
        with mock.patch.dict(os.environ, env):
            cold = long_prompt(runner, n, ("long", name, "cold"), profile_last=False, title=f"{name} cold")
            warm = long_prompt(runner, n, ("long", name, "warm"), profile_last=False, title=f"{name} warm")
            long_prompt(runner, n, ("long", name, "profiled"), profile_last=True, title=f"{name} profiled")
        out[name] = {"env": env, "cold": cold, "warm": warm}
    print(f"\n| long prompt {n}: variant | cold ms | warm ms | warm tok/s | warm last chunk ms |\n|---|---|---|---|---|")
    for name, r in out.items():
        w = r["warm"]
        print(f"| {name} | {r['cold']['total_ms']:.0f} | {w['total_ms']:.0f} | {n / w['total_ms'] * 1e3:.0f} | "
              f"{w['chunks'][-1]['ms']:.1f} |")
    return out


def long_prompt(runner, n: int, seq, chunk: int = 2048, profile_last: bool = True, title: str = "") -> dict:
    """One n-token prompt in ``chunk``-token steps (the engine's prefill chunks on CUDA): ms per
    chunk, printed with the history it attended, and the top CUDA kernels of the last chunk."""
    import contextlib
    import time

    import torch
    from torch.profiler import ProfilerActivity, profile

    # a new prompt each run (its first token): a repeated one would be served from the prefix cache
    salt = next(_RUNS)
    ids = [salt % 1000 + 3] + [(7 * i + 1) % 1000 + 3 for i in range(1, n)]
    runner.add_sequence(seq)
    rows = []
    print(f"\n| long prompt {n} {title}: chunk | history | ms |\n|---|---|---|")
    prof = None
    try:
        for c0 in range(0, n, chunk):
            last = c0 + chunk >= n and profile_last
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            with (profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) if last
                  else contextlib.nullcontext()) as p:
                runner.step([(seq, ids[c0:c0 + chunk])], device_logits=True)
                torch.cuda.synchronize()
            prof = p if last else prof
            ms = (time.perf_counter() - t0) * 1e3
            rows.append({"chunk": c0 // chunk, "history": c0, "ms": ms})
            print(f"| {c0 // chunk} | {c0} | {ms:.1f} |", flush=True)
    finally:
        runner.free_sequence(seq)
    total = sum(r["ms"] for r in rows)
    print(f"total {total:.0f} ms, {n / total * 1e3:.0f} tok/s" + (" (the last chunk profiled: its ms include the profiler)"
                                                                    if prof is not None else ""))
    if prof is not None:
        print(f"--- profile of the last chunk (history {rows[-1]['history']}) by CUDA time, {title}")
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=14))
    return {"tokens": n, "chunks": rows, "total_ms": total}


if __name__ == "__main__":
    sys.exit(main())

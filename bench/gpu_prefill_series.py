"""Is a long prompt's forward bimodal, and why: the same prompt length many times in one process.

    python3 bench/gpu_prefill_series.py CKPT [--tokens 2048] [--n 10] [--sleeps 0,0.5,3] [--sync-debug] [--no-profile]
                                         [--paths eager,long,fused,graph] [--device cpu]

A served 2048-token prefill step spread 36-54 ms on one H100 and a forward in one process read
~36 or ~48-50 ms (docs/gpu-sessions.md, the 2026-12-06 19:15 session): clocks, the caching allocator or
something else? For each idle gap in ``--sleeps`` (the host sleeps that long before each forward,
as a server idles between requests), ``--n`` forwards of one new ``--tokens`` prompt through the
paged pool (``Runner.step``, serve's path), each printed with:
- its CUDA-event ms and host wall ms;
- the SM / memory clocks, power and clock-event reasons that ``nvidia-smi -lms`` sampled during it;
- the caching allocator's cudaMalloc / cudaFree calls and retries during it (torch.cuda.memory_stats).
Then (unless ``--no-profile``) the series again under torch.profiler: per forward the kernels'
summed ms against the GPU span (a span well above the kernels: gaps, so the host or a sync), and
the kernels whose time differs most between the slowest and the fastest profiled forward, and the
fastest one's longest idle gaps with the kernels on either side. ``--sync-debug``: first one forward
under torch's sync debug mode, each op that made the host wait for the GPU with the line of ours
that called it. ``--paths eager,long,fused,graph``: each forward once per path in turn, the eager
forward, the decoder's eager long step (PagedDecoder.long_step, the default on CUDA since 2026-12-07
05:29; GQA models), the eager forward with the fused step's glue (PagedDecoder.eager_body, the
fused_eager preview; GQA and MLA models) and the long step padded to a LONG_GRAPH_ROWS bucket and
replayed as a graph (long_graphs, the default on CUDA since 2026-12-07 10:08; captured on first use),
with each forward's activation peak and a median per path; the sync list and the profile once per path.
``--device cpu``: the same series on the CPU through the static step (no clocks, allocator, sync
list or profile; host ms): a smoke run of this script, tests/test_bench_prefill_series.py.
A diagnostic (docs/gpu.md), not a benchmark table; CI runs only the CPU smoke run.
"""

from __future__ import annotations

import argparse
import collections
import datetime as dt
import itertools
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

FIELDS = "timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu"
REASONS = ("clocks_event_reasons.active", "clocks_throttle_reasons.active")   # newer name first


class ClockSampler:
    """``nvidia-smi -lms`` in the background into a file; after ``stop``, ``samples()`` reads it once
    (timestamps in local time to the millisecond, as datetime.now() gives the host's) and
    ``window`` summarizes those between two host times."""

    def __init__(self, period_ms: int = 20):
        self.proc = None
        self.out = Path(tempfile.mkstemp(prefix="clocks", suffix=".csv")[1])
        if not shutil.which("nvidia-smi"):
            return
        for reason in REASONS:
            probe = subprocess.run(["nvidia-smi", f"--query-gpu={reason}", "--format=csv,noheader"],
                                   capture_output=True, text=True)
            if probe.returncode == 0 and "not a valid" not in probe.stdout.lower():
                break
        else:
            reason = ""
        query = FIELDS + (f",{reason}" if reason else "")
        self.proc = subprocess.Popen(["nvidia-smi", "-i", "0", f"--query-gpu={query}", "--format=csv,noheader,nounits",
                                      "-lms", str(period_ms)], stdout=self.out.open("w"), stderr=subprocess.DEVNULL)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait()

    def samples(self) -> list[tuple]:
        """(time, SM MHz, memory MHz, power W, clock-event reasons) per sample."""
        out = []
        for line in self.out.read_text(errors="replace").splitlines():
            parts = [p.strip() for p in line.split(",")]
            try:
                ts = dt.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f")
                out.append((ts, float(parts[1]), float(parts[2]), float(parts[3]), parts[5] if len(parts) > 5 else ""))
            except (ValueError, IndexError):
                continue
        return out


def window(samples: list[tuple], t0: dt.datetime, t1: dt.datetime) -> dict:
    """The clocks, power and reasons of the samples between two host times."""
    rows = [r[1:] for r in samples if t0 <= r[0] <= t1]
    if not rows:
        return {"samples": 0}
    sm = [r[0] for r in rows]
    return {"samples": len(rows), "sm_min": min(sm), "sm_med": statistics.median(sm),
            "mem_med": statistics.median(r[1] for r in rows), "power_max": max(r[2] for r in rows),
            "reasons": sorted({r[3] for r in rows if r[3] and r[3] != "0x0000000000000000"})}


ALLOC = ("num_device_alloc", "num_device_free", "num_alloc_retries")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("ckpt")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--n", type=int, default=10, help="forwards per idle gap")
    ap.add_argument("--sleeps", default="0,0.5,3", help="idle seconds before each forward, one series each")
    ap.add_argument("--max-cache-tokens", type=int, default=40000)
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--paths", default="",
                    help="eager,long,fused,graph: alternate the eager forward, the decoder's eager long step, the eager "
                         "forward with the fused glue and the long step's graph (long_graphs) "
                         "(default: whichever the runner takes)")
    ap.add_argument("--device", default="cuda", help="cuda, or cpu: a smoke run (see the module doc)")
    ap.add_argument("--sync-debug", action="store_true",
                    help="first one forward under torch.cuda.set_sync_debug_mode('warn'): each op that makes the "
                         "host wait for the GPU, with the line of ours that called it")
    a = ap.parse_args(argv)
    import torch

    from exl3tools.runtime.runner import load_runner

    cuda = a.device != "cpu"
    runner = load_runner(a.ckpt, device=a.device, max_cache_tokens=a.max_cache_tokens, max_num_seqs=32,
                         decode=None if cuda else "static")
    sid = itertools.count()
    d = runner.paged.decoder
    paths = [p for p in a.paths.split(",") if p] or [""]
    if {"long", "graph"} & set(paths) and (d is None or d._fused is None or d._fused.mla):
        raise SystemExit("--paths long / graph need the fused step of a GQA model (PagedDecoder.long_step)")
    if "fused" in paths and (d is None or d._fused is None):
        raise SystemExit("--paths fused needs the fused step (PagedDecoder.eager_body)")

    from exl3tools.runtime.long_steps import long_buckets

    def use(path: str) -> None:
        if path:                   # the runner takes the decoder's long step where long_steps is on,
            d.long_steps = path in ("long", "graph")   # its eager forward the fused glue where eager_body is set
            d.eager_body = d._fused.eager if path == "fused" else None
            # the long step padded to a bucket and replayed as a graph (captured on its first use)
            d.long_buckets = long_buckets(d.prompt_rows) if path == "graph" else []

    def forward() -> None:
        s = next(sid)
        runner.add_sequence(s)
        try:
            runner.step([(s, [(7 * i + s) % 1000 + 3 for i in range(a.tokens)])], device_logits=True)
        finally:
            runner.free_sequence(s)

    for path in paths:   # warm-up: kernels load, Triton compiles, the pool's first pages
        use(path)
        forward()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    stats = torch.cuda.memory_stats if cuda else dict
    sync()
    if a.sync_debug and cuda:
        for path in paths:
            use(path)
            host_syncs(forward, path)
    sleeps = [float(v) for v in a.sleeps.split(",")]
    sampler = ClockSampler()
    time.sleep(0.5)
    rows = []
    try:
        for sleep in sleeps:
            for i, path in itertools.product(range(a.n), paths):
                use(path)
                time.sleep(sleep)     # the only idle time between forwards: the table comes after
                before = stats()
                if cuda:
                    torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated() if cuda else 0
                e0, e1 = (torch.cuda.Event(enable_timing=True) for _ in range(2)) if cuda else (None, None)
                t0, w0 = dt.datetime.now(), time.perf_counter()
                if cuda:
                    e0.record()
                forward()
                if cuda:
                    e1.record()
                    e1.synchronize()
                w1, t1 = time.perf_counter(), dt.datetime.now()
                after = stats()
                rows.append({"sleep": sleep, "i": i, "path": path if path in ("fused", "graph") else runner.last_path,
                             "ms": e0.elapsed_time(e1) if cuda else (w1 - w0) * 1e3, "wall_ms": (w1 - w0) * 1e3,
                             "peak_mb": (torch.cuda.max_memory_allocated() - base) / 2**20 if cuda else 0.0,
                             "t": (t0, t1), **{k: after.get(k, 0) - before.get(k, 0) for k in ALLOC}})
        time.sleep(0.1)               # the sampler's last lines
    finally:
        sampler.stop()
    samples = sampler.samples()
    print(f"| {a.tokens}-token forward: idle s | # | path | ms | wall ms | peak MB | SM MHz min / median | mem MHz | "
          "power W max | clock reasons | cudaMalloc | cudaFree | retries |\n|---|---|---|---|---|---|---|---|---|---|---|"
          "---|---|")
    for row in rows:
        row.update(window(samples, *row.pop("t")))
        f = lambda k, r=row: f"{r[k]:.0f}" if k in r else "-"   # noqa: E731
        print(f"| {row['sleep']:g} | {row['i']} | {row['path']} | {row['ms']:.1f} | {row['wall_ms']:.1f} | "
              f"{row['peak_mb']:.0f} | {f('sm_min')} / "
              f"{f('sm_med')} | {f('mem_med')} | {f('power_max')} | {' '.join(row.get('reasons', [])) or '-'} | "
              f"{row['num_device_alloc']} | {row['num_device_free']} | {row['num_alloc_retries']} |")
    for sleep, path in itertools.product(sleeps, sorted({r["path"] for r in rows})):
        ms = [r["ms"] for r in rows if r["sleep"] == sleep and r["path"] == path]
        peak = max(r["peak_mb"] for r in rows if r["sleep"] == sleep and r["path"] == path)
        print(f"idle {sleep:g} s, {path}: median {statistics.median(ms):.1f} ms, min {min(ms):.1f}, max {max(ms):.1f}, "
              f"peak {peak:.0f} MB")
    if not a.no_profile and cuda:
        for path in paths:
            use(path)
            profiled(forward, a.n, max(sleeps), path)
    runner.close()
    return 0


def host_syncs(forward, path: str = "") -> None:
    """One forward with torch's sync debug mode on: each synchronizing op (a .item(), .tolist(),
    nonzero, a blocking copy) once, with the innermost frame of exl3tools / kernels that called it
    and how often."""
    import traceback
    import warnings

    import torch

    seen: collections.Counter = collections.Counter()

    def show(message, category, filename, lineno, file=None, line=None):
        ours = [f for f in traceback.extract_stack() if "/exl3tools/" in f.filename or "/kernels/" in f.filename]
        where = f"{Path(ours[-1].filename).name}:{ours[-1].lineno} {ours[-1].line}" if ours else "?"
        seen[(str(message).split("\n")[0][:80], where[:120])] += 1

    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():     # restores showwarning and the filters on exit
            warnings.simplefilter("always")
            warnings.showwarning = show
            forward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    print(f"\n| host syncs in one forward{f' ({path})' if path else ''} ({sum(seen.values())}): op | where | "
          "times |\n|---|---|---|")
    for (msg, where), n in seen.most_common(20):
        print(f"| {msg} | {where} | {n} |")


def profiled(forward, n: int, sleep: float, path: str = "", gap_ms: float = 5.0) -> None:
    """n forwards under torch.profiler, ``sleep`` s apart (at least 20 ms, so the kernels of one
    forward are the cluster between two gaps of ``gap_ms``): per forward the span of its kernels and
    their summed time, then the kernels that differ most between the slowest and fastest forward."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            time.sleep(max(sleep, 0.02))
            forward()
            torch.cuda.synchronize()
    kern = sorted(((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                   if e.device_type == DeviceType.CUDA), key=lambda k: k[0])
    groups: list[list] = []
    for k in kern:
        if not groups or k[0] - groups[-1][-1][1] > gap_ms * 1e3:
            groups.append([])
        groups[-1].append(k)
    print(f"\n| profiled forward{f' ({path})' if path else ''} (idle {max(sleep, 0.02):g} s before each) | kernels | "
          f"GPU span ms | kernel ms | "
          f"span - kernels |\n|---|---|---|---|---|")
    per = []
    for j, g in enumerate(groups):
        span = (max(k[1] for k in g) - g[0][0]) / 1e3
        busy = sum(k[1] - k[0] for k in g) / 1e3
        by = collections.Counter()
        for k in g:
            by[k[2][:70]] += (k[1] - k[0]) / 1e3
        per.append((span, by))
        print(f"| {j} | {len(g)} | {span:.1f} | {busy:.1f} | {span - busy:.1f} |")
    if len(groups) != n:
        print(f"({len(groups)} kernel clusters for {n} forwards: a gap of over {gap_ms} ms inside a forward)")
    if groups:
        fastest = min(groups, key=lambda g: max(k[1] for k in g) - g[0][0])
        gaps, end, last = [], fastest[0][1], fastest[0][2]
        for k in fastest[1:]:      # idle: a kernel starts after every earlier one ended
            gaps.append((k[0] - end, last, k[2]))
            if k[1] > end:
                end, last = k[1], k[2]
        gaps.sort(reverse=True)
        total = sum(g[0] for g in gaps if g[0] > 0) / 1e3
        print(f"\n| the fastest profiled forward's longest idle gaps (all gaps {total:.1f} ms; the profiler "
              f"slows the host) | µs | after | before |\n|---|---|---|---|")
        for j, (gap, before, after) in enumerate(gaps[:12]):
            print(f"| {j} | {gap:.0f} | {before[:50]} | {after[:50]} |")
    if len(per) >= 2:
        slow, fast = max(per, key=lambda p: p[0]), min(per, key=lambda p: p[0])
        print(f"\n| kernel (slowest {slow[0]:.1f} ms vs fastest {fast[0]:.1f} ms forward) | slow ms | fast ms | "
              "delta |\n|---|---|---|---|")
        names = set(slow[1]) | set(fast[1])
        for name in sorted(names, key=lambda k: -abs(slow[1][k] - fast[1][k]))[:12]:
            print(f"| {name} | {slow[1][name]:.2f} | {fast[1][name]:.2f} | {slow[1][name] - fast[1][name]:+.2f} |")


if __name__ == "__main__":
    sys.exit(main())

"""Where a served multi-stream decode spends its host time: the real server, N streams through the
official openai client, the engine's step trace and (where py-spy can attach) a sampled profile of
every server thread.

    python3 bench/gpu_serve_profile.py CKPT [--device cuda] [--config NAME:ARGS] [--streams 32]
        [--tokens 256] [--seconds 4] [--procs 1,4] [--py-spy PATH] [--out DIR]

Prints: the client's events/s and its own CPU per event (the openai client is not free: ~100-200 µs
an event); from GET /v1/engine/steps the steady steps (every stream decoding): median interval
between step starts against the median step time (an interval well above the step: the host, not
the GPU, sets the pace); and per thread the top self frames and the top exl3tools frames by samples
(py-spy ``--threads``, idle frames dropped; a config named ``prof*`` also prints the engine
thread's cProfile, EXL3TOOLS_PROFILE_ENGINE). A diagnostic (docs/serve.md "Diagnostics"), not a
benchmark table.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_clients import spread_round, stream_round  # noqa: E402
from serve_process import Server, parse_config  # noqa: E402
from serve_report import steady_steps  # noqa: E402

IDLE = ("Condition.wait", "EpollSelector.select", "Event.wait", "Thread.join", "sleep ", "_worker (concurrent",
        "Queue.get", "select (selectors")


def summarize_raw(path: Path, top: int = 14) -> list[str]:
    """py-spy ``-f raw`` (``thread;frame;...;frame count``): per busy thread, top self frames and
    top exl3tools frames (inclusive), idle frames dropped."""
    by_thread: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    incl: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    busy: collections.Counter = collections.Counter()
    for line in path.read_text(errors="replace").splitlines():
        stack, _, n = line.rpartition(" ")
        if not n.isdigit():
            continue
        frames = stack.split(";")
        thread = re.sub(r"\(\d+\)", "", frames[0]).strip()
        if any(i in frames[-1] for i in IDLE):
            continue
        busy[thread] += int(n)
        by_thread[thread][frames[-1][:110]] += int(n)
        for f in dict.fromkeys(re.sub(r" \(/\S*/(exl3tools|kernels|cli)/", r" (\1/", f) for f in frames[1:]):
            if "exl3tools/" in f or "kernels/" in f:
                incl[thread][f[:110]] += int(n)
    out = []
    for thread, n in busy.most_common(4):
        out.append(f"--- {thread}: {n} busy samples")
        out += [f"  self {k:6d} {f}" for f, k in by_thread[thread].most_common(top)]
        out += [f"  incl {k:6d} {f}" for f, k in incl[thread].most_common(top)]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("ckpt")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--config", type=parse_config, default=parse_config("default:--max-model-len 32768"))
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--seconds", type=int, default=4)
    ap.add_argument("--procs", default="1", help="client processes per round, e.g. 1,4: one round each")
    ap.add_argument("--py-spy", default=shutil.which("py-spy") or "/tmp/site/bin/py-spy")
    ap.add_argument("--out", type=Path, default=Path("/tmp/serve_profile"))
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    name, args = a.config
    srv = Server(a, name, args, a.out)
    srv.start()
    try:
        print(f"[{name}] ready after {srv.wait_ready(600):.1f} s", flush=True)
        model = srv.get("/v1/models").json()["data"][0]["id"]
        asyncio.run(stream_round(srv.url, model, a.streams, 16))          # warm-up: the bucket's graphs
        for procs in [int(p) for p in a.procs.split(",")]:
            tag = f"{name} procs={procs}"
            spy = raw = None
            if Path(a.py_spy).exists():
                raw = a.out / f"pyspy_{name}_p{procs}.txt"
                spy = subprocess.Popen([a.py_spy, "record", "-p", str(srv.proc.pid), "-d", str(max(1, round(a.seconds))),
                                        "-r", "250", "--threads", "--nonblocking", "-f", "raw", "-o", str(raw)],
                                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
                time.sleep(0.5)
            t_round = time.monotonic()       # the server's step trace is on this clock
            events, wall, cpu = spread_round(srv.url, model, a.streams, a.tokens, procs)
            print(f"[{tag}] {a.streams} streams x {a.tokens} tokens: {events} events in {wall:.3f} s = "
                  f"{events / wall:.0f} events/s; the client's CPU {1e6 * cpu / max(events, 1):.0f} µs an event", flush=True)
            steps = [s for s in srv.get("/v1/engine/steps").json()["steps"] if s["t"] >= t_round]
            print(f"[{tag}] steady steps: {steady_steps(steps, a.streams)}", flush=True)
            if spy is not None:
                log = spy.communicate(timeout=a.seconds + 60)[0].decode(errors="replace")
                if raw is not None and raw.exists():
                    print("\n".join(summarize_raw(raw)), flush=True)
                else:
                    print(f"[{tag}] py-spy gave no profile: {log.strip()[-400:]}", flush=True)
            else:
                print(f"[{tag}] no py-spy at {a.py_spy}: no thread profile", flush=True)
    finally:
        srv.stop(20)
    prof = srv.log_path.with_suffix(".prof")      # a config named prof*: the engine thread's cProfile
    if prof.exists():
        import pstats

        st = pstats.Stats(str(prof))
        st.sort_stats("tottime").print_stats(30)      # where the time itself goes
        st.sort_stats("cumulative").print_stats(15)   # and under which of the engine's calls
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Serving benchmark as a user sees it: `exl3tools serve` through the official openai client, next to
exllamav3's Generator on the same checkpoint, in the same run.

    python3 bench/gpu_serve.py CKPT [--device cuda] [--config NAME:ARGS ...] [--tokens 128] [--repeats 3]
        [--streams 8,32] [--prompt-len 2048] [--ctx 4096[,30000]] [--ctx-streams 1,8] [--join N:CTX:M]
        [--exllamav3 auto|on|off] [--json OUT.json] [--out DIR]

Per ``--config NAME:ARGS`` (default ``ml32k:--max-context 32768``; leading ``EXL3TOOLS_X=V`` words
set the server's environment, e.g. ``fused:EXL3TOOLS_FUSED=1 --max-model-len 32768``) the real server runs as a
subprocess (``exl3tools serve CKPT --device DEV --host 127.0.0.1 --port FREE ARGS``, log in
``--out``), is waited for (GET /health 200), measured, and stopped (SIGINT, then SIGTERM, then kill)
before the next one. Every request is a streamed completion of token-id prompts at temperature 0 (or
``--temperature``) with
``ignore_eos`` (so it yields exactly ``max_tokens`` tokens) and ``return_token_ids`` (one chunk per
token event, counted from the ids and checked against the usage chunk); prompts are
``gpu_e2e_model.make_prompts`` (BOS then random valid ids, fixed seeds, distinct per stream and phase),
sent as ids, or with ``--text-prompts`` as the text they decode to (the server tokenizes it, as it
does a chat or text request; exllamav3 keeps the ids).
Before timing (unless ``--no-warmup``): 8-token completions at every batch size used, one long prefill,
one prompt at each ``--ctx`` length and, with ``--join``, one join (one stream at CTX, one short prompt).

1. one stream of ``--tokens`` from a 32-token prompt, ``--repeats`` times: decode tok/s =
   (tokens after the first) / (first -> last token), TTFT; medians;
2. N concurrent streams for N in ``--streams``: aggregate tok/s = all tokens / (first request sent ->
   last token), and the median per-stream decode tok/s; beside them the server's own pace from its
   step trace (the steps holding all N streams: their median start-to-start interval, N x 1000 /
   interval tok/s). A burst of ``--client-min-streams`` (8) or more streams, here and in phase 4, is
   spread over ``--client-procs`` (4) client processes, each with its own openai client, as separate
   users would be: one asyncio openai client spends 170-320 µs of CPU an event (H200 host,
   2026-12-03), so alone it caps a 32-stream burst near its own parsing rate, not the server's;
3. TTFT of ``--prompt-len`` prompts, max_tokens 1: median of ``--ttft-prompts`` distinct prompts (cold)
   and of the same prompts sent again (prefix-cache hit, where the engine has one);
4. decode with ``--ctx``-token prompts (each value in turn) for N in ``--ctx-streams``: tokens produced while every stream
   is past its prefill and none has finished, over that window (prefill excluded; falls back to
   tokens after each stream's first over first first token -> last token when the window holds
   fewer than 2 tokens per stream); one stream: ``--repeats`` times, median;
5. ``--join N:CTX:M``: N streams decode after CTX-token prompts (at least 64 tokens each, so they
   still run when the new ones land); once each has 8 tokens, M short prompts are sent: their
   TTFT, and the still-running streams' longest gap between tokens while
   the new ones are admitted (first new request -> last new first token) against their median gap
   before (what a user mid-answer sees when others arrive); the server's schedule of each burst
   comes from GET /v1/engine/steps;
6. memory: nvidia-smi's per-process figure for the server's process tree (else the change of the
   GPUs' total used memory since the script started), or peak RSS without nvidia-smi, sampled after
   every phase (max); GET /metrics once (the kv / cache / prefix / preempt lines) and GET
   /v1/engine/stats (KV budget, preemptions per phase).

exllamav3 (``--exllamav3 auto``: when it imports and the device is CUDA) runs after the servers are
stopped, in this process: ``gpu_e2e_model.load_exllamav3`` with one cache of
max(streams) x (longest prompt + tokens) tokens (rounded up to its 256-token page), its
``Generator`` with one ``Job`` per stream (``ArgmaxSampler``, no stop conditions, the same token ids),
timed per ``iterate()`` the same way; memory both by the same nvidia-smi method and
torch.cuda.max_memory_allocated.

The tables come last: one row per config plus exllamav3 (ours with its start-up, "ready after s": load,
KV budget and graph captures until GET /health said 200), then ours/exllamav3 per column. ``--json``
writes every raw number (rewritten after each phase, so a killed run keeps what it measured).
Exit status: 0; 1 when a server died or a phase failed (its log's tail is printed; the other configs
still run); 2 on bad usage; 130 on SIGINT/SIGTERM (after stopping the server and printing the tables).
CPU smoke test: tests/test_bench_gpu_serve.py (``--device cpu`` on ``synth_checkpoint.py --small``).
Beside this file: the phases and stream figures (serve_measure.py), the openai clients and their
processes (serve_clients.py), the seeded phase (serve_seeded.py), the exllamav3 side
(serve_exllamav3.py), the tables (serve_report.py), the server process (serve_process.py).
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import json
import os
import platform
import shlex
import shutil
import signal
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

import serve_clients  # noqa: E402
from gpu_e2e_model import parse_ints  # noqa: E402
from proc_memory import gpu_total_used_mib, keep_max_memory, memory_sample, run_quiet  # noqa: E402
from serve_clients import client_proc, make_client, spawn_pool, start_time, stream_one  # noqa: E402
from serve_exllamav3 import exllamav3_usable, run_exllamav3_side  # noqa: E402
from serve_measure import BenchError, Stream, check_streams, join_kv_tokens, join_tokens, measure  # noqa: E402
from serve_process import Server, ServerDied, api_key_of, config_env, parse_config  # noqa: E402,F401
from serve_report import burst_line, burst_schedule, ctx_cases, steady_steps, summarize, tables  # noqa: E402
from serve_seeded import seeded_check, seeded_line  # noqa: E402

DEFAULT_CONFIG = "ml32k:--max-context 32768"


def scrape_metrics(text: str) -> list[str]:
    keys = ("kv", "cache", "prefix", "preempt")
    return [ln for ln in text.splitlines() if ln and not ln.startswith("#") and "_created" not in ln
            and any(k in ln.lower() for k in keys)]


def ttft_histogram(srv) -> tuple[float, int] | None:
    """The server's TTFT histogram (exl3tools_time_to_first_token_seconds) as (sum, count), None
    where /metrics does not answer with both."""
    try:
        r = srv.get("/metrics")
    except Exception:  # noqa: BLE001 - the TTFT column is then left empty, the rest goes on
        return None
    vals = {}
    for ln in r.text.splitlines() if r.status_code == 200 else ():
        name, _, v = ln.partition(" ")
        if name in ("exl3tools_time_to_first_token_seconds_sum", "exl3tools_time_to_first_token_seconds_count"):
            vals[name.rsplit("_", 1)[1]] = float(v)
    return (vals["sum"], int(vals["count"])) if len(vals) == 2 else None


def budget_notes(a, name: str, stats: dict | None, max_model_len: int | None) -> list[str]:
    notes = []
    need = {f"{n} streams": n * (a.short_prompt_len + a.tokens) for n in a.streams}
    need |= {f"{n} stream(s) @ctx{c}": n * (c + a.tokens) for _, n, c in ctx_cases(a)}
    longest = max(*a.ctx, a.prompt_len) + a.tokens
    if getattr(a, "join", None):
        n, c, m = a.join
        need[f"the join, {n} @ctx{c} + {m}"] = join_kv_tokens(a)
        longest = max(longest, c + join_tokens(a))
    budget = (stats or {}).get("cache_tokens_budget")
    if budget:
        for case, k in need.items():
            if k > budget:
                notes.append(f"{name}: {case} needs {k} KV tokens > the server's budget {budget}: it queues or "
                             "preempts (raise --max-cache-tokens)")
    if max_model_len and longest > max_model_len:
        notes.append(f"{name}: max_model_len {max_model_len} < {longest}")
    return notes


def run_server_config(a, name: str, args: list[str], report: dict, baseline_mib, save) -> dict:
    """Start, measure and stop one server; its entry is in report["configs"] from the start, so what
    a failed or interrupted run measured is saved and printed too."""
    entry: dict = {"name": name, "args": args, "results": {"phases": {}}}
    report["configs"].append(entry)
    notes = report["notes"]
    srv = Server(a, name, args, a.out)
    entry.update(command=srv.cmd, log=str(srv.log_path), port=srv.port)
    print(f"[{name}] {shlex.join(srv.cmd)}", flush=True)
    print(f"[{name}] log: {srv.log_path}", flush=True)
    srv.start()
    try:
        entry["ready_s"] = srv.wait_ready(a.ready_timeout)
        print(f"[{name}] ready after {entry['ready_s']:.1f} s", flush=True)
        _measure_server(a, srv, entry, baseline_mib, save, notes)
    except (Exception, KeyboardInterrupt) as exc:
        try:
            srv.check_alive(grace=0 if isinstance(exc, ServerDied) else 1.0)
            died = False
        except ServerDied:
            died = True
        msg = f"{type(exc).__name__}: {exc}"
        if died and not isinstance(exc, ServerDied):
            msg = f"server exited with status {srv.proc.returncode} ({msg})"
        if isinstance(exc, KeyboardInterrupt):
            entry["error"] = "interrupted (SIGINT/SIGTERM)"
            print(f"[{name}] interrupted", flush=True)
        else:
            entry["error"] = msg
            print(f"[{name}] FAILED: {msg}\n[{name}] last lines of {srv.log_path}:\n{srv.log_tail()}", flush=True)
        if isinstance(exc, KeyboardInterrupt):
            entry["stop_status"] = srv.stop(a.stop_timeout)
            raise
    finally:
        entry["summary"] = summarize(entry["results"])
        if entry.get("ready_s") is not None:
            entry["summary"]["ready_s"] = entry["ready_s"]
        if "stop_status" not in entry:
            t = time.perf_counter()
            entry["stop_status"] = srv.stop(a.stop_timeout)
            print(f"[{name}] stopped (status {entry['stop_status']}, {time.perf_counter() - t:.1f} s)", flush=True)
    return entry


def client_pool(a):
    """``--client-procs`` > 1 and a phase of ``--client-min-streams`` or more: the client processes
    (serve_clients.spawn_pool); else None."""
    if a.client_procs <= 1 or max(a.streams + a.ctx_streams) < a.client_min_streams:
        return None
    return spawn_pool(a.client_procs)


def _measure_server(a, srv: Server, entry: dict, baseline_mib, save, notes: list[str]) -> None:
    loop = asyncio.new_event_loop()
    n_conn = max(a.streams + a.ctx_streams) + 8
    current: contextvars.ContextVar[Stream | None] = contextvars.ContextVar("stream", default=None)
    client = make_client(srv.url, srv.key, a.request_timeout, n_conn, current)
    pool = None
    res = entry["results"]
    try:
        pool = client_pool(a)
        models = loop.run_until_complete(asyncio.wait_for(client.models.list(), 60))
        card = models.data[0]
        model = card.id
        entry["model"] = model
        entry["max_model_len"] = getattr(card, "max_model_len", None)
        stats0 = _engine_stats(srv)
        entry["engine_stats_start"] = stats0
        for n in budget_notes(a, srv.name, stats0, entry["max_model_len"]):
            print(f"[{srv.name}] note: {n}", flush=True)
            notes.append(n)

        def one(prompt: list[int] | str, max_tokens: int, gate=None, seen=None):
            return stream_one(client, model, current, prompt, max_tokens, gate, seen)

        def spread(prompts: list[list[int]], max_tokens: int) -> list[tuple[Stream, int | None]]:
            """The burst over the client processes (prompt i to process i % P), sent together."""
            P = min(a.client_procs, len(prompts))
            start_at = start_time()
            last_run["t"] = time.monotonic() + (start_at - time.time())
            futs = [pool.submit(client_proc, (srv.url, srv.key, model, prompts[i::P], max_tokens, a.request_timeout,
                                              start_at)) for i in range(P)]
            got: list = [None] * len(prompts)
            for i, f in enumerate(futs):
                got[i::P] = f.result(timeout=a.request_timeout + 30)
            return got

        last_run = {"t": time.monotonic()}
        as_text = prompt_texts(a.ckpt) if a.text_prompts else None

        def run(prompts: list[list[int]], max_tokens: int, join_after: tuple[int, int] | None = None) -> list[Stream]:
            if as_text is not None:
                prompts = [as_text(p) for p in prompts]
            last_run["t"] = time.monotonic()     # the server's step trace is on the same clock

            async def all_() -> list:
                n, k = join_after or (len(prompts), 0)
                gate, base = asyncio.Event(), {}

                def seen(s: Stream) -> None:       # the first n streams: open the gate once each has k tokens
                    base[id(s)] = s
                    if len(base) == n and all(b.tokens >= k for b in base.values()):
                        gate.set()
                coros = [one(p, max_tokens, seen=seen) for p in prompts[:n]]
                coros += [one(p, max_tokens, gate=gate) for p in prompts[n:]]
                got = await asyncio.gather(*coros, return_exceptions=True)
                for g in got:
                    if isinstance(g, BaseException):
                        raise g
                return got
            srv.check_alive()
            try:
                if pool is not None and join_after is None and len(prompts) >= a.client_min_streams:
                    got = spread(prompts, max_tokens)
                else:
                    got = loop.run_until_complete(asyncio.wait_for(all_(), a.request_timeout))
            except (asyncio.TimeoutError, TimeoutError) as exc:
                raise BenchError(f"{len(prompts)} request(s) not done after {a.request_timeout:.0f} s") from exc
            except Exception:
                srv.check_alive(grace=3.0)       # a dead server says so rather than a connection error
                raise
            streams = [g[0] for g in got]
            check_streams(streams, max_tokens, [g[1] for g in got])
            return streams

        pre = {"preempted": (stats0 or {}).get("preempted_total")}

        def after_phase(phase: str, r: dict) -> None:
            srv.check_alive()
            keep_max_memory(r, memory_sample(srv.proc.pid, baseline_mib))
            st = _engine_stats(srv)
            p = (st or {}).get("preempted_total")
            ph = {"t": time.perf_counter(), "memory_gb": r["memory"]["gb"]}
            if p is not None and pre["preempted"] is not None:
                ph["preempted"] = p - pre["preempted"]
                if ph["preempted"]:
                    notes.append(f"{srv.name}: {ph['preempted']} sequence(s) preempted during {phase}")
                pre["preempted"] = p
            res["phases"][phase] = ph
            if phase.startswith("streams_"):
                steps = trace_steps(srv)
                if steps is not None:
                    b = burst_schedule(steps, last_run["t"])
                    res.setdefault("bursts", {})[phase] = b
                    print(f"[{srv.name}]  {phase} burst: {burst_line(b)}", flush=True)
                    # the server's own pace once every stream decodes (not the client's receipt)
                    n = int(phase.split("_")[1])
                    st = steady_steps([x for x in steps if x["t"] >= last_run["t"]], n)
                    res["streams"][n]["server_steady"] = st
                    if st["interval_ms_median"]:
                        print(f"[{srv.name}]  {phase} server: {st['steps']} steps of all {n} streams, "
                              f"{st['interval_ms_median']:.2f} ms apart ({n * 1e3 / st['interval_ms_median']:.0f} tok/s), "
                              f"{st['step_ms_median']:.2f} ms each", flush=True)
                    else:       # e.g. more streams than --max-num-seqs: the rest queued
                        most = max((x.get("seqs") or 0 for x in steps if x["t"] >= last_run["t"]), default=0)
                        print(f"[{srv.name}]  {phase} server: no two steps held all {n} streams (at most {most} "
                              f"a step)", flush=True)
            save()

        measure(run, a, a.vocab, after_phase, res, log=lambda m: print(f"[{srv.name}]{m}", flush=True),
                server_ttft=lambda: ttft_histogram(srv), server_steps=lambda: trace_steps(srv))
        if a.seeded:
            res["seeded"] = loop.run_until_complete(asyncio.wait_for(
                seeded_check(client, model, a.seeded, a.vocab, a.tokens), a.request_timeout))
            print(f"[{srv.name}] seeded: {seeded_line(res['seeded'])}", flush=True)
            after_phase("seeded", res)
        res["engine_stats_end"] = _engine_stats(srv)
        try:
            r = srv.get("/metrics")
            res["metrics"] = scrape_metrics(r.text) if r.status_code == 200 else [f"HTTP {r.status_code}"]
        except Exception as exc:  # noqa: BLE001 - a missing endpoint must not lose the numbers
            res["metrics"] = [f"{type(exc).__name__}: {exc}"]
        mem = res["memory"]
        print(f"[{srv.name}] memory {mem['gb']:.2f} GB ({mem['source']}){memory_split(mem['gb'], res['engine_stats_end'])}"
              f"; metrics: {res['metrics']}", flush=True)
    finally:
        try:                                    # an interrupted batch leaves tasks behind: end them quietly
            pending = asyncio.all_tasks(loop)
            for t in pending:
                t.cancel()
            if pending:
                loop.run_until_complete(asyncio.wait(pending, timeout=10))
            loop.run_until_complete(asyncio.wait_for(client.close(), 10))
        except Exception:  # noqa: BLE001
            pass
        loop.close()
        if pool is not None:
            pool.shutdown(cancel_futures=True)


def trace_steps(srv: Server) -> list[dict] | None:
    """The server's last steps (GET /v1/engine/steps); None without it."""
    try:
        r = srv.get("/v1/engine/steps")
        return r.json()["steps"] if r.status_code == 200 else None
    except Exception:  # noqa: BLE001 - an optional endpoint
        return None


def memory_split(total_gb: float, stats: dict | None) -> str:
    """' = weights W + KV K + beyond B GB' (issue 13's bound: beyond < 2 GB) from /v1/engine/stats,
    '' where the server does not report weights (an older tree, the CPU)."""
    m = (stats or {}).get("memory") or {}
    if not m.get("weights") or not m.get("kv_pool"):
        return ""
    w, kv = m["weights"] / 1e9, m["kv_pool"] / 1e9
    return f" = weights {w:.2f} + KV {kv:.2f} + beyond {total_gb - w - kv:.2f} GB"


def _engine_stats(srv: Server) -> dict | None:
    try:
        r = srv.get("/v1/engine/stats")
        return r.json() if r.status_code == 200 else None
    except Exception:  # noqa: BLE001 - an optional endpoint
        return None


# ------------------------------------------------------------------ exllamav3
# ------------------------------------------------------------------ main
def parse_args(argv: list[str] | None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("ckpt")
    ap.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (for the servers and exllamav3)")
    ap.add_argument("--config", dest="configs", action="append", type=parse_config, default=None,
                    metavar="NAME:ARGS", help=f"server configuration, repeatable (default {DEFAULT_CONFIG!r})")
    ap.add_argument("--tokens", type=int, default=128, help="completion tokens per stream")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="the streams' sampling temperature (0: greedy; > 0 times sampled serving)")
    ap.add_argument("--repeats", type=int, default=3, help="single-stream repeats (median)")
    ap.add_argument("--client-procs", type=int, default=4,
                    help="client processes a burst of --client-min-streams or more is spread over (1: one "
                         "asyncio openai client for all, whose parsing caps it near 4000-6000 events/s)")
    ap.add_argument("--client-min-streams", type=int, default=8, help="see --client-procs")
    ap.add_argument("--streams", type=parse_ints, default=[8, 32], help="concurrent streams, e.g. 8,32")
    ap.add_argument("--short-prompt-len", type=int, default=32, help="prompt tokens of the decode phases")
    ap.add_argument("--prompt-len", type=int, default=2048, help="prompt tokens of the TTFT phase")
    ap.add_argument("--ttft-prompts", type=int, default=3, help="distinct cold TTFT prompts (median)")
    ap.add_argument("--ctx", type=parse_ints, default=[4096],
                    help="prompt tokens of the long-context decode phases, e.g. 4096,30000 (one phase each)")
    ap.add_argument("--ctx-streams", type=parse_ints, default=[1, 8])
    ap.add_argument("--join", type=parse_join, default=None, metavar="N:CTX:M",
                    help="also: M short prompts sent while N streams decode after CTX-token prompts")
    ap.add_argument("--text-prompts", action="store_true",
                    help="our servers get each prompt as the text its ids decode to (tokenized by the server, "
                         "as a chat or text request is), not as token ids; exllamav3 keeps the ids")
    ap.add_argument("--no-warmup", dest="warmup", action="store_false",
                    help="skip the warm-up requests (each batch size, one long prefill) before timing")
    ap.add_argument("--exllamav3", choices=("auto", "on", "off"), default="auto",
                    help="auto: when exllamav3 imports and the device is CUDA")
    ap.add_argument("--seeded", type=int, default=32, metavar="N",
                    help="a seeded sampled request alone, then among N streams: same tokens? (0: off)")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=Path("out/gpu_serve"), help="server logs")
    ap.add_argument("--ready-timeout", type=float, default=600, help="seconds until /health is 200")
    ap.add_argument("--request-timeout", type=float, default=600, help="seconds for one batch of requests")
    ap.add_argument("--stop-timeout", type=float, default=30, help="seconds after SIGINT before SIGTERM")
    a = ap.parse_args(argv)
    if a.temperature < 0:
        ap.error("--temperature must be >= 0")
    # the client processes read it at import (serve_clients.TEMPERATURE); this one too
    os.environ["EXL3TOOLS_BENCH_TEMPERATURE"] = str(a.temperature)
    serve_clients.TEMPERATURE = a.temperature
    a.configs = a.configs or [parse_config(DEFAULT_CONFIG)]
    names = [n for n, _ in a.configs]
    if len(set(names)) != len(names) or "exllamav3" in names:
        ap.error("config names must be distinct and not 'exllamav3'")
    if min(a.tokens, a.repeats, a.short_prompt_len, a.prompt_len, a.ttft_prompts, *a.ctx) < 1 or a.tokens < 2:
        ap.error("--tokens >= 2; --repeats, --short-prompt-len, --prompt-len, --ttft-prompts, --ctx >= 1")
    if not (Path(a.ckpt) / "config.json").is_file():
        ap.error(f"{a.ckpt}: no config.json (a checkpoint directory)")
    cfg = json.loads((Path(a.ckpt) / "config.json").read_text())
    a.vocab = int(cfg.get("vocab_size") or (cfg.get("text_config") or {}).get("vocab_size") or 0)
    if a.vocab < 8:
        ap.error(f"{a.ckpt}/config.json: no usable vocab_size")
    if a.text_prompts and not (Path(a.ckpt) / "tokenizer.json").is_file():
        ap.error(f"{a.ckpt}: --text-prompts needs its tokenizer.json")
    return a


def prompt_texts(ckpt: str):
    """ids -> the text they decode to, by the checkpoint's tokenizer (--text-prompts)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(ckpt) / "tokenizer.json"))
    return lambda ids: tok.decode(ids, skip_special_tokens=False)


def parse_join(s: str) -> tuple[int, int, int]:
    try:
        n, c, m = (int(x) for x in s.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--join takes N:CTX:M (three integers), got {s!r}") from None
    if min(n, c, m) < 1:
        raise argparse.ArgumentTypeError(f"--join N:CTX:M must be >= 1 each, got {s!r}")
    return n, c, m


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, _sigterm)
    import openai

    t_start = time.perf_counter()
    gpu_name = run_quiet(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"]) if shutil.which(
        "nvidia-smi") else None
    baseline_mib = gpu_total_used_mib()
    report: dict = {
        "checkpoint": str(a.ckpt), "device": a.device, "gpu": gpu_name.strip() if gpu_name else None,
        "host": {"python": platform.python_version(), "cpus": os.cpu_count(), "openai": openai.__version__},
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items() if k != "configs"},
        "baseline_gpu_used_mib": baseline_mib, "configs": [], "exllamav3": None, "notes": []}
    notes: list[str] = report["notes"]

    def save() -> None:
        if a.json:
            a.json.parent.mkdir(parents=True, exist_ok=True)
            tmp = a.json.with_suffix(a.json.suffix + ".tmp")
            tmp.write_text(json.dumps(report, indent=1, default=str) + "\n")
            tmp.replace(a.json)

    failed = False
    interrupted = False
    on = f"{a.device} ({report['gpu']})" if report["gpu"] else a.device
    print(f"gpu_serve: {a.ckpt} on {on}; "
          f"{a.tokens} tokens per stream, streams {a.streams}, TTFT at {a.prompt_len}, ctx {a.ctx} x {a.ctx_streams}"
          + (f"; bursts of {a.client_min_streams}+ streams over {a.client_procs} client processes" if a.client_procs > 1 else ""),
          flush=True)
    try:
        for name, args in a.configs:
            entry = run_server_config(a, name, args, report, baseline_mib, save)
            failed |= "error" in entry
            save()
        if a.exllamav3 == "off":
            notes.append("exllamav3: off (--exllamav3 off)")
        else:
            ok, why = exllamav3_usable(a)
            if not ok:
                msg = f"exllamav3: not available, skipped ({why})"
                print(msg, flush=True)
                notes.append(msg)
                report["exllamav3"] = {"skipped": why}
                failed |= a.exllamav3 == "on"
            else:
                try:
                    run_exllamav3_side(a, report, baseline_mib, save)
                except Exception as exc:  # noqa: BLE001 - our rows still print
                    msg = f"{type(exc).__name__}: {exc}"
                    print(f"[exllamav3] FAILED: {msg}", flush=True)
                    report["exllamav3"] = dict(report["exllamav3"] or {}, error=msg)
                    failed = True
    except KeyboardInterrupt:
        interrupted = failed = True
        print("interrupted: printing what was measured", flush=True)
    report["elapsed_s"] = time.perf_counter() - t_start
    save()

    named = [(c["name"], c.get("summary")) for c in report["configs"]]
    ex = report["exllamav3"] or {}
    named.append(("exllamav3", ex.get("summary")))
    for c in report["configs"]:
        if "error" in c:
            notes.append(f"{c['name']}: FAILED: {c['error']}")
    if ex.get("error"):
        notes.append(f"exllamav3: FAILED: {ex['error']}")
    differ = [c["name"] for c in report["configs"] if str((c.get("summary") or {}).get("seeded", "")).startswith("no")
              and "--batch-invariant" not in c["args"]]
    if differ:
        notes.append(f"{', '.join(differ)}: a seeded text that differs among streams is expected without "
                     "--batch-invariant (a request's logits move at float rounding with what else its steps hold; "
                     "docs/serve.md, batch-invariant serving)")
    print(f"\nnotes ({report['elapsed_s']:.0f} s in all; raw numbers: {a.json or 'pass --json'}; logs: {a.out}):")
    for n in notes:
        print(f"- {n}")
    print()
    print(tables(a, named, ex.get("summary")), flush=True)
    return 130 if interrupted else (1 if failed else 0)


def _sigterm(signum, frame):
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())

"""bench/gpu_serve.py's measurement plan, the same for our server and exllamav3's Generator: the
phases (``measure``), one stream's and a group's figures from chunk arrival times, and the checks.
Pure Python over a ``run(prompts, max_tokens) -> list[Stream]`` callable (CPU-tested through
tests/test_bench_gpu_serve.py)."""

from __future__ import annotations

import itertools
import statistics
import time
from dataclasses import dataclass, field

from gpu_e2e_model import make_prompts
from serve_report import ctx_cases

PAGE = 256                       # exllamav3's cache page, tokens
SEEDS = {"warmup": 11, "single": 21, "streams": 31, "ttft": 41, "ctx": 51, "join": 61, "seeded": 71}
JOIN_AFTER_TOKENS = 8            # the join phase's new prompts go out once every running stream has this many
JOIN_MIN_TOKENS = 8 * JOIN_AFTER_TOKENS  # the join phase's streams run at least this many, so the running ones
                                         # are still decoding when the new requests land (a 24-token stream on
                                         # the CPU server finished first on a busy 2-core CI machine, 2026-12-05)


def join_tokens(a) -> int:
    """Tokens each stream of the join phase (``--join``) runs."""
    return max(a.tokens, JOIN_MIN_TOKENS)


def join_kv_tokens(a) -> int:
    """KV tokens the join phase holds at once: N streams at CTX and M short ones."""
    n, c, m = a.join
    t = join_tokens(a)
    return n * (c + t) + m * (a.short_prompt_len + t)


class BenchError(RuntimeError):
    """A phase failed; the message says which and why."""


def round_pages(n: int, page: int = PAGE) -> int:
    return -(-n // page) * page


@dataclass
class Stream:
    """One request: when it was sent, and (arrival time, tokens) per chunk that carried tokens;
    ``t_wire``: when its HTTP request left the openai client (httpx's request hook), so the client's
    own cost of building it (a 2048-id prompt: ~28 ms of openai's transform on 2 cores) is known."""
    t_send: float
    events: list[tuple[float, int]] = field(default_factory=list)
    t_wire: float | None = None

    @property
    def tokens(self) -> int:
        return sum(k for _, k in self.events)


def stream_stats(s: Stream) -> dict:
    t_first, t_last = s.events[0][0], s.events[-1][0]
    after = s.tokens - s.events[0][1]
    dt = t_last - t_first
    return {"tokens": s.tokens, "ttft_ms": 1e3 * (t_first - s.t_send), "total_ms": 1e3 * (t_last - s.t_send),
            "decode_tok_s": after / dt if dt > 0 and after > 0 else None,
            "client_ms": None if s.t_wire is None else 1e3 * (s.t_wire - s.t_send)}


def group_stats(streams: list[Stream]) -> dict:
    """Aggregate figures of streams sent together (see the module docstring, points 2 and 4)."""
    per = [stream_stats(s) for s in streams]
    t0 = min(s.t_send for s in streams)
    firsts = [s.events[0][0] for s in streams]
    lasts = [s.events[-1][0] for s in streams]
    total = sum(s.tokens for s in streams)
    wall = max(lasts) - t0
    out = {"streams": len(streams), "tokens": total, "wall_s": wall,
           "tok_s": total / wall if wall > 0 else None,
           "per_stream_decode_tok_s_median": _median([p["decode_tok_s"] for p in per]),
           "ttft_ms_median": _median([p["ttft_ms"] for p in per]),
           "ttft_ms_max": max(p["ttft_ms"] for p in per)}
    after = sum(s.tokens - s.events[0][1] for s in streams)
    span = max(lasts) - min(firsts)
    out["decode_after_first_tok_s"] = after / span if span > 0 and after > 0 else None
    a, b = max(firsts), min(lasts)                 # every stream is decoding in (a, b]
    n = sum(k for s in streams for t, k in s.events if a < t <= b)
    out["steady_window_s"] = max(0.0, b - a)
    out["steady_tok_s"] = n / (b - a) if b > a and n > 0 else None
    if out["steady_tok_s"] is not None and n >= 2 * len(streams):
        out["decode_tok_s"], out["decode_method"] = out["steady_tok_s"], "steady window"
    else:
        out["decode_tok_s"], out["decode_method"] = out["decode_after_first_tok_s"], "after first tokens"
    out["per_stream"] = per
    return out


def join_stats(base: list[Stream], new: list[Stream]) -> dict:
    """What running streams feel when new requests arrive: the new ones' TTFT, and each running
    stream's longest gap between tokens while the new ones are being admitted (from the first new
    request sent to the last new stream's first token), beside its median gap before them. A stream
    that had finished before the first new request went out felt no join: it counts in neither, and
    with none still running the stall is None."""
    t_join = min(s.t_send for s in new)
    t_done = max(s.events[0][0] for s in new)
    before, stalls = [], []
    for s in base:
        pairs = list(itertools.pairwise(s.events))
        before += [b - a for (a, _), (b, _) in pairs if b <= t_join]
        if s.events[-1][0] > t_join:
            stalls.append(max([b - a for (a, _), (b, _) in pairs if b > t_join and a < t_done], default=0.0))
    ttfts = [1e3 * (s.events[0][0] - s.t_send) for s in new]
    return {"base": len(base), "joiners": len(new), "running_at_join": len(stalls),
            "joiner_ttft_ms_median": statistics.median(ttfts), "joiner_ttft_ms_max": max(ttfts),
            "itl_ms_median_before": 1e3 * _median(before) if before else None,
            "stall_ms_max": 1e3 * max(stalls) if stalls else None,
            "stall_ms_median": 1e3 * statistics.median(stalls) if stalls else None,
            "window_ms": 1e3 * (t_done - t_join)}


def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _hist_mean_ms(before, after) -> float | None:
    """Mean ms of the observations a histogram's (sum seconds, count) gained between two reads."""
    if before is None or after is None or after[1] <= before[1]:
        return None
    return (after[0] - before[0]) / (after[1] - before[1]) * 1e3


# ------------------------------------------------------------------ the measurement plan (both engines)
def measure(run, a, vocab: int, after_phase, res: dict | None = None, log=print, server_ttft=None,
            server_steps=None) -> dict:
    """Phases 1-4 (and the join phase with ``a.join``) through ``run(prompts, max_tokens, join_after=None)
    -> list[Stream]`` (one stream per prompt, sent together; with ``join_after`` (n, k) the prompts
    after the first n go out once each of those n streams has k tokens), filling ``res``.
    ``after_phase(name, res)`` samples memory, checks liveness, saves the JSON. ``server_ttft()``
    (None: not known): the server's TTFT histogram as (seconds summed, count), read around the TTFT
    phase for the server's own mean, request queued -> first token: no client time in it.
    ``server_steps()`` (None: not known): the server's step trace (GET /v1/engine/steps), read around
    the cold TTFT prompts for the steps that ran their prefill (each step's own time: no queueing,
    no HTTP)."""
    res = {} if res is None else res
    S, T = a.short_prompt_len, a.tokens
    if a.warmup:
        t = time.perf_counter()
        run(make_prompts(1, S, vocab, SEEDS["warmup"]), min(T, 8))
        for n in sorted(set(a.streams + a.ctx_streams)):
            run(make_prompts(n, S, vocab, SEEDS["warmup"] + n), min(T, 8))
        run(make_prompts(1, a.prompt_len, vocab, SEEDS["warmup"] - 1), 1)     # a long prefill's first call
        # each long context's first prefill and, with --join, one join: kernels compiled on first
        # use at a new shape would otherwise land in those phases (on the H200, 2026-12-02,
        # exllamav3's first 4096-token prompt took 2.2 s (GLM-5: 6.0 s) against 138 ms for 2048)
        join = getattr(a, "join", None)
        for c in sorted({c for _, _, c in ctx_cases(a)}):
            run(make_prompts(1, c, vocab, SEEDS["warmup"] - 2), 1)
        if join:                # its stream's prompt is the join's CTX-token prefill too
            run(make_prompts(1, join[1], vocab, SEEDS["warmup"] - 3) + make_prompts(1, S, vocab, SEEDS["warmup"] - 4),
                JOIN_AFTER_TOKENS + 2, join_after=(1, JOIN_AFTER_TOKENS))
        res["warmup_s"] = time.perf_counter() - t
        after_phase("warmup", res)

    prompt = make_prompts(1, S, vocab, SEEDS["single"])
    runs = [stream_stats(run(prompt, T)[0]) for _ in range(a.repeats)]
    res["single"] = {"runs": runs, "decode_tok_s": _median([r["decode_tok_s"] for r in runs]),
                     "ttft_ms": _median([r["ttft_ms"] for r in runs])}
    log(f"  1 stream: {res['single']['decode_tok_s']:.1f} tok/s decode, TTFT {res['single']['ttft_ms']:.1f} ms")
    after_phase("single", res)

    res["streams"] = {}
    for n in a.streams:
        g = group_stats(run(make_prompts(n, S, vocab, SEEDS["streams"] + n), T))
        res["streams"][n] = g
        log(f"  {n} streams: {g['tok_s']:.1f} tok/s aggregate, {g['per_stream_decode_tok_s_median'] or 0:.1f} "
            f"tok/s per stream (median), TTFT median {g['ttft_ms_median']:.1f} ms")
        after_phase(f"streams_{n}", res)

    prompts = make_prompts(a.ttft_prompts, a.prompt_len, vocab, SEEDS["ttft"])
    read_ttft = server_ttft or (lambda: None)
    read_steps = server_steps or (lambda: None)
    h0 = read_ttft()
    before = read_steps() or []
    cold = [stream_stats(run([p], 1)[0]) for p in prompts]
    h1 = read_ttft()
    t0 = max((x["t"] for x in before), default=float("-inf"))
    after = read_steps()
    prefill_ms = None if after is None else [x["ms"] for x in after if x["t"] > t0 and x.get("prefill")]
    hit = [stream_stats(run([p], 1)[0]) for p in prompts]
    h2 = read_ttft()
    res["ttft"] = {"prompt_len": a.prompt_len, "cold_runs_ms": [c["ttft_ms"] for c in cold],
                   "hit_runs_ms": [h["ttft_ms"] for h in hit],
                   "cold_ms": statistics.median(c["ttft_ms"] for c in cold),
                   "hit_ms": statistics.median(h["ttft_ms"] for h in hit),
                   "client_ms": _median([x["client_ms"] for x in cold + hit]),
                   "server_cold_ms": _hist_mean_ms(h0, h1), "server_hit_ms": _hist_mean_ms(h1, h2),
                   "cold_prefill_steps_ms": prefill_ms}
    t = res["ttft"]
    client = t["client_ms"]
    server = ("" if t["server_cold_ms"] is None or t["server_hit_ms"] is None else
              f"; the server's own (queued -> first token, mean): cold {t['server_cold_ms']:.1f} ms, "
              f"again {t['server_hit_ms']:.1f} ms")
    if prefill_ms:
        server += (f"; its prefill steps: {len(prefill_ms)} for {len(prompts)} prompts, "
                   f"{sum(prefill_ms) / len(prompts):.2f} ms a prompt ({', '.join(f'{m:.2f}' for m in prefill_ms[:8])})")
    log(f"  TTFT {a.prompt_len}: cold {t['cold_ms']:.1f} ms, again {t['hit_ms']:.1f} ms"
        + ("" if client is None else f" (of which the openai client building the request: {client:.1f} ms)")
        + server)
    after_phase("ttft", res)

    res["ctx"] = {}
    for key, n, c in ctx_cases(a):
        ps = make_prompts(n, c, vocab, SEEDS["ctx"] + n)
        reps = a.repeats if n == 1 else 1
        groups = [group_stats(run(ps, T)) for _ in range(reps)]
        g = dict(groups[-1])
        if reps > 1:
            g["repeats"] = [x["decode_tok_s"] for x in groups]
            g["decode_tok_s"] = _median(g["repeats"])
        res["ctx"][key] = g
        log(f"  {n} stream{'s' if n > 1 else ''} @ctx{c}: {g['decode_tok_s'] or 0:.1f} tok/s decode ({g['decode_method']}), "
            f"TTFT median {g['ttft_ms_median']:.0f} ms")
        after_phase(f"ctx_{key}", res)

    if getattr(a, "join", None):
        n, c, m = a.join
        base, new = make_prompts(n, c, vocab, SEEDS["join"]), make_prompts(m, S, vocab, SEEDS["join"] + 1)
        Tj = join_tokens(a)
        streams = run(base + new, Tj, join_after=(n, JOIN_AFTER_TOKENS))
        j = res["join"] = {"ctx": c, "tokens": Tj, **join_stats(streams[:n], streams[n:])}
        gap = ("every running stream had finished before they went out" if j["stall_ms_max"] is None else
               f"{j['running_at_join']} running streams' longest gap {j['stall_ms_max']:.0f} ms "
               f"(median {j['stall_ms_median']:.0f})")
        log(f"  join: {m} new {S}-token prompts beside {n} streams @ctx{c}: their TTFT median "
            f"{j['joiner_ttft_ms_median']:.0f} ms (max {j['joiner_ttft_ms_max']:.0f}); the {gap} against "
            f"{j['itl_ms_median_before'] or 0:.1f} ms between tokens before")
        after_phase("join", res)
    return res


def check_streams(streams: list[Stream], max_tokens: int, usage: list[int | None] | None = None,
                  slack: int = 0) -> None:
    """Each stream brought max_tokens tokens (± slack), as its usage says."""
    for i, s in enumerate(streams):
        if not s.events or abs(s.tokens - max_tokens) > slack:
            raise BenchError(f"stream {i} produced {s.tokens} tokens, expected {max_tokens}")
        if usage is not None and usage[i] is not None and usage[i] != max_tokens:
            raise BenchError(f"stream {i}: usage says {usage[i]} completion tokens, expected {max_tokens}")

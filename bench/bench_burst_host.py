"""The host's work for a burst of requests before its first step, on the demo checkpoint: what each
request costs the HTTP side (body parse and validation, then preparation) and what admitting them
costs the engine thread (cache checks, ``Runner.add_sequence`` with its prefix lookup).

    python bench/bench_burst_host.py [--streams 8,32,64] [--prompt 2048] [--rounds 5]

Every millisecond here holds the GIL while the burst arrives, before and beside its first step
(docs/gpu-sessions.md, "Earlier plans for the next GPU session", item 4 of one). Printed, medians of ``--rounds``:

- one ``--prompt``-id streamed completion request: ``protocol.parse_body`` against ``json.loads``
  of the same body in the same run (the floor of reading it), and ``prepare_completion``;
- tokenizing a chat prompt of ``--prompt`` tokens as the server does (``detok.encode_ids``: the
  tokenizer's ``encode_batch``) against ``encode``, each while a Python thread counts: that
  thread's rate against its rate alone says how much of the call held the GIL;
- per N of ``--streams``: ``Engine._admit`` of N fresh requests, and beside it, in the same run,
  the admission as it was before 2026-12-03 (each candidate's cache check summed over every running
  sequence again, each prompt converted to ints whole): the ratio is what the change saves; then
  ``Engine._plan``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from exl3tools.runtime.runner import load_runner  # noqa: E402
from exl3tools.server import protocol  # noqa: E402
from exl3tools.server.app import ServeConfig, create_app  # noqa: E402
from exl3tools.server.engine import Engine  # noqa: E402
from exl3tools.server.protocol import SamplingParams  # noqa: E402
from exl3tools.server.testing import LiveServer  # noqa: E402

MODEL = REPO / "demo" / "glm4_moe-3.0bpw-mcg" / "model"


def admit_as_before(eng: Engine) -> None:
    """Engine._admit before 2026-12-03: O(N^2) cache checks and whole-prompt int conversion."""
    r = eng.runner
    while eng._waiting and len(eng._running) < eng.max_batch:
        seq = eng._waiting[0]
        need = [(s.seq_id, s.pending + 1) for s in eng._running] + [(None, seq.pending + 1)]
        if r.blocks_needed(need) > r.blocks.free_blocks():
            break
        eng._waiting.popleft()
        tokens = [int(t) for t in seq.prompt][:r.max_context]
        seq.num_cached = r.add_sequence(seq.seq_id, tokens)
        eng._running.append(seq)


def one_burst(r, n: int, prompts: list[list[int]], admit) -> tuple[float, float]:
    """(admission ms, plan ms) of n queued requests; their sequences are freed afterwards."""
    eng = Engine(lambda: r, max_batch=n)
    eng.runner, eng.state = r, "ready"
    loop = asyncio.new_event_loop()
    try:
        for p in prompts:
            eng.submit(loop, [p], SamplingParams(max_tokens=8), 1)
        t0 = time.perf_counter()
        admit(eng)
        t1 = time.perf_counter()
        eng._plan()
        t2 = time.perf_counter()
        assert len(eng._running) == n, "the cache did not take the burst"
        for s in eng._running:
            r.free_sequence(s.seq_id)
    finally:
        loop.close()
    return 1e3 * (t1 - t0), 1e3 * (t2 - t1)


def per_request(prompt_len: int, rounds: int) -> None:
    """parse_body vs json.loads of one streamed token-id completion request, and its preparation."""
    rng = random.Random(1)
    body = json.dumps({"model": "demo", "prompt": [rng.randrange(1, 1000) for _ in range(prompt_len)],
                       "max_tokens": 128, "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
                       "ignore_eos": True, "return_token_ids": True}).encode()
    app = create_app(ServeConfig(model_path=str(MODEL), served_model_name="demo"))
    with LiveServer(app):                        # the engine loaded: prepare reads its runner's limits
        server = app.state.server
        req = protocol.parse_body(body, protocol.CompletionRequest)
        server.prepare_completion(req)
        parse, floor, prep = (_median_ms(fn, rounds) for fn in (
            lambda: protocol.parse_body(body, protocol.CompletionRequest), lambda: json.loads(body),
            lambda: server.prepare_completion(req)))
    print(f"one {prompt_len}-id request: parse_body {parse:.3f} ms, json.loads {floor:.3f} ms "
          f"({parse / floor:.1f}x the floor), prepare {prep:.3f} ms")


def _median_ms(fn, rounds: int, n: int = 50) -> float:
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        times.append(1e3 * (time.perf_counter() - t) / n)
    return statistics.median(times)


def tokenize_beside_python(prompt_len: int, rounds: int) -> None:
    """encode_ids vs encode on one long text while a Python thread counts (the engine thread's stand-in)."""
    import threading

    from tokenizers import Tokenizer

    from exl3tools.server.detok import encode_ids

    tok = Tokenizer.from_file(str(MODEL / "tokenizer.json"))
    unit = "the quick brown fox jumps over the lazy dog "
    text = unit * max(1, prompt_len // len(tok.encode(unit, add_special_tokens=False).ids))
    count, stop = [0], threading.Event()

    def spin() -> None:
        while not stop.is_set():
            count[0] += 1

    def rate(fn) -> tuple[float, float]:          # (counts a second beside fn, ms a call)
        c0, t0 = count[0], time.perf_counter()
        for _ in range(rounds):
            fn()
        dt = time.perf_counter() - t0
        return (count[0] - c0) / dt, 1e3 * dt / rounds

    th = threading.Thread(target=spin)
    th.start()
    try:
        alone = rate(lambda: time.sleep(0.02))[0]
        ours, ours_ms = rate(lambda: encode_ids(tok, text, add_special_tokens=False))
        enc, enc_ms = rate(lambda: tok.encode(text, add_special_tokens=False))
    finally:
        stop.set()
        th.join()
    n = len(tok.encode(text, add_special_tokens=False).ids)
    print(f"tokenizing {n} tokens: encode_ids {ours_ms:.2f} ms, a Python thread beside it at {ours / alone:.0%} "
          f"of its rate alone; encode {enc_ms:.2f} ms, {enc / alone:.0%}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", default="8,32,64")
    ap.add_argument("--prompt", type=int, default=2048, help="prompt tokens per request")
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args(argv)
    ns = [int(x) for x in a.streams.split(",")]
    per_request(a.prompt, a.rounds)
    tokenize_beside_python(a.prompt, a.rounds)
    r = load_runner(MODEL, max_num_seqs=max(ns), max_cache_tokens=2 * max(ns) * (a.prompt + 64), block_size=16)
    rng = random.Random(0)
    print(f"demo checkpoint, {a.prompt}-token prompts, median of {a.rounds} bursts (ms on the engine thread)")
    print(f"{'N':>4} {'admit':>8} {'before':>8} {'saved':>6} {'plan':>6}")
    with r:
        for n in ns:
            rows: dict[str, list[float]] = {"now": [], "before": [], "plan": []}
            for _ in range(a.rounds):
                fresh = [[rng.randrange(1, 1000) for _ in range(a.prompt)] for _ in range(n)]
                ms, plan = one_burst(r, n, fresh, Engine._admit)
                rows["now"].append(ms)
                rows["plan"].append(plan)
                rows["before"].append(one_burst(r, n, fresh, admit_as_before)[0])
            m = {k: statistics.median(v) for k, v in rows.items()}
            print(f"{n:>4} {m['now']:>8.2f} {m['before']:>8.2f} {m['before'] / m['now']:>5.1f}x {m['plan']:>6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

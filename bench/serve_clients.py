"""The openai clients of the serving benchmarks: bench/gpu_serve.py's streams (one ``Stream`` record
per request, its chunks' arrival times, usage and token ids) and bench/gpu_serve_profile.py's bare
stream counter (events and the client's CPU), each either in the calling process or spread over
spawned client processes that send at one moment, as separate users would (one asyncio openai
client spends 170-320 µs of its CPU on every token event: alone, it caps a many-stream burst near
its own parsing rate; docs/gpu.md "Serving benchmark")."""

from __future__ import annotations

import asyncio
import contextvars
import os
import time

from serve_measure import BenchError, Stream

# the streams' sampling temperature (gpu_serve.py --temperature; the client processes inherit it):
# 0, greedy, unless a run times sampled serving
TEMPERATURE = float(os.environ.get("EXL3TOOLS_BENCH_TEMPERATURE", "0"))


# ------------------------------------------------------------------ gpu_serve.py's streams
def make_client(url: str, key: str | None, timeout: float, n_conn: int, current: contextvars.ContextVar):
    """The official openai client over its own httpx pool; httpx's request hook stamps the stream in
    ``current`` (its ``t_wire``: when the request left the client)."""
    import httpx
    from openai import AsyncOpenAI

    async def on_request(request) -> None:       # runs in the task that sends it: its Stream
        s = current.get()
        if s is not None and s.t_wire is None:
            s.t_wire = time.perf_counter()

    http = httpx.AsyncClient(trust_env=False, timeout=timeout, event_hooks={"request": [on_request]},
                             limits=httpx.Limits(max_connections=n_conn, max_keepalive_connections=n_conn))
    return AsyncOpenAI(base_url=f"{url}/v1", api_key=key or "unused", http_client=http, max_retries=0, timeout=timeout)


async def stream_one(client, model: str, current: contextvars.ContextVar, prompt: list[int] | str, max_tokens: int,
                     gate=None, seen=None) -> tuple[Stream, int | None]:
    """One streamed completion; ``gate``: an asyncio.Event to wait for before sending;
    ``seen(stream)``: called after each chunk that carried tokens."""
    if gate is not None:
        await gate.wait()
    s = Stream(time.perf_counter())
    current.set(s)
    usage = None
    stream = await client.completions.create(
        model=model, prompt=prompt, max_tokens=max_tokens, temperature=TEMPERATURE, stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True, "return_token_ids": True})
    async for chunk in stream:
        now = time.perf_counter()
        if chunk.usage is not None:
            usage = chunk.usage.completion_tokens
        for c in chunk.choices:
            ids = getattr(c, "token_ids", None)
            k = len(ids) if ids is not None else (1 if c.text else 0)
            if k:
                s.events.append((now, k))
                if seen is not None:
                    seen(s)
                    # a client behind the server reads buffered chunks without yielding: let a gate
                    # just opened send its requests now, not once this stream has drained its buffer
                    await asyncio.sleep(0)
        if len(s.events) > max_tokens + 8:
            raise BenchError(f"more than {max_tokens} token chunks in one stream")
    return s, usage


def client_proc(job: tuple) -> list[tuple[Stream, int | None]]:
    """One client process's share of a burst (gpu_serve.py ``--client-procs``): its own openai
    client, its streams sent together at ``start_at`` (``start_time``). Stream times are
    perf_counter()'s, one clock across processes (CLOCK_MONOTONIC)."""
    url, key, model, prompts, max_tokens, timeout, start_at = job
    current: contextvars.ContextVar[Stream | None] = contextvars.ContextVar("stream", default=None)

    async def go() -> list:
        client = make_client(url, key, timeout, len(prompts) + 4, current)
        try:
            await asyncio.sleep(max(0.0, start_at - time.time()))
            return await asyncio.gather(*[stream_one(client, model, current, p, max_tokens) for p in prompts])
        finally:
            await client.close()
    return asyncio.run(go())


def _client_ready(_: int) -> int:
    import openai  # noqa: F401  (a client process imports the client before its first burst)

    time.sleep(0.2)                  # every worker gets one: the pool starts them all now
    return os.getpid()


def spawn_pool(procs: int):
    """A pool of ``procs`` spawned client processes, started and with the openai client imported,
    so that a burst sent through it leaves them at once (``start_time``)."""
    import concurrent.futures
    import multiprocessing

    pool = concurrent.futures.ProcessPoolExecutor(procs, mp_context=multiprocessing.get_context("spawn"))
    list(pool.map(_client_ready, range(procs)))
    return pool


def start_time(lead_s: float = 0.3) -> float:
    """A moment (time.time()) for a burst's processes to send at: ``lead_s`` from now, time enough
    for a warm pool to receive every process's share."""
    return time.time() + lead_s


# ------------------------------------------------------------------ gpu_serve_profile.py's counter
async def stream_round(url: str, model: str, n: int, tokens: int, first: int = 0) -> tuple[int, float, float]:
    """N streamed completions of ``tokens`` each (ignore_eos) through the openai client: (events,
    wall s, the client's CPU s); ``first``: the first stream's prompt offset."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"{url}/v1", api_key="x")

    async def one(i: int) -> int:
        s = await client.completions.create(model=model, prompt=[1 + first + i, 2, 3], max_tokens=tokens, stream=True,
                                            temperature=0, extra_body={"ignore_eos": True})
        return sum([1 async for _ in s])
    t, cpu = time.perf_counter(), time.process_time()
    events = sum(await asyncio.gather(*[one(i) for i in range(n)]))
    wall, cpu = time.perf_counter() - t, time.process_time() - cpu
    await client.close()             # inside this loop (asyncio.run closes it next)
    return events, wall, cpu


def _proc_round(args: tuple) -> tuple[int, float, float]:
    *args, start_at = args
    time.sleep(max(0.0, start_at - time.time()))
    return asyncio.run(stream_round(*args))


def spread_round(url: str, model: str, n: int, tokens: int, procs: int) -> tuple[int, float, float]:
    """The N streams split over ``procs`` client processes (separate users: one asyncio loop of
    the openai client parses ~5000-6000 events/s at most): (events, wall s of the slowest, CPU s
    summed)."""
    if procs <= 1:
        return asyncio.run(stream_round(url, model, n, tokens))
    start_at = start_time()
    parts = [(url, model, n // procs + (i < n % procs), tokens, i * n, start_at) for i in range(procs)]
    with spawn_pool(procs) as pool:
        got = list(pool.map(_proc_round, parts))
    return sum(g[0] for g in got), max(g[1] for g in got), sum(g[2] for g in got)

"""`exl3tools serve` on CPU: tokens/s and time to first token at 1, 8 and 32 concurrent streams.

The server runs as its own process (`exl3tools serve`, the demo checkpoint) so the client's work
does not share its GIL; the client streams with raw httpx. Side by side, in the same run: the
engine alone (scheduler, sampling, detokenisation; no HTTP) and the runner's own decode rate at
the same batch sizes (no sampling), so the ratios say where the time goes.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
MODEL = REPO / "demo" / "glm4_moe-3.0bpw-mcg" / "model"
MAX_TOKENS = 64
CONCURRENCY = (1, 8, 32)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def one_stream(client: httpx.AsyncClient, i: int) -> tuple[float, float, int]:
    body = {"model": "demo", "prompt": f"Story number {i}: once upon a time", "max_tokens": MAX_TOKENS,
            "temperature": 1.0, "seed": i, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft, tokens = None, 0
    async with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: {") and ttft is None:
                ttft = time.perf_counter() - t0
            if '"usage":{' in line:
                tokens = int(line.split('"completion_tokens":')[1].split(",")[0])
    return ttft or 0.0, time.perf_counter() - t0, tokens


async def run_level(url: str, c: int) -> dict:
    limits = httpx.Limits(max_connections=c + 4)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:
        await one_stream(client, 10_000)  # warm: first-call allocations, tokenizer caches
        t0 = time.perf_counter()
        results = await asyncio.gather(*(one_stream(client, i) for i in range(c)))
        wall = time.perf_counter() - t0
    ttfts = sorted(r[0] for r in results)
    tokens = sum(r[2] for r in results)
    assert tokens == c * MAX_TOKENS, tokens
    return {"c": c, "tok_s": tokens / wall, "ttft_p50": statistics.median(ttfts), "ttft_max": ttfts[-1],
            "per_stream": statistics.median(r[2] / (r[1] - r[0]) for r in results)}


def runner_rates(model: str, device: str) -> dict[int, float]:
    """Decode tokens/s of the runner alone at each batch size (same threads as the server)."""
    import torch

    from exl3tools.runtime.runner import load_runner

    torch.set_num_threads(max(1, (os.cpu_count() or 2) - 1))
    r = load_runner(model, device=device)
    out = {}
    for b in CONCURRENCY:
        for s in range(b):
            r.add_sequence(s)
        r.step([(s, [1, 100 + s, 200, 300]) for s in range(b)])
        r.step([(s, [5]) for s in range(b)])
        n = 32
        t0 = time.perf_counter()
        for k in range(n):
            logits = r.step([(s, [10 + k]) for s in range(b)])
        float(logits[0, 0])  # waits for the device
        out[b] = b * n / (time.perf_counter() - t0)
        for s in range(b):
            r.free_sequence(s)
    return out


def engine_rates(model: str, device: str) -> dict[int, float]:
    """Tokens/s of the engine alone (scheduler + sampling + detokenisation, no HTTP)."""
    from exl3tools.server.app import ServeConfig, runtime_hooks, runtime_loader
    from exl3tools.server.engine import Engine
    from exl3tools.server.protocol import SamplingParams

    engine = Engine(runtime_loader(ServeConfig(model_path=model, device=device)), max_batch=64,
                    **runtime_hooks())
    engine.start()
    while engine.state == "loading":
        time.sleep(0.05)

    async def level(c: int) -> float:
        loop = asyncio.get_running_loop()

        async def drain(h) -> None:
            async for _ in h.events():
                pass

        def submit(i: int):
            params = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=i, ignore_eos=True)
            return engine.submit(loop, [[1, 100 + i % 1000, 200, 300]], params, 1)  # ids inside any vocab

        await drain(submit(10_000))
        t0 = time.perf_counter()
        await asyncio.gather(*(drain(submit(i)) for i in range(c)))
        return c * MAX_TOKENS / (time.perf_counter() - t0)

    try:
        return {c: asyncio.run(level(c)) for c in CONCURRENCY}
    finally:
        engine.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(MODEL))
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "exl3tools.cli", "serve", args.model, "--port", str(port),
                             "--served-model-name", "demo", "--log-level", "warning",
                             "--device", args.device], cwd=REPO)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline or proc.poll() is not None:
                raise SystemExit("server did not become ready")
            time.sleep(0.1)
        rows = [asyncio.run(run_level(url, c)) for c in CONCURRENCY]
    finally:
        proc.terminate()
        proc.wait(15)
    direct = runner_rates(args.model, args.device)
    engine = engine_rates(args.model, args.device)
    base = rows[0]["tok_s"]
    print(f"exl3tools serve, {Path(args.model).parent.name}/{Path(args.model).name} on {args.device} "
          f"({os.cpu_count()} cores), {MAX_TOKENS} tokens per stream")
    print(f"{'streams':>7} {'tok/s':>8} {'vs 1':>6} {'TTFT p50':>9} {'TTFT max':>9} {'tok/s/stream':>13} "
          f"{'engine tok/s':>13} {'runner tok/s':>13} {'server/runner':>13}")
    for r in rows:
        d = direct[r["c"]]
        print(f"{r['c']:>7} {r['tok_s']:>8.0f} {r['tok_s'] / base:>5.1f}x {r['ttft_p50'] * 1e3:>7.0f}ms "
              f"{r['ttft_max'] * 1e3:>7.0f}ms {r['per_stream']:>13.0f} {engine[r['c']]:>13.0f} {d:>13.0f} "
              f"{r['tok_s'] / d:>12.0%}")
    print("server: HTTP + SSE, client in another process; engine: scheduler + sampling + detokenising, "
          "no HTTP; runner: step() alone")


if __name__ == "__main__":
    main()

"""The serving stack's host side alone: can it keep a GPU's decode steps back to back at N streams?

    python bench/serve_host_ceiling.py [--step-ms 5.5] [--streams 8,32] [--tokens 256] [--switch-ms MS]

The real server (FastAPI app, engine thread, chained steps, device-token sampling, detokenizer,
SSE) over the demo checkpoint's runner with its forward skipped and a GPU's queue emulated: each
launched step finishes ``--step-ms`` after the one before it, and reading a step's tokens (a CUDA
sync on a GPU: ``DeviceTokens.tolist``) sleeps until then with the GIL released. The server runs in
its own process; N streams of the official openai client read it. Printed per N: tokens/s against
the emulated ceiling (N tokens a step), the steady steps' median start-to-start interval against
``--step-ms`` (equal: the host keeps up; above: the host sets the pace), and the client's CPU per
event. A diagnostic for docs/serve.md ("Diagnostics"), not the product's numbers: those come from
bench/gpu_serve.py on a GPU.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MODEL = REPO / "demo" / "glm4_moe-3.0bpw-mcg" / "model"
MODEL_NAME = "glm4_moe-3.0bpw-mcg"      # what the server calls it (its directory)


def serve(port: int, step_ms: float, switch_ms: float | None) -> None:
    """The server process: the real app over the demo runner with the emulated GPU queue."""
    import torch
    import uvicorn

    sys.path.insert(0, str(REPO))
    from exl3tools.runtime import sampling
    from exl3tools.server.app import ServeConfig, create_app, runtime_loader

    queue = {"done": 0.0, "pending": 0.0}

    def launch() -> None:           # this step ends step_ms after the previous one (or now)
        queue["pending"] = queue["done"] = max(time.perf_counter(), queue["done"]) + step_ms / 1e3

    class QueuedTokens(sampling.DeviceTokens):
        def __init__(self, tokens):
            super().__init__(tokens)
            self.ready = queue["pending"]

        def tolist(self) -> list[int]:
            time.sleep(max(0.0, self.ready - time.perf_counter()))     # the sync, GIL released
            return super().tolist()

    real_sample = sampling.sample_device
    sampling.sample_device = lambda *a, **k: QueuedTokens(real_sample(*a, **k).tensor)
    cfg = ServeConfig(model_path=str(MODEL), device="cpu", max_batch=64, max_cache_tokens=1 << 17,
                      cuda_graphs="force")
    real_load = runtime_loader(cfg)

    def load():
        r = real_load()

        def step(batch, *, all_logits=False, device_logits=False):
            for seq_id, toks in batch:
                r._seqs[seq_id].tokens.extend(int(t) for t in toks)
            launch()
            return torch.randn(sum(len(t) for _, t in batch) if all_logits else len(batch), r.vocab_size)

        def step_chained(seq_ids, tokens):
            launch()
            return torch.randn(len(seq_ids), r.vocab_size)
        r.step, r.step_chained = step, step_chained
        return r
    if switch_ms:
        sys.setswitchinterval(switch_ms / 1e3)
    uvicorn.run(create_app(cfg, load=load), host="127.0.0.1", port=port, log_level="warning")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--step-ms", type=float, default=5.5, help="the emulated GPU step (air6 at batch 32 on the H200: 5.5)")
    ap.add_argument("--streams", default="8,32")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--switch-ms", type=float, default=None, help="the server's GIL switch interval")
    ap.add_argument("--serve", type=int, default=None, help=argparse.SUPPRESS)   # (the server process)
    a = ap.parse_args(argv)
    if a.serve is not None:
        serve(a.serve, a.step_ms, a.switch_ms)
        return 0
    from bench_serve import free_port
    from serve_clients import stream_round
    from serve_report import steady_steps

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, __file__, "--serve", str(port), "--step-ms", str(a.step_ms)]
    if a.switch_ms:
        cmd += ["--switch-ms", str(a.switch_ms)]
    proc = subprocess.Popen(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    try:
        for _ in range(240):
            try:
                if urllib.request.urlopen(f"{url}/health", timeout=2).status == 200:
                    break
            except OSError:
                time.sleep(0.25)
        else:
            print(f"server not ready: {proc.stderr.read().decode(errors='replace')[-600:]}", file=sys.stderr)
            return 1
        for n in (int(x) for x in a.streams.split(",")):
            asyncio.run(stream_round(url, MODEL_NAME, n, 8))         # warm-up at this width
            events, wall, cpu = asyncio.run(stream_round(url, MODEL_NAME, n, a.tokens))
            ceiling = n / (a.step_ms / 1e3)
            steps = json.load(urllib.request.urlopen(f"{url}/v1/engine/steps"))["steps"]
            interval = steady_steps(steps, n)["interval_ms_median"]
            print(f"{n} streams: {n * a.tokens / wall:.0f} tok/s of the emulated {ceiling:.0f} "
                  f"({n * a.tokens / wall / ceiling:.0%}); steady step interval "
                  f"{'-' if interval is None else f'{interval:.2f}'} ms for {a.step_ms} ms steps; "
                  f"client CPU {1e6 * cpu / max(events, 1):.0f} µs an event", flush=True)
    finally:
        proc.terminate()
        proc.wait(10)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.exit(main())

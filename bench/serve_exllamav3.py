"""bench/gpu_serve.py's exllamav3 side: its Generator on the same checkpoint, in the benchmark's
process, through the same measurement plan (serve_measure.measure) as our server, with one cache
sized for the longest phase."""

from __future__ import annotations

import os
import sys
import time

from proc_memory import keep_max_memory, memory_sample
from serve_measure import BenchError, Stream, check_streams, join_kv_tokens, measure, round_pages
from serve_report import summarize


def exllamav3_usable(a) -> tuple[bool, str]:
    if not a.device.startswith("cuda"):
        return False, f"device {a.device} is not CUDA"
    try:
        import torch

        if not torch.cuda.is_available():
            return False, "torch.cuda is not available"
        import exllamav3  # noqa: F401 - may JIT-build its extension (minutes) without a prebuilt one
    except Exception as exc:  # noqa: BLE001 - ImportError, OSError (no CUDA_HOME), build failures
        return False, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:200]
    return True, ""


def exllamav3_cache_tokens(a) -> int:
    longest = max(*a.ctx, a.prompt_len, a.short_prompt_len)
    need = max(a.streams + a.ctx_streams + [1]) * (longest + a.tokens)
    if getattr(a, "join", None):          # N streams at CTX and M short ones at once
        need = max(need, join_kv_tokens(a))
    return round_pages(need)


def run_exllamav3_side(a, report: dict, baseline_mib, save) -> dict:
    """exllamav3's Generator through the same plan, in this process; report["exllamav3"] from the start."""
    import importlib.metadata

    import torch
    from exllamav3 import ArgmaxSampler, Generator, Job
    from gpu_e2e_model import _free, load_exllamav3

    try:
        version = importlib.metadata.version("exllamav3")
    except importlib.metadata.PackageNotFoundError:     # on PYTHONPATH without its metadata
        version = getattr(sys.modules["exllamav3"], "__version__", "unknown")
    res: dict = {"phases": {}}
    entry: dict = {"name": "exllamav3", "version": version, "results": res}
    report["exllamav3"] = entry
    notes = report["notes"]
    dev = a.device if ":" in a.device else "cuda:0"
    torch.cuda.set_device(torch.device(dev))
    torch.cuda.reset_peak_memory_stats()
    ntok = exllamav3_cache_tokens(a)
    entry["cache_tokens"] = ntok
    print(f"[exllamav3] {entry['version']}: loading with a {ntok}-token cache on {dev}", flush=True)
    config, model, caches, tokenizer, load_s = load_exllamav3(a.ckpt, ntok, 1, dev)
    entry["load_s"] = load_s
    print(f"[exllamav3] loaded in {load_s:.1f} s", flush=True)
    gen = Generator(model=model, cache=caches[0], tokenizer=tokenizer)
    serial = [0]

    def run(prompts: list[list[int]], max_tokens: int, join_after: tuple[int, int] | None = None) -> list[Stream]:
        streams, ids = [], {}
        n, k = join_after or (len(prompts), 0)

        def enqueue(ps: list[list[int]]) -> None:
            for p in ps:
                serial[0] += 1
                ids[serial[0]] = len(streams)
                streams.append(Stream(time.perf_counter()))
                gen.enqueue(Job(input_ids=torch.tensor([p], dtype=torch.long), max_new_tokens=max_tokens,
                                sampler=ArgmaxSampler(), stop_conditions=None, identifier=serial[0]))

        enqueue(prompts[:n])
        later = prompts[n:]               # the join phase's: once each of the first n has k tokens
        deadline = time.monotonic() + a.request_timeout
        its, max_its = 0, 4 * (len(prompts) * max_tokens + sum(map(len, prompts))) + 1000   # bounded loop
        while gen.num_remaining_jobs() or later:
            if later and all(s.tokens >= k for s in streams[:n]):
                enqueue(later)
                later = []
            results = gen.iterate()
            now = time.perf_counter()
            for r in results:
                if r.get("stage") != "streaming" or r.get("identifier") not in ids:
                    continue
                t = r.get("token_ids")
                got = int(t.numel()) if t is not None else 0
                if got:
                    streams[ids[r["identifier"]]].events.append((now, got))
            its += 1
            if time.monotonic() > deadline or its > max_its:
                raise BenchError(f"exllamav3: {gen.num_remaining_jobs()} job(s) not done after "
                                 f"{a.request_timeout:.0f} s / {its} iterations")
        check_streams(streams, max_tokens, slack=1)      # its max_new_tokens may count the prefill's token
        return streams

    def after_phase(phase: str, r: dict) -> None:
        torch.cuda.synchronize()
        keep_max_memory(r, memory_sample(os.getpid(), baseline_mib))
        r["phases"][phase] = {"t": time.perf_counter(), "memory_gb": r["memory"]["gb"]}
        save()

    try:
        measure(run, a, a.vocab, after_phase, res, log=lambda m: print(f"[exllamav3]{m}", flush=True))
        res["max_memory_allocated_gb"] = torch.cuda.max_memory_allocated() / 1e9
        res["max_memory_reserved_gb"] = torch.cuda.max_memory_reserved() / 1e9
        notes.append(f"exllamav3 {entry['version']}: torch.cuda.max_memory_allocated "
                     f"{res['max_memory_allocated_gb']:.2f} GB, reserved {res['max_memory_reserved_gb']:.2f} GB "
                     f"(table: {res['memory']['source']}, {ntok}-token cache)")
    finally:
        entry["summary"] = summarize(res)
        gen = None                              # noqa: F841 - run() holds the generator's cell
        try:
            model.unload()
        except Exception as exc:  # noqa: BLE001 - the numbers are measured already
            print(f"[exllamav3] unload: {exc}", flush=True)
        del model, caches
        _free()
    return entry

"""Where serve's GPU memory goes beyond weights and the KV pool (issue 13: < 2 GB of scratch).

    python3 bench/gpu_memory.py CKPT [--max-model-len 32768] [--max-num-batched-tokens 2048]
        [--prompt 2048] [--speculative-tokens K] [--json out.json]

Loads CKPT as ``exl3tools serve --device cuda`` does (load_runner: the startup profile forward, the
KV pool at --gpu-memory-utilization, the decode graphs), runs one prompt of ``--prompt`` tokens and
a few decode steps, with torch's allocator history on. Prints the stages (allocated / reserved /
peak) and, at the moment the live bytes peaked, the live allocations beyond weights and KV grouped
by the innermost exl3tools / kernels frame that made them. CUDA only; nothing is written but --json.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GB = 1e9
OURS = ("exl3tools/", "kernels/", "bench/")


def owner(frames: list[dict]) -> str:
    """The innermost frame in our code: 'file:line function'."""
    for f in frames:
        name = f.get("filename", "")
        if any(s in name for s in OURS) and "gpu_memory.py" not in name:
            tail = name.split("exl3tools/")[-1] if "exl3tools/" in name else name.rsplit("/", 2)[-2] + "/" + name.rsplit("/", 1)[-1]
            return f"{tail}:{f.get('line')} {f.get('name')}"
    return "(outside exl3tools)"


def peak_live(snapshot: dict, device: int = 0, skip_over: int = 1 << 30,
              at_end: bool = False) -> tuple[int, list[tuple[str, int, int]]]:
    """Replay the allocator trace: (peak live bytes, [(owner, bytes, count)] live at the peak), not
    counting single blocks of ``skip_over`` bytes or more (the KV pool). ``at_end``: the live set
    when the trace ends instead of at the peak."""
    live: dict[int, tuple[int, str]] = {}
    cur = best = 0
    at_best: dict[int, tuple[int, str]] = {}
    for ev in snapshot["device_traces"][device]:
        act, addr, size = ev["action"], ev["addr"], ev["size"]
        if act == "alloc" and size < skip_over:
            live[addr] = (size, owner(ev.get("frames", [])))
            cur += size
            if cur > best:
                best, at_best = cur, dict(live)
        elif act in ("free_requested", "free") and addr in live:
            cur -= live.pop(addr)[0]
    if at_end:
        best, at_best = cur, live
    return best, _grouped(at_best.values())


def _grouped(items) -> list[tuple[str, int, int]]:
    groups: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for size, who in items:
        groups[who][0] += size
        groups[who][1] += 1
    return sorted(((k, v[0], v[1]) for k, v in groups.items()), key=lambda r: -r[1])


def pools(snapshot: dict, device: int = 0) -> list[tuple[str, int, int]]:
    """Reserved and allocated bytes per allocator pool: [(pool, reserved, allocated)], "default"
    first, then each CUDA-graph pool (its id): what the graphs keep beside the eager steps' memory."""
    out: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for seg in snapshot["segments"]:
        if seg.get("device", device) != device:
            continue
        pid = tuple(seg.get("segment_pool_id") or (0, 0))
        name = "default" if pid == (0, 0) else f"graph pool {pid[0]}.{pid[1]}"
        out[name][0] += seg.get("total_size", 0)
        out[name][1] += seg.get("allocated_size", 0)
    return sorted(((k, v[0], v[1]) for k, v in out.items()), key=lambda r: (r[0] != "default", -r[1]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("ckpt")
    ap.add_argument("--max-model-len", type=int, default=32768)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--speculative-tokens", type=int, default=0)
    ap.add_argument("--top", type=int, default=14)
    ap.add_argument("--json")
    a = ap.parse_args(argv)

    from exl3tools.cli._runtime import check_device

    from exl3tools.errors import UsageError

    try:
        check_device("cuda")        # serve's allocator settings (expandable segments) before CUDA starts
    except UsageError:
        print("no CUDA device: nothing to measure")
        return 0
    import torch

    from exl3tools.runtime.runner import load_runner
    dev = torch.device("cuda", 0)
    stages = []

    def stage(name: str) -> None:
        torch.cuda.synchronize(dev)
        s = {"stage": name, "allocated": torch.cuda.memory_allocated(dev), "reserved": torch.cuda.memory_reserved(dev),
             "peak": torch.cuda.max_memory_allocated(dev), "used": (lambda f, t: t - f)(*torch.cuda.mem_get_info(dev))}
        stages.append(s)
        print(f"{name:<28} allocated {s['allocated'] / GB:7.2f}  reserved {s['reserved'] / GB:7.2f}  "
              f"peak {s['peak'] / GB:7.2f}  device used {s['used'] / GB:7.2f} GB", flush=True)

    torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
    r = load_runner(a.ckpt, device="cuda", max_context=a.max_model_len, decode="graphs",
                    gpu_memory_utilization=a.gpu_memory_utilization, max_num_batched_tokens=a.max_num_batched_tokens,
                    speculative_tokens=a.speculative_tokens)
    weights = sum(t.numel() * t.element_size() for t in _model_tensors(r.model))
    kv = r.paged.nbytes()            # the block pool and, with MTP, the head's block pool
    stage("loaded (profile, pool, graphs)")
    loaded = torch.cuda.memory._snapshot()
    # a fresh history for the serving part (turning it off clears the trace): its peak and owners are
    # what serving adds; what the load left live comes from the load's own trace
    torch.cuda.memory._record_memory_history(enabled=None)
    torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
    prompt = [i % r.model.info.vocab_size for i in range(a.prompt)]
    _run_prompt(r, prompt, a.max_num_batched_tokens)
    stage(f"after a {a.prompt}-token prompt")
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    best, groups = peak_live(snap)
    end, held = peak_live(loaded, at_end=True)
    print(f"\nweights (model tensors) {weights / GB:.2f} GB, KV pool {kv / GB:.2f} GB; "
          f"reserved beyond both {(stages[-1]['reserved'] - weights - kv) / GB:.2f} GB, "
          f"device used beyond both {(stages[-1]['used'] - weights - kv) / GB:.2f} GB (CUDA context included)")
    print(f"serving (the prompt and decode steps): peak of what it allocated {best / GB:.2f} GB; at that moment, by owner:")
    for who, nbytes, count in groups[:a.top]:
        print(f"  {nbytes / 2**20:9.1f} MiB  {count:6d}  {who}")
    print(f"live after loading, the KV pool (blocks of 1 GiB and more) aside: {end / GB:.2f} GB, by owner:")
    for who, nbytes, count in held[:a.top]:
        print(f"  {nbytes / 2**20:9.1f} MiB  {count:6d}  {who}")
    by_pool = pools(snap)
    print("allocator pools (reserved / allocated GB):")
    for name, res, alloc in by_pool:
        print(f"  {name:<20} {res / GB:7.3f} / {alloc / GB:7.3f}")
    if a.json:
        Path(a.json).write_text(json.dumps({"stages": stages, "weights": weights, "kv": kv, "peak_live": best,
                                            "groups": groups[:50], "loaded_live": end, "loaded_groups": held[:50],
                                            "pools": by_pool}, indent=1))
    return 0


def _model_tensors(model):
    """Every distinct CUDA tensor reachable from the model's attributes (weights, tables, buffers)."""
    import torch

    seen, out, stack = set(), [], [model]
    visited = set()
    while stack:
        o = stack.pop()
        if id(o) in visited:
            continue
        visited.add(id(o))
        if isinstance(o, torch.Tensor):
            if o.is_cuda and o.untyped_storage().data_ptr() not in seen:
                seen.add(o.untyped_storage().data_ptr())
                out.append(o)
        elif isinstance(o, dict):
            stack.extend(o.values())
        elif isinstance(o, (list, tuple)):
            stack.extend(o)
        elif hasattr(o, "__dict__") and type(o).__module__.startswith(("exl3tools", "kernels")):
            stack.extend(vars(o).values())
        elif hasattr(o, "__slots__") and type(o).__module__.startswith(("exl3tools", "kernels")):
            stack.extend(getattr(o, s) for s in o.__slots__ if hasattr(o, s))
    return out


def _run_prompt(r, prompt: list[int], budget: int, decode_steps: int = 8) -> None:
    """One sequence through the Runner as serve drives it: the prompt in chunks of the token budget,
    then a few decode steps (graph replays)."""
    r.add_sequence("m")
    try:
        for i in range(0, len(prompt), budget):
            logits = r.step([("m", prompt[i:i + budget])], device_logits=True)
        for _ in range(decode_steps):
            logits = r.step([("m", [int(logits.argmax(-1)[0])])], device_logits=True)
    finally:
        r.free_sequence("m")


if __name__ == "__main__":
    sys.exit(main())

"""``load_runner(path) -> Runner``: a checkpoint's ranks started (spawned, or under torchrun),
rank 0's model built and its Runner (runtime/runner.py) made; the other ranks serve it."""

from __future__ import annotations

import atexit
import os
from typing import TYPE_CHECKING

import torch

from exl3tools.errors import CheckpointError, Exl3Error, UsageError
from exl3tools.kernels.dispatch import resolve_backend
from exl3tools.runtime import distributed as D
from exl3tools.runtime.loader import resolve
from exl3tools.runtime.rank_model import build_local_model, rank_device
from exl3tools.runtime.rank_state import DEFAULT_BLOCK_SIZE, DEFAULT_GPU_MEMORY_UTILIZATION

if TYPE_CHECKING:
    from exl3tools.runtime.runner import Runner


def _torchrun_env() -> tuple[int, int] | None:
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return None


def load_runner(path, *, device: str = "cpu", tp: int = 1, backend: str = "auto",
                max_cache_tokens: int | None = None, max_context: int | None = None, moe: str = "tp",
                decode: str | None = None, max_num_seqs: int = 32, block_size: int = DEFAULT_BLOCK_SIZE,
                kv_dtype: str = "auto", gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION,
                prefix_caching: bool = True, max_num_batched_tokens: int = 512,
                speculative_tokens: int = 0) -> Runner | None:
    """Load a checkpoint (unsliced, or a rank-slice output for ``tp`` ranks) and return its Runner.

    ``tp > 1`` spawns ranks 1..tp-1 as processes. Under torchrun (``RANK``/``WORLD_SIZE`` set)
    nothing is spawned: rank 0 gets the Runner; other ranks serve rank 0 inside this call and get
    ``None`` back once rank 0 closes its Runner. ``moe`` ("tp" | "ep") only matters for an
    unsliced checkpoint with ``tp > 1`` (a rank-slice output carries its own cut). The cache and
    decode options are Runner's.
    """
    backend = resolve_backend(backend, device)
    env = _torchrun_env()
    if env is not None:
        rank, world = env
        if tp not in (1, world):
            raise UsageError(f"--tp {tp} but torchrun started {world} processes")
    else:
        rank, world = 0, int(tp)
    if world < 1:
        raise UsageError(f"--tp must be >= 1, got {tp}")
    layout = resolve(path, world)          # names only: a wrong --tp fails here, before any spawn
    trace = os.environ.get("EXL3TOOLS_TRACE_OPENS") == "1"
    opts = dict(backend=backend, device=device, max_context=max_context, moe=moe, trace=trace)
    if env is not None and rank != 0:
        from exl3tools.runtime.worker import serve_rank  # torchrun's worker ranks

        serve_rank(str(path), rank=rank, world=world, port=None, **opts)
        return None
    procs = []
    if world > 1:
        port = None
        if env is None:
            port = D.free_port()
            procs = D.spawn_workers(world, port, str(path), {**opts, "threads": torch.get_num_threads()
                                                              // world or 1})
    try:
        if world > 1:
            D.init_group(0, world, rank_device(device, 0, world), port, procs)
        if trace:
            D.trace_opens_start()
        err, model = None, None
        try:
            model = build_local_model(layout, 0, world, backend=backend, device=device, max_context=max_context,
                                      moe=moe)
        except Exl3Error as exc:
            err = exc
            if world == 1:
                raise
        opened = {0: D.trace_opens_stop()} if trace else {}
        if world > 1:
            status = D.exchange_status(err, opened.get(0))
            opened = {st["rank"]: st["opened"] for st in status} if trace else {}
    except BaseException:
        if world > 1:
            D.destroy()
            D.reap(procs, wait=5.0)
        raise
    from exl3tools.runtime.runner import Runner  # here: runner.py re-exports load_runner

    name = layout.root.name if layout.root.name not in ("model",) else layout.root.parent.name
    try:
        runner = Runner(model, layout.rank_dir(0), name, world=world, procs=procs,
                        max_cache_tokens=max_cache_tokens, opened=opened, max_num_seqs=max_num_seqs,
                        block_size=block_size, kv_dtype=kv_dtype, gpu_memory_utilization=gpu_memory_utilization,
                        decode=decode, prefix_caching=prefix_caching,
                        max_num_batched_tokens=max_num_batched_tokens, speculative_tokens=speculative_tokens)
    except BaseException:
        if world > 1:       # the workers wait for a command: release them
            try:
                D.broadcast(("stop",))
            except Exception:  # noqa: BLE001 - peers may be gone already
                pass
            D.destroy()
            D.reap(procs, wait=5.0)
        raise
    if world > 1:
        atexit.register(runner.close)
    if model is None:  # pragma: no cover - exchange_status raised already
        raise CheckpointError("model failed to load")
    return runner

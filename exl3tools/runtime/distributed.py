"""Tensor parallelism across processes: one process per rank, torch.distributed underneath.

Rank 0 is the caller (the CLI or the server process); ``spawn_workers`` starts ranks 1..N-1
(``spawn`` start method), or torchrun starts them all (env ``RANK``/``WORLD_SIZE``). Rank 0 drives:
every state change (add/free sequence, step) is broadcast as a small command and every rank runs
the same forward; collectives inside the model combine the partial results. gloo on CPU, NCCL on
GPU. The model's collectives have a timeout (``EXL3TOOLS_TP_TIMEOUT`` seconds, default 120), so a
dead peer turns into an error, never a hang.

Commands travel over a gloo group of their own (``broadcast``), with no timeout: a worker waits
for the next command as long as the server idles (on the model's group it died after 120 idle
seconds), and a lost rank 0 still ends it at once (its sockets close). On GPUs that also keeps
the commands off the device: over NCCL each command was a collective queued behind the worker's
running step, so its host could not prepare step N+1 while the GPU ran step N.

After loading, ranks exchange a status record (ok or the error they hit, and, when
``EXL3TOOLS_TRACE_OPENS=1``, the files they opened) so that a load error on any rank surfaces on
rank 0 as one clear error and every rank exits.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import subprocess
import sys
import time
import traceback

import torch

from exl3tools import errors as E

_OPENED: list[str] | None = None
_COMMANDS = None         # the commands' gloo group (init_group)
# gloo takes a wait in milliseconds: ten years is "never" for a server and far from overflowing
_IDLE = datetime.timedelta(days=3650)
# how long rank 0 waits for its workers to start (a worker that exits fails the wait at once):
# not the collectives' EXL3TOOLS_TP_TIMEOUT, since starting Python and torch on a busy machine
# can take longer than a step may
JOIN_TIMEOUT_S = 600.0


def _audit(event: str, args) -> None:
    if event == "open" and _OPENED is not None and args and isinstance(args[0], (str, bytes, os.PathLike)):
        _OPENED.append(os.path.abspath(os.fsdecode(args[0])))


def trace_opens_start() -> None:
    """Record every file this process opens from now on (an audit hook; used by tests)."""
    global _OPENED
    if _OPENED is None:
        _OPENED = []
        if not getattr(trace_opens_start, "_hooked", False):
            sys.addaudithook(_audit)
            trace_opens_start._hooked = True


def trace_opens_stop() -> list[str]:
    global _OPENED
    out, _OPENED = (_OPENED or []), None
    return out


def one_gpu() -> bool:
    """EXL3TOOLS_TP_ONE_GPU=1: every rank on cuda:0 and the model's collectives over gloo (which
    takes CUDA tensors through host copies). Slow and without CUDA graphs (gloo syncs the host),
    it is a test bed: the tensor-parallel CUDA paths (a rank's fused MoE, its 16 / 32 MLA heads,
    chained steps and device drafts at TP) checked against TP 1 on a machine with one GPU."""
    return os.environ.get("EXL3TOOLS_TP_ONE_GPU") == "1"


def model_backend(device: str) -> str:
    """The model's collectives: NCCL on GPUs (gloo with ``one_gpu``), gloo on the CPU."""
    return "nccl" if str(device).startswith("cuda") and not one_gpu() else "gloo"


def timeout_s() -> float:
    return float(os.environ.get("EXL3TOOLS_TP_TIMEOUT", "120"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_group(rank: int, world: int, device: str, port: int | None = None, procs=()) -> None:
    """Join the process group. With ``port``, rank 0 hosts the store and waits for every worker to
    check in, failing at once if one of ``procs`` exits first (instead of waiting out the timeout)."""
    import torch.distributed as dist

    global _COMMANDS
    backend = model_backend(device)
    timeout = datetime.timedelta(seconds=timeout_s())
    if port is None:  # torchrun: MASTER_ADDR/MASTER_PORT come from the environment
        dist.init_process_group(backend, timeout=timeout)
        _COMMANDS = dist.new_group(backend="gloo", timeout=_IDLE)
        return
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout, wait_for_workers=False)
    if rank == 0:
        wait = max(JOIN_TIMEOUT_S, timeout_s())
        deadline = time.monotonic() + wait
        keys = [f"ready{r}" for r in range(1, world)]
        while not store.check(keys):       # every worker has set its "ready" key
            for p in procs:
                if p.poll() is not None:
                    raise E.RuntimeFailure(f"tensor-parallel worker (pid {p.pid}) exited with code "
                                           f"{p.returncode} before joining")
            if time.monotonic() > deadline:
                raise E.RuntimeFailure(f"tensor-parallel workers did not join within {wait:.0f} s")
            time.sleep(0.05)
    else:
        store.set(f"ready{rank}", "1")
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    _COMMANDS = dist.new_group(backend="gloo", timeout=_IDLE)


def broadcast(obj=None):
    """Rank 0 sends the command ``obj``; every rank returns it (over the commands' group: a
    worker may wait here for as long as the server idles)."""
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=0, group=_COMMANDS)
    return box[0]


def gather_ints(value: int) -> list[int]:
    """Every rank's ``value``, by rank, on every rank (over the commands' group: once at load)."""
    import torch
    import torch.distributed as dist

    out = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size())]
    dist.all_gather(out, torch.tensor([int(value)], dtype=torch.int64), group=_COMMANDS)
    return [int(t) for t in out]


def broadcast_tensor(t: torch.Tensor) -> torch.Tensor:
    """Rank 0's ``t`` into every rank's ``t`` (same shape and dtype), over the model's group: on
    GPUs a stream-ordered NCCL broadcast that never waits on the host (a chained step's tokens)."""
    import torch.distributed as dist

    dist.broadcast(t, src=0)
    return t


def exchange_status(error: BaseException | None, opened: list[str] | None) -> list[dict]:
    """All ranks share how loading went; raises the first rank's error on every rank. Over the
    commands' group: ranks that finish loading apart (one slice slower to read) wait for each
    other without the collectives' timeout; a rank that dies ends the wait (its socket closes)."""
    import torch.distributed as dist

    mine = {"rank": dist.get_rank(), "ok": error is None, "opened": opened,
            "cls": type(error).__name__ if error else None, "msg": str(error) if error else None}
    world = dist.get_world_size()
    all_status: list = [None] * world
    dist.all_gather_object(all_status, mine, group=_COMMANDS)
    for st in all_status:
        if not st["ok"]:
            cls = getattr(E, st["cls"], None)
            if not (isinstance(cls, type) and issubclass(cls, E.Exl3Error)):
                cls = E.RuntimeFailure
            msg = st["msg"] or st["cls"]
            raise cls(f"rank {st['rank']}: {msg}" if not msg.startswith("rank ") else msg)
    return all_status


def abort() -> None:
    """Abort the model's group after a peer died, where its collectives would wait for the dead
    rank (NCCL: the communicators are aborted, so kernels in flight return); gloo's fail alone."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_backend() != "nccl":
        return
    try:
        dist.distributed_c10d._abort_process_group()
    except Exception as exc:  # noqa: BLE001 - a private API; the watchdog's timeout still ends the wait
        print(f"exl3tools: aborting the NCCL group failed: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}", file=sys.stderr)


def destroy() -> None:
    import torch.distributed as dist

    global _COMMANDS
    _COMMANDS = None
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - best effort at shutdown
            pass


def reap(procs, wait: float = 10.0) -> None:
    """Wait for our worker processes to exit; kill (by pid, ours only) any that do not."""
    for p in procs:
        try:
            p.wait(timeout=wait)
        except Exception:  # noqa: BLE001 - subprocess.TimeoutExpired
            p.kill()
            p.wait()


def spawn_workers(world: int, port: int, path: str, opts: dict) -> list[subprocess.Popen]:
    """Start ranks 1..world-1 as ``python -m exl3tools.runtime.distributed`` processes (a fresh
    interpreter each: no dependence on the caller's ``__main__``)."""
    procs = []
    for r in range(1, world):
        args = [sys.executable, "-m", "exl3tools.runtime.distributed", json.dumps(
            {"rank": r, "world": world, "port": port, "path": str(path), "opts": opts})]
        procs.append(subprocess.Popen(args, stdin=subprocess.DEVNULL))
    return procs


def worker_main(rank: int, world: int, port: int | None, path: str, opts: dict) -> int:
    """Entry point of a non-zero rank: load, report status, then serve rank 0's commands."""
    from exl3tools.runtime.worker import serve_rank

    torch.set_num_threads(max(1, int(opts.get("threads") or 1)))
    try:
        serve_rank(path, rank=rank, world=world, port=port, **{k: v for k, v in opts.items() if k != "threads"})
    except E.Exl3Error:
        return 1          # rank 0 reports it
    except Exception:    # noqa: BLE001 - a bug or a lost peer on a worker: say so and exit
        traceback.print_exc()
        return 1
    return 0


if __name__ == "__main__":
    a = json.loads(sys.argv[1])
    sys.exit(worker_main(a["rank"], a["world"], a["port"], a["path"], a["opts"]))

"""What the commands that run the model (generate, serve) check before loading it, and the load
progress bar they show while it loads."""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from pathlib import Path

import click

from exl3tools.errors import NotFoundError, UsageError

API_KEY_ENV = "EXL3TOOLS_SERVE_API_KEY"     # one key
API_KEYS_ENV = "EXL3TOOLS_SERVE_API_KEYS"   # several, whitespace-separated (click's auto env var)
VLLM_API_KEY_ENV = "VLLM_API_KEY"           # vLLM's one key: read only where neither of ours is set


def cuda_alloc_conf() -> None:
    """Before CUDA starts: prefill steps of every length reuse freed activation memory without
    fragmenting the cache (H200 serve: 1.4 GB reserved beyond the allocated peak without it)."""
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")


def check_device(device: str) -> str:
    """``cpu``, ``cuda`` or ``cuda:N`` that this machine has; else UsageError, before any loading."""
    m = re.fullmatch(r"cpu|cuda(?::(\d+))?", device)
    if m is None:
        raise UsageError(f"--device {device!r}: use auto, cpu, cuda or cuda:N")
    if device == "cpu":
        return device
    cuda_alloc_conf()
    import torch

    if not torch.cuda.is_available():
        raise UsageError(f"--device {device}: no CUDA device here (torch {torch.__version__} sees none); "
                         "use --device cpu")
    n = torch.cuda.device_count()
    if m.group(1) is not None and int(m.group(1)) >= n:
        raise UsageError(f"--device {device}: this machine has {n} CUDA device(s), cuda:0..cuda:{n - 1}")
    return device


def check_output_file(path: Path | None, option: str) -> None:
    """A file the command will write at the end: its folder must exist and be writable now."""
    if path is None:
        return
    parent = path.parent
    if not parent.is_dir():
        raise NotFoundError(f"{option} {path}: the folder {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"{option} {path}: the folder {parent} is not writable")
    if path.is_dir():
        raise UsageError(f"{option} {path}: is a directory")


def api_keys_option(ctx: click.Context, param: click.Parameter, value: tuple[str, ...]) -> tuple[str, ...]:
    """--api-key values; without any on the command line, EXL3TOOLS_SERVE_API_KEY (one key) and
    EXL3TOOLS_SERVE_API_KEYS (several); only without both, vLLM's VLLM_API_KEY (one key), so a vLLM
    deployment's environment keeps working. A variable that is read but set empty is refused: it
    usually means a secret that did not arrive, and the server would otherwise start open."""
    from click.core import ParameterSource

    keys = list(value)
    if ctx.get_parameter_source(param.name) != ParameterSource.COMMANDLINE:
        names = [n for n in (API_KEYS_ENV, API_KEY_ENV) if n in os.environ]
        if not names and VLLM_API_KEY_ENV in os.environ:     # vLLM's, last
            names = [VLLM_API_KEY_ENV]
        for name in names:
            raw = os.environ[name].strip()
            if not raw:
                raise UsageError(f"{name} is set but empty; give a real API key or unset it")
            if name != API_KEYS_ENV and raw not in keys:     # API_KEYS: click's auto env var, already in value
                keys.append(raw)
    from exl3tools.server.limits import check_api_keys

    return check_api_keys(keys)  # UsageError: one line, exit 2


class LoadProgress:
    """A Rich bar on stderr (bytes, tensors, throughput) while the runtime reads weights, fed by
    ``exl3tools.runtime.weights.progress_hook``; one summary line at the end. Safe to use from
    the engine thread that loads (serve); ``close()`` is idempotent."""

    def __init__(self, log: logging.Logger | None = None) -> None:
        from exl3tools.cli._output import err_console
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TransferSpeedColumn,
        )

        self._log = log
        self._progress = Progress(TextColumn("loading weights"), BarColumn(), DownloadColumn(),
                                  TransferSpeedColumn(), TextColumn("{task.fields[tensors]} tensors"),
                                  TimeElapsedColumn(), console=err_console, transient=True)
        self._task = None
        self._lock = threading.Lock()
        self.tensors = self.bytes = 0
        self._t0 = self._t_last = 0.0  # first and last read
        self._open = False

    def hook(self, nbytes: int, total: int) -> None:
        with self._lock:
            if not self._open:
                return
            if self._task is None:
                self._task = self._progress.add_task("load", total=total, tensors=0)
                self._t0 = time.perf_counter()
            self._t_last = time.perf_counter()
            self.tensors += 1
            self.bytes += nbytes
            self._progress.update(self._task, advance=nbytes, tensors=self.tensors)

    def __enter__(self) -> LoadProgress:
        from exl3tools.runtime import weights

        self._open = True
        weights.progress_hook = self.hook
        self._progress.start()
        return self

    def close(self) -> None:
        from exl3tools.runtime import weights

        with self._lock:
            if not self._open:
                return
            self._open = False
            if weights.progress_hook == self.hook:
                weights.progress_hook = None
        self._progress.stop()
        if self.tensors and self._log is not None:
            dt = self._t_last - self._t0
            self._log.info("read %d tensors, %.1f MB in %.1f s (%.0f MB/s)", self.tensors,
                           self.bytes / 1e6, dt, self.bytes / 1e6 / max(dt, 1e-9))

    def __exit__(self, *exc: object) -> None:
        self.close()


def preflight_plan(path: str, *, device: str, tp: int, moe: str, mem_get_info=None, **opts) -> None:
    """Before any weight is read: on a CUDA device, refuse (DoesNotFitError, exit 3) when exl3tools
    plan says the checkpoint cannot fit the memory free now (docs/plan.md). Only an unsliced local
    checkpoint is planned; ``opts`` are plan_memory's (util, block_size, kv_dtype, ...)."""
    if not str(device).startswith("cuda") or not Path(path).is_dir():
        return
    import torch

    from exl3tools.checkpoint import Checkpoint
    from exl3tools.plan import CUDA_CONTEXT, plan_memory
    from exl3tools.runtime.loader import resolve

    if resolve(path, tp).kind != "unsliced" or (mem_get_info is None and not torch.cuda.is_available()):
        return
    first = (torch.device(device).index or 0) if tp == 1 else 0
    info = mem_get_info or torch.cuda.mem_get_info
    free, total = min((info(i) for i in range(first, first + tp)), key=lambda ft: ft[0])
    # mem_get_info just created this process's CUDA context: plan counts it already (CUDA_CONTEXT)
    in_use = max(total - free - CUDA_CONTEXT, 0)
    # the message names the GPU: "cuda:0 [NVIDIA H200]" (a faked mem_get_info: the device string only)
    gpu = str(device) if mem_get_info is not None else f"{device} [{torch.cuda.get_device_name(first)}]"
    plan_memory(Checkpoint.open(path), gpu=gpu, gpu_total=total,
                tp=tp, moe=moe, in_use=in_use, **opts).raise_unless_fits()

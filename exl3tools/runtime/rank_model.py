"""The model part one rank runs: its checkpoint directory opened (only it), the architecture's
modules built on this rank's device (runtime/runner.py's rank 0 and runtime/worker.py's ranks)."""

from __future__ import annotations

import logging
import os

import torch

from exl3tools.runtime.arch import BuildContext, arch_module
from exl3tools.runtime.loader import Layout, open_rank
from exl3tools.runtime.model import CausalLM
from exl3tools.runtime.tp import TPContext
from exl3tools.runtime.weights import WeightSource
from exl3tools.text import first_line

log = logging.getLogger("exl3tools.runtime")


def build_local_model(layout: Layout, rank: int, world: int, *, backend: str = "reference",
                      device: str = "cpu", max_context: int | None = None, moe: str = "tp") -> CausalLM:
    """Open this rank's directory (only it) and build the model part this rank runs.

    An unsliced checkpoint run with ``world > 1`` is planned in memory with the rank-slice rules
    (``moe``: "tp" or "ep") and each rank reads only the byte ranges of its cut."""
    ckpt, cut = open_rank(layout, rank)
    mod = arch_module(ckpt.architecture)
    device = rank_device(device, rank, world)
    block = ckpt.config.get("exl3tools") if layout.kind == "ranks" else None
    if cut:
        from exl3tools.slicing import plan_rank_slices

        block = plan_rank_slices(ckpt, world, moe).configs[rank]["exl3tools"]
    ctx = BuildContext(ckpt.config, WeightSource(ckpt), TPContext(world, rank), cut, block, backend, device,
                       max_context)
    model = mod.build(ctx)
    if rank == 0:   # the server's weight-read metric, from the headers already open (not re-read at ready)
        model.weight_reads = _weight_reads(ckpt, world, moe)
    return model


def _weight_reads(ckpt, world: int, moe: str):
    """roofline.DecodeReads of rank 0, or None: the metric is a nicety, never a reason not to load."""
    from exl3tools.roofline import decode_reads

    try:
        return decode_reads(ckpt, world, moe)
    except Exception as exc:  # noqa: BLE001
        log.warning("no decode weight-read estimate: %s", first_line(exc))
        return None


def rank_device(device: str, rank: int, world: int) -> str:
    """A bare "cuda" under TP means one GPU per rank: cuda:LOCAL_RANK (torchrun) or cuda:rank
    (every rank on cuda:0 with EXL3TOOLS_TP_ONE_GPU=1, distributed.one_gpu)."""
    from exl3tools.runtime.distributed import one_gpu

    if str(device) == "cuda" and world > 1:
        local = 0 if one_gpu() else int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(local)
        return f"cuda:{local}"
    return device

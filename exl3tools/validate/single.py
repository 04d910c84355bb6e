"""One checkpoint directory: structure, linears, architecture, then numerics (sampled or deep)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from exl3tools.validate import deep as D
from exl3tools.validate import numeric as N
from exl3tools.validate.architecture import check_architecture
from exl3tools.validate.context import Context
from exl3tools.validate.findings import ProgressFactory, Sink
from exl3tools.validate.linears import check_linears
from exl3tools.validate.structure import check_qfile, check_quant_config, open_tolerant


def check_checkpoint(root: Path, sink: Sink, *, deep: bool, sample_blocks: int,
                     progress: ProgressFactory | None, gpu: Any = None) -> dict[str, Any]:
    parallel = not deep and N.can_fork()
    opened = open_tolerant(root, sink, defer_qfile=parallel)
    if opened is None:
        return {"files": 0, "tensors": 0}
    ckpt, bad_files = opened
    ctx = Context.build(ckpt, sink, bad_files)
    run = None if deep else N.start_sampled(ctx)  # forks workers; quantization_config.json job starts now
    try:
        check_quant_config(ctx)
        check_linears(ctx)
    except BaseException:
        if run is not None:
            N.abort_sampled(run)
        raise
    if run is None:
        check_architecture(ctx)
        check_qfile(ctx)
        num = D.check_deep(ctx, progress, gpu)
    else:  # the architecture check runs in this process while workers read samples
        num = N.finish_sampled(run, sample_blocks, meanwhile=lambda: check_architecture(ctx))
    return {"files": len(ckpt.headers), "tensors": len(ckpt.tensors), "linears": len(ctx.scan.linears),
            "file_bytes": ckpt.file_bytes, "architecture": ckpt.architecture, **num}

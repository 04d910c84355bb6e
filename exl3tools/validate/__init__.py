"""validate(path) -> Report[Finding]: every problem of an EXL3 checkpoint, before anything loads it.

Default mode reads headers, JSON files and small samples (sign vectors, markers, one trellis strip
per linear, up to a budget of decoded 128x128 blocks); ``deep=True`` reads every byte (sha256 of
every file, every linear decoded, every dense tensor checked). Rules and codes: rules.py,
docs/validate.md. A rank-slice output (DST with manifest.json / rank-r-of-N dirs) is recognised and
checked as a set (ranks.py).

The package's floors, each importing only the ones below it:

    rules -> findings -> context -> structure -> linears -> architecture -> numeric -> deep
      -> single (one checkpoint dir) -> ranks (a rank-slice set) -> validate() here
    report (Rich / JUnit rendering) sits on findings + rules.
"""

from __future__ import annotations

import time
from typing import Any

from exl3tools.checkpoint.header import gc_paused
from exl3tools.checkpoint.reader import Checkpoint, existing_dir
from exl3tools.validate import ranks
from exl3tools.validate.findings import Finding, ProgressFactory, Report, Sink
from exl3tools.validate.single import check_checkpoint

__all__ = ["validate", "Report", "Finding"]


def validate(path: Any, *, deep: bool = False, sample_blocks: int = 256,
             progress: ProgressFactory | None = None, gpu: Any = None) -> Report:
    """Validate a checkpoint directory, a rank-slice output set, or one of its rank dirs.

    ``path``: a directory, or an opened Checkpoint (its directory is re-read tolerantly).
    ``progress(total_bytes, files)`` (deep mode) returns a callback taking bytes read.
    ``gpu`` (deep mode): a kernels.gpu_decode.GpuDecoder to decode the linears on, or None (CPU).
    Raises NotFoundError / NotACheckpointError for paths that are not checkpoints at all (exit 2).
    """
    root = existing_dir(path.root if isinstance(path, Checkpoint) else path)
    t0 = time.perf_counter()
    sink = Sink(root)
    # No cyclic GC while checking: a GLM-5 checkpoint is ~2M long-lived acyclic objects (headers, scan,
    # index, tensor_storage), and the full collections their allocation triggers cost ~1 s.
    with gc_paused():
        if ranks.is_rank_set(root):
            stats = ranks.check_rank_set(root, sink, deep=deep, sample_blocks=sample_blocks, progress=progress,
                                          gpu=gpu)
        else:
            stats = check_checkpoint(root, sink, deep=deep, sample_blocks=sample_blocks, progress=progress, gpu=gpu)
            ranks.check_lone_rank_dir(root, sink)
    if sink.dropped:
        stats["findings_not_listed"] = sum(sink.dropped.values())
    stats["seconds"] = round(time.perf_counter() - t0, 3)
    stats["mode"] = "deep" if deep else "sampled"
    return Report(str(root), sink.sorted(), stats)

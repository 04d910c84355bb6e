"""The offline flow in one place: (normalize) -> rank-slice -> verify.

    from exl3tools.pipeline import slice_and_verify
    slice_and_verify("GLM-5-exl3", "GLM-5-tp4", tp=4)
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from exl3tools.checkpoint import Checkpoint
from exl3tools.checkpoint.manifest import RankManifest
from exl3tools.normalize import apply_normalize, plan_normalize
from exl3tools.slicing import dequantize_to_writer, plan_rank_slices, write_rank_shards
from exl3tools.slicing.verify import VerifyReport, verify_sliced


def needs_normalize(ck: Checkpoint) -> bool:
    """True when names/layout differ from canonical (a missing index alone does not count)."""
    return any(not a.startswith("write ") for a in plan_normalize(ck).actions)


def slice_and_verify(src: str | os.PathLike[str], dst: str | os.PathLike[str], tp: int, moe: str = "tp",
                     layout: str = "ranks", resume: bool = False, work: str | os.PathLike[str] | None = None,
                     progress: Callable[[int], None] | None = None) -> tuple[RankManifest, VerifyReport]:
    ck = Checkpoint.open(src)
    if needs_normalize(ck):  # foreign names: slice a normalized copy (written to ``work``)
        work = Path(work or f"{os.fspath(dst).rstrip('/')}.normalized")
        if not (work / "model.safetensors.index.json").is_file():
            apply_normalize(ck, plan_normalize(ck), work, progress)
        ck = Checkpoint.open(work)
    plan = plan_rank_slices(ck, tp, moe, layout)
    man = write_rank_shards(ck, plan, dst, resume=resume, progress=progress,
                            dequant=dequantize_to_writer if layout == "vllm-hybrid" else None)
    return man, verify_sliced(ck.root, dst)

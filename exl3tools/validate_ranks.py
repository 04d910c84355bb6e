"""E5xx: rank-slice outputs (docs/rank-slice.md). Filled in once the format lands."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def is_rank_set(root: Path) -> bool:
    return (root / "manifest.json").is_file() or any(root.glob("rank-*-of-*"))


def check_rank_set(root: Path, sink, **kw: Any) -> dict[str, Any]:
    return {}


def check_lone_rank_dir(root: Path, sink) -> None:
    return None

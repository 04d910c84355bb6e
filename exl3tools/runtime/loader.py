"""Find and open the one checkpoint directory this rank reads; build the model from it.

Accepted paths:
- an unsliced EXL3 checkpoint (``config.json`` without an ``exl3tools`` block); with TP > 1 each
  rank cuts its part while reading (byte ranges only);
- a rank-slice output root holding ``rank-{r}-of-{N}/`` directories (``exl3tools rank-slice``);
  rank r opens only ``rank-{r}-of-{N}/``;
- one ``rank-{r}-of-{N}/`` directory itself (its siblings are found by name, never opened).
The layout checks here look at directory *names* only, so no rank opens another rank's files.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from exl3tools.checkpoint.reader import Checkpoint, existing_dir, load_json, nested_checkpoint_hint
from exl3tools.errors import (
    CheckpointError,
    IncompleteOutputError,
    NotACheckpointError,
    UsageError,
)
from exl3tools.text import first_line

RANK_DIR = re.compile(r"^rank-(\d+)-of-(\d+)$")


@dataclass(frozen=True, slots=True)
class Layout:
    """Where each rank reads from."""

    kind: str                 # "unsliced" | "ranks"
    root: Path                # the checkpoint dir, or the rank-slice output root
    tp: int                   # for "ranks": the N the output was cut for

    def rank_dir(self, rank: int) -> Path:
        return self.root if self.kind == "unsliced" else self.root / f"rank-{rank}-of-{self.tp}"


def rank_dirs(root: Path) -> dict[int, tuple[int, Path]]:
    out = {}
    for p in root.iterdir() if root.is_dir() else ():
        m = RANK_DIR.match(p.name)
        if m and p.is_dir():
            out[int(m.group(1))] = (int(m.group(2)), p)
    return out


def resolve(path: str | Path, tp: int) -> Layout:
    """Check the layout against ``tp`` before any process is started (names only, no file opened
    except the unsliced checkpoint's own config)."""
    root = existing_dir(path)
    if RANK_DIR.match(root.name) and not (root / "config.json").is_file():
        raise NotACheckpointError(f"{root}: rank directory without config.json")
    if RANK_DIR.match(root.name):
        root = root.parent
    ranks = rank_dirs(root)
    if not ranks:
        if not (root / "config.json").is_file():
            raise NotACheckpointError(f"{root}: no config.json and no rank-*-of-*/ directories"
                                      + nested_checkpoint_hint(root))
        return Layout("unsliced", root, tp)
    ns = {n for n, _ in ranks.values()}
    if len(ns) != 1:
        raise CheckpointError(f"{root}: rank directories of different sizes ({sorted(ns)}) mixed together")
    n = ns.pop()
    if n != tp:
        raise UsageError(f"{root} is a rank-slice output for --tp {n} (rank-*-of-{n}), but --tp {tp} was given")
    missing = [r for r in range(n) if r not in ranks]
    if missing:
        names = ", ".join(f"rank-{r}-of-{n}" for r in missing)
        raise NotACheckpointError(f"{root}: rank directories missing: {names}")
    if not (root / "manifest.json").is_file():
        raise IncompleteOutputError(f"{root}: no manifest.json, the rank-slice output is unfinished "
                                    "(rerun exl3tools rank-slice with --resume)")
    return Layout("ranks", root, n)


def open_rank(layout: Layout, rank: int) -> tuple[Checkpoint, bool]:
    """(this rank's checkpoint, cut_in_memory). Verifies the rank dir's own ``exl3tools`` block."""
    d = layout.rank_dir(rank)
    ckpt = Checkpoint.open(d)
    block = ckpt.config.get("exl3tools")
    if layout.kind == "unsliced":
        if isinstance(block, dict) and int(block.get("tp", 1)) > 1:
            raise UsageError(f"{d}: one rank of a tp={block.get('tp')} output; give its parent directory")
        return ckpt, layout.tp > 1
    if not isinstance(block, dict):
        raise CheckpointError(f"{d}/config.json: no 'exl3tools' block; not written by exl3tools rank-slice")
    if block.get("format_version") != 1 or block.get("layout") != "ranks":
        raise CheckpointError(f"{d}/config.json: exl3tools block format_version {block.get('format_version')} "
                              f"layout {block.get('layout')!r}; this runtime reads format_version 1, layout ranks")
    if int(block.get("tp", -1)) != layout.tp or int(block.get("rank", -1)) != rank:
        raise CheckpointError(f"{d}/config.json says tp={block.get('tp')} rank={block.get('rank')}, "
                              f"expected tp={layout.tp} rank={rank}")
    return ckpt, False


MAX_TOKENIZER_BYTES = 1 << 30  # the largest tokenizer.json we parse (real ones are < 50 MB)


def load_tokenizer(path: Path):
    """``tokenizer.json`` as a ``tokenizers.Tokenizer``, None when there is no such file.
    Unreadable: the OSError (exit 2); too large or not a tokenizer: CheckpointError (exit 1)."""
    if not path.is_file():
        return None
    from tokenizers import Tokenizer

    if path.stat().st_size > MAX_TOKENIZER_BYTES:
        raise CheckpointError(f"{path}: {path.stat().st_size} bytes, more than a tokenizer.json can be")
    with path.open("rb") as f:  # PermissionError and friends surface as themselves
        data = f.read(MAX_TOKENIZER_BYTES + 1)
    try:
        return Tokenizer.from_str(data.decode("utf-8"))
    except Exception as exc:  # noqa: BLE001 - tokenizers raises a bare Exception for bad JSON
        raise CheckpointError(f"{path}: not a readable tokenizer ({first_line(exc)})") from None


def read_config(layout: Layout) -> dict:
    return load_json(layout.rank_dir(0) / "config.json", "config.json")

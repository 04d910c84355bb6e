"""One output object, two audiences: Rich for people (stderr for status), JSON on stdout."""

from __future__ import annotations

import errno
import json
import sys
from typing import Any

from rich.console import Console

from exl3tools.text import for_console


class StdoutClosed(BrokenPipeError):
    """Whoever read stdout stopped (``| head -1``); cli/__init__.py exits quietly with its code."""


class _Console(Console):
    def on_broken_pipe(self) -> None:
        # rich's own handler exits 1, the code of a broken checkpoint (validate | head -1 "found errors")
        raise StdoutClosed(errno.EPIPE, "stdout closed")


console = _Console(highlight=False)            # tables and results, stdout
err_console = Console(stderr=True, highlight=False)  # status, warnings, progress


def emit_json(obj: Any) -> None:
    """One JSON document on stdout."""
    try:
        sys.stdout.write(json.dumps(obj, indent=2, sort_keys=False, default=_default) + "\n")
        sys.stdout.flush()
    except BrokenPipeError as exc:
        raise StdoutClosed(*exc.args) from None


def _default(o: Any) -> Any:
    if hasattr(o, "to_json"):
        return o.to_json()
    if isinstance(o, (set, frozenset, tuple)):
        return list(o)
    return str(o)


def warn(message: str) -> None:
    err_console.print(f"[yellow]warning:[/] {for_console(message)}")


def status(message: str) -> None:
    err_console.print(for_console(message))


def byte_progress(label: str, *, transient: bool = False, disable: bool = False):
    """The one progress bar of long commands: bytes done, bytes/s and ETA, on stderr."""
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    return Progress(TextColumn(label), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                    TimeRemainingColumn(), console=err_console, transient=transient, disable=disable)


def byte_bar(total: int, label: str):
    """(progress, advance callback) for one task of ``total`` bytes."""
    prog = byte_progress(label)
    task = prog.add_task(label, total=total)
    return prog, (lambda n: prog.update(task, advance=n))

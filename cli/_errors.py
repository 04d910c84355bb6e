"""One table maps errors to a one-line message and an exit code.

Exit codes (documented in README.md):
  0  success
  1  the checkpoint (or sliced output) is broken / validate found errors / verify failed /
     a Hub repo's revision moved (or a file of it changed) while it was being sliced
  2  usage or I/O problem: bad options, missing path, not a checkpoint, unwritable output,
     an optional dependency not installed (the message names the extra), a Hub download that
     failed after its retries
  3  refused: a valid request exl3tools cannot do (unsupported architecture, illegal cut, the model
     does not fit the GPU memory: plan, serve, generate)
  4  runtime failure (a worker or tensor-parallel peer died)
 70  internal error: a bug in exl3tools (please report it; --debug shows the traceback)
130  interrupted
141  stdout closed before all output was written (``| head -1``), as SIGPIPE ends a shell filter; quiet
 70  internal error: a bug (anything not in the table below); please report it with --debug output
Tracebacks only with --debug or EXL3TOOLS_DEBUG=1.
"""

from __future__ import annotations

import traceback

from exl3tools import errors as E
from exl3tools.text import printable

EXIT_OK = 0
EXIT_BAD_CHECKPOINT = 1
EXIT_USAGE = 2
EXIT_REFUSED = 3
EXIT_RUNTIME = 4
EXIT_INTERRUPTED = 130
EXIT_STDOUT_CLOSED = 141  # 128 + SIGPIPE: what `yes | head -1` exits with under `set -o pipefail`

# Ordered: the first matching class wins, so subclasses come before their bases.
ERROR_TABLE: list[tuple[type[BaseException], int, str]] = [
    (E.UsageError, EXIT_USAGE, "usage error"),
    (E.NotFoundError, EXIT_USAGE, "not found"),
    (E.NotACheckpointError, EXIT_USAGE, "not a checkpoint"),
    (E.OutputExistsError, EXIT_USAGE, "output exists"),
    (E.UnsupportedArchitectureError, EXIT_REFUSED, "unsupported architecture"),
    (E.IncompatibleSliceError, EXIT_REFUSED, "cannot slice"),
    (E.RevisionChangedError, EXIT_BAD_CHECKPOINT, "revision changed"),
    (E.TransferError, EXIT_USAGE, "download failed"),
    (E.DoesNotFitError, EXIT_REFUSED, "does not fit"),
    (E.IncompleteOutputError, EXIT_BAD_CHECKPOINT, "incomplete output"),
    (E.VerifyError, EXIT_BAD_CHECKPOINT, "verify failed"),
    (E.NotExl3Error, EXIT_BAD_CHECKPOINT, "not EXL3"),
    (E.HeaderError, EXIT_BAD_CHECKPOINT, "corrupt safetensors"),
    (E.CheckpointError, EXIT_BAD_CHECKPOINT, "invalid checkpoint"),
    (E.RuntimeFailure, EXIT_RUNTIME, "runtime failure"),
    (FileNotFoundError, EXIT_USAGE, "not found"),
    (PermissionError, EXIT_USAGE, "permission denied"),
    (IsADirectoryError, EXIT_USAGE, "is a directory"),
    (NotADirectoryError, EXIT_USAGE, "not a directory"),
    (OSError, EXIT_USAGE, "I/O error"),
    (E.Exl3Error, EXIT_BAD_CHECKPOINT, "error"),
]


# A core install (no extras) lacks these: name the extra that brings each (pyproject.toml).
EXTRA_FOR_MODULE = {
    "torch": "runtime", "tokenizers": "runtime", "jinja2": "runtime",
    "fastapi": "serve", "uvicorn": "serve", "starlette": "serve", "pydantic": "serve",
    "prometheus_client": "serve",
    "exllamav3": "gpu", "triton": "gpu",
}


def classify(exc: BaseException) -> tuple[int, str] | None:
    """(exit code, one-line message) for a known error, None for a bug."""
    if isinstance(exc, ModuleNotFoundError):
        top = (exc.name or "").partition(".")[0]
        extra, via = EXTRA_FOR_MODULE.get(top), ""
        if extra is None:   # a dependency of a dependency (fastapi 0.165 imports opentelemetry)
            for frame, _ in traceback.walk_tb(exc.__traceback__):
                owner = str(frame.f_globals.get("__name__", "")).partition(".")[0]
                if owner in EXTRA_FOR_MODULE:
                    extra, via = EXTRA_FOR_MODULE[owner], f" (imported by {owner})"
                    break
        if extra is None:
            return None
        return EXIT_USAGE, (f"missing dependency: {exc.name}{via} is not installed; "
                            f"pip install 'exl3tools[{extra}]'")
    for cls, code, label in ERROR_TABLE:
        if isinstance(exc, cls):
            text = str(exc).strip() or cls.__name__
            if isinstance(exc, OSError) and not isinstance(exc, E.Exl3Error):
                name = exc.filename or ""
                text = f"{name}: {exc.strerror or text}" if name else text
            return code, f"{label}: {printable(text)}"  # one line, whatever a name in it holds
    return None

"""Finding, Report and Sink: what every validate check produces, and where it collects it."""

from __future__ import annotations

import re
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from exl3tools.errors import CheckpointError
from exl3tools.validate.rules import RULES

SEVERITY_ORDER = ("error", "warning")


@dataclass(frozen=True, slots=True)
class Finding:
    code: str
    severity: str          # "error" | "warning"
    file: str | None       # path relative to the validated directory
    tensor: str | None     # tensor (or module) name
    message: str

    @property
    def line(self) -> str:
        where = ":".join(x for x in (self.file, self.tensor) if x)
        return f"{self.code} {where}: {self.message}" if where else f"{self.code} {self.message}"

    def to_json(self) -> dict[str, Any]:
        return {"code": self.code, "severity": self.severity, "file": self.file, "tensor": self.tensor,
                "message": self.message}


@dataclass(frozen=True, slots=True)
class Report:
    path: str
    findings: tuple[Finding, ...]
    stats: dict[str, Any] = field(default_factory=dict)

    @property
    def errors(self) -> tuple[Finding, ...]:
        return tuple(f for f in self.findings if f.severity == "error")

    @property
    def warnings(self) -> tuple[Finding, ...]:
        return tuple(f for f in self.findings if f.severity == "warning")

    @property
    def codes(self) -> set[str]:
        return {f.code for f in self.findings}

    def ok(self, strict: bool = False) -> bool:
        return not self.errors and not (strict and self.warnings)

    def exit_code(self, strict: bool = False) -> int:
        return 0 if self.ok(strict) else 1

    def raise_for_errors(self) -> None:
        if self.errors:
            first = self.errors[0]
            raise CheckpointError(f"{self.path}: {len(self.errors)} validate error(s), first: {first.line}")

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "ok": self.ok(), "errors": len(self.errors), "warnings": len(self.warnings),
                "stats": self.stats, "findings": [f.to_json() for f in self.findings]}


MAX_PER_CODE = 10_000  # findings kept per rule: 10^6 hostile tensors must not become 10^6 findings


class Sink:
    """Collects findings; checks call ``add``. Identical findings are kept once; past MAX_PER_CODE
    findings of one rule the rest are only counted (one summary finding says how many)."""

    def __init__(self, root: Path, prefix: str = "", parent: Sink | None = None):
        self.root = root
        self.prefix = prefix              # a rank dir's name when checked as part of a set
        self._seen: set[tuple] = set() if parent is None else parent._seen
        self.findings: list[Finding] = [] if parent is None else parent.findings
        self._lock = threading.Lock() if parent is None else parent._lock  # numeric checks run in threads
        self._kept: Counter[str] = Counter() if parent is None else parent._kept
        self.dropped: Counter[str] = Counter() if parent is None else parent.dropped

    def child(self, sub: str) -> Sink:
        """A sink for checks of ``root/sub`` that reports paths relative to this root."""
        return Sink(self.root / sub, f"{self.prefix}{sub}/" if sub not in ("", ".") else self.prefix, self)

    def rel(self, path: str | Path | None) -> str | None:
        if path is None:
            return None
        p = Path(path)
        if p.is_absolute():
            try:
                p = p.relative_to(self.root)
            except ValueError:
                return str(p)
        return f"{self.prefix}{p}"

    def add(self, code: str, file: str | Path | None, tensor: str | None, message: str) -> None:
        rule = RULES[code]  # KeyError = a check using an undocumented code: a bug
        if self._kept[code] >= MAX_PER_CODE:
            with self._lock:
                self.dropped[code] += 1
            return
        f = Finding(code, rule.severity, self.rel(file), tensor, message)
        key = (f.code, f.file, f.tensor, f.message)
        with self._lock:
            if key not in self._seen:
                self._seen.add(key)
                self.findings.append(f)
                self._kept[code] += 1

    def skip(self, code: str, n: int) -> None:
        """Count ``n`` findings of ``code`` that a check did not even build (past the per-rule cap)."""
        if n > 0:
            with self._lock:
                self.dropped[code] += n

    _PATH_PREFIX = re.compile(r"^(?P<path>[^:]+?): (?P<rest>.*)$")
    _TENSOR = re.compile(r"tensor '(?P<t>[^']+)'")

    def add_issue(self, code: str, message: str) -> None:
        """Map a reader/header (code, 'path: message') issue to a Finding."""
        m = self._PATH_PREFIX.match(message)
        path, rest = (m.group("path"), m.group("rest")) if m else (None, message)
        t = self._TENSOR.search(rest)
        self.add(code if code in RULES else "E104", path, t.group("t") if t else None, rest)

    def sorted(self) -> tuple[Finding, ...]:
        more = [Finding(c, RULES[c].severity, None, None, f"{n:,} more {c} findings not listed "
                        f"(at most {MAX_PER_CODE:,} per rule)") for c, n in self.dropped.items()]
        return tuple(sorted(self.findings + more, key=lambda f: (SEVERITY_ORDER.index(f.severity), f.code,
                                                                 f.file or "", f.tensor or "")))


Progress = Callable[[int], None]  # called with bytes just read (deep mode)
ProgressFactory = Callable[[int, int], "Progress | None"]  # (total bytes, files) -> Progress

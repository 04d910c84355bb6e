"""Names from a checkpoint are untrusted text: printed raw, a tensor name holding a newline or an ANSI
escape forges lines (or colours) in a report. Everything a human reads goes through ``printable``;
JSON output needs nothing (json.dumps escapes control characters itself)."""

from __future__ import annotations

import re

# C0/C1 controls and DEL; zero-width and bidirectional overrides (text that reads differently than it is)
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u200b-\u200f\u2028-\u202e\u2066-\u2069\ufeff]")


def _escape(m: re.Match[str]) -> str:
    c = ord(m.group())
    return f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}"


def printable(text: str) -> str:
    """``text`` with every control or invisible formatting character written as an escape; one line."""
    return _UNSAFE.sub(_escape, text)


def first_line(exc: BaseException) -> str:
    """An exception's first line of text for a one-line message, else its type's name."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def for_console(text: object) -> str:
    """Untrusted text for a Rich console: ``printable``, and Rich markup (``[red]``) neutralised."""
    from rich.markup import escape

    return escape(printable(str(text)))

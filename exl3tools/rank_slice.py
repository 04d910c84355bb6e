"""The former public entry of rank-slice, kept for callers that still import it (the runtime):
everything now lives in the ``exl3tools.slicing`` package."""

from __future__ import annotations

from exl3tools.slicing import *  # noqa: F403

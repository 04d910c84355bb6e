"""Timing helper shared by the CPU benchmarks (imported as a sibling: scripts run as bench/x.py)."""

from __future__ import annotations

import time
from collections.abc import Callable


def best_of(fn: Callable[[], object], reps: int = 3, warmup: bool = True) -> float:
    """Fastest of ``reps`` runs in seconds: this machine is shared, the slow runs measure the neighbours."""
    if warmup:
        fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)

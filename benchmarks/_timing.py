"""Shared timing helpers for the benchmarks: interleaved repetitions, medians, one process."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def per_call(fn: Callable[[], object], calls: int) -> float:
    """Seconds per call of fn over `calls` calls."""
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def interleaved(
    unpatched: Callable[[], object],
    patched: Callable[[], object],
    *,
    apply: Callable[[], None],
    revert: Callable[[], None],
    rounds: int = 30,
    calls: int = 2000,
) -> tuple[float, float]:
    """Median seconds per call (unpatched, patched), alternating rounds so drift hits both."""
    a: list[float] = []
    b: list[float] = []
    for _ in range(rounds):
        revert()
        a.append(per_call(unpatched, calls))
        apply()
        b.append(per_call(patched, calls))
    revert()
    return statistics.median(a), statistics.median(b)

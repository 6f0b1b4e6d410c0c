"""Shared timing helpers for the benchmark scripts: repeat, take the median and spread."""

from __future__ import annotations

import statistics
import time
from typing import Callable


def time_call(fn: Callable[[], object], repeats: int, warmup: int = 1) -> list[float]:
    """Wall-clock seconds of `repeats` calls of fn, after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def summary(samples: list[float]) -> dict[str, float]:
    """Median and the min..max spread, in seconds."""
    return {"median_s": statistics.median(samples), "min_s": min(samples), "max_s": max(samples), "n": len(samples)}

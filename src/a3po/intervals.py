"""95 % intervals of a mean: of per-seed differences (Student's t) and of per-problem results (Wilson).

`a3po eval` reports a model's held-out accuracy with `accuracy_interval`; `a3po bench` and the
results pages compare arms with `t_interval`. Leaf module (no a3po imports, no torch).
"""

from __future__ import annotations

import math
import statistics

# two-sided 95 % quantiles of Student's t for 1..10 degrees of freedom
T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228)


def t_interval(xs: list[float]) -> dict:
    """Mean, std and the 95 % Student-t interval of the mean of `xs` (NaN bounds below two values), and whether
    the interval holds 0: then the data show no measurable difference."""
    m = statistics.fmean(xs)
    sd = statistics.stdev(xs) if len(xs) > 1 else math.nan
    half = T975[min(len(xs) - 1, len(T975)) - 1] * sd / math.sqrt(len(xs)) if len(xs) > 1 else math.nan
    lo, hi = m - half, m + half
    return {"values": xs, "n": len(xs), "mean": m, "std": sd, "interval": (lo, hi),
            "measurable": bool(len(xs) > 1 and (lo > 0 or hi < 0))}


def accuracy_interval(solved: list[float]) -> tuple[float, float]:
    """95 % interval of a mean of per-problem results: Wilson's score interval when each result is 0 or 1 (right
    at an accuracy of 0 or 1 too), else Student's t over problems, clamped to [0, 1]."""
    n = len(solved)
    if n == 0:
        return math.nan, math.nan
    if all(x in (0.0, 1.0) for x in solved):
        z, p = 1.959964, sum(solved) / n
        centre, half = p + z * z / (2 * n), z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
        return (centre - half) / (1 + z * z / n), (centre + half) / (1 + z * z / n)
    lo, hi = t_interval(solved)["interval"]
    return max(0.0, lo), min(1.0, hi)

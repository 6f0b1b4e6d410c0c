"""Intervals of a mean: of per-seed differences (Student's t) and of per-problem results (Wilson).

`a3po eval` reports a model's held-out accuracy with `accuracy_interval`; `a3po bench` and the
results pages compare arms with `t_interval` (95 %); an equivalence test reads a 90 % interval
with `t_quantile` at any number of seeds. Leaf module (no a3po imports, no torch).
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


def t_cdf(t: float, df: int) -> float:
    """P(T <= t) for Student's t with `df` degrees of freedom, through the regularised incomplete beta function."""
    x = df / (df + t * t)
    tail = 0.5 * _incomplete_beta(df / 2, 0.5, x)
    return 1.0 - tail if t > 0 else tail


def t_quantile(p: float, df: int) -> float:
    """The p-quantile of Student's t with `df` degrees of freedom (bisection on `t_cdf`, to 1e-10)."""
    if not 0.0 < p < 1.0 or df < 1:
        raise ValueError(f"t_quantile needs 0 < p < 1 and df >= 1, got p={p}, df={df}")
    lo, hi = -1e4, 1e4
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t_cdf(mid, df) < p else (lo, mid)
        if hi - lo < 1e-10:
            break
    return (lo + hi) / 2


def _incomplete_beta(a: float, b: float, x: float) -> float:
    """I_x(a, b), by its continued fraction (modified Lentz), on the side where it converges fast."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    if x > (a + 1) / (a + b + 2):
        return 1.0 - _incomplete_beta(b, a, 1.0 - x)
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)) / a
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    f = d
    for m in range(1, 500):
        for num in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                    -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            f *= c * d
        if abs(c * d - 1.0) < 1e-15:
            break
    return front * f

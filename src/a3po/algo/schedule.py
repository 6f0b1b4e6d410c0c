"""Learning-rate schedules: linear warm-up, then constant, linear or cosine decay.

Pure Python, no torch: `LR_SCHEDULES` is the one list of schedule names, and the config
schema reads it for `actor.optimizer.lr_scheduler_type` without importing torch
(trainer/optim.py hands the schedule to torch's LambdaLR).
"""

from __future__ import annotations

import math
from collections.abc import Callable

from a3po.algo.variants import lookup


def _constant(progress: float) -> float:
    return 1.0


def _linear(progress: float) -> float:
    return 1.0 - progress


def _cosine(progress: float) -> float:
    return 0.5 * (1.0 + math.cos(math.pi * progress))


# actor.optimizer.lr_scheduler_type: the factor after warm-up, as a function of the share of the decay done
LR_SCHEDULES: dict[str, Callable[[float], float]] = {"constant": _constant, "linear": _linear, "cosine": _cosine}


def lr_schedule(kind: str, total: int, warmup: int) -> Callable[[int], float]:
    """The multiplier of the base learning rate as a function of the optimizer step (0-based)."""
    decay = lookup(LR_SCHEDULES, kind, "lr_scheduler_type")

    def factor(step: int) -> float:
        if warmup > 0 and step < warmup:
            return (step + 1) / warmup
        return decay(min(1.0, (step - warmup) / max(1, total - warmup)))

    return factor

"""AdamW and its learning-rate schedule: linear warm-up, then constant, linear or cosine decay."""

from __future__ import annotations

import math

import torch

from a3po.config.schema import OptimizerConfig


def lr_factor(step: int, total: int, warmup: int, kind: str) -> float:
    """Multiplier of the base learning rate at optimizer step `step` (0-based)."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    if kind == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    if kind == "linear":
        return 1.0 - progress
    if kind == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"unknown lr_scheduler_type {kind!r}; allowed: constant, linear, cosine")


def build_optimizer(params, cfg: OptimizerConfig, total_steps: int):
    # The fused kernel does the whole update in one pass over each tensor: on a CPU it is ~6x
    # faster than the default multi-tensor path (0.11 s vs 0.7 s per step for 135M parameters,
    # one thread), which matters when the optimizer is a tenth of a training step.
    params = list(params)
    hyper = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, weight_decay=cfg.weight_decay)
    try:
        opt = torch.optim.AdamW(params, fused=True, **hyper)
    except (RuntimeError, ValueError):  # a device or dtype without the fused kernel
        opt = torch.optim.AdamW(params, **hyper)
    warmup = int(round(cfg.warmup_steps_proportion * total_steps))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, total_steps, warmup, cfg.lr_scheduler_type))
    return opt, sched

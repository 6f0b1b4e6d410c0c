"""AdamW and its learning-rate schedule (algo/schedule.py: linear warm-up, then constant, linear or cosine decay)."""

from __future__ import annotations

import torch

from a3po.algo.schedule import lr_schedule
from a3po.config.schema import OptimizerConfig


def build_optimizer(params, cfg: OptimizerConfig, total_steps: int):
    # The fused kernel does the whole update in one pass over each tensor: on a CPU it is several
    # times faster than the default multi-tensor path (docs/results.md), which matters because the
    # optimizer is a noticeable share of a small model's training step.
    params = list(params)
    hyper = {"lr": cfg.lr, "betas": (cfg.beta1, cfg.beta2), "eps": cfg.eps, "weight_decay": cfg.weight_decay}
    try:
        opt = torch.optim.AdamW(params, fused=True, **hyper)
    except (RuntimeError, ValueError):  # a device or dtype without the fused kernel
        opt = torch.optim.AdamW(params, **hyper)
    warmup = round(cfg.warmup_steps_proportion * total_steps)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_schedule(cfg.lr_scheduler_type, total_steps, warmup))
    return opt, sched

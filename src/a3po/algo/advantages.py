"""Rewards to advantages: reward shaping, group/batch normalisation, RLOO.

A batch holds B sequences, `group_size` consecutive ones per prompt. The estimators
are the composable normalisation of AReaL's `adv_norm` (keys `mean_level`, `std_level`,
`mean_leave1out`):

    GRPO      mean_level=group  std_level=group   A_i = (r_i - mean_g) / (std_g + eps)
    Dr.GRPO   mean_level=group  std_level=none    A_i = r_i - mean_g
    RLOO      mean_level=group  std_level=none    A_i = r_i - mean_{g, j != i}  (mean_leave1out)
    batch     mean_level=batch  std_level=batch   A_i = (r_i - mean_B) / (std_B + eps)
    mixed     mean_level=group  std_level=batch   A_i = c_i / (std_B(c) + eps),  c_i = r_i - mean_g

std is the unbiased sample standard deviation of the centred values c over the std_level
(1, i.e. no division, for a group of one), so the advantages have unit spread where they are divided: a batch
std of the raw rewards would also count the spread between group means, which the group
baseline removed.
"""

from __future__ import annotations

import torch
from torch import Tensor

LEVELS = ("group", "batch", "none")


def shape_rewards(rewards: Tensor, scaling: float = 1.0, bias: float = 0.0, clip: float | None = None) -> Tensor:
    """(r + bias) * scaling, then clipped to [-clip, clip]."""
    out = (rewards + bias) * scaling
    return out if clip is None else out.clamp(-clip, clip)


def _centre(r: Tensor, level: str, leave1out: bool) -> Tensor:
    """r (G, n) minus its baseline along the last axis."""
    if level == "none":
        return r
    n = r.shape[-1]
    total = r.sum(-1, keepdim=True)
    if leave1out and n > 1:
        return r - (total - r) / (n - 1)
    return r - total / n


def _std(c: Tensor) -> Tensor:
    """Unbiased std of c (G, n) along the last axis; 1 (no division) for n = 1: one sample has
    no spread, and dividing by a zero std would turn any nonzero value into value / eps."""
    n = c.shape[-1]
    return c.std(-1, keepdim=True) if n > 1 else torch.ones_like(c[..., :1])


def normalize_advantages(
    rewards: Tensor,  # (B,)
    group_size: int,
    mean_level: str = "group",
    std_level: str = "group",
    mean_leave1out: bool = False,
    eps: float = 1e-5,
) -> Tensor:
    """Sequence-level advantages (B,) from sequence rewards."""
    for name, level in (("mean_level", mean_level), ("std_level", std_level)):
        if level not in LEVELS:
            raise ValueError(f"unknown adv_norm.{name} {level!r}; allowed: {', '.join(LEVELS)}")
    B = rewards.shape[0]
    if B % group_size:
        raise ValueError(f"batch of {B} sequences is not a whole number of groups of {group_size}")
    r = rewards.double()  # in float64 a group of equal float32 rewards has exactly their value as mean
    grouped = r.view(B // group_size, group_size)  # (G, n)
    flat = r.view(1, B)  # (1, B)

    centred = _centre(grouped if mean_level == "group" else flat, mean_level, mean_leave1out).reshape(B)
    if std_level == "none":
        return centred.float()
    # the spread of what is divided: with group baselines and a batch std, the raw rewards' batch
    # std would also count the differences between group means that the baseline removed
    std = _std(centred.view(-1, group_size) if std_level == "group" else centred.view(1, B))  # (G, 1) or (1, 1)
    std = std.expand(-1, group_size if std_level == "group" else B).reshape(B)
    return (centred / (std + eps)).float()

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

from a3po.algo import variants
from a3po.algo.variants import implements, lookup


def shape_rewards(rewards: Tensor, scaling: float = 1.0, bias: float = 0.0, clip: float | None = None) -> Tensor:
    """(r + bias) * scaling, then clipped to [-clip, clip]."""
    out = (rewards + bias) * scaling
    return out if clip is None else out.clamp(-clip, clip)


def _groups(x: Tensor, group_size: int) -> Tensor:
    return x.view(-1, group_size)  # (G, n)


def _batch(x: Tensor, group_size: int) -> Tensor:
    return x.view(1, -1)  # (1, B)


# actor.adv_norm.mean_level / std_level: the rows a statistic runs along; none skips the statistic
LEVELS = implements({"group": _groups, "batch": _batch, "none": None}, variants.ADV_NORM_LEVELS)


def _centre(r: Tensor, leave1out: bool) -> Tensor:
    """r (G, n) minus its baseline along the last axis."""
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
    mean_rows = lookup(LEVELS, mean_level, "adv_norm.mean_level")
    std_rows = lookup(LEVELS, std_level, "adv_norm.std_level")
    B = rewards.shape[0]
    if B % group_size:
        raise ValueError(f"batch of {B} sequences is not a whole number of groups of {group_size}")
    r = rewards.double()  # in float64 a group of equal float32 rewards has exactly their value as mean
    c = r if mean_rows is None else _centre(mean_rows(r, group_size), mean_leave1out).reshape(B)
    if std_rows is None:
        return c.float()
    # the spread of what is divided: with group baselines and a batch std, the raw rewards' batch
    # std would also count the differences between group means that the baseline removed
    rows = std_rows(c, group_size)  # (G, n) or (1, B)
    return (rows / (_std(rows) + eps)).reshape(B).float()

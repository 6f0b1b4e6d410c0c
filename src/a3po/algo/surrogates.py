"""The per-token policy-gradient surrogates that `actor.policy_loss` chooses between (loss.py, stage 4).

Each takes the log trust-region ratio log r_t = theta_t - p_t (carrying the gradient; pooled per
sequence under GSPO) and the advantage A_t, and returns the per-token loss s_t before the behaviour
weight:

    ppo    s = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)),  with dual clip c: min(s, -c A) where A < 0
    cispo  s = -A sg(clip(r, 1 - eps_low, 1 + eps_high)) * log-prob          (MiniMax-M1, arXiv 2506.13585)
    sapo   s = -A (4 / tau) sigmoid(tau (r - 1)),  tau = tau_pos if A > 0 else tau_neg   (arXiv 2511.20347)

CISPO never drops a token: the clipped, stop-gradient ratio only scales a REINFORCE term, so a token
outside the band still trains, at most with weight 1 + eps_high. SAPO's gate has slope 1 at r = 1,
as PPO's surrogate, and fades smoothly away from it instead of cutting the gradient at the band edge.

Choices where the peers differ:
- CISPO's clip is the two-sided [1 - eps_low, 1 + eps_high] of most peers (TRL clips at eps_high alone);
  eps_low near 1 leaves it one-sided, as the paper's setting does;
- CISPO's loss is written -A sg(c) (1 + log r - sg(log r)): the gradient of -A sg(c) log pi_theta, and the
  value -A c, on PPO's scale, so `loss/total` stays comparable between the losses;
- `clipped` marks, for CISPO, a ratio outside the band (its weight was clipped); SAPO clips nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from a3po.algo import variants
from a3po.algo.variants import implements


@dataclass(frozen=True)
class SurrogateParams:
    eps_low: float = 0.2
    eps_high: float = 0.2
    c_clip: float | None = None  # PPO's dual clip; None disables
    tau_pos: float = 1.0  # SAPO's gate temperature for A > 0
    tau_neg: float = 1.05  # and for A <= 0


@dataclass
class Surrogate:
    pg: Tensor  # (B, T) s_t, with gradient through log r
    clipped: Tensor  # (B, T) bool
    dual_clipped: Tensor  # (B, T) bool


def ppo_clip(log_r: Tensor, adv: Tensor, p: SurrogateParams) -> Surrogate:
    ratio = torch.exp(log_r)
    unclipped = -adv * ratio
    clipped_pg = -adv * ratio.clamp(1.0 - p.eps_low, 1.0 + p.eps_high)
    pg = torch.maximum(unclipped, clipped_pg)
    clipped = clipped_pg > unclipped
    dual = torch.zeros_like(clipped)
    if p.c_clip is not None:
        bound = -adv * p.c_clip
        dual = (adv < 0) & (pg > bound)
        pg = torch.where(dual, bound, pg)
    return Surrogate(pg, clipped, dual)


def cispo(log_r: Tensor, adv: Tensor, p: SurrogateParams) -> Surrogate:
    ratio = torch.exp(log_r.detach())
    weight = ratio.clamp(1.0 - p.eps_low, 1.0 + p.eps_high)
    pg = -adv * weight * (1.0 + log_r - log_r.detach())
    return Surrogate(pg, weight != ratio, torch.zeros_like(ratio, dtype=torch.bool))


def sapo(log_r: Tensor, adv: Tensor, p: SurrogateParams) -> Surrogate:
    tau = torch.where(adv > 0, p.tau_pos, p.tau_neg).to(log_r.dtype)
    gate = torch.sigmoid(tau * (torch.exp(log_r) - 1.0)) * (4.0 / tau)
    none = torch.zeros_like(log_r, dtype=torch.bool)
    return Surrogate(-adv * gate, none, none)


# actor.policy_loss
SURROGATES: dict[str, Callable[[Tensor, Tensor, SurrogateParams], Surrogate]] = implements(
    {"ppo": ppo_clip, "cispo": cispo, "sapo": sapo}, variants.POLICY_LOSSES)

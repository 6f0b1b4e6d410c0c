"""KL to a reference policy.

With x_t = theta_t - ref_t (log pi_theta / pi_ref on a token sampled from pi_theta's
neighbourhood), Schulman's estimators of KL(pi_theta || pi_ref) are

    k1 = x                   unbiased, high variance, can be negative
    k2 = x^2 / 2             biased, low variance, >= 0
    k3 = exp(-x) - 1 + x     unbiased, low variance, >= 0

The KL can enter the loss (actor.kl_ctl with actor.kl_in_reward=false: added per token
by `ppo_loss`, x_t = theta_t - ref_t) or the reward (kl_in_reward=true: each sequence's
shaped reward loses kl_ctl * sum_t KL_t before the group normalisation, as in classic RLHF
PPO, so the advantages see it). In the reward x_t = b_t - ref_t: the behaviour policy drew
the tokens, so the estimate is of KL(pi_behav || pi_ref) and needs only the reference's
forward pass (TrainEngine.reference_kl, called by the trainer's stage 2).

In the reward, k1 is the estimator whose score-function gradient is the KL's gradient
(E[grad log pi * k1] = grad KL); k2 and k3 estimate the KL's value with less variance but
their penalties in the reward follow another gradient (with k3 a token whose probability
fell is charged more than one whose probability rose by as much, which can push further
from the reference). In the loss, k3 (the default) is the usual choice.
"""

from __future__ import annotations

import torch
from torch import Tensor

from a3po.algo import variants
from a3po.algo.masked import masked_sum
from a3po.algo.variants import implements, lookup

# actor.kl_estimator
KL_ESTIMATORS = implements({
    "k1": lambda x: x,
    "k2": lambda x: 0.5 * x.square(),
    "k3": lambda x: torch.expm1(-x) + x,
}, variants.KL_ESTIMATORS)


def kl_penalty(logp_theta: Tensor, logp_ref: Tensor, estimator: str = "k3") -> Tensor:
    """Per-token KL estimate, (B, T); gradient flows through logp_theta."""
    fn = lookup(KL_ESTIMATORS, estimator, "KL estimator")
    x = torch.nan_to_num(logp_theta - logp_ref.detach(), nan=0.0).clamp(-20.0, 20.0)
    return fn(x)


def kl_in_reward(rewards: Tensor, kl: Tensor, mask: Tensor, kl_ctl: float) -> Tensor:
    """rewards (B,) minus kl_ctl times each sequence's summed KL (B, T) over its generated tokens."""
    return rewards - kl_ctl * masked_sum(kl.detach(), mask.bool(), dim=-1)

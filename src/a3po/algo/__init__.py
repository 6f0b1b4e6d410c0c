"""The algorithm core: pure functions over (B, T) tensors, no model, no config object.

    prox.py        proximal log-probs: recompute, loglinear (A-3PO), linear, reuse, metrics
    loss.py        decoupled PPO loss (clipping, dual clip, behaviour-weight cap, GSPO, M2PO)
    masked.py      masked reductions and the loss aggregation modes
    advantages.py  reward shaping, GRPO / Dr.GRPO / RLOO / batch normalisation
    kl.py          KL estimators k1/k2/k3, KL in reward
    stats.py       per-step statistics, one flat documented namespace
"""

from a3po.algo.advantages import normalize_advantages, shape_rewards
from a3po.algo.kl import kl_in_reward, kl_penalty
from a3po.algo.loss import LossTerms, coupled_ppo_loss, ppo_loss
from a3po.algo.masked import aggregate, masked_mean, masked_sum
from a3po.algo.prox import (
    PROX_METHODS,
    approximation_errors,
    get_method,
    interpolation_weight,
    proximal_logp,
    staleness,
)
from a3po.algo.stats import approx_error_stats, loss_stats, mismatch_stats, staleness_stats

__all__ = [
    "PROX_METHODS", "LossTerms", "aggregate", "approx_error_stats", "approximation_errors",
    "coupled_ppo_loss", "get_method", "interpolation_weight",
    "kl_in_reward", "kl_penalty", "loss_stats", "masked_mean", "mismatch_stats", "masked_sum",
    "normalize_advantages", "ppo_loss", "proximal_logp", "shape_rewards",
    "staleness", "staleness_stats",
]

"""The algorithm core: pure functions over (B, T) tensors, no model, no config object.

    variants.py    the names of every variant (prox methods, cap modes, IS levels, ...), torch-free
    prox.py        proximal log-probs: recompute, loglinear (A-3PO), linear, reuse, metrics
    loss.py        decoupled PPO loss (clipping, dual clip, behaviour-weight cap, GSPO, M2PO)
    surrogates.py  the per-token surrogate: PPO's clip, CISPO, SAPO
    corrections.py off-policy corrections of the behaviour weight: TIS, MIS/IcePop, geometric mask, OPSM
    masked.py      masked reductions and the loss aggregation modes
    advantages.py  reward shaping, GRPO / Dr.GRPO / RLOO / batch normalisation
    kl.py          KL estimators k1/k2/k3, KL in reward
    stats.py       per-step statistics, one flat documented namespace

The names below are imported from their modules on first use (PEP 562), so that importing
`a3po.algo.variants`, as the config schema and `a3po --help` do, does not import torch.
"""

from __future__ import annotations

import importlib

_MODULE_OF = {
    "normalize_advantages": "advantages", "shape_rewards": "advantages",
    "kl_in_reward": "kl", "kl_penalty": "kl",
    "LossSpec": "loss", "LossTerms": "loss", "ppo_loss": "loss",
    "aggregate": "masked", "masked_mean": "masked", "masked_sum": "masked",
    "PROX_METHODS": "prox", "approximation_errors": "prox", "get_method": "prox",
    "interpolation_weight": "prox", "proximal_logp": "prox", "staleness": "prox",
    "approx_error_stats": "stats", "loss_by_staleness": "stats", "loss_stats": "stats", "mismatch_stats": "stats",
    "staleness_stats": "stats",
}

__all__ = list(_MODULE_OF)


def __getattr__(name: str):
    if name not in _MODULE_OF:
        raise AttributeError(f"module 'a3po.algo' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"a3po.algo.{_MODULE_OF[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_MODULE_OF})

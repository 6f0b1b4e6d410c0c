"""The names of the algorithm's variants, one tuple each, and the one way a name is looked up.

These tuples are the only list of each variant's names: the config schema's `choices`,
`a3po bench` and `a3po --help` read them, and the tables that implement the variants
(prox.py, loss.py, masked.py, kl.py, advantages.py) are keyed by them and checked against
them at import by `implements`. They sit beside those tables rather than in them because
the tables' modules import torch, which would add two seconds to every `a3po` command,
`--help` included; this module imports no torch. (The learning-rate schedules need no
torch, so their table in algo/schedule.py is itself the list.)

The proximal methods also carry what the rest of the program must know about them
(`ProxTraits`): the config check, the trainer and the benchmarks read these flags
instead of knowing methods by name, so a new method states its constraints once, here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ProxTraits:
    """What a proximal method asks of the trainer, independent of how it computes p (prox.py)."""

    name: str
    needs_recompute: bool  # the extra forward pass of version v runs before the update
    single_step_only: bool  # exact only if each sample gets one gradient step (actor.ppo_n_minibatches=1)
    reports_errors: bool  # also measures every approximation against the recomputed truth


PROX_TRAITS: dict[str, ProxTraits] = {t.name: t for t in (  # actor.prox_logp_method (prox.py)
    ProxTraits("recompute", needs_recompute=True, single_step_only=False, reports_errors=False),
    ProxTraits("loglinear", needs_recompute=False, single_step_only=False, reports_errors=False),
    ProxTraits("linear", needs_recompute=False, single_step_only=False, reports_errors=False),
    ProxTraits("reuse", needs_recompute=False, single_step_only=True, reports_errors=False),
    ProxTraits("metrics", needs_recompute=True, single_step_only=False, reports_errors=True),
)}
PROX_METHODS = tuple(PROX_TRAITS)
BEHAV_WEIGHT_MODES = ("token_mask", "token_truncate", "sequence_mask", "sequence_truncate")  # loss.py
IS_LEVELS = ("token", "sequence", "sequence_token")  # actor.importance_sampling_level (loss.py)
POLICY_LOSSES = ("ppo", "cispo", "sapo")  # actor.policy_loss (surrogates.py)
CORRECTION_RATIOS = ("behav", "current")  # actor.correction.ratio (corrections.py)
TIS_LEVELS = ("none", "token", "sequence")  # actor.correction.tis (corrections.py)
MIS_KINDS = ("none", "token", "sequence", "geometric")  # actor.correction.mis (corrections.py)
AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")  # actor.loss_agg_mode (masked.py)
KL_ESTIMATORS = ("k1", "k2", "k3")  # actor.kl_estimator (kl.py)
ADV_NORM_LEVELS = ("group", "batch", "none")  # actor.adv_norm.mean_level / std_level (advantages.py)


def implements(table: dict[str, Any], names: tuple[str, ...]) -> dict[str, Any]:
    """`table`, after checking that its keys are exactly `names`, in order (run at import)."""
    if tuple(table) != names:
        raise ImportError(f"a variant table implements {tuple(table)}, but its names are {names}")
    return table


def lookup(table: dict[str, Any], name: str, key: str) -> Any:
    """table[name], or a ValueError naming the config key and what it allows."""
    try:
        return table[name]
    except KeyError:
        raise ValueError(f"unknown {key} {name!r}; allowed: {', '.join(table)}") from None


def prox_traits(name: str) -> ProxTraits:
    """The traits of proximal method `name`, or a ValueError listing the methods."""
    return lookup(PROX_TRAITS, name, "prox_logp_method")

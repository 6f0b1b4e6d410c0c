"""Proximal log-probabilities for decoupled PPO, including A-3PO's approximation.

Decoupled PPO (Hilton et al.; AReaL) separates two policies that coupled PPO conflates:
the behaviour policy pi_behav that sampled the tokens, and the proximal policy pi_prox
that anchors the trust region. Computing pi_prox exactly costs one extra forward pass
of the trainer's weights of version v (`recompute`). A-3PO (arXiv 2512.06547, Sec. 3)
replaces that pass by a per-token interpolation whose weight depends on the token's
staleness d = v - version(token):

    lambda_t = (d - 1) / d    for d >= 1,   0 for d = 0 and for prompt tokens
    loglinear:  p_t = b_t + lambda_t * (sg(theta_t) - b_t)            (paper Eq. 7, alpha = 1/d)
    linear:     p_t = log((1 - lambda_t) * exp(b_t) + lambda_t * exp(sg(theta_t)))

so a token sampled by the previous version (d = 1) gets p = b, i.e. coupled PPO.

Methods live in one table, `PROX_METHODS`, keyed by the names in variants.py and built on
the traits declared there (which pass a method needs, how many gradient steps it allows);
`get_method` is the only place a method's name is looked up.

Deliberate deviations from the AReaL reference (1.0.4):
- loglinear is evaluated as (1 - lambda) * b + lambda * theta with lambda = 0 taken
  exactly, so b = -inf or theta = -inf gives -inf, never NaN;
- linear is evaluated with logaddexp instead of log(p + 1e-10): no floor on tiny
  probabilities, no log(0);
- a token whose version is newer than the current version is an error, not clamped:
  it means versions and weights went out of step somewhere upstream.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from a3po.algo import variants
from a3po.algo.variants import implements, lookup


def staleness(versions: Tensor, current_version: int) -> Tensor:
    """d = v - version(token) for generated tokens, 0 for prompt/padding (version < 0)."""
    generated = versions >= 0
    d = torch.where(generated, current_version - versions, torch.zeros_like(versions))
    if (d < 0).any():
        newest = int(versions.max())
        raise ValueError(
            f"token version {newest} is newer than the trainer's current version {current_version}: "
            "versions must count optimizer steps applied to the weights that sampled each token"
        )
    return d


def interpolation_weight(versions: Tensor, current_version: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """lambda_t = (d - 1) / d for d >= 1, else 0 (prompt tokens, fresh tokens)."""
    d = staleness(versions, current_version).to(dtype)
    return torch.where(d >= 1, (d - 1) / d.clamp(min=1), torch.zeros_like(d))


def loglinear(logp_behav: Tensor, logp_theta: Tensor, lam: Tensor) -> Tensor:
    """A-3PO: geometric interpolation between pi_behav and sg(pi_theta)."""
    theta = logp_theta.detach()
    mixed = (1 - lam) * logp_behav + lam * theta
    return torch.where(lam > 0, mixed, logp_behav)


def linear(logp_behav: Tensor, logp_theta: Tensor, lam: Tensor) -> Tensor:
    """Arithmetic interpolation of probabilities, computed in log space."""
    theta = logp_theta.detach()
    safe_lam = lam.clamp(min=1e-30)  # only read where lam > 0
    mixed = torch.logaddexp(torch.log1p(-lam) + logp_behav, torch.log(safe_lam) + theta)
    return torch.where(lam > 0, mixed, logp_behav)


@dataclass(frozen=True)
class ProxMethod(variants.ProxTraits):
    """A method's traits (variants.py, what the trainer must do for it) and how it gets p_t."""

    fn: Callable[..., Tensor]


def _recompute(logp_behav, logp_theta, lam, logp_recomputed):
    if logp_recomputed is None:
        raise ValueError("prox_logp_method 'recompute' needs the recomputed log-probs of version v")
    return logp_recomputed


def _loglinear(logp_behav, logp_theta, lam, logp_recomputed):
    return loglinear(logp_behav, logp_theta, lam)


def _linear(logp_behav, logp_theta, lam, logp_recomputed):
    return linear(logp_behav, logp_theta, lam)


def _reuse(logp_behav, logp_theta, lam, logp_recomputed):
    # Exact when the current weights still are version v: first gradient step on the sample.
    return logp_theta.detach()


PROX_METHODS: dict[str, ProxMethod] = {
    name: ProxMethod(**vars(variants.PROX_TRAITS[name]), fn=fn) for name, fn in implements({
        "recompute": _recompute,
        "loglinear": _loglinear,
        "linear": _linear,
        "reuse": _reuse,
        "metrics": _recompute,
    }, variants.PROX_METHODS).items()
}

# Approximations compared against the recomputed truth in `metrics` mode. "behav" is
# coupled PPO's choice p = b, the baseline every approximation should beat.
APPROXIMATIONS: dict[str, Callable[[Tensor, Tensor, Tensor], Tensor]] = {
    "loglinear": loglinear,
    "linear": linear,
    "behav": lambda logp_behav, logp_theta, lam: logp_behav,
}


def get_method(name: str) -> ProxMethod:
    return lookup(PROX_METHODS, name, "prox_logp_method")


def proximal_logp(
    method: str,
    logp_behav: Tensor,  # (B, T) from the inference engine
    logp_theta: Tensor,  # (B, T) current weights, may carry grad (only its value is used)
    versions: Tensor,  # (B, T) int, -1 on prompt tokens
    current_version: int,
    logp_recomputed: Tensor | None = None,  # (B, T) version-v forward pass, if the method needs it
) -> Tensor:
    """p_t for the named method; never carries gradient."""
    lam = interpolation_weight(versions, current_version, dtype=logp_behav.dtype)
    return get_method(method).fn(logp_behav, logp_theta, lam, logp_recomputed).detach()


@dataclass
class ApproxErrors:
    """Per-token errors of one approximation p_hat against the recomputed p, all (B, T)."""

    abs: Tensor  # |p_hat - p|
    rel: Tensor  # |pi_hat / pi - 1| = |exp(p_hat - p) - 1|, relative error of the probability
    sq: Tensor  # (p_hat - p)^2
    iw: Tensor  # |exp(p_hat - b) - exp(p - b)|, error of the behaviour importance weight


def approximation_errors(
    logp_true: Tensor,  # (B, T) recomputed proximal log-probs
    logp_behav: Tensor,
    logp_theta: Tensor,
    versions: Tensor,
    current_version: int,
) -> dict[str, ApproxErrors]:
    """Each approximation's per-token error against the truth (the `metrics` method)."""
    lam = interpolation_weight(versions, current_version, dtype=logp_behav.dtype)
    out = {}
    for name, approx in APPROXIMATIONS.items():
        p_hat = approx(logp_behav, logp_theta.detach(), lam)
        diff = _finite(p_hat - logp_true)
        out[name] = ApproxErrors(
            abs=diff.abs(),
            rel=torch.expm1(diff.clamp(max=80.0)).abs(),
            sq=diff.square(),
            iw=(_exp_clamped(p_hat - logp_behav) - _exp_clamped(logp_true - logp_behav)).abs(),
        )
    return out


LOG_MAX = math.log(1e30)


def _finite(x: Tensor) -> Tensor:
    """Errors bounded to +-log(1e30) so squares stay finite; -inf - (-inf) (NaN) counts as 0."""
    return torch.nan_to_num(x, nan=0.0, posinf=LOG_MAX, neginf=-LOG_MAX).clamp(-LOG_MAX, LOG_MAX)


def _exp_clamped(x: Tensor) -> Tensor:
    return torch.exp(_finite(x).clamp(max=LOG_MAX))

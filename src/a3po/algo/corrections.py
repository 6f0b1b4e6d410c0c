"""Off-policy corrections: truncated and masked importance sampling on the sampler's ratio (docs/design.md).

The decoupled loss multiplies each token's surrogate by the behaviour weight w_t = exp(p_t - b_t).
A correction reads a ratio rho_t against the sampler's log-prob b_t and rescales or zeroes w_t:

    rho_t = exp(p_t - b_t)          ratio="behav":   w itself (proximal vs sampler)
    rho_t = exp(sg(theta_t) - b_t)  ratio="current": the whole product r_t w_t (current vs sampler),
                                    what a method whose p is b at d <= 1 (loglinear, coupled) can see
    R = rho_t (token), prod_t rho_t (sequence), exp(mean_t log rho_t) (geometric), over the tokens that count

    TIS (truncate, upper bound C):   w_t <- w_t * min(R, C) / rho_t    so that the weight the correction
                                     sees, rho_t, becomes min(R, C): ratio="behav" gives w_t <- min(R, C)
    MIS (mask, band [lo, hi]):       w_t <- 0 where R leaves [lo, hi] (bounds inclusive), else unchanged,
                                     so a kept token keeps rho_t as its weight (verl, OpenRLHF, AReaL),
                                     not 1 (SkyRL's token mask)
    OPSM (DeepSeek-V3.2, delta):     every token of a sequence with mean_t A_t < 0 and
                                     mean_t (b_t - sg(theta_t)) > delta gets w_t <- 0

IcePop is MIS at the token level with its band [alpha, beta]; geometric sequence masking is MIS on the
geometric mean (SkyRL suggests [0.99, 1.01]). A dropped token keeps its place in the token-mean
denominator, as the behaviour-weight cap's mask does (AReaL, SkyRL, TRL, OpenRLHF; verl's decoupled
mode drops it from the count).

Choices where the peers disagree, each tested in tests/test_corrections.py:
- sequence TIS/MIS use the product of the token ratios (verl, SkyRL, TRL); the geometric mean is its own
  kind, and the older `actor.behav_imp_weight_mode=sequence_*` cap keeps AReaL's geometric mean;
- TIS has an upper bound only (verl, SkyRL), not OpenRLHF's clamp to [0.5, 5];
- OPSM pools the sequence's token advantages by their mean and reads the sampler's log-probs b (the
  policy that generated the sequence), not a recomputed old policy;
- every ratio is computed in log space, log-ratios clamped to [-20, 20] per token, so a sequence product
  never overflows.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from a3po.algo import variants
from a3po.algo.masked import masked_mean, masked_sum
from a3po.algo.variants import implements, lookup

LOG_RATIO_LIMIT = 20.0


def _log_ratio(a: Tensor, b: Tensor) -> Tensor:
    return torch.nan_to_num(a - b, nan=0.0).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT).detach()


# actor.correction.ratio: log rho_t from (p, theta, b)
RATIOS: dict[str, Callable[[Tensor, Tensor, Tensor], Tensor]] = implements({
    "behav": lambda logp_prox, logp_theta, logp_behav: _log_ratio(logp_prox, logp_behav),
    "current": lambda logp_prox, logp_theta, logp_behav: _log_ratio(logp_theta, logp_behav),
}, variants.CORRECTION_RATIOS)


def _per_sequence(x: Tensor) -> Tensor:
    return x.unsqueeze(-1)  # (B,) -> (B, 1), broadcast over the sequence's tokens


def _token(log_rho: Tensor, mask: Tensor) -> Tensor:
    return log_rho


def _product(log_rho: Tensor, mask: Tensor) -> Tensor:
    return _per_sequence(masked_sum(log_rho, mask, dim=-1)).expand_as(log_rho)


def _geometric(log_rho: Tensor, mask: Tensor) -> Tensor:
    return _per_sequence(masked_mean(log_rho, mask, dim=-1)).expand_as(log_rho)


# log R per token from log rho_t (B, T): the token's own, its sequence's product, or geometric mean.
# "none" is no correction; the tables hold the kinds that compute something.
TIS_LEVELS = implements({"token": _token, "sequence": _product}, variants.TIS_LEVELS[1:])
MIS_KINDS = implements({"token": _token, "sequence": _product, "geometric": _geometric}, variants.MIS_KINDS[1:])


@dataclass(frozen=True)
class CorrectionSpec:
    """The corrections a run applies (actor.correction.*); the defaults apply none."""

    ratio: str = "behav"  # RATIOS: which ratio rho the TIS and MIS read
    tis: str = "none"  # TIS_LEVELS or "none"
    tis_cap: float = 2.0  # C
    mis: str = "none"  # MIS_KINDS or "none"
    mis_low: float | None = None  # lo; None = no lower bound
    mis_high: float | None = None  # hi; None = no upper bound
    opsm_delta: float | None = None  # OPSM's threshold on mean(b - theta); None disables

    def __post_init__(self) -> None:
        lookup(RATIOS, self.ratio, "actor.correction.ratio")
        if self.tis != "none":
            lookup(TIS_LEVELS, self.tis, "actor.correction.tis")
        if self.mis != "none":
            lookup(MIS_KINDS, self.mis, "actor.correction.mis")


@dataclass
class Corrected:
    """What the corrections did, all (B, T) and detached: the factor on w and where they acted."""

    factor: Tensor  # w_t is multiplied by this (0 where a mask dropped the token)
    truncated: Tensor  # bool: TIS lowered the token's weight
    masked: Tensor  # bool: MIS dropped the token (its own ratio, or its sequence's)
    opsm: Tensor  # bool: OPSM dropped the token's sequence
    token_drop: Tensor  # bool: dropped by a token-level mask alone (leaves GSPO's sequence means)


def truncation_factor(log_rho: Tensor, mask: Tensor, level: str, cap: float) -> tuple[Tensor, Tensor]:
    """TIS: (min(R, C) / rho_t, truncated) per token, R pooled at `level` (token or sequence product)."""
    log_r = lookup(TIS_LEVELS, level, "actor.correction.tis")(log_rho, mask)
    log_cap = math.log(cap)
    factor = torch.exp(log_r.clamp(max=log_cap) - log_rho)
    return torch.where(mask, factor, torch.ones_like(factor)), (log_r > log_cap) & mask


def band_rejects(log_rho: Tensor, mask: Tensor, kind: str, low: float | None, high: float | None) -> Tensor:
    """MIS: the tokens whose R (token, sequence product or geometric mean) leaves [low, high]."""
    log_r = lookup(MIS_KINDS, kind, "actor.correction.mis")(log_rho, mask)
    out = torch.zeros_like(mask)
    if low is not None:
        out |= log_r < (math.log(low) if low > 0 else -math.inf)
    if high is not None:
        out |= log_r > math.log(high)
    return out & mask


def opsm_rejects(logp_behav: Tensor, logp_theta: Tensor, adv: Tensor, mask: Tensor, delta: float) -> Tensor:
    """DeepSeek-V3.2's off-policy sequence masking: every token of the sequences whose mean advantage is
    negative and whose mean_t (b_t - theta_t), a k1 estimate of KL(pi_behav || pi_theta), exceeds delta."""
    divergence = masked_mean(-_log_ratio(logp_theta, logp_behav), mask, dim=-1)  # (B,)
    negative = masked_mean(adv.detach(), mask, dim=-1) < 0  # (B,)
    return _per_sequence(negative & (divergence > delta)).expand_as(mask) & mask


def correct(
    logp_prox: Tensor, logp_theta: Tensor, logp_behav: Tensor, adv: Tensor, mask: Tensor, spec: CorrectionSpec
) -> Corrected:
    """Every correction `spec` names, on the tokens of `mask` (B, T); each input may be garbage off the mask."""
    log_rho = torch.where(mask, RATIOS[spec.ratio](logp_prox, logp_theta, logp_behav), 0.0)
    none = torch.zeros_like(mask)
    factor, truncated = torch.ones_like(log_rho), none
    if spec.tis != "none":
        factor, truncated = truncation_factor(log_rho, mask, spec.tis, spec.tis_cap)
    masked = none
    if spec.mis != "none":
        masked = band_rejects(log_rho, mask, spec.mis, spec.mis_low, spec.mis_high)
    opsm = none
    if spec.opsm_delta is not None:
        opsm = opsm_rejects(logp_behav, logp_theta, adv, mask, spec.opsm_delta)
    factor = torch.where(masked | opsm, torch.zeros_like(factor), factor)
    token_drop = masked & (spec.mis == "token")
    return Corrected(factor=factor, truncated=truncated, masked=masked, opsm=opsm, token_drop=token_drop)

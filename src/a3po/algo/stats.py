"""Per-step statistics of the objective, over the tokens that count.

Every key, with its formula (masked means run over the loss mask; prompt tokens and
padding never count):

    loss/ratio_mean, _min, _max   r_t = exp(theta_t - p_t)
    loss/clipped_frac             share of tokens where the clipped branch won
    loss/dual_clipped_frac        share of tokens bounded by the dual clip
    loss/behav_weight_mean, _max  w_t = exp(p_t - b_t) before the cap
    loss/behav_capped_frac        share of tokens with w_t above the cap
    loss/m2_dropped_frac          share of tokens removed by M2PO
    loss/approx_kl                mean of p_t - theta_t (k1 estimate of KL(pi_prox || pi_theta))
    loss/entropy                  mean per-token entropy of pi_theta
    loss/kl_ref                   with actor.kl_ctl > 0: mean per-token KL estimate (actor.kl_estimator) to the
                                  reference, of pi_theta in the loss, of pi_behav in the reward (kl_in_reward)
    stale/mean, stale/max         d_t = v - version_t over generated tokens
    stale/frac_d<k>               share of generated tokens with d_t = k, for every k = 0..eta
    mismatch/abs_mean, _abs_max   |theta_t - b_t| on tokens with d_t = 0 (sampled by the very weights
                                  being trained), at the first minibatch: train/rollout numerics gap
    mismatch/k3                   mean of exp(theta_t - b_t) - 1 - (theta_t - b_t) there: k3 estimate of
                                  KL(pi_behav || pi_theta) (samples come from pi_behav)
    mismatch/tokens               how many tokens those three are over (keys absent when none)
    prox_err/<approx>/<err>       metrics mode: mean abs, rel, sq, iw error (see prox.ApproxErrors)
    prox_err/<approx>/<err>/d<k>  the same, restricted to tokens of staleness k
    prox_err/tokens/d<k>          how many tokens had staleness k (to pool the means over steps)
"""

from __future__ import annotations

from torch import Tensor

from a3po.algo.kl import kl_penalty
from a3po.algo.loss import LossTerms
from a3po.algo.masked import masked_max, masked_mean, masked_min
from a3po.algo.prox import ApproxErrors, staleness


def loss_stats(
    terms: LossTerms,
    loss_mask: Tensor,  # (B, T) the mask given to the loss, before M2PO
    logp_theta: Tensor,
    logp_prox: Tensor,
    entropy: Tensor | None = None,
) -> dict[str, float]:
    m = terms.mask
    out = {
        "loss/ratio_mean": masked_mean(terms.ratio, m),
        "loss/ratio_min": masked_min(terms.ratio, m),
        "loss/ratio_max": masked_max(terms.ratio, m),
        "loss/clipped_frac": masked_mean(terms.clipped.float(), m),
        "loss/dual_clipped_frac": masked_mean(terms.dual_clipped.float(), m),
        "loss/behav_weight_mean": masked_mean(terms.behav_weight, m),
        "loss/behav_weight_max": masked_max(terms.behav_weight, m),
        "loss/behav_capped_frac": masked_mean(terms.capped.float(), m),
        "loss/m2_dropped_frac": masked_mean(terms.m2_dropped.float(), loss_mask.bool()),
        "loss/approx_kl": masked_mean((logp_prox - logp_theta).detach(), m),
    }
    if entropy is not None:
        out["loss/entropy"] = masked_mean(entropy.detach(), m)
    return {k: float(v) for k, v in out.items()}


def staleness_stats(versions: Tensor, current_version: int, mask: Tensor, eta: int) -> dict[str, float]:
    d = staleness(versions, current_version)
    m = mask.bool() & (versions >= 0)
    out = {"stale/mean": float(masked_mean(d.float(), m)), "stale/max": float(masked_max(d.float(), m))}
    n = max(1, int(m.sum()))
    for k in range(eta + 1):
        out[f"stale/frac_d{k}"] = float((m & (d == k)).sum()) / n
    return out


def mismatch_stats(logp_theta: Tensor, logp_behav: Tensor, mask: Tensor) -> dict[str, float]:
    """How far the trainer's log-probs are from the sampler's on tokens both computed with the
    same weights; {} when there are none (a deep pipeline may have no d = 0 tokens)."""
    m = mask.bool()
    if not m.any():
        return {}
    gap = (logp_theta.detach() - logp_behav).masked_fill(~m, 0.0)
    return {
        "mismatch/abs_mean": float(masked_mean(gap.abs(), m)),
        "mismatch/abs_max": float(masked_max(gap.abs(), m)),
        "mismatch/k3": float(masked_mean(kl_penalty(logp_behav, logp_theta.detach(), "k3"), m)),
        "mismatch/tokens": float(m.sum()),
    }


def approx_error_stats(
    errors: dict[str, ApproxErrors],
    mask: Tensor,
    versions: Tensor | None = None,
    current_version: int | None = None,
) -> dict[str, float]:
    """Mean of each error; grouped by staleness d too when versions are given."""
    mask = mask.bool()
    groups: dict[str, Tensor] = {"": mask}
    if versions is not None and current_version is not None:
        d = staleness(versions, current_version)
        for k in sorted(set(d[mask].tolist())):
            groups[f"/d{k}"] = mask & (d == k)
    out = {f"prox_err/tokens{suffix}": float(m.sum()) for suffix, m in groups.items() if suffix}
    for name, err in errors.items():
        for kind in ("abs", "rel", "sq", "iw"):
            values = getattr(err, kind)
            for suffix, m in groups.items():
                out[f"prox_err/{name}/{kind}{suffix}"] = float(masked_mean(values, m))
    return out

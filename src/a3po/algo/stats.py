"""Per-step statistics of the objective, over the tokens that count.

Masked means run over the loss mask: prompt tokens and padding never count. The keys
these functions return (loss/, stale/, mismatch/, prox_err/), with their formulas and
units, are declared in a3po/metrics.py, the one list of every logged key (rendered as
docs/metrics.md); tests/test_metrics.py fails on a key returned here and missing there.
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
        # the off-policy corrections, over the loss mask's tokens and over its sequences (each counted once)
        "loss/tis_truncated_frac": masked_mean(terms.tis_truncated.float(), m),
        "loss/tis_truncated_seq_frac": masked_mean(terms.seq_truncated.float(), terms.seq_first),
        "loss/corr_masked_frac": masked_mean(terms.corr_masked.float(), m),
        "loss/corr_masked_seq_frac": masked_mean(terms.seq_masked.float(), terms.seq_first),
        "loss/opsm_masked_seq_frac": masked_mean(terms.opsm_masked.float(), terms.seq_first),
    }
    if entropy is not None:
        out["loss/entropy"] = masked_mean(entropy.detach(), m)
    return {k: float(v) for k, v in out.items()}


LOW_D = 2  # "fresh" for the gradient-share statistic: tokens at most this many versions old


def loss_by_staleness(terms: LossTerms, d: Tensor, adv: Tensor, grad_coef: Tensor) -> dict[str, float]:
    """Where the clip, the cap and the off-policy corrections act, per staleness d (each (1, N) over the tokens
    that count), and the share of the update's per-token weight |dloss/dtheta_t| (the coefficient of
    grad log pi(y_t) in the gradient) that falls on tokens with A_t < 0 and d_t <= LOW_D: the tokens an
    unbounded ratio can blow up when p = b."""
    m = terms.mask.bool()
    out = {}
    for k in sorted(set(d[m].tolist())):
        at = m & (d == k)
        out[f"loss/clipped_frac_d{k}"] = float(masked_mean(terms.clipped.float(), at))
        out[f"loss/behav_capped_frac_d{k}"] = float(masked_mean(terms.capped.float(), at))
        out[f"loss/tis_truncated_frac_d{k}"] = float(masked_mean(terms.tis_truncated.float(), at))
        out[f"loss/corr_masked_frac_d{k}"] = float(masked_mean(terms.corr_masked.float(), at))
    weight = grad_coef.abs().masked_fill(~m, 0.0)
    total = float(weight.sum())
    low = float(weight[m & (adv < 0) & (d <= LOW_D)].sum())
    out["loss/grad_share_neg_low_d"] = low / total if total > 0 else 0.0
    return out


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

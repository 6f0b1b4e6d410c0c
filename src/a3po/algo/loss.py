"""The decoupled PPO objective (docs/design.md §6), and coupled PPO/GRPO as its special case.

Per generated token t, with theta = current log-prob (grad), p = proximal, b = behaviour:

    r_t = exp(theta_t - p_t)                                   trust-region ratio
    s_t = max(-A_t r_t, -A_t clip(r_t, 1 - eps_clip, 1 + eps_clip_higher))
          and, with dual clip c > 1, s_t = min(s_t, -c A_t) where A_t < 0
          (policy_loss="cispo" or "sapo" replace this surrogate: surrogates.py)
    w_t = exp(p_t - b_t), detached                             behaviour importance weight
          above behav_imp_weight_cap: *_mask drops the token (w = 0, it still counts in the
          token-mean denominator, as in AReaL), *_truncate clamps w to the cap;
          sequence_* uses the sequence's geometric-mean weight for all its tokens;
          then the off-policy corrections (TIS, MIS, IcePop, geometric mask, OPSM) rescale
          or zero w (corrections.py)
    loss = aggregate(s_t w_t) - entropy_coef * aggregate(H_t) + kl_coef * aggregate(KL_t)

Options beyond the plain objective:
- importance_sampling_level="sequence" (GSPO, arXiv 2507.18071): the sequence is the unit
  of the trust region. r is the geometric mean of its token ratios, exp(mean_t(theta_t - p_t)),
  and A the mean of its tokens' advantages (GSPO's one advantage per sequence; the same as
  A_t when advantages are per sequence, as GRPO's are), both shared by its tokens: a token
  keeping its own A_t under the shared r would be clipped on its own sign of A_t. Both means
  run over the tokens that count, so a token that token_mask drops enters neither.
- importance_sampling_level="sequence_token" (GSPO-token, same paper): each token keeps its own A_t
  and its own gradient, under the value of its sequence's ratio: log r_t = sg(mean_s log r_s) +
  log r_t - sg(log r_t). With one advantage per sequence it is GSPO.
- m2_threshold (M2PO, arXiv 2510.01161): drop the tokens with the largest (b_t - p_t)^2,
  largest first, until the mean of the rest is at most the threshold.

Coupled PPO/GRPO is p = b: `ppo_loss(logp_theta, logp_behav, logp_behav, ...)`, where w = 1 exactly.

Every setting above is a field of one frozen `LossSpec`, built once per run and passed whole;
the counts a micro-batch shares with its minibatch and the entropy and KL tensors are per call.

Deliberate deviations from AReaL:
- w is applied whenever this loss runs, with or without a cap (AReaL 1.0.4 applies it only
  when a rejection-sampling filter is configured);
- log-ratios are clamped to [-20, 20] before exp, and inputs on masked-out positions are
  zeroed first, so -inf or huge log-probs never produce NaN/Inf in the loss or gradient.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from a3po.algo import variants
from a3po.algo.corrections import LOG_RATIO_LIMIT, CorrectionSpec, correct
from a3po.algo.masked import AGGREGATORS, aggregate, masked_mean
from a3po.algo.surrogates import SURROGATES, SurrogateParams
from a3po.algo.variants import implements, lookup


@dataclass
class LossTerms:
    """Per-token diagnostics of one loss evaluation, all (B, T) and detached."""

    mask: Tensor  # tokens that entered the loss (after M2PO)
    ratio: Tensor  # r_t
    clipped: Tensor  # bool: the clipped branch of the max was taken
    dual_clipped: Tensor  # bool: the dual clip bound was taken
    behav_weight: Tensor  # w_t before the cap
    capped: Tensor  # bool: w_t exceeded the cap
    m2_dropped: Tensor  # bool: removed by M2PO
    pg: Tensor  # s_t * w_t
    tis_truncated: Tensor  # bool: TIS lowered w_t (actor.correction.tis)
    corr_masked: Tensor  # bool: an off-policy mask dropped the token (actor.correction.mis, opsm_delta)
    opsm_masked: Tensor  # bool: OPSM dropped the token's sequence
    seq_first: Tensor  # bool: the first token of each sequence that counts, to count sequences once
    seq_truncated: Tensor  # bool, on every token of a sequence with a tis_truncated token
    seq_masked: Tensor  # bool, on every token of a sequence with a corr_masked token


def _safe_log_ratio(a: Tensor, b: Tensor) -> Tensor:
    return torch.nan_to_num(a - b, nan=0.0).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)


def m2po_keep_mask(logp_behav: Tensor, logp_prox: Tensor, mask: Tensor, m2_threshold: float) -> Tensor:
    """M2PO: keep the largest set of tokens, dropping the biggest (b - p)^2 first, whose mean <= threshold."""
    m2 = _safe_log_ratio(logp_behav, logp_prox).square()[mask]  # (N,)
    if m2.numel() == 0:
        return mask
    order = torch.argsort(m2, descending=True)
    sorted_m2 = m2[order]
    # suffix_mean[k] = mean of sorted_m2[k:], the second moment after dropping the k largest
    suffix_sum = sorted_m2.flip(0).cumsum(0).flip(0)
    suffix_mean = suffix_sum / torch.arange(len(m2), 0, -1, device=m2.device, dtype=m2.dtype)
    ok = suffix_mean <= m2_threshold
    n_drop = int(ok.to(torch.int8).argmax()) if ok.any() else len(m2)
    keep_sorted = torch.arange(len(m2), device=m2.device) >= n_drop
    keep = torch.empty_like(keep_sorted)
    keep[order] = keep_sorted
    out = torch.zeros_like(mask)
    out[mask] = keep
    return out


@dataclass(frozen=True)
class CapMode:
    """What `behav_imp_weight_cap` does to a behaviour weight above it."""

    per_sequence: bool  # the weight is the sequence's geometric mean, shared by its tokens
    drop: bool  # drop the token (w = 0) rather than clamp w to the cap


# behav_imp_weight_mode
CAP_MODES: dict[str, CapMode] = implements({
    "token_mask": CapMode(per_sequence=False, drop=True),
    "token_truncate": CapMode(per_sequence=False, drop=False),
    "sequence_mask": CapMode(per_sequence=True, drop=True),
    "sequence_truncate": CapMode(per_sequence=True, drop=False),
}, variants.BEHAV_WEIGHT_MODES)


def _sequence_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Each sequence's masked mean of x (B, T), on every position of the sequence (B, T)."""
    return masked_mean(x, mask, dim=-1).unsqueeze(-1).expand_as(x)


def _per_token(x: Tensor, mask: Tensor) -> Tensor:
    return x


def _sequence_value_token_gradient(x: Tensor, mask: Tensor) -> Tensor:
    """GSPO-token's log ratio: the sequence mean's value, each token's own gradient."""
    return _sequence_mean(x, mask).detach() + x - x.detach()


@dataclass(frozen=True)
class IsLevel:
    """How log r and A are pooled before the surrogate."""

    log_ratio: Callable[[Tensor, Tensor], Tensor]
    adv: Callable[[Tensor, Tensor], Tensor]


# importance_sampling_level
IS_LEVELS = implements({
    "token": IsLevel(_per_token, _per_token),
    "sequence": IsLevel(_sequence_mean, _sequence_mean),  # GSPO
    "sequence_token": IsLevel(_sequence_value_token_gradient, _per_token),  # GSPO-token
}, variants.IS_LEVELS)


@dataclass(frozen=True)
class LossSpec:
    """The objective's settings, fixed for a whole run: built once from the config (trainer/objective.py)
    and passed whole, so that a new correction is one field here and one stage of `ppo_loss`, not a
    parameter threaded through every caller. The defaults are plain PPO (no dual clip, no cap).

    Each variant's name is looked up when the spec is built: a wrong one fails before any step runs."""

    eps_clip: float = 0.2  # clip range below 1 (and above 1 unless eps_clip_higher is set)
    eps_clip_higher: float | None = None  # clip range above 1; None = eps_clip
    c_clip: float | None = None  # dual clip bound c for A < 0; None disables
    behav_imp_weight_cap: float | None = None  # cap on w; None disables
    behav_imp_weight_mode: str = "token_mask"  # CAP_MODES: what the cap does
    importance_sampling_level: str = "token"  # IS_LEVELS: r and A per token or per sequence (GSPO)
    m2_threshold: float | None = None  # M2PO's bound on the second moment of log(p/b); None disables
    correction: CorrectionSpec = CorrectionSpec()  # off-policy corrections of w (corrections.py); none by default
    policy_loss: str = "ppo"  # surrogates.SURROGATES: PPO's clip, CISPO or SAPO
    sapo_tau_pos: float = 1.0  # SAPO's gate temperature for A > 0
    sapo_tau_neg: float = 1.05  # and for A <= 0
    agg_mode: str = "token-mean"  # masked.AGGREGATORS: per-token losses to one number
    agg_norm: float = 1.0  # constant divisor of seq-mean-token-sum
    entropy_coef: float = 0.0  # entropy bonus
    kl_coef: float = 0.0  # KL penalty to the reference, when the KL is passed in

    def __post_init__(self) -> None:
        _ = self.cap_mode, self.pool, lookup(AGGREGATORS, self.agg_mode, "loss aggregation mode")
        lookup(SURROGATES, self.policy_loss, "policy_loss")

    @property
    def cap_mode(self) -> CapMode:
        return lookup(CAP_MODES, self.behav_imp_weight_mode, "behav_imp_weight_mode")

    @property
    def pool(self) -> IsLevel:
        """How log r and A are pooled before the surrogate: per token, each sequence's mean, or GSPO-token's."""
        return lookup(IS_LEVELS, self.importance_sampling_level, "importance_sampling_level")

    @property
    def eps_high(self) -> float:
        return self.eps_clip if self.eps_clip_higher is None else self.eps_clip_higher

    @property
    def surrogate(self) -> SurrogateParams:
        return SurrogateParams(eps_low=self.eps_clip, eps_high=self.eps_high, c_clip=self.c_clip,
                               tau_pos=self.sapo_tau_pos, tau_neg=self.sapo_tau_neg)


def behaviour_weight(
    logp_prox: Tensor, logp_behav: Tensor, mask: Tensor, cap: float | None, mode: CapMode
) -> tuple[Tensor, Tensor, Tensor]:
    """(w before cap, w applied, capped) per token; everything detached."""
    log_w = _safe_log_ratio(logp_prox, logp_behav).detach()
    if mode.per_sequence:
        log_w = _sequence_mean(log_w, mask)
    w = torch.exp(log_w)
    if cap is None:
        return w, w, torch.zeros_like(mask)
    capped = (w > cap) & mask
    if mode.drop:
        return w, torch.where(capped, torch.zeros_like(w), w), capped
    return w, w.clamp(max=cap), capped


def _first_of_each_row(mask: Tensor) -> Tensor:
    """True on each row's first True of `mask` (B, T), so a flattened mean over these counts sequences."""
    return mask & (mask.cumsum(-1) == 1)


def _whole_row(flags: Tensor) -> Tensor:
    """Each row's any(), on every position of the row (B, T)."""
    return flags.any(-1, keepdim=True).expand_as(flags)


def ppo_loss(
    logp_theta: Tensor,  # (B, T) current policy, carries the gradient
    logp_prox: Tensor,  # (B, T) proximal policy, no gradient
    logp_behav: Tensor,  # (B, T) behaviour policy from the inference engine
    adv: Tensor,  # (B, T) per-token advantages (averaged per sequence at the sequence level)
    mask: Tensor,  # (B, T) bool, generated tokens that count
    spec: LossSpec = LossSpec(),
    *,
    n_tokens: int | None = None,  # the minibatch's counts, when these rows are one micro-batch of it (masked.py)
    n_seqs: int | None = None,
    entropy: Tensor | None = None,  # (B, T) per-token entropy, with grad if it is a bonus
    kl: Tensor | None = None,  # (B, T) per-token KL to a reference policy (see kl.py)
) -> tuple[Tensor, LossTerms]:
    """Scalar decoupled PPO loss and its per-token diagnostics.

    At importance_sampling_level="sequence" (GSPO) each sequence trains with one ratio and one
    advantage, the means of log r_t and of A_t over its tokens that count: per-token advantages
    under a shared ratio would let each token's own sign of A_t decide whether it is clipped.
    """
    mask = mask.bool()
    seq_first = _first_of_each_row(mask)  # before M2PO: every sequence given counts once
    zero = torch.zeros((), dtype=logp_theta.dtype, device=logp_theta.device)
    theta = torch.where(mask, logp_theta, zero)
    prox = torch.where(mask, logp_prox.detach(), zero)
    behav = torch.where(mask, logp_behav.detach(), zero)
    adv = torch.where(mask, adv.detach(), zero)

    # 1. M2PO: drop the tokens that push the second moment of log(p/b) over the threshold.
    m2_dropped = torch.zeros_like(mask)
    if spec.m2_threshold is not None:
        kept = m2po_keep_mask(behav, prox, mask, spec.m2_threshold)
        m2_dropped = mask & ~kept
        mask = kept

    # 2. Behaviour importance weight w = pi_prox / pi_behav, capped.
    cap_mode = spec.cap_mode
    w_raw, w, capped = behaviour_weight(prox, behav, mask, spec.behav_imp_weight_cap, cap_mode)

    # 3. Off-policy corrections: TIS rescales w, the masks (MIS, IcePop, geometric, OPSM) zero it.
    fix = correct(prox, theta, behav, adv, mask, spec.correction)
    w = w * fix.factor

    # 4. Trust-region ratio r = pi_theta / pi_prox and advantage, per token or per sequence (GSPO). A token
    #    a token-level cap or mask drops leaves the sequence mean too: it must not move what its neighbours
    #    train with.
    pool = spec.pool
    token_drop = fix.token_drop | (capped if cap_mode.drop and not cap_mode.per_sequence else torch.zeros_like(mask))
    in_mean = mask & ~token_drop
    log_r = pool.log_ratio(_safe_log_ratio(theta, prox), in_mean)
    adv = torch.where(mask, pool.adv(adv, in_mean), zero)

    # 5. The surrogate s_t (PPO's clip with the optional dual clip, CISPO or SAPO), times w_t.
    s = SURROGATES[spec.policy_loss](log_r, adv, spec.surrogate)
    clipped, dual_clipped = s.clipped & mask, s.dual_clipped & mask
    pg = s.pg * w

    # 6. Aggregate, then the optional entropy bonus and KL penalty.
    def agg(x: Tensor) -> Tensor:  # (B, T) -> ()
        return aggregate(x, mask, spec.agg_mode, spec.agg_norm, n_tokens, n_seqs)

    loss = agg(pg)
    if entropy is not None and spec.entropy_coef != 0.0:
        loss = loss - spec.entropy_coef * agg(entropy)
    if kl is not None and spec.kl_coef != 0.0:
        loss = loss + spec.kl_coef * agg(kl)

    terms = LossTerms(
        mask=mask,
        ratio=torch.exp(log_r.detach()),
        clipped=clipped,
        dual_clipped=dual_clipped,
        behav_weight=w_raw,
        capped=capped,
        m2_dropped=m2_dropped,
        pg=pg.detach(),
        tis_truncated=fix.truncated,
        corr_masked=fix.masked | fix.opsm,
        opsm_masked=fix.opsm,
        seq_first=seq_first,
        seq_truncated=_whole_row(fix.truncated),
        seq_masked=_whole_row(fix.masked | fix.opsm),
    )
    return loss, terms


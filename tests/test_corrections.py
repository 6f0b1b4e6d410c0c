"""The off-policy corrections (a3po.algo.corrections) and how the loss applies them, by hand.

What this file proves, on tensors small enough to check with a pencil:
- TIS truncates the ratio per token, or per sequence on the product of its token ratios, at the cap;
- MIS drops tokens (IcePop) or whole sequences (product, geometric mean) outside an inclusive band,
  one-sided or two-sided;
- OPSM drops exactly the sequences with a negative mean advantage and mean (b - theta) above delta;
- ratio=behav reads w = exp(p - b) and ratio=current reads exp(theta - b): under A-3PO at d <= 1 (p = b)
  only `current` sees the sampler's gap, and TIS there bounds the whole r w at the cap;
- a dropped token keeps its place in the token-mean denominator and leaves GSPO's sequence means;
- the token and sequence shares the statistics report;
- two cases ported from SkyRL's own tests (skyrl-train/tests/cpu/algorithms/test_off_policy_correction.py).

Run: .venv/bin/python -m pytest tests/test_corrections.py -q
"""

from __future__ import annotations

import math

import pytest
import torch

from a3po.algo import LossSpec, loss_stats, ppo_loss
from a3po.algo.corrections import CorrectionSpec, band_rejects, correct, opsm_rejects, truncation_factor

F64 = torch.float64


def bt(*rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=F64)


def mt(*rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.bool)


def log(*rows) -> torch.Tensor:
    """log of a (B, T) grid of ratios."""
    return bt(*rows).log()


# ----------------------------------------------------------------------------- TIS


def test_token_tis_caps_each_ratio_and_flags_it():
    # rho = [0.5, 1.5, 3, 9 (padding)], cap 2: min(rho, 2) / rho = [1, 1, 2/3, 1 (off the mask)]
    factor, truncated = truncation_factor(log([0.5, 1.5, 3.0, 9.0]), mt([1, 1, 1, 0]), "token", 2.0)
    torch.testing.assert_close(factor, bt([1.0, 1.0, 2 / 3, 1.0]))
    assert truncated.tolist() == [[False, False, True, False]]


def test_sequence_tis_caps_the_product_and_gives_it_to_every_token():
    # rho = [2, 3] -> product 6 > cap 4: each token's weight rho_t becomes 4, so factor = 4 / rho_t = [2, 4/3];
    # the second row's product 0.5 * 1.5 = 0.75 <= 4 keeps its ratios: factor 0.75 / rho_t = [1.5, 0.5]
    factor, truncated = truncation_factor(log([2.0, 3.0], [0.5, 1.5]), mt([1, 1], [1, 1]), "sequence", 4.0)
    torch.testing.assert_close(factor * bt([2.0, 3.0], [0.5, 1.5]), bt([4.0, 4.0], [0.75, 0.75]))
    assert truncated.tolist() == [[True, True], [False, False]]


def test_ported_from_skyrl_token_tis_ratio():
    """SkyRL test_compute_tis_ratio_token_level: old - rollout = [0.5, -0.5, 1.0], cap 2 ->
    [1.6487, 0.6065, 2.0] and one token in three capped (their old log-probs are our p, rollout ours b)."""
    p, b = bt([-1.0, -1.5, -0.5]), bt([-1.5, -1.0, -1.5])
    mask = mt([1, 1, 1])
    fix = correct(p, p, b, torch.ones_like(p), mask, CorrectionSpec(tis="token", tis_cap=2.0))
    torch.testing.assert_close((p - b).exp() * fix.factor, bt([1.6487, 0.6065, 2.0]), rtol=1e-3, atol=1e-4)
    assert float(fix.truncated.float().mean()) == pytest.approx(1 / 3)


def test_ported_from_skyrl_sequence_tis_ratio_with_mask():
    """SkyRL test_compute_tis_ratio_with_mask: log ratios [0.5, -0.5, 1.0] with the middle token masked out,
    cap 10: the sequence ratio is exp(0.5 + 1.0) = 4.4817, not capped."""
    p, b = bt([-1.0, -1.5, -0.5]), bt([-1.5, -1.0, -1.5])
    mask = mt([1, 0, 1])
    fix = correct(p, p, b, torch.ones_like(p), mask, CorrectionSpec(tis="sequence", tis_cap=10.0))
    weight = ((p - b).exp() * fix.factor)[mask]
    torch.testing.assert_close(weight, torch.full((2,), math.exp(1.5), dtype=F64))
    assert not fix.truncated.any()


# ----------------------------------------------------------------------------- MIS, IcePop, geometric


def test_token_mis_is_icepop_with_inclusive_two_sided_bounds():
    # band [0.5, 2]: 0.4 below, 0.5 and 2 on the bounds (kept), 3 above, 9 on padding (ignored)
    rejected = band_rejects(log([0.4, 0.5, 1.0, 2.0, 3.0, 9.0]), mt([1, 1, 1, 1, 1, 0]), "token", 0.5, 2.0)
    assert rejected.tolist() == [[True, False, False, False, True, False]]
    # one-sided: no lower bound drops only the 3
    upper = band_rejects(log([0.4, 0.5, 1.0, 2.0, 3.0, 9.0]), mt([1, 1, 1, 1, 1, 0]), "token", None, 2.0)
    assert upper.tolist() == [[False, False, False, False, True, False]]


def test_sequence_mis_reads_the_product_of_the_sequence():
    # products: 2 * 2 = 4 > 3 (dropped whole); 0.5 * 3 = 1.5 (kept, though 3 alone is above the band)
    rejected = band_rejects(log([2.0, 2.0], [0.5, 3.0]), mt([1, 1], [1, 1]), "sequence", 0.5, 3.0)
    assert rejected.tolist() == [[True, True], [False, False]]


def test_ported_from_skyrl_geometric_sequence_mask():
    """SkyRL test_compute_sequence_mask_geometric and ..._rejects: log ratios [0.1, -0.1, 0] have geometric mean 1
    (kept in [0.9, 1.1]); [0.5, 0.5, 0.5] have exp(0.5) = 1.6487 (the sequence is masked)."""
    p = bt([-1.0, -1.1, -1.0], [-1.0, -1.0, -1.0])
    b = bt([-1.1, -1.0, -1.0], [-1.5, -1.5, -1.5])
    fix = correct(p, p, b, torch.ones_like(p), mt([1, 1, 1], [1, 1, 1]),
                  CorrectionSpec(mis="geometric", mis_low=0.9, mis_high=1.1))
    assert fix.masked.tolist() == [[False] * 3, [True] * 3]
    assert fix.factor.tolist() == [[1.0] * 3, [0.0] * 3]


def test_the_geometric_band_of_skyrl_suggestion_is_tight():
    # rho = [1.02, 0.99]: geometric mean sqrt(1.0098) = 1.00489 inside [0.99, 1.01]; [1.03, 1.0] -> 1.01489 outside
    rejected = band_rejects(log([1.02, 0.99], [1.03, 1.0]), mt([1, 1], [1, 1]), "geometric", 0.99, 1.01)
    assert rejected.tolist() == [[False, False], [True, True]]


# ----------------------------------------------------------------------------- OPSM


def test_opsm_drops_negative_sequences_that_drifted_from_the_sampler():
    # b - theta per token; delta 0.2:
    #   row 0: A = -1, mean(b - theta) = (0.4 + 0.2) / 2 = 0.3 > 0.2  -> dropped
    #   row 1: A = +1, same drift                                  -> kept (positive advantage)
    #   row 2: A = -1, mean (0.1 + 0.1) / 2 = 0.1                  -> kept (close to the sampler)
    #   row 3: A = [-3, +1] (mean -1), drift 0.3 with padding 9 ignored -> dropped
    theta = bt([-1.4, -1.2, 0.0], [-1.4, -1.2, 0.0], [-1.1, -1.1, 0.0], [-1.4, -1.2, -10.0])
    b = torch.full_like(theta, -1.0)
    adv = bt([-1.0] * 3, [1.0] * 3, [-1.0] * 3, [-3.0, 1.0, 0.0])
    mask = mt([1, 1, 0], [1, 1, 0], [1, 1, 0], [1, 1, 0])
    assert opsm_rejects(b, theta, adv, mask, 0.2).tolist() == [
        [True, True, False], [False] * 3, [False] * 3, [True, True, False]]


# ----------------------------------------------------------------------------- in the loss


def test_behav_ratio_is_blind_at_d_le_1_under_a3po_and_current_sees_the_sampler():
    # p = b (loglinear at d <= 1); theta - b = log 3 on token 0 and 0 on token 1; A < 0 so PPO leaves r = 3
    # unclipped (no dual clip). IcePop band [0.5, 2]:
    #   ratio=behav: rho = p/b = 1 on both, nothing dropped: loss = (3 + 1) / 2 = 2
    #   ratio=current: rho = theta/b = 3 drops token 0, which still counts in the mean: loss = (0 + 1) / 2 = 0.5
    b = bt([-1.0, -1.0])
    theta = (b + log([3.0, 1.0])).requires_grad_()
    adv, mask = bt([-1.0, -1.0]), mt([1, 1])
    spec = dict(c_clip=None)
    behav, _ = ppo_loss(theta, b, b, adv, mask, LossSpec(**spec, correction=CorrectionSpec(
        mis="token", mis_low=0.5, mis_high=2.0)))
    current, terms = ppo_loss(theta, b, b, adv, mask, LossSpec(**spec, correction=CorrectionSpec(
        ratio="current", mis="token", mis_low=0.5, mis_high=2.0)))
    torch.testing.assert_close(behav, torch.tensor(2.0, dtype=F64))
    torch.testing.assert_close(current, torch.tensor(0.5, dtype=F64))
    assert terms.corr_masked.tolist() == [[True, False]]
    current.backward()
    torch.testing.assert_close(theta.grad, bt([0.0, 0.5]))  # d/dtheta of r_1 / 2, nothing from the dropped token


def test_tis_on_the_current_ratio_bounds_the_whole_importance_product():
    # p = b, theta - b = log 4, A = -1, no dual clip: PPO's s = max(4, 1.2) = 4; TIS at 2 on theta/b
    # scales w by min(4, 2) / 4 = 0.5, so s * w = 2 = A-weighted min(theta/b, C); the gradient is 2 too
    b = bt([-1.0])
    theta = (b + math.log(4.0)).requires_grad_()
    loss, terms = ppo_loss(theta, b, b, bt([-1.0]), mt([1]), LossSpec(
        c_clip=None, correction=CorrectionSpec(ratio="current", tis="token", tis_cap=2.0)))
    torch.testing.assert_close(loss, torch.tensor(2.0, dtype=F64))
    assert terms.tis_truncated.tolist() == [[True]]
    loss.backward()
    torch.testing.assert_close(theta.grad, bt([2.0]))


def test_behav_tis_replaces_the_behaviour_weight_by_the_capped_one():
    # w = p/b = [3, 1.5], r = 1, A = 1: s = -1 per token; token TIS at 2 -> w = [2, 1.5]: loss = -(2 + 1.5) / 2
    b = bt([-2.0, -2.0])
    p = b + log([3.0, 1.5])
    theta = p.clone().requires_grad_()
    loss, _ = ppo_loss(theta, p, b, bt([1.0, 1.0]), mt([1, 1]), LossSpec(
        behav_imp_weight_cap=None, correction=CorrectionSpec(tis="token", tis_cap=2.0)))
    torch.testing.assert_close(loss, torch.tensor(-1.75, dtype=F64))


def test_gspo_sequence_mean_leaves_out_a_token_icepop_drops():
    # one sequence, A = 1, p = b except token 1 whose w = 4 leaves IcePop's [0.5, 2] (ratio=behav).
    # log r = [0.1, -0.1]: the sequence ratio averages token 0 alone, exp(0.1); loss = -exp(0.1) / 2
    b = bt([-1.0, -1.0])
    p = b + log([1.0, 4.0])
    theta = (p + bt([0.1, -0.1])).requires_grad_()
    loss, terms = ppo_loss(theta, p, b, bt([1.0, 1.0]), mt([1, 1]), LossSpec(
        behav_imp_weight_cap=None, importance_sampling_level="sequence",
        correction=CorrectionSpec(mis="token", mis_low=0.5, mis_high=2.0)))
    r = math.exp(0.1)
    torch.testing.assert_close(terms.ratio, bt([r, r]))
    torch.testing.assert_close(loss, torch.tensor(-r / 2, dtype=F64))


def test_statistics_count_tokens_and_sequences_once_each():
    # three sequences (the second of one token); TIS at 2 on tokens with rho = 3; OPSM drops row 2 (A < 0,
    # b - theta = 0.5 > 0.3). Of the 5 tokens that count, TIS lowered 2 (rows 0 and 1): 2/5, in 2 of 3 sequences;
    # OPSM dropped 2 (row 2): 2/5 of the tokens, 1/3 of the sequences.
    theta = bt([-1.0, -1.0], [-1.0, 0.0], [-1.5, -1.5])
    b = torch.full_like(theta, -1.0)
    p = b + log([3.0, 1.0], [3.0, 1.0], [1.0, 1.0])
    mask = mt([1, 1], [1, 0], [1, 1])
    spec = LossSpec(behav_imp_weight_cap=None, correction=CorrectionSpec(tis="token", tis_cap=2.0, opsm_delta=0.3))
    _, terms = ppo_loss(theta, p, b, bt([1.0, 1.0], [1.0, 1.0], [-1.0, -1.0]), mask, spec)
    s = loss_stats(terms, mask, theta, p)
    assert s["loss/tis_truncated_frac"] == pytest.approx(2 / 5)  # over the 5 tokens that count
    assert s["loss/tis_truncated_seq_frac"] == pytest.approx(2 / 3)
    assert s["loss/corr_masked_frac"] == pytest.approx(2 / 5)
    assert s["loss/corr_masked_seq_frac"] == pytest.approx(1 / 3)
    assert s["loss/opsm_masked_seq_frac"] == pytest.approx(1 / 3)


@pytest.mark.parametrize("spec, match", [
    (dict(ratio="engine"), "actor.correction.ratio"),
    (dict(tis="seq"), "actor.correction.tis"),
    (dict(mis="icepop"), "actor.correction.mis"),
])
def test_an_unknown_correction_name_is_refused_when_the_spec_is_built(spec, match):
    with pytest.raises(ValueError, match=match):
        CorrectionSpec(**spec)

"""The decoupled PPO loss (a3po.algo.loss) and its aggregation (a3po.algo.masked), by hand.

What this file proves, each on a tensor small enough to check with a pencil:
- the clipped surrogate for A > 0 and A < 0, inside and outside [1 - eps, 1 + eps_high],
  symmetric and asymmetric, with the clipped flags and the gradient (0 where clipped);
- the dual clip bound -c A for A < 0 and large ratios;
- the behaviour weight w = exp(p - b) is always applied, and the four cap modes
  (token/sequence x mask/truncate) drop or clamp it as documented;
- GSPO's sequence-level ratio exp(mean_t(theta - p)) and the mean of the sequence's
  advantages are shared by its tokens; a token the token_mask cap drops enters neither mean;
- M2PO drops the largest (b - p)^2 first until the rest's mean is under the threshold;
- the three aggregation modes, empty sequences, an empty mask (0, not NaN), and that
  micro-batches given the whole minibatch's n_tokens / n_seqs sum to the whole loss;
- the entropy bonus and KL penalty enter with the right sign and coefficient;
- garbage (NaN, inf) on masked-out positions changes nothing.

Run: .venv/bin/python -m pytest tests/test_loss.py -q
"""

from __future__ import annotations

import math

import pytest
import torch

from a3po.algo import LossSpec, aggregate, masked_mean, masked_sum, ppo_loss
from a3po.algo.loss import m2po_keep_mask

F64 = torch.float64
INF = float("inf")
NAN = float("nan")


def bt(*rows, dtype=F64) -> torch.Tensor:
    """A (B, T) float tensor from B lists of T numbers."""
    return torch.tensor(rows, dtype=dtype)


def mt(*rows) -> torch.Tensor:
    """A (B, T) bool mask from B lists of 0/1."""
    return torch.tensor(rows, dtype=torch.bool)


def inputs(ratios, advs, weights=None, b=None):
    """(theta, p, b, adv) with theta - p = log(ratio) and p - b = log(w); theta requires grad."""
    ratios, advs = bt(*ratios), bt(*advs)
    weights = torch.ones_like(ratios) if weights is None else bt(*weights)
    b = torch.full_like(ratios, -1.0) if b is None else bt(*b)
    p = b + weights.log()
    theta = (p + ratios.log()).requires_grad_()
    return theta, p, b, advs


# ----------------------------------------------------------------------------- clipped surrogate

# (A, r) per token and the loss term s_t = max(-A r, -A clip(r, 0.8, 1.28)):
CLIP_CASES = [
    (+1.0, 1.10),  # inside:                         -1.1
    (+1.0, 1.50),  # above 1.28, A > 0: clipped      max(-1.5, -1.28) = -1.28
    (+1.0, 0.50),  # below 0.8, A > 0: not clipped   max(-0.5, -0.8)  = -0.5
    (-1.0, 0.50),  # below 0.8, A < 0: clipped       max(0.5, 0.8)    = 0.8
    (-1.0, 1.50),  # above 1.28, A < 0: not clipped  max(1.5, 1.28)   = 1.5
    (-1.0, 0.90),  # inside:                         0.9
    (+2.0, 1.25),  # inside the asymmetric upper bound 1.28 (outside 1.2): -2.5
]


def test_clipped_surrogate_asymmetric_hand_values():
    theta, p, b, adv = inputs([[r for _, r in CLIP_CASES]], [[a for a, _ in CLIP_CASES]])
    mask = torch.ones_like(adv, dtype=torch.bool)
    loss, terms = ppo_loss(theta, p, b, adv, mask, LossSpec(eps_clip=0.2, eps_clip_higher=0.28))
    expected_pg = bt([-1.1, -1.28, -0.5, 0.8, 1.5, 0.9, -2.5])
    torch.testing.assert_close(terms.pg, expected_pg)
    torch.testing.assert_close(terms.ratio, bt([r for _, r in CLIP_CASES]))
    assert terms.clipped.tolist() == [[False, True, False, True, False, False, False]]
    # (-1.1 - 1.28 - 0.5 + 0.8 + 1.5 + 0.9 - 2.5) / 7 = -2.18 / 7
    torch.testing.assert_close(loss, torch.tensor(-2.18 / 7, dtype=F64))

    loss.backward()
    # d/dtheta of -A r / N is -A r / N where the unclipped branch wins, 0 where clipped
    grad = [0.0 if clipped else -a * r / 7 for (a, r), clipped in zip(CLIP_CASES, terms.clipped[0].tolist())]
    torch.testing.assert_close(theta.grad, bt(grad))


def test_clipped_surrogate_symmetric_clips_the_upper_bound_at_1_plus_eps():
    theta, p, b, adv = inputs([[r for _, r in CLIP_CASES]], [[a for a, _ in CLIP_CASES]])
    mask = torch.ones_like(adv, dtype=torch.bool)
    loss, terms = ppo_loss(theta, p, b, adv, mask, LossSpec(eps_clip=0.2))
    # now 1.5 -> 1.2 for A = +1 (-1.2) and 1.25 -> 1.2 for A = +2 (-2.4)
    torch.testing.assert_close(terms.pg, bt([-1.1, -1.2, -0.5, 0.8, 1.5, 0.9, -2.4]))
    assert terms.clipped.tolist() == [[False, True, False, True, False, False, True]]
    # (-1.1 - 1.2 - 0.5 + 0.8 + 1.5 + 0.9 - 2.4) / 7 = -2.0 / 7
    torch.testing.assert_close(loss, torch.tensor(-2.0 / 7, dtype=F64))


def test_dual_clip_bounds_negative_advantages():
    # c = 3, eps = 0.2, eps_high = 0.28
    #   (A=-1, r=5): max(5, 1.28) = 5 > -cA = 3      -> 3, dual-clipped
    #   (A=-1, r=2): max(2, 1.28) = 2 <= 3           -> 2
    #   (A=+1, r=5): max(-5, -1.28) = -1.28          -> A > 0: never dual-clipped
    #   (A=-2, r=4): max(8, 2.56) = 8 > -cA = 6      -> 6, dual-clipped
    theta, p, b, adv = inputs([[5.0, 2.0, 5.0, 4.0]], [[-1.0, -1.0, 1.0, -2.0]])
    mask = torch.ones_like(adv, dtype=torch.bool)
    loss, terms = ppo_loss(theta, p, b, adv, mask, LossSpec(eps_clip=0.2, eps_clip_higher=0.28, c_clip=3.0))
    torch.testing.assert_close(terms.pg, bt([3.0, 2.0, -1.28, 6.0]))
    assert terms.dual_clipped.tolist() == [[True, False, False, True]]
    assert terms.clipped.tolist() == [[False, False, True, False]]
    torch.testing.assert_close(loss, torch.tensor((3 + 2 - 1.28 + 6) / 4, dtype=F64))  # 9.72 / 4 = 2.43
    loss.backward()
    # the bound is constant: no gradient on dual-clipped or clipped tokens; -A r / N = 2/4 on token 2
    torch.testing.assert_close(theta.grad, bt([0.0, 0.5, 0.0, 0.0]))

    # without the dual clip the same tokens give 5 and 8
    _, terms = ppo_loss(theta, p, b, adv, mask, LossSpec(eps_clip=0.2, eps_clip_higher=0.28))
    torch.testing.assert_close(terms.pg, bt([5.0, 2.0, -1.28, 8.0]))
    assert not terms.dual_clipped.any()


# ----------------------------------------------------------------------------- behaviour weight and its cap


def test_behaviour_weight_is_applied_without_a_cap():
    # r = 1, A = 1: s = -1; w = exp(p - b) = 0.5, 2, 4 -> pg = -0.5, -2, -4; mean = -6.5 / 3
    theta, p, b, adv = inputs([[1.0, 1.0, 1.0]], [[1.0, 1.0, 1.0]], weights=[[0.5, 2.0, 4.0]])
    loss, terms = ppo_loss(theta, p, b, adv, torch.ones(1, 3, dtype=torch.bool))
    torch.testing.assert_close(terms.behav_weight, bt([0.5, 2.0, 4.0]))
    torch.testing.assert_close(terms.pg, bt([-0.5, -2.0, -4.0]))
    torch.testing.assert_close(loss, torch.tensor(-6.5 / 3, dtype=F64))
    assert not terms.capped.any()


@pytest.mark.parametrize(
    "mode, expected_pg, expected_loss",
    [
        # w = 0.5, 2, 4 with cap 3: the 4 is dropped, the token still counts in the denominator
        ("token_mask", [-0.5, -2.0, 0.0], (-0.5 - 2.0 + 0.0) / 3),
        # ... or clamped to the cap
        ("token_truncate", [-0.5, -2.0, -3.0], (-0.5 - 2.0 - 3.0) / 3),
    ],
)
def test_token_level_cap(mode, expected_pg, expected_loss):
    theta, p, b, adv = inputs([[1.0, 1.0, 1.0]], [[1.0, 1.0, 1.0]], weights=[[0.5, 2.0, 4.0]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    loss, terms = ppo_loss(theta, p, b, adv, mask, LossSpec(behav_imp_weight_cap=3.0, behav_imp_weight_mode=mode))
    torch.testing.assert_close(terms.pg, bt(expected_pg))
    torch.testing.assert_close(loss, torch.tensor(expected_loss, dtype=F64))
    assert terms.capped.tolist() == [[False, False, True]]
    torch.testing.assert_close(terms.behav_weight, bt([0.5, 2.0, 4.0]))  # reported before the cap
    assert terms.mask.tolist() == [[True, True, True]]  # a dropped token is not removed from the mask


@pytest.mark.parametrize(
    "mode, expected_pg, expected_loss",
    [
        # seq 0: w = 0.5, 2 -> geometric mean sqrt(0.5 * 2) = 1 <= 3; seq 1: w = 4, 9 -> sqrt(36) = 6 > 3
        ("sequence_mask", [[-1.0, -1.0, 0.0], [0.0, 0.0, 0.0]], (-1 - 1 + 0 + 0) / 4),
        ("sequence_truncate", [[-1.0, -1.0, 0.0], [-3.0, -3.0, 0.0]], (-1 - 1 - 3 - 3) / 4),
    ],
)
def test_sequence_level_cap_uses_the_geometric_mean_weight(mode, expected_pg, expected_loss):
    theta, p, b, adv = inputs(
        [[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]],
        [[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]],
        weights=[[0.5, 2.0, 50.0], [4.0, 9.0, 50.0]],  # the 50s are padding
    )
    mask = mt([1, 1, 0], [1, 1, 0])
    loss, terms = ppo_loss(theta, p, b, adv, mask, LossSpec(behav_imp_weight_cap=3.0, behav_imp_weight_mode=mode))
    torch.testing.assert_close(terms.pg, bt(*expected_pg))
    torch.testing.assert_close(loss, torch.tensor(expected_loss, dtype=F64))
    assert terms.capped.tolist() == [[False, False, False], [True, True, False]]
    torch.testing.assert_close(terms.behav_weight[:, :2], bt([1.0, 1.0], [6.0, 6.0]))


def test_unknown_behaviour_weight_mode_raises_when_a_cap_is_set():
    theta, p, b, adv = inputs([[1.0]], [[1.0]])
    with pytest.raises(ValueError, match="behav_imp_weight_mode"):
        ppo_loss(theta, p, b, adv, mt([1]), LossSpec(behav_imp_weight_cap=2.0, behav_imp_weight_mode="token_clip"))
    with pytest.raises(ValueError, match="behav_imp_weight_mode"):
        ppo_loss(theta, p, b, adv, mt([1]), LossSpec(behav_imp_weight_cap=2.0, behav_imp_weight_mode="batch_mask"))


# ----------------------------------------------------------------------------- GSPO


@pytest.mark.parametrize("key", ["behav_imp_weight_mode", "importance_sampling_level", "agg_mode"])
def test_a_loss_spec_with_an_unknown_variant_is_refused_when_it_is_built(key):
    # before any step runs, and whether or not the variant would be read (no cap is set here)
    with pytest.raises(ValueError, match="behav_imp_weight_mode|importance_sampling_level|aggregation mode"):
        LossSpec(**{key: "nope"})


def test_the_spec_is_the_loss_settings_whole():
    # LossSpec() is plain PPO; the same settings as one spec or field by field give the same loss: a
    # micro-batch's counts, the entropy and the KL stay per call. Hand values as in the asymmetric clip
    # test: A = [1, 1, -1], r = [1.5, 0.9, 0.5] clip to [1.28, 0.9, 0.8] -> pg = [-1.28, -0.9, 0.8]
    theta, p, b, adv = inputs([[1.5, 0.9, 0.5]], [[1.0, 1.0, -1.0]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    spec = LossSpec(eps_clip=0.2, eps_clip_higher=0.28)
    assert spec.eps_high == 0.28 and LossSpec().eps_high == 0.2
    loss, _ = ppo_loss(theta, p, b, adv, mask, spec, n_tokens=4)
    torch.testing.assert_close(loss, torch.tensor((-1.28 - 0.9 + 0.8) / 4, dtype=F64))  # the minibatch's 4 tokens


def test_gspo_sequence_ratio_is_shared_by_the_sequence():
    # log r: seq 0 [0.0, 0.2, (9.0 padding)] -> mean 0.1  -> r = e^0.1  = 1.105171
    #        seq 1 [0.3, -0.3, 0.06]         -> mean 0.02 -> r = e^0.02 = 1.020201
    log_r = bt([0.0, 0.2, 9.0], [0.3, -0.3, 0.06])
    theta, p, b, adv = inputs(log_r.exp().tolist(), [[1.0] * 3, [1.0] * 3])
    mask = mt([1, 1, 0], [1, 1, 1])
    loss, terms = ppo_loss(theta, p, b, adv, mask, LossSpec(importance_sampling_level="sequence"))
    r0, r1 = math.exp(0.1), math.exp(0.02)
    torch.testing.assert_close(terms.ratio[:, :2], bt([r0, r0], [r1, r1]))
    torch.testing.assert_close(terms.ratio[1], torch.full((3,), r1, dtype=F64))
    assert not terms.clipped.any()  # both within [0.8, 1.2]
    # -(2 r0 + 3 r1) / 5 = -(2.210342 + 3.060603) / 5 = -1.054189
    torch.testing.assert_close(loss, torch.tensor(-(2 * r0 + 3 * r1) / 5, dtype=F64))
    loss.backward()
    # dr_i/dtheta_t = r_i / n_i, so grad_t = -(sum_i A) r_i / (n_i N): seq 0: -2 r0 / (2 * 5), seq 1: -3 r1 / (3 * 5)
    torch.testing.assert_close(theta.grad, bt([-r0 / 5, -r0 / 5, 0.0], [-r1 / 5, -r1 / 5, -r1 / 5]))


def test_gspo_clips_the_whole_sequence():
    # seq log r [0.5, 0.3] -> mean 0.4 -> r = e^0.4 = 1.4918 > 1.2: A > 0, every token clipped at -1.2
    theta, p, b, adv = inputs([[math.exp(0.5), math.exp(0.3)]], [[1.0, 1.0]])
    loss, terms = ppo_loss(theta, p, b, adv, mt([1, 1]), LossSpec(importance_sampling_level="sequence"))
    assert terms.clipped.tolist() == [[True, True]]
    torch.testing.assert_close(loss, torch.tensor(-1.2, dtype=F64))
    with pytest.raises(ValueError, match="importance_sampling_level"):
        ppo_loss(theta, p, b, adv, mt([1, 1]), LossSpec(importance_sampling_level="batch"))


def test_gspo_gives_each_sequence_one_advantage_the_mean_of_its_tokens():
    # one sequence of two tokens (a third, A = 99, is padding): A = [+1, -3] -> one advantage, the mean -1.
    # log r = log 1.5 on both -> r = 1.5 > 1.2; with A = -1 the unclipped branch wins: s = max(1.5, 1.2) = 1.5
    # on both tokens, loss = (1.5 + 1.5) / 2 = 1.5 = r, so d loss / d theta_t = d r / d theta_t = r / 2 = 0.75.
    # (per-token A under the shared ratio gave max(-1.5, -1.2) = -1.2 and max(4.5, 3.6) = 4.5: loss 1.65,
    # and gradient 3/2 * r / 2 = 1.125 on each token from the second token's term alone)
    theta, p, b, adv = inputs([[1.5, 1.5, 1.5]], [[1.0, -3.0, 99.0]])
    loss, terms = ppo_loss(theta, p, b, adv, mt([1, 1, 0]), LossSpec(importance_sampling_level="sequence"))
    torch.testing.assert_close(terms.pg, bt([1.5, 1.5, 0.0]))
    assert not terms.clipped.any()
    torch.testing.assert_close(loss, torch.tensor(1.5, dtype=F64))
    loss.backward()
    torch.testing.assert_close(theta.grad, bt([0.75, 0.75, 0.0]))


def test_gspo_token_keeps_each_tokens_advantage_and_gradient_under_the_sequence_ratio():
    # one sequence, log r = [0.5, 0.3] -> the value of every token's ratio is e^0.4 = 1.491825 (its own gradient);
    # A = [+1, -1], no dual clip: token 0 (A > 0, above 1.2) is clipped at -1.2 and gets no gradient; token 1
    # keeps max(1.491825, 1.2) = 1.491825 and d/dtheta_1 = r / 2 (the token mean over 2) = 0.745912.
    # GSPO would pool A to 0 (no gradient at all); per-token PPO would see token 1's own r = e^0.3.
    theta, p, b, adv = inputs([[math.exp(0.5), math.exp(0.3)]], [[1.0, -1.0]])
    spec = LossSpec(importance_sampling_level="sequence_token", c_clip=None)
    loss, terms = ppo_loss(theta, p, b, adv, mt([1, 1]), spec)
    r = math.exp(0.4)
    torch.testing.assert_close(terms.ratio, bt([r, r]))
    assert terms.clipped.tolist() == [[True, False]]
    torch.testing.assert_close(loss, torch.tensor((-1.2 + r) / 2, dtype=F64))
    loss.backward()
    torch.testing.assert_close(theta.grad, bt([0.0, r / 2]))


def test_gspo_with_a_token_cap_drops_the_capped_token_before_the_sequence_mean():
    # one sequence, A = 1: log r = [0.1, -0.1], w = [1, 4]; cap 3 with token_mask drops token 1.
    # The sequence ratio averages the kept token only: r = exp(0.1) = 1.105171 for both tokens (averaging
    # both, exp(0) = 1, let the dropped token move its sequence's ratio).
    # pg = [-1 * 1.105171 * 1, 0]; the dropped token still counts in the token mean, as at token level:
    # loss = -1.105171 / 2 = -0.552585; d loss / d theta_0 = -r / 2 = -0.552585, theta_1 gets nothing
    theta, p, b, adv = inputs([[math.exp(0.1), math.exp(-0.1)]], [[1.0, 1.0]], weights=[[1.0, 4.0]])
    loss, terms = ppo_loss(theta, p, b, adv, mt([1, 1]), LossSpec(importance_sampling_level="sequence",
                           behav_imp_weight_cap=3.0, behav_imp_weight_mode="token_mask"))
    r = math.exp(0.1)
    torch.testing.assert_close(terms.ratio, bt([r, r]))
    assert terms.capped.tolist() == [[False, True]]
    torch.testing.assert_close(loss, torch.tensor(-r / 2, dtype=F64))
    loss.backward()
    torch.testing.assert_close(theta.grad, bt([-r / 2, 0.0]))


# ----------------------------------------------------------------------------- M2PO

# b - p per token: 0.1, 2, 0.1, 1 and a padding token -> (b - p)^2 = 0.01, 4, 0.01, 1
M2_B = bt([0.0, 0.0, 0.0, 0.0, 0.0])
M2_P = bt([-0.1, -2.0, -0.1, -1.0, -5.0])
M2_MASK = mt([1, 1, 1, 1, 0])


@pytest.mark.parametrize(
    "threshold, keep",
    [
        # mean of all: 5.02 / 4 = 1.255 > 0.5; without the 4: 1.02 / 3 = 0.34 <= 0.5 -> drop one
        (0.5, [1, 0, 1, 1, 0]),
        # 0.34 > 0.3; without the 4 and the 1: 0.02 / 2 = 0.01 <= 0.3 -> drop two
        (0.3, [1, 0, 1, 0, 0]),
        # 1.255 <= 2: keep all
        (2.0, [1, 1, 1, 1, 0]),
        # even 0.01 alone is above 0.001: drop all
        (0.001, [0, 0, 0, 0, 0]),
    ],
)
def test_m2po_keep_mask_hand_values(threshold, keep):
    kept = m2po_keep_mask(M2_B, M2_P, M2_MASK, threshold)
    assert kept.tolist() == mt(keep).tolist()


def test_m2po_keeps_a_set_whose_mean_equals_the_threshold():
    # b - p = 2, 1, 0.5, 0.5 -> (b - p)^2 = 4, 1, 0.25, 0.25 (all exact in binary)
    # mean of all 5.5 / 4 = 1.375; without the 4: 1.5 / 3 = 0.5 exactly = threshold -> kept ("at most")
    p = bt([-2.0, -1.0, -0.5, -0.5])
    kept = m2po_keep_mask(torch.zeros_like(p), p, mt([1, 1, 1, 1]), 0.5)
    assert kept.tolist() == [[False, True, True, True]]


def test_m2po_with_nothing_masked_in_returns_the_mask():
    empty = torch.zeros(1, 5, dtype=torch.bool)
    assert torch.equal(m2po_keep_mask(M2_B, M2_P, empty, 0.3), empty)


def test_m2po_in_the_loss_removes_tokens_from_the_mean():
    # r = 1, A = 1, w = exp(p - b): pg = -w; threshold 0.5 drops token 1 (w = e^-2)
    theta = M2_P.clone().requires_grad_()
    adv = torch.ones_like(M2_P)
    loss, terms = ppo_loss(theta, M2_P, M2_B, adv, M2_MASK, LossSpec(m2_threshold=0.5))
    assert terms.m2_dropped.tolist() == [[False, True, False, False, False]]
    assert terms.mask.tolist() == [[True, False, True, True, False]]
    # -(e^-0.1 + e^-0.1 + e^-1) / 3: the dropped token leaves the denominator too
    expected = -(2 * math.exp(-0.1) + math.exp(-1.0)) / 3
    torch.testing.assert_close(loss, torch.tensor(expected, dtype=F64))
    loss.backward()
    assert theta.grad[0, 1] == 0


# ----------------------------------------------------------------------------- aggregation

# x on three sequences with 3, 1 and 0 tokens; 99 and NaN sit on masked-out positions
AGG_X = bt([1.0, 2.0, 3.0, 99.0], [4.0, NAN, 99.0, 99.0], [NAN, 99.0, 99.0, 99.0])
AGG_MASK = mt([1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0])


@pytest.mark.parametrize(
    "mode, norm, expected",
    [
        ("token-mean", 1.0, (1 + 2 + 3 + 4) / 4),  # 2.5
        ("seq-mean-token-mean", 1.0, ((1 + 2 + 3) / 3 + 4 / 1) / 2),  # (2 + 4) / 2 = 3; empty seq ignored
        ("seq-mean-token-sum", 4.0, ((1 + 2 + 3) / 4 + 4 / 4) / 2),  # (1.5 + 1) / 2 = 1.25
    ],
)
def test_aggregate_hand_values(mode, norm, expected):
    torch.testing.assert_close(aggregate(AGG_X, AGG_MASK, mode, norm), torch.tensor(expected, dtype=F64))


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_aggregate_of_an_empty_mask_is_zero(mode):
    out = aggregate(AGG_X, torch.zeros_like(AGG_MASK), mode)
    assert out.item() == 0.0


def test_aggregate_unknown_mode_raises():
    with pytest.raises(ValueError, match="seq-mean-token-mean"):
        aggregate(AGG_X, AGG_MASK, "sequence-mean")


def test_masked_sum_and_mean_ignore_nan_padding():
    torch.testing.assert_close(masked_sum(AGG_X, AGG_MASK, dim=-1), bt([6.0, 4.0, 0.0])[0])
    torch.testing.assert_close(masked_mean(AGG_X, AGG_MASK, dim=-1), bt([2.0, 4.0, 0.0])[0])  # empty row: 0
    torch.testing.assert_close(masked_mean(AGG_X, AGG_MASK), torch.tensor(2.5, dtype=F64))


@pytest.mark.parametrize(
    "mode, norm", [("token-mean", 1.0), ("seq-mean-token-mean", 1.0), ("seq-mean-token-sum", 16.0)]
)
def test_micro_batches_sum_to_the_minibatch_loss(mode, norm):
    torch.manual_seed(3)
    B, T = 5, 6
    b = -torch.rand(B, T, dtype=F64) * 2
    p = b + 0.2 * torch.randn(B, T, dtype=F64)
    theta0 = p + 0.3 * torch.randn(B, T, dtype=F64)
    adv = torch.randn(B, T, dtype=F64)
    mask = mt([0, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1], [0, 1, 0, 0, 0, 0])
    spec = LossSpec(agg_mode=mode, agg_norm=norm, eps_clip_higher=0.28, c_clip=3.0)

    theta = theta0.clone().requires_grad_()
    whole, _ = ppo_loss(theta, p, b, adv, mask, spec)
    whole.backward()

    n_tokens, n_seqs = int(mask.sum()), int((mask.sum(-1) > 0).sum())  # 13 tokens, 4 sequences with tokens
    theta_m = theta0.clone().requires_grad_()
    parts = []
    for sl in (slice(0, 2), slice(2, 5)):
        part, _ = ppo_loss(theta_m[sl], p[sl], b[sl], adv[sl], mask[sl], spec, n_tokens=n_tokens, n_seqs=n_seqs)
        part.backward()
        parts.append(part.detach())
    torch.testing.assert_close(parts[0] + parts[1], whole.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(theta_m.grad, theta.grad, rtol=1e-12, atol=1e-12)
    # and without the minibatch counts each half would be normalised on its own: not the same
    alone = sum(ppo_loss(theta0[sl], p[sl], b[sl], adv[sl], mask[sl], spec)[0] for sl in (slice(0, 2), slice(2, 5)))
    assert not torch.isclose(alone, whole.detach())


# ----------------------------------------------------------------------------- entropy and KL terms


def test_entropy_bonus_and_kl_penalty_signs_and_coefficients():
    # r = 1, w = 1, A = [1, 3]: pg = [-1, -3] -> base = -2
    theta, p, b, adv = inputs([[1.0, 1.0, 1.0]], [[1.0, 3.0, 0.0]])
    mask = mt([1, 1, 0])
    entropy = bt([0.5, 1.5, NAN]).requires_grad_()  # masked mean 1.0
    kl = bt([0.2, 0.4, INF])  # masked mean 0.3
    base, _ = ppo_loss(theta, p, b, adv, mask)
    torch.testing.assert_close(base, torch.tensor(-2.0, dtype=F64))

    with_h, _ = ppo_loss(theta, p, b, adv, mask, LossSpec(entropy_coef=0.1), entropy=entropy)
    torch.testing.assert_close(with_h, torch.tensor(-2.0 - 0.1 * 1.0, dtype=F64))  # a bonus lowers the loss

    with_kl, _ = ppo_loss(theta, p, b, adv, mask, LossSpec(kl_coef=0.5), kl=kl)
    torch.testing.assert_close(with_kl, torch.tensor(-2.0 + 0.5 * 0.3, dtype=F64))  # a penalty raises it

    both, _ = ppo_loss(theta, p, b, adv, mask, LossSpec(entropy_coef=0.1, kl_coef=0.5), entropy=entropy, kl=kl)
    torch.testing.assert_close(both, torch.tensor(-2.0 - 0.1 + 0.15, dtype=F64))  # -1.95
    both.backward()
    # d loss / d H_t = -coef / N = -0.1 / 2 on the tokens, 0 on padding
    torch.testing.assert_close(entropy.grad, bt([-0.05, -0.05, 0.0]))

    # coefficient 0 means no term, even if the tensor is given
    zero, _ = ppo_loss(theta, p, b, adv, mask, LossSpec(entropy_coef=0.0, kl_coef=0.0), entropy=entropy, kl=kl)
    torch.testing.assert_close(zero, base)


def test_entropy_and_kl_use_the_loss_aggregation():
    # seq-mean-token-mean: entropy [[1, 3], [5, pad]] -> (2 + 5) / 2 = 3.5
    theta, p, b, adv = inputs([[1.0, 1.0], [1.0, 1.0]], [[0.0, 0.0], [0.0, 0.0]])
    mask = mt([1, 1], [1, 0])
    entropy = bt([1.0, 3.0], [5.0, NAN])
    spec = LossSpec(agg_mode="seq-mean-token-mean", entropy_coef=1.0)
    loss, _ = ppo_loss(theta, p, b, adv, mask, spec, entropy=entropy)
    torch.testing.assert_close(loss, torch.tensor(-3.5, dtype=F64))


# ----------------------------------------------------------------------------- padding never matters

PADDING_OPTIONS = [  # on the inputs below two tokens clip, and each dual-clip, cap or M2PO option fires
    {},
    {"eps_clip_higher": 0.28, "c_clip": 1.05},
    {"behav_imp_weight_cap": 0.9, "behav_imp_weight_mode": "sequence_truncate"},
    {"behav_imp_weight_cap": 1.1, "behav_imp_weight_mode": "token_mask"},
    {"importance_sampling_level": "sequence"},
    {"m2_threshold": 0.1},
    {"agg_mode": "seq-mean-token-sum", "agg_norm": 4.0},
]


@pytest.mark.parametrize("options", PADDING_OPTIONS)
@pytest.mark.parametrize("junk", [NAN, INF, -INF, 1e30])
def test_garbage_on_masked_out_positions_changes_nothing(options, junk):
    torch.manual_seed(4)
    b = -torch.rand(2, 5, dtype=F64) * 2
    p = b + 0.5 * torch.randn(2, 5, dtype=F64)
    theta0 = p + 0.8 * torch.randn(2, 5, dtype=F64)  # some tokens clip, some weights exceed the cap
    adv = 2 * torch.randn(2, 5, dtype=F64)
    entropy = torch.rand(2, 5, dtype=F64)
    kl = torch.rand(2, 5, dtype=F64)
    mask = mt([0, 0, 1, 1, 1], [0, 1, 1, 0, 0])  # prompt in front, padding behind

    def run(fill):
        def dirty(x):
            return torch.where(mask, x, torch.full_like(x, fill)) if fill is not None else x

        theta = dirty(theta0).detach().clone().requires_grad_()
        spec = LossSpec(entropy_coef=0.01, kl_coef=0.1, **options)
        loss, terms = ppo_loss(theta, dirty(p), dirty(b), dirty(adv), mask, spec, entropy=dirty(entropy), kl=dirty(kl))
        loss.backward()
        return loss.detach(), theta.grad, terms

    clean_loss, clean_grad, clean_terms = run(None)
    loss, grad, terms = run(junk)
    assert torch.isfinite(loss)
    assert torch.equal(loss, clean_loss)
    assert torch.equal(grad, clean_grad)
    assert bool((grad[~mask] == 0).all())
    for name in ("ratio", "behav_weight", "pg"):
        assert torch.equal(getattr(terms, name)[mask], getattr(clean_terms, name)[mask]), name
    for name in ("mask", "clipped", "dual_clipped", "capped", "m2_dropped"):
        assert torch.equal(getattr(terms, name), getattr(clean_terms, name)), name


def test_coupled_ppo_is_the_decoupled_loss_with_p_equal_b():
    theta, _, b, adv = inputs([[1.1, 1.5, 0.5]], [[1.0, -1.0, 2.0]], weights=[[2.0, 0.5, 3.0]])
    mask = mt([1, 1, 1])
    coupled, terms = ppo_loss(theta, b, b, adv, mask)
    # with p = b, r = exp(theta - b) = 1.1 * 2, 1.5 * 0.5, 0.5 * 3 = 2.2, 0.75, 1.5 and w = 1
    torch.testing.assert_close(terms.ratio, bt([2.2, 0.75, 1.5]))
    torch.testing.assert_close(terms.behav_weight, bt([1.0, 1.0, 1.0]))
    # A = 1, r = 2.2 -> -1.2; A = -1, r = 0.75 -> max(0.75, 0.8) = 0.8; A = 2, r = 1.5 -> -2.4
    torch.testing.assert_close(coupled, torch.tensor((-1.2 + 0.8 - 2.4) / 3, dtype=F64))


# ----------------------------------------------------------------------------- the per-token bound of the default loss


@pytest.mark.parametrize("method", ["recompute", "loglinear", "linear", "reuse", "coupled"])
def test_default_loss_bounds_every_tokens_gradient_at_every_staleness(method):
    """|dloss/dtheta_t| x N <= max(c_clip, 1 + eps_high) x cap x |A_t| for every token, whatever theta, b and the
    recomputed p are and however stale the token is: with the defaults no token can dominate an update. Without
    the dual clip loglinear breaks it at d <= 1 (p = b, w = 1, the ratio of an A < 0 token unbounded)."""
    from a3po.algo.prox import proximal_logp
    from a3po.config.schema import ActorConfig

    cfg = ActorConfig()
    bound = max(cfg.c_clip, 1 + (cfg.eps_clip_higher or cfg.eps_clip)) * cfg.behav_imp_weight_cap
    gen = torch.Generator().manual_seed(0)
    v, n = 9, 4000
    versions = torch.randint(0, v + 1, (1, n), generator=gen)  # d = 0..9
    b = -torch.rand(1, n, generator=gen, dtype=F64) * 8
    theta = (b + (torch.rand(1, n, generator=gen, dtype=F64) - 0.3) * 12).clamp(max=0).requires_grad_()
    recomputed = (b + (torch.rand(1, n, generator=gen, dtype=F64) - 0.3) * 8).clamp(max=0)
    adv = torch.randn(1, n, generator=gen, dtype=F64) * 2
    mask = torch.ones_like(adv, dtype=torch.bool)

    def grads(c_clip):
        theta.grad = None
        p = b if method == "coupled" else proximal_logp(method, b, theta, versions, v, recomputed)
        cap = None if method == "coupled" else cfg.behav_imp_weight_cap
        loss, _ = ppo_loss(theta, p, b, adv, mask, LossSpec(eps_clip=cfg.eps_clip, eps_clip_higher=cfg.eps_clip_higher,
                           c_clip=c_clip, behav_imp_weight_cap=cap, behav_imp_weight_mode=cfg.behav_imp_weight_mode))
        loss.backward()
        return (theta.grad * n).abs()[0]

    g = grads(cfg.c_clip)
    assert (g <= bound * adv.abs()[0] + 1e-9).all()
    assert g.max() > 0.5  # tokens do train
    if method == "loglinear":
        unbounded = grads(None)
        low = (v - versions[0] <= 1) & (adv[0] < 0)
        assert (unbounded[low] > bound * adv.abs()[0][low]).any()


def test_loss_by_staleness_hand_values():
    from a3po.algo import loss_by_staleness
    from a3po.algo.loss import LossTerms

    z = torch.zeros(1, 5, dtype=F64)
    mask = torch.tensor([[True, True, True, True, False]])
    clipped = torch.tensor([[True, False, True, False, True]])
    capped = torch.tensor([[False, False, False, True, True]])
    none = mask & False
    truncated = torch.tensor([[False, True, False, False, True]])
    dropped = torch.tensor([[False, False, True, True, False]])
    terms = LossTerms(mask=mask, ratio=z, clipped=clipped, dual_clipped=none, behav_weight=z, capped=capped,
                      m2_dropped=none, pg=z, tis_truncated=truncated, corr_masked=dropped, opsm_masked=none,
                      seq_first=none, seq_truncated=none, seq_masked=none)
    d = torch.tensor([[0, 0, 3, 3, 0]])
    adv = bt([-1.0, 1.0, -1.0, -1.0, -1.0])
    coef = bt([0.2, -0.2, 0.5, 0.1, 9.0])  # the masked-out token's weight does not count
    out = loss_by_staleness(terms, d, adv, coef)
    assert out == pytest.approx({"loss/clipped_frac_d0": 0.5, "loss/behav_capped_frac_d0": 0.0,
                                 "loss/clipped_frac_d3": 0.5, "loss/behav_capped_frac_d3": 0.5,
                                 "loss/tis_truncated_frac_d0": 0.5, "loss/tis_truncated_frac_d3": 0.0,
                                 "loss/corr_masked_frac_d0": 0.0, "loss/corr_masked_frac_d3": 1.0,
                                 "loss/grad_share_neg_low_d": 0.2 / 1.0})

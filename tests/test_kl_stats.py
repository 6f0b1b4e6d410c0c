"""KL estimators (a3po.algo.kl), masked reductions (a3po.algo.masked), and the
per-step statistics (a3po.algo.stats).

What this file proves:
- k1, k2, k3 on x = +-log 2 by hand; k3 >= 0 everywhere (hypothesis); the gradient flows
  through theta only; NaN / -inf inputs give a finite estimate;
- KL in the reward subtracts kl_ctl times each sequence's masked KL sum;
- masked_min / masked_max / masked_mean on empty masks give 0, never NaN or an error;
- loss_stats' keys and values on a hand example, and that prompt / padding positions never
  count (extreme values there change no statistic);
- staleness_stats' mean and max over generated tokens; approx_error_stats grouped by d.

Run: .venv/bin/python -m pytest tests/test_kl_stats.py -q
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from a3po.algo import (
    LossSpec,
    approx_error_stats,
    approximation_errors,
    kl_in_reward,
    kl_penalty,
    loss_stats,
    mismatch_stats,
    ppo_loss,
    staleness_stats,
)
from a3po.algo.masked import masked_max, masked_mean, masked_min

F64 = torch.float64
INF = float("inf")
NAN = float("nan")
LOG2 = math.log(2.0)


def bt(*rows, dtype=F64) -> torch.Tensor:
    """A (B, T) float tensor from B lists of T numbers."""
    return torch.tensor(rows, dtype=dtype)


def mt(*rows) -> torch.Tensor:
    """A (B, T) bool mask from B lists of 0/1."""
    return torch.tensor(rows, dtype=torch.bool)


# ----------------------------------------------------------------------------- KL estimators


@pytest.mark.parametrize(
    "estimator, expected",
    [
        # x = theta - ref = +log 2, then -log 2
        ("k1", [LOG2, -LOG2]),  # x: 0.693147, -0.693147
        ("k2", [0.5 * LOG2**2, 0.5 * LOG2**2]),  # x^2 / 2 = 0.240227 both ways
        ("k3", [0.5 - 1 + LOG2, 2 - 1 - LOG2]),  # exp(-x) - 1 + x: 0.193147, 0.306853
    ],
)
def test_kl_estimators_hand_values(estimator, expected):
    theta = bt([LOG2 - 1.0, -LOG2 - 1.0])
    ref = bt([-1.0, -1.0])
    torch.testing.assert_close(kl_penalty(theta, ref, estimator), bt(expected))


def test_kl_gradient_flows_through_theta_only():
    theta = bt([LOG2, -LOG2]).requires_grad_()
    ref = bt([0.0, 0.0]).requires_grad_()
    kl_penalty(theta, ref, "k3").sum().backward()
    # d k3 / dx = 1 - exp(-x): at log 2 -> 1 - 0.5 = 0.5, at -log 2 -> 1 - 2 = -1
    torch.testing.assert_close(theta.grad, bt([0.5, -1.0]))
    assert ref.grad is None


def test_kl_unknown_estimator_raises():
    with pytest.raises(ValueError, match="k1, k2, k3"):
        kl_penalty(bt([0.0]), bt([0.0]), "k4")


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.floats(-1e6, 0.0), st.floats(-1e6, 0.0)), min_size=1, max_size=16))
def test_k3_and_k2_are_never_negative(pairs):
    theta = torch.tensor([[a for a, _ in pairs]])
    ref = torch.tensor([[b for _, b in pairs]])
    for est in ("k2", "k3"):
        kl = kl_penalty(theta, ref, est)
        assert torch.isfinite(kl).all()
        assert bool((kl >= 0).all()), (est, kl)


def test_kl_of_infinite_or_nan_inputs_is_finite():
    theta = bt([-INF, -INF, 0.0, NAN, -1e30])
    ref = bt([-INF, 0.0, -INF, 0.0, 0.0])
    for est in ("k1", "k2", "k3"):
        kl = kl_penalty(theta, ref, est)
        assert torch.isfinite(kl).all(), (est, kl)
        assert kl[0, 0] == 0 and kl[0, 3] == 0  # -inf - -inf and NaN count as x = 0


def test_kl_in_reward_subtracts_the_masked_sum():
    rewards = torch.tensor([1.0, 2.0], dtype=F64)
    kl = bt([0.1, 0.2, 5.0], [0.3, NAN, 0.4])  # 5.0 and NaN are on masked-out positions
    mask = mt([1, 1, 0], [1, 0, 1])
    # sums: 0.1 + 0.2 = 0.3 and 0.3 + 0.4 = 0.7; with kl_ctl 0.5: 1 - 0.15 = 0.85, 2 - 0.35 = 1.65
    torch.testing.assert_close(kl_in_reward(rewards, kl, mask, kl_ctl=0.5), torch.tensor([0.85, 1.65], dtype=F64))
    # the reward carries no gradient back into the KL
    kl_g = kl.clone().requires_grad_()
    assert not kl_in_reward(rewards, kl_g, mask, 0.5).requires_grad


# ----------------------------------------------------------------------------- masked reductions


def test_masked_min_max_mean_hand_values_and_empty_masks():
    x = bt([5.0, -2.0, 7.0], [NAN, 3.0, -INF])
    m = mt([1, 1, 0], [0, 1, 0])
    assert masked_min(x, m).item() == -2.0
    assert masked_max(x, m).item() == 5.0
    assert masked_mean(x, m).item() == 2.0  # (5 - 2 + 3) / 3
    none = torch.zeros_like(m)
    for f in (masked_min, masked_max, masked_mean):
        assert f(x, none).item() == 0.0


# ----------------------------------------------------------------------------- loss_stats


def stats_example(fill=None):
    """B=2, T=3: a prompt token at (0, 0) and padding at (1, 2), masked out.

    token   (0,1)  (0,2)  (1,0)  (1,1)
    r       1.5    1.0    0.5    1.1
    A       +1     +1     -1     -1
    w       2      1      0.5    4
    H       1      2      3      4
    """
    mask = mt([0, 1, 1], [1, 1, 0])
    b = bt([-1.0, -2.0, -0.7], [-1.5, -3.0, -0.2])
    log_w = bt([0.0, math.log(2.0), 0.0], [math.log(0.5), math.log(4.0), 0.0])
    log_r = bt([0.0, math.log(1.5), 0.0], [math.log(0.5), math.log(1.1), 0.0])
    adv = bt([0.0, 1.0, 1.0], [-1.0, -1.0, 0.0])
    entropy = bt([0.0, 1.0, 2.0], [3.0, 4.0, 0.0])
    p = b + log_w
    theta = p + log_r
    if fill is not None:  # extreme values on the positions the mask leaves out
        tensors = [theta, p, b, adv, entropy]
        theta, p, b, adv, entropy = (torch.where(mask, x, torch.full_like(x, fill)) for x in tensors)
    return theta, p, b, adv, mask, entropy


STATS_SPEC = LossSpec(eps_clip=0.2, c_clip=1.05, behav_imp_weight_cap=3.0, behav_imp_weight_mode="token_mask")


def test_loss_stats_hand_example():
    theta, p, b, adv, mask, entropy = stats_example()
    _, terms = ppo_loss(theta, p, b, adv, mask, STATS_SPEC)
    stats = loss_stats(terms, mask, theta, p, entropy)
    assert set(stats) == {
        "loss/ratio_mean", "loss/ratio_min", "loss/ratio_max", "loss/clipped_frac", "loss/dual_clipped_frac",
        "loss/behav_weight_mean", "loss/behav_weight_max", "loss/behav_capped_frac", "loss/m2_dropped_frac",
        "loss/approx_kl", "loss/entropy", "loss/tis_truncated_frac", "loss/tis_truncated_seq_frac",
        "loss/corr_masked_frac", "loss/corr_masked_seq_frac", "loss/opsm_masked_seq_frac",
    }
    assert all(isinstance(v, float) for v in stats.values())
    expected = {
        "loss/ratio_mean": (1.5 + 1.0 + 0.5 + 1.1) / 4,  # 1.025
        "loss/ratio_min": 0.5,
        "loss/ratio_max": 1.5,
        # (0,1): A > 0, r = 1.5 > 1.2 clipped; (1,0): A < 0, r = 0.5 < 0.8 clipped -> 2 / 4
        "loss/clipped_frac": 0.5,
        # (1,1): A = -1, r = 1.1: max(1.1, 1.1) = 1.1 > -c A = 1.05 -> 1 / 4
        "loss/dual_clipped_frac": 0.25,
        "loss/behav_weight_mean": (2 + 1 + 0.5 + 4) / 4,  # 1.875
        "loss/behav_weight_max": 4.0,
        "loss/behav_capped_frac": 0.25,  # w = 4 > cap 3
        "loss/m2_dropped_frac": 0.0,
        # mean(p - theta) = -mean(log r) = -(0.405465 + 0 - 0.693147 + 0.095310) / 4 = 0.048093
        "loss/approx_kl": -(math.log(1.5) + math.log(0.5) + math.log(1.1)) / 4,
        "loss/entropy": (1 + 2 + 3 + 4) / 4,  # 2.5
        # no off-policy correction in STATS_SPEC: none truncates or masks anything
        "loss/tis_truncated_frac": 0.0, "loss/tis_truncated_seq_frac": 0.0, "loss/corr_masked_frac": 0.0,
        "loss/corr_masked_seq_frac": 0.0, "loss/opsm_masked_seq_frac": 0.0,
    }
    for key, value in expected.items():
        assert stats[key] == pytest.approx(value, rel=1e-12, abs=1e-12), key


def test_loss_stats_without_entropy_has_no_entropy_key():
    theta, p, b, adv, mask, _ = stats_example()
    _, terms = ppo_loss(theta, p, b, adv, mask)
    assert "loss/entropy" not in loss_stats(terms, mask, theta, p)


@pytest.mark.parametrize("fill", [NAN, INF, -INF, 1e30, -1e30])
def test_loss_stats_ignore_prompt_and_padding_positions(fill):
    clean = stats_example()
    dirty = stats_example(fill)
    stats = []
    for theta, p, b, adv, mask, entropy in (clean, dirty):
        _, terms = ppo_loss(theta, p, b, adv, mask, STATS_SPEC)
        stats.append(loss_stats(terms, mask, theta, p, entropy))
    assert stats[0] == stats[1]
    assert all(math.isfinite(v) for v in stats[1].values())


def test_loss_stats_m2_dropped_frac_counts_over_the_loss_mask():
    # (b - p)^2 on the four tokens: log w^2 = 0.480453 (w = 2), 0, 0.480453 (w = 0.5), 1.921812 (w = 4)
    # mean 0.720680 > 0.5; without the 1.92: 0.960906 / 3 = 0.320302 <= 0.5 -> token (1,1) dropped
    theta, p, b, adv, mask, entropy = stats_example()
    _, terms = ppo_loss(theta, p, b, adv, mask, LossSpec(m2_threshold=0.5))
    stats = loss_stats(terms, mask, theta, p, entropy)
    assert stats["loss/m2_dropped_frac"] == pytest.approx(0.25)
    # the other stats now run over the three kept tokens
    assert stats["loss/ratio_mean"] == pytest.approx((1.5 + 1.0 + 0.5) / 3)
    assert stats["loss/behav_weight_max"] == pytest.approx(2.0)
    assert stats["loss/entropy"] == pytest.approx((1 + 2 + 3) / 3)


def test_loss_stats_on_an_empty_mask_are_zero_not_nan():
    theta, p, b, adv, _, entropy = stats_example()
    none = torch.zeros(2, 3, dtype=torch.bool)
    _, terms = ppo_loss(theta, p, b, adv, none)
    stats = loss_stats(terms, none, theta, p, entropy)
    assert all(v == 0.0 for v in stats.values()), stats


# ----------------------------------------------------------------------------- staleness_stats


def test_staleness_stats_mean_and_max_over_generated_tokens():
    versions = torch.tensor([[-1, 3, 2], [4, 4, -1]])
    mask = mt([1, 1, 1], [1, 1, 0])  # the prompt token at (0, 0) is in the mask but never counts
    # current 5: d = 2, 3, 1, 1 -> mean 7 / 4 = 1.75, max 3; shares of d = 0..4: 0, 2/4, 1/4, 1/4, 0
    assert staleness_stats(versions, 5, mask, eta=4) == {
        "stale/mean": 1.75, "stale/max": 3.0,
        "stale/frac_d0": 0.0, "stale/frac_d1": 0.5, "stale/frac_d2": 0.25, "stale/frac_d3": 0.25, "stale/frac_d4": 0.0,
    }
    # nothing generated: 0 everywhere, and every d up to eta still has its key
    assert staleness_stats(versions, 5, torch.zeros_like(mask), eta=1) == {
        "stale/mean": 0.0, "stale/max": 0.0, "stale/frac_d0": 0.0, "stale/frac_d1": 0.0}


def test_mismatch_stats_on_fresh_tokens_only():
    theta = torch.tensor([[-1.0, -2.0, -0.5], [-3.0, -1.0, 0.0]])
    behav = torch.tensor([[-1.5, -2.0, -9.0], [-3.0, -0.5, 0.0]])
    fresh = mt([1, 1, 0], [0, 1, 0])  # the 8.5 gap at (0, 2) is a stale token: it must not count
    out = mismatch_stats(theta, behav, fresh)
    # gaps theta - b: 0.5, 0.0, -0.5 -> |.| mean 1/3, max 0.5
    # k3 = exp(x) - 1 - x: x = 0.5 -> 0.148721, 0 -> 0, -0.5 -> 0.106531; mean 0.085084
    assert out["mismatch/abs_mean"] == pytest.approx(1 / 3)
    assert out["mismatch/abs_max"] == pytest.approx(0.5)
    assert out["mismatch/k3"] == pytest.approx((math.exp(0.5) - 1.5 + math.exp(-0.5) - 0.5) / 3, rel=1e-6)
    assert out["mismatch/tokens"] == 3
    assert mismatch_stats(theta, behav, torch.zeros_like(fresh)) == {}


# ----------------------------------------------------------------------------- approx_error_stats


def test_approx_error_stats_grouped_by_staleness():
    # current 3: versions 2, 1, 1 -> d = 1, 2, 2; the last token is padding
    # b = -2, theta = -0.5, truth = -1, -2, -1
    # loglinear p_hat: d = 1 -> b = -2; d = 2 -> -2 + 0.5 * 1.5 = -1.25
    # abs errors: |-2 - -1| = 1, |-1.25 - -2| = 0.75 -> all 0.875, d1 1.0, d2 0.75
    # behav p_hat = -2: |-2 - -1| = 1, |-2 - -2| = 0 -> all 0.5, d1 1.0, d2 0.0
    b = bt([-2.0, -2.0, -2.0])
    theta = bt([-0.5, -0.5, -0.5])
    truth = bt([-1.0, -2.0, -1.0])
    versions = torch.tensor([[2, 1, 1]])
    mask = mt([1, 1, 0])
    errors = approximation_errors(truth, b, theta, versions, 3)
    stats = approx_error_stats(errors, mask, versions, 3)

    expected_keys = {
        f"prox_err/{name}/{kind}{suffix}"
        for name in ("loglinear", "linear", "behav")
        for kind in ("abs", "rel", "sq", "iw")
        for suffix in ("", "/d1", "/d2")
    }
    expected_keys |= {"prox_err/tokens/d1", "prox_err/tokens/d2"}
    assert set(stats) == expected_keys  # no d0, no d3: only staleness present in the mask
    assert (stats["prox_err/tokens/d1"], stats["prox_err/tokens/d2"]) == (1.0, 1.0)
    assert stats["prox_err/loglinear/abs"] == pytest.approx(0.875)
    assert stats["prox_err/loglinear/abs/d1"] == pytest.approx(1.0)
    assert stats["prox_err/loglinear/abs/d2"] == pytest.approx(0.75)
    assert stats["prox_err/loglinear/sq/d2"] == pytest.approx(0.5625)  # 0.75^2
    assert stats["prox_err/behav/abs"] == pytest.approx(0.5)
    assert stats["prox_err/behav/abs/d2"] == pytest.approx(0.0)
    # iw at d2 for loglinear: |exp(-1.25 + 2) - exp(-2 + 2)| = exp(0.75) - 1 = 1.117000
    assert stats["prox_err/loglinear/iw/d2"] == pytest.approx(math.exp(0.75) - 1)

    # without versions: only the overall means
    plain = approx_error_stats(errors, mask)
    assert set(plain) == {k for k in expected_keys if "/d" not in k}
    assert not any(k.startswith("prox_err/tokens") for k in plain)
    assert plain["prox_err/loglinear/abs"] == stats["prox_err/loglinear/abs"]

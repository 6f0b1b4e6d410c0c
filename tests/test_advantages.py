"""Rewards to advantages (a3po.algo.advantages): shaping, GRPO / Dr.GRPO / RLOO / batch
normalisation.

What this file proves:
- each estimator on hand-computed rewards (unbiased std, eps, leave-one-out baseline); with
  group baselines a batch std is the std of the group-centred values;
- degenerate groups (size 1, all rewards equal) give 0, never NaN, and a group of one under
  a batch baseline is not divided by eps; bad shapes and level names are refused;
- reward shaping is (r + bias) * scaling then clip.

Run: .venv/bin/python -m pytest tests/test_advantages.py -q
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from a3po.algo import normalize_advantages, shape_rewards


def vec(*xs) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.float32)


def close(actual, expected, tol=1e-6):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), rtol=0, atol=tol)


# ----------------------------------------------------------------------------- shaping


def test_shape_rewards_bias_then_scale_then_clip():
    r = vec(-3.0, 0.5, 2.0)
    # (r + 1) * 2 = (-2) * 2, 1.5 * 2, 3 * 2 = -4, 3, 6
    close(shape_rewards(r, scaling=2.0, bias=1.0), [-4.0, 3.0, 6.0])
    # ... then clipped to [-5, 5]
    close(shape_rewards(r, scaling=2.0, bias=1.0, clip=5.0), [-4.0, 3.0, 5.0])
    # clip applies on both sides: [-3, 0.5, 2] -> [-1, 0.5, 1]
    close(shape_rewards(r, clip=1.0), [-1.0, 0.5, 1.0])
    assert torch.equal(shape_rewards(r), r)  # identity by default


# ----------------------------------------------------------------------------- group estimators

R = vec(1.0, 0.0, 0.0, 1.0)


def test_grpo_groups_of_two():
    # group [1, 0]: mean 0.5, unbiased std sqrt((0.25 + 0.25) / 1) = 0.707107
    # A = +-0.5 / (0.707107 + 1e-5) = +-0.707097
    a = normalize_advantages(R, group_size=2)
    s = 0.5 / (math.sqrt(0.5) + 1e-5)
    close(a, [s, -s, -s, s])


def test_grpo_groups_of_four_uses_the_unbiased_std():
    # group [1, 0, 0, 1]: mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = sqrt(1/3) = 0.577350
    # (the biased std would be 0.5 and give +-1)
    a = normalize_advantages(R, group_size=4)
    s = 0.5 / (math.sqrt(1 / 3) + 1e-5)  # 0.866010
    close(a, [s, -s, -s, s])


def test_grpo_eps_is_added_to_the_std():
    # eps = 1: A = 0.5 / (sqrt(1/3) + 1) = 0.5 / 1.577350 = 0.316987
    a = normalize_advantages(R, group_size=4, eps=1.0)
    s = 0.5 / (math.sqrt(1 / 3) + 1.0)
    close(a, [s, -s, -s, s])


def test_dr_grpo_centres_without_dividing():
    # groups [1, 0] and [0, 1], mean 0.5 each: A = r - 0.5
    close(normalize_advantages(R, group_size=2, std_level="none"), [0.5, -0.5, -0.5, 0.5])
    # a reward scale survives: [3, 1] -> mean 2 -> [1, -1]
    close(normalize_advantages(vec(3.0, 1.0), group_size=2, std_level="none"), [1.0, -1.0])


def test_rloo_groups_of_two():
    # leave-one-out baseline in a group of two is the other reward: [1-0, 0-1], [0-1, 1-0]
    a = normalize_advantages(R, group_size=2, std_level="none", mean_leave1out=True)
    close(a, [1.0, -1.0, -1.0, 1.0])


def test_rloo_groups_of_four():
    # sum = 2; baseline_i = (2 - r_i) / 3: r = 1 -> 1/3, r = 0 -> 2/3
    # A = 1 - 1/3 = 2/3, 0 - 2/3 = -2/3
    a = normalize_advantages(R, group_size=4, std_level="none", mean_leave1out=True)
    close(a, [2 / 3, -2 / 3, -2 / 3, 2 / 3])


def test_rloo_is_a_rescaled_dr_grpo():
    # r_i - (S - r_i)/(n-1) = n/(n-1) * (r_i - S/n): with n = 3, RLOO = 1.5 * Dr.GRPO
    r = vec(0.2, 1.0, 0.6, 0.9, 0.1, 0.5)
    rloo = normalize_advantages(r, group_size=3, std_level="none", mean_leave1out=True)
    dr = normalize_advantages(r, group_size=3, std_level="none")
    torch.testing.assert_close(rloo, 1.5 * dr)


def test_batch_normalisation_ignores_groups():
    # [1, 2, 3, 4]: mean 2.5, unbiased std sqrt((2.25 + 0.25 + 0.25 + 2.25) / 3) = sqrt(5/3) = 1.290994
    a = normalize_advantages(vec(1.0, 2.0, 3.0, 4.0), group_size=2, mean_level="batch", std_level="batch")
    s = math.sqrt(5 / 3) + 1e-5
    close(a, [-1.5 / s, -0.5 / s, 0.5 / s, 1.5 / s])


def test_group_mean_with_batch_std_divides_by_the_spread_of_the_centred_values():
    # groups [1, 2], [3, 5] centred on their means 1.5 and 4: [-0.5, 0.5, -1, 1]. The batch std is the
    # std of these centred values: mean 0, sum sq = 0.25 + 0.25 + 1 + 1 = 2.5, / 3 -> sqrt(0.833333) = 0.912871
    # (the raw rewards' batch std, sqrt(8.75 / 3) = 1.707825, would also count the spread between the groups'
    # means, which the group baseline has already removed)
    a = normalize_advantages(vec(1.0, 2.0, 3.0, 5.0), group_size=2, mean_level="group", std_level="batch")
    s = math.sqrt(2.5 / 3) + 1e-5
    close(a, [-0.5 / s, 0.5 / s, -1 / s, 1 / s])


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"std_level": "none"}, {"std_level": "none", "mean_leave1out": True}, {"mean_leave1out": True}],
)
def test_group_of_one_gives_zero_not_nan(kwargs):
    a = normalize_advantages(vec(3.0, -2.0, 7.0), group_size=1, **kwargs)
    assert torch.equal(a, torch.zeros(3))


def test_group_of_one_under_a_batch_baseline_is_not_divided():
    # batch mean (3 - 2 + 7) / 3 = 8/3: centred [1/3, -14/3, 13/3]. A group of one has no spread, so its std
    # counts as 1: A = c / (1 + eps). As 0 it divided by eps = 1e-5 and gave -466,667 and 433,333
    a = normalize_advantages(vec(3.0, -2.0, 7.0), group_size=1, mean_level="batch", std_level="group")
    s = 1 + 1e-5
    close(a, [1 / 3 / s, -14 / 3 / s, 13 / 3 / s])
    # the same for a batch of one sequence under a batch std, without a baseline: 3 / (1 + eps)
    close(normalize_advantages(vec(3.0), group_size=1, mean_level="none", std_level="batch"), [3.0 / s])


@pytest.mark.parametrize("kwargs", [{}, {"std_level": "none"}, {"std_level": "none", "mean_leave1out": True}])
def test_all_equal_group_gives_zero(kwargs):
    a = normalize_advantages(vec(2.0, 2.0, 2.0, 5.0, 5.0, 5.0), group_size=3, **kwargs)
    assert not a.isnan().any()
    close(a, [0.0] * 6)


def test_batch_not_divisible_by_group_size_raises():
    with pytest.raises(ValueError, match="group"):
        normalize_advantages(vec(1.0, 0.0, 1.0), group_size=2)


@pytest.mark.parametrize("kwargs", [{"mean_level": "token"}, {"std_level": "global"}])
def test_unknown_level_raises(kwargs):
    with pytest.raises(ValueError, match="allowed"):
        normalize_advantages(R, group_size=2, **kwargs)


def grouped_rewards(values):
    """(group_size, rewards) with a whole number of groups of 2..6."""
    return st.integers(min_value=2, max_value=6).flatmap(
        lambda n: st.tuples(
            st.just(n),
            st.lists(values, min_size=n, max_size=4 * n).map(lambda xs: xs[: len(xs) - len(xs) % n]),
        )
    )


@settings(max_examples=60, deadline=None)
@given(grouped_rewards(st.floats(min_value=-10, max_value=10)))
def test_dr_grpo_and_rloo_advantages_per_group(case):
    # summing to zero holds for any centring, so each baseline is checked by its own value:
    # Dr. GRPO subtracts the group mean, RLOO the mean of the other n - 1 rewards
    n, rewards = case
    r = torch.tensor(rewards, dtype=torch.float64).view(-1, n)
    tol = 1e-5 * (1 + float(r.abs().max()))
    mean = r.mean(-1, keepdim=True)
    others = (r.sum(-1, keepdim=True) - r) / (n - 1)
    for kwargs, expected in (({"std_level": "none"}, r - mean),
                             ({"std_level": "none", "mean_leave1out": True}, r - others)):
        a = normalize_advantages(r.flatten().float(), group_size=n, **kwargs).view(-1, n).double()
        torch.testing.assert_close(a, expected, rtol=0, atol=tol, msg=str(kwargs))
        assert bool((a.sum(-1).abs() <= tol * n).all()), kwargs


@settings(max_examples=60, deadline=None)
@given(grouped_rewards(st.sampled_from([0.0, 0.25, 0.5, 1.0])))
def test_grpo_advantages_sum_to_zero_and_have_unit_std_per_group(case):
    # verifiable-reward style values: a group is either all equal or has std >= 0.14
    n, rewards = case
    a = normalize_advantages(torch.tensor(rewards), group_size=n).view(-1, n)
    assert torch.isfinite(a).all()
    torch.testing.assert_close(a.sum(-1), torch.zeros(a.shape[0]), rtol=0, atol=1e-5)
    spread = torch.tensor(rewards).view(-1, n).std(-1) > 0
    # unbiased std of (r - m) / (s + eps) is s / (s + eps), i.e. 1 up to eps / s <= 1e-4
    if spread.any():
        torch.testing.assert_close(a[spread].std(-1), torch.ones(int(spread.sum())), rtol=0, atol=1e-4)
    assert bool((a[~spread] == 0).all())  # all-equal groups: exactly 0


@pytest.mark.parametrize("value, n", [(0.7, 8), (0.1, 16), (6.227503627083578, 3)])
def test_grpo_all_equal_non_dyadic_group_gives_zero(value, n):
    # a float32 mean is off by an ulp for non-dyadic rewards, and / (0 + eps) blows that up
    # (0.7 x 8 gave 0.0059 each); the mean is taken in float64, where it is exact
    a = normalize_advantages(torch.full((n,), value), group_size=n)
    torch.testing.assert_close(a, torch.zeros(n), rtol=0, atol=1e-6)

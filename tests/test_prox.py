"""Proximal log-probs (a3po.algo.prox) and the docs/design.md §5 invariants that follow from them.

What this file proves, with hand-computed values where the arithmetic is short:
- staleness d = v - version (0 on prompt tokens) and the weight lambda = (d - 1) / d;
- each method's p_t (recompute, loglinear, linear, reuse, metrics) and the method table;
- d <= 1 is exactly coupled PPO (bitwise, loss and gradient);
- loglinear keeps r_t * w_t = exp(theta_t - b_t); p_t lies between b_t and theta_t;
- prompt tokens keep p = b; p never carries gradient; the gradient of the loss flows
  only through theta (gradcheck, and "p as a constant" gives the same gradient);
- -inf / huge log-probs never give NaN, neither in p nor in the loss built on it;
- the per-token approximation errors of the `metrics` method.

Run: .venv/bin/python -m pytest tests/test_prox.py -q
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from a3po.algo import (
    PROX_METHODS,
    LossSpec,
    approximation_errors,
    get_method,
    interpolation_weight,
    ppo_loss,
    proximal_logp,
    staleness,
)

INF = float("inf")
NAN = float("nan")


def bt(*rows, dtype=torch.float32) -> torch.Tensor:
    """A (B, T) float tensor from B lists of T numbers."""
    return torch.tensor(rows, dtype=dtype)


def vt(*rows) -> torch.Tensor:
    """A (B, T) int64 tensor of token versions (-1 on prompt tokens)."""
    return torch.tensor(rows, dtype=torch.long)


def mt(*rows) -> torch.Tensor:
    """A (B, T) bool mask from B lists of 0/1."""
    return torch.tensor(rows, dtype=torch.bool)


# ----------------------------------------------------------------------------- staleness


def test_staleness_is_current_minus_version_and_zero_on_prompt():
    versions = vt([-1, -1, 3, 5, 2], [0, 1, 4, 5, -1])
    d = staleness(versions, current_version=5)
    # generated: 5-3=2, 5-5=0, 5-2=3, 5-0=5, 5-1=4, 5-4=1, 5-5=0; prompt (-1): 0
    assert torch.equal(d, vt([0, 0, 2, 0, 3], [5, 4, 1, 0, 0]))


def test_staleness_refuses_a_version_newer_than_current():
    with pytest.raises(ValueError, match="newer"):
        staleness(vt([-1, 2, 6]), current_version=5)


def test_interpolation_weight_hand_values_for_d_0_to_4():
    # current 5: versions -1 (prompt), 5, 4, 3, 2, 1 -> d = 0(prompt), 0, 1, 2, 3, 4
    lam = interpolation_weight(vt([-1, 5, 4, 3, 2, 1]), current_version=5, dtype=torch.float64)
    expected = bt([0.0, 0.0, 0.0, 1 / 2, 2 / 3, 3 / 4], dtype=torch.float64)  # (d-1)/d: 0/1, 1/2, 2/3, 3/4
    torch.testing.assert_close(lam, expected, rtol=0, atol=1e-15)
    assert lam.dtype == torch.float64


def test_interpolation_weight_refuses_future_versions():
    with pytest.raises(ValueError):
        interpolation_weight(vt([7]), current_version=3)


# ----------------------------------------------------------------------------- the method table


def test_method_table_names_and_flags():
    assert set(PROX_METHODS) == {"recompute", "loglinear", "linear", "reuse", "metrics"}
    # only recompute and metrics pay the extra forward pass; only reuse is single-step-only
    assert {n for n, m in PROX_METHODS.items() if m.needs_recompute} == {"recompute", "metrics"}
    assert {n for n, m in PROX_METHODS.items() if m.single_step_only} == {"reuse"}
    assert get_method("loglinear").name == "loglinear"


def test_unknown_method_raises_and_lists_allowed_names():
    b = bt([-1.0])
    with pytest.raises(ValueError) as err:
        proximal_logp("log-linear", b, b, vt([0]), 0)
    msg = str(err.value)
    assert "log-linear" in msg
    for name in ("recompute", "loglinear", "linear", "reuse", "metrics"):
        assert name in msg


# ----------------------------------------------------------------------------- hand values per method


@pytest.mark.parametrize("method", ["recompute", "metrics"])
def test_recompute_and_metrics_return_the_recomputed_logp(method):
    b, theta = bt([-2.0, -1.0, -3.0]), bt([-1.0, -0.5, -2.0])
    recomputed = bt([-1.7, -0.9, -2.5])
    p = proximal_logp(method, b, theta, vt([-1, 3, 1]), 3, logp_recomputed=recomputed)
    assert torch.equal(p, recomputed)  # every token, prompt included: it is the truth


@pytest.mark.parametrize("method", ["recompute", "metrics"])
def test_recompute_and_metrics_need_the_recomputed_logp(method):
    b = bt([-2.0])
    with pytest.raises(ValueError, match="recompute"):
        proximal_logp(method, b, b, vt([0]), 1)


def test_loglinear_hand_values():
    # d: 2 -> lam 1/2: p = -2 + 1/2 * (-1 - -2) = -1.5
    #    3 -> lam 2/3: p = -2 + 2/3 * (-0.5 - -2) = -2 + 1.0 = -1.0
    #    4 -> lam 3/4: p = -4 + 3/4 * (0 - -4) = -4 + 3 = -1.0
    #    1 -> lam 0:   p = b = -3
    b = bt([-2.0, -2.0, -4.0, -3.0], dtype=torch.float64)
    theta = bt([-1.0, -0.5, 0.0, -1.0], dtype=torch.float64)
    p = proximal_logp("loglinear", b, theta, vt([3, 2, 1, 4]), 5)
    torch.testing.assert_close(p, bt([-1.5, -1.0, -1.0, -3.0], dtype=torch.float64), rtol=0, atol=1e-12)


def test_linear_hand_values():
    # d = 2, lam = 1/2: p = log(1/2 * 0.2 + 1/2 * 0.6) = log(0.4)
    # d = 4, lam = 3/4: p = log(1/4 * 0.2 + 3/4 * 0.6) = log(0.05 + 0.45) = log(0.5)
    # d = 1: p = b = log(0.2)
    b = bt([math.log(0.2)] * 3, dtype=torch.float64)
    theta = bt([math.log(0.6)] * 3, dtype=torch.float64)
    p = proximal_logp("linear", b, theta, vt([2, 0, 3]), 4)
    expected = bt([math.log(0.4), math.log(0.5), math.log(0.2)], dtype=torch.float64)
    torch.testing.assert_close(p, expected, rtol=0, atol=1e-12)


def test_reuse_returns_theta_detached():
    theta = bt([-1.0, -0.25, -3.0]).requires_grad_()
    p = proximal_logp("reuse", bt([-2.0, -2.0, -2.0]), theta, vt([-1, 0, 7]), 9)
    assert torch.equal(p, theta.detach())
    assert not p.requires_grad


@pytest.mark.parametrize("method", sorted(PROX_METHODS))
def test_proximal_logp_never_requires_grad(method):
    b = bt([-2.0, -1.0, -0.5]).requires_grad_()
    theta = bt([-1.0, -1.5, -0.7]).requires_grad_()
    recomputed = bt([-1.2, -1.1, -0.6]).requires_grad_()
    p = proximal_logp(method, b, theta, vt([-1, 1, 3]), 4, logp_recomputed=recomputed)
    assert not p.requires_grad
    assert p.grad_fn is None


# ----------------------------------------------------------------------------- d <= 1 is coupled PPO


@pytest.mark.parametrize("method", ["loglinear", "linear"])
def test_d_at_most_one_gives_p_equal_b_bitwise(method):
    torch.manual_seed(0)
    b = -torch.rand(3, 5) * 4
    theta = -torch.rand(3, 5) * 4
    versions = torch.tensor([[-1, -1, 6, 7, 7], [-1, 7, 7, 6, 6], [6, 6, 6, 7, -1]])  # d in {0, 1}, prompts
    p = proximal_logp(method, b, theta, versions, 7)
    assert torch.equal(p, b)


@pytest.mark.parametrize("method", ["loglinear", "linear"])
@pytest.mark.parametrize(
    "options",
    [
        {},
        {"eps_clip": 0.2, "eps_clip_higher": 0.28, "c_clip": 3.0},
        {"behav_imp_weight_cap": 2.0, "behav_imp_weight_mode": "token_truncate"},
        {"importance_sampling_level": "sequence", "agg_mode": "seq-mean-token-mean"},
    ],
)
def test_d_at_most_one_loss_and_grad_equal_coupled_ppo_exactly(method, options):
    torch.manual_seed(1)
    b = -torch.rand(2, 6) * 3
    theta0 = b + 0.6 * torch.randn(2, 6)  # some tokens clip, some do not
    adv = torch.randn(2, 6)
    mask = mt([0, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1])
    versions = vt([-1, 4, 4, 3, 3, -1], [-1, -1, 3, 4, 4, 3])  # current 4: d in {0, 1}

    theta_a = theta0.clone().requires_grad_()
    p = proximal_logp(method, b, theta_a, versions, 4)
    loss_a, terms_a = ppo_loss(theta_a, p, b, adv, mask, LossSpec(**options))
    loss_a.backward()

    theta_b = theta0.clone().requires_grad_()
    loss_b, terms_b = ppo_loss(theta_b, b, b, adv, mask, LossSpec(**options))  # coupled: p = b
    loss_b.backward()

    assert torch.equal(loss_a, loss_b)
    assert torch.equal(theta_a.grad, theta_b.grad)
    assert torch.equal(terms_a.ratio, terms_b.ratio)
    assert torch.equal(terms_a.behav_weight, torch.ones_like(b))  # w = exp(b - b) = 1 exactly
    assert theta_a.grad.abs().sum() > 0  # the equality is not between two zero gradients


# ----------------------------------------------------------------------------- invariants (hypothesis)

logp = st.floats(min_value=-15.0, max_value=0.0, allow_nan=False, allow_infinity=False)
token = st.tuples(logp, logp, st.integers(min_value=-1, max_value=8))  # (b, theta, version)


def _columns(tokens):
    b = torch.tensor([[t[0] for t in tokens]])
    theta = torch.tensor([[t[1] for t in tokens]])
    versions = torch.tensor([[t[2] for t in tokens]])
    return b, theta, versions


@settings(max_examples=80, deadline=None)
@given(st.lists(token, min_size=1, max_size=12), st.integers(min_value=8, max_value=12))
def test_loglinear_ratio_times_weight_is_exp_theta_minus_b(tokens, current):
    b, theta, versions = _columns(tokens)
    p = proximal_logp("loglinear", b, theta, versions, current)
    # straight from p:  exp(theta - p) * exp(p - b) = exp(theta - b)
    torch.testing.assert_close(torch.exp(theta - p) * torch.exp(p - b), torch.exp(theta - b), rtol=1e-4, atol=0)
    # and as the loss sees it (|theta - b| <= 15 < the log-ratio clamp of 20, no cap)
    mask = torch.ones_like(b, dtype=torch.bool)
    _, terms = ppo_loss(theta, p, b, torch.ones_like(b), mask)
    torch.testing.assert_close(terms.ratio * terms.behav_weight, torch.exp(theta - b), rtol=1e-4, atol=0)


@settings(max_examples=100, deadline=None)
@given(
    st.sampled_from(["loglinear", "linear"]),
    st.lists(token, min_size=1, max_size=12),
    st.integers(min_value=8, max_value=12),
)
def test_proximal_lies_between_behaviour_and_current(method, tokens, current):
    b, theta, versions = _columns(tokens)
    p = proximal_logp(method, b, theta, versions, current)
    lo, hi = torch.minimum(b, theta), torch.maximum(b, theta)
    tol = 1e-5 * (1 + hi.abs().maximum(lo.abs()))  # float32 rounding of the interpolation
    assert bool((p >= lo - tol).all()) and bool((p <= hi + tol).all())
    # prompt tokens (version -1) and fresh tokens keep p = b exactly
    untouched = (versions < 0) | (versions >= current - 1)
    assert torch.equal(p[untouched], b[untouched])


@pytest.mark.parametrize("method", ["loglinear", "linear"])
def test_prompt_tokens_are_untouched(method):
    # b far below theta on a prompt token: any leak of theta (even weighted 1e-30) would show
    b = bt([-2.0, -90.0, -1.0, -2.0, -90.0])
    theta = bt([-0.1, -0.2, -0.3, -1.0, -0.2])
    versions = vt([-1, -1, 0, 0, 10])  # two prompt tokens, two tokens of staleness 10, one of 0
    p = proximal_logp(method, b, theta, versions, 10)
    assert torch.equal(p[:, :2], b[:, :2])
    assert torch.equal(p[:, 4:], b[:, 4:])
    assert bool((p[:, 2:4] != b[:, 2:4]).all())  # and the stale generated ones did move


# ----------------------------------------------------------------------------- -inf and huge values

EXTREMES = [-INF, -1e30, -1e4, -50.0, -1.0, 0.0]


@pytest.mark.parametrize("method", ["loglinear", "linear"])
def test_extreme_logps_give_no_nan_in_p(method):
    pairs = [(b, t) for b in EXTREMES for t in EXTREMES]
    b = torch.tensor([[x for x, _ in pairs] * 3])
    theta = torch.tensor([[y for _, y in pairs] * 3])
    versions = torch.tensor([[5] * len(pairs) + [3] * len(pairs) + [-1] * len(pairs)])  # d = 0, 2, prompt
    p = proximal_logp(method, b, theta, versions, 5)
    assert not p.isnan().any()
    assert not (p == INF).any()
    # prompt and fresh (d = 0) tokens keep p = b exactly, whatever theta is
    fresh = (versions == 5) | (versions == -1)
    assert torch.equal(p[fresh], b[fresh])
    # p may be -inf only where an input is -inf
    assert bool(((p == -INF) <= ((b == -INF) | (theta == -INF))).all())
    if method == "linear":
        # a mixture of probabilities is -inf only when both parts are
        stale = versions == 3
        assert bool(((p == -INF) & stale).eq((b == -INF) & (theta == -INF) & stale).all())


extreme_logp = st.one_of(
    st.floats(min_value=-30.0, max_value=0.0),
    st.sampled_from([-INF, -1e30, -1e4, -1e-30, 0.0]),
)
garbage = st.sampled_from([NAN, INF, -INF, 1e30, -1e30, 0.0])


@settings(max_examples=100, deadline=None)
@given(
    method=st.sampled_from(["loglinear", "linear"]),
    tokens=st.lists(
        st.tuples(
            extreme_logp,  # b
            extreme_logp,  # theta
            st.integers(min_value=-1, max_value=4),  # version
            st.floats(min_value=-5.0, max_value=5.0),  # advantage
            st.booleans(),  # in the loss mask
            garbage,  # what padding holds where the mask is off
        ),
        min_size=1,
        max_size=10,
    ),
    options=st.sampled_from(
        [
            {},
            {"eps_clip_higher": 0.28, "c_clip": 3.0},
            {"behav_imp_weight_cap": 5.0, "behav_imp_weight_mode": "token_mask"},
            {"behav_imp_weight_cap": 5.0, "behav_imp_weight_mode": "sequence_truncate"},
            {"importance_sampling_level": "sequence", "agg_mode": "seq-mean-token-mean"},
            {"m2_threshold": 0.5},
        ]
    ),
)
def test_loss_on_extreme_logps_is_finite_with_finite_grad(method, tokens, options):
    b = torch.tensor([[t[0] for t in tokens]])
    theta0 = torch.tensor([[t[1] for t in tokens]])
    versions = torch.tensor([[t[2] for t in tokens]])
    adv = torch.tensor([[t[3] for t in tokens]])
    mask = torch.tensor([[t[4] for t in tokens]])
    junk = torch.tensor([[t[5] for t in tokens]])
    p = proximal_logp(method, b, theta0, versions, 4)
    assert not p.isnan().any()

    # masked-out positions hold garbage in every input, as padding may
    theta = torch.where(mask, theta0, junk).requires_grad_()
    p_in = torch.where(mask, p, junk)
    b_in = torch.where(mask, b, junk)
    adv_in = torch.where(mask, adv, junk)
    loss, terms = ppo_loss(theta, p_in, b_in, adv_in, mask, LossSpec(**options))
    loss.backward()
    assert torch.isfinite(loss)
    assert torch.isfinite(theta.grad).all()
    assert bool((theta.grad[~mask] == 0).all())  # padding gets no gradient
    assert torch.isfinite(terms.ratio).all() and torch.isfinite(terms.pg).all()


# ----------------------------------------------------------------------------- gradient only through theta

GRAD_CONFIGS = {
    "plain": {},
    "asymmetric": {"eps_clip": 0.2, "eps_clip_higher": 0.28},
    "dual_clip": {"eps_clip": 0.2, "c_clip": 3.0},
    "cap_truncate": {"behav_imp_weight_cap": 1.5, "behav_imp_weight_mode": "token_truncate"},
    "cap_mask": {"behav_imp_weight_cap": 1.1, "behav_imp_weight_mode": "sequence_mask"},  # seq 0 capped
    "gspo": {"importance_sampling_level": "sequence"},
    "seq_mean_token_mean": {"agg_mode": "seq-mean-token-mean"},
    "seq_mean_token_sum": {"agg_mode": "seq-mean-token-sum", "agg_norm": 8.0},
    "m2po": {"m2_threshold": 0.05},  # drops the (log w)^2 = 0.36 token
}


def _gradcheck_inputs():
    """Inputs whose ratios sit well away from every kink (1 +- 0.2/0.28, c = 3)."""
    f64 = torch.float64
    # log r = theta - p per token: ratios 1.05, 0.9, 1.6 (clipped, A > 0), 0.5 (clipped, A < 0),
    # 5.0 (dual-clipped for A < 0), 1.1, and two masked-out positions
    log_r = bt([0.0, math.log(1.05), math.log(0.9), math.log(1.6)],
               [math.log(0.5), math.log(5.0), math.log(1.1), 0.0], dtype=f64)
    adv = bt([9.0, 1.0, -0.5, 2.0], [-1.0, -2.0, 0.7, 9.0], dtype=f64)
    mask = mt([0, 1, 1, 1], [1, 1, 1, 0])
    b = bt([-1.0, -2.0, -0.5, -1.2], [-0.3, -2.2, -1.0, -4.0], dtype=f64)
    p = b + bt([0.0, 0.1, -0.3, 0.6], [0.2, -0.1, 0.0, 0.0], dtype=f64)  # log w
    theta = (p + log_r).requires_grad_()
    return theta, p, b, adv, mask


@pytest.mark.parametrize("name", sorted(GRAD_CONFIGS))
def test_gradcheck_loss_wrt_theta(name):
    theta, p, b, adv, mask = _gradcheck_inputs()
    options = GRAD_CONFIGS[name]
    assert torch.autograd.gradcheck(lambda t: ppo_loss(t, p, b, adv, mask, LossSpec(**options))[0], (theta,))


@pytest.mark.parametrize("method", ["loglinear", "linear"])
def test_no_gradient_through_the_proximal_path(method):
    torch.manual_seed(2)
    b = -torch.rand(2, 5, dtype=torch.float64) * 2
    theta0 = b + 0.05 * torch.randn(2, 5, dtype=torch.float64)  # ratios near 1: nothing clips
    adv = torch.randn(2, 5, dtype=torch.float64)
    mask = mt([0, 1, 1, 1, 1], [1, 1, 1, 1, 0])
    versions = vt([-1, 0, 1, 2, 3], [0, 0, 1, 1, 3])  # current 4: d = 4, 3, 2, 1

    theta = theta0.clone().requires_grad_()
    p = proximal_logp(method, b, theta, versions, 4)  # p computed from theta itself
    loss, terms = ppo_loss(theta, p, b, adv, mask)
    loss.backward()

    theta_c = theta0.clone().requires_grad_()
    p_const = proximal_logp(method, b, theta0.clone(), versions, 4)  # same values, no link to theta_c
    loss_c, _ = ppo_loss(theta_c, p_const, b, adv, mask)
    loss_c.backward()

    assert not terms.clipped.any()
    torch.testing.assert_close(theta.grad, theta_c.grad, rtol=0, atol=0)
    # with p constant, d/dtheta_t of -A_t exp(theta_t - p_t) w_t / N is -A_t r_t w_t / N, N = 8 tokens
    expected = torch.where(mask, -adv * terms.ratio * terms.behav_weight / 8, torch.zeros_like(adv))
    torch.testing.assert_close(theta.grad, expected, rtol=1e-10, atol=1e-12)
    if method == "loglinear":  # and r w = exp(theta - b): the A-3PO gradient
        torch.testing.assert_close(theta.grad, torch.where(mask, -adv * torch.exp(theta0 - b) / 8, 0.0))


def test_behaviour_prox_and_advantage_get_no_gradient():
    theta, p, b, adv, mask = _gradcheck_inputs()
    p, b, adv = p.clone().requires_grad_(), b.clone().requires_grad_(), adv.clone().requires_grad_()
    loss, _ = ppo_loss(theta, p, b, adv, mask, LossSpec(c_clip=3.0, behav_imp_weight_cap=1.2,
                       behav_imp_weight_mode="token_truncate"))
    loss.backward()
    assert theta.grad is not None and theta.grad.abs().sum() > 0
    for leaf in (p, b, adv):
        assert leaf.grad is None or bool((leaf.grad == 0).all())


# ----------------------------------------------------------------------------- approximation errors


def test_approximation_errors_hand_values_one_token():
    # b = -2, theta = -0.5, truth p = -1, d = 2 (lam = 1/2)
    # loglinear: p_hat = -2 + 0.5 * 1.5 = -1.25, diff = -0.25
    #   abs = 0.25, rel = |exp(-0.25) - 1| = 0.221199, sq = 0.0625
    #   iw = |exp(-1.25 + 2) - exp(-1 + 2)| = |exp(0.75) - e| = |2.117000 - 2.718282| = 0.601282
    # linear: p_hat = log(0.5 e^-2 + 0.5 e^-0.5) = log(0.067668 + 0.303265) = log(0.370933) = -0.991741
    #   diff = 0.008259, abs = 0.008259
    # behav: p_hat = b = -2, diff = -1: abs = 1, rel = 1 - e^-1 = 0.632121, sq = 1, iw = |1 - e| = 1.718282
    f64 = torch.float64
    errs = approximation_errors(bt([-1.0], dtype=f64), bt([-2.0], dtype=f64), bt([-0.5], dtype=f64), vt([1]), 3)
    assert set(errs) == {"loglinear", "linear", "behav"}
    ll = errs["loglinear"]
    torch.testing.assert_close(ll.abs, bt([0.25], dtype=f64))
    torch.testing.assert_close(ll.rel, bt([1 - math.exp(-0.25)], dtype=f64))
    torch.testing.assert_close(ll.sq, bt([0.0625], dtype=f64))
    torch.testing.assert_close(ll.iw, bt([math.e - math.exp(0.75)], dtype=f64))
    lin_hat = math.log(0.5 * math.exp(-2) + 0.5 * math.exp(-0.5))
    torch.testing.assert_close(errs["linear"].abs, bt([abs(lin_hat + 1)], dtype=f64))
    be = errs["behav"]
    torch.testing.assert_close(be.abs, bt([1.0], dtype=f64))
    torch.testing.assert_close(be.rel, bt([1 - math.exp(-1)], dtype=f64))
    torch.testing.assert_close(be.sq, bt([1.0], dtype=f64))
    torch.testing.assert_close(be.iw, bt([math.e - 1], dtype=f64))


def test_loglinear_error_is_zero_on_fresh_tokens_when_truth_is_behaviour():
    b = bt([-2.0, -1.0, -3.0, -0.5])
    theta = bt([-1.0, -0.2, -2.0, -0.1])
    versions = vt([-1, 5, 4, 3])  # d = prompt, 0, 1, 2
    errs = approximation_errors(b.clone(), b, theta, versions, 5)["loglinear"]
    for kind in ("abs", "rel", "sq", "iw"):
        values = getattr(errs, kind)
        assert torch.equal(values[:, :3], torch.zeros(1, 3)), kind
        assert values[0, 3] > 0, kind  # the d = 2 token moved away from b, so it has an error


def test_approximation_errors_with_inf_inputs_are_not_nan():
    b = bt([-INF, -INF, -1.0, -1.0])
    theta = bt([-INF, -1.0, -INF, -1.0])
    truth = bt([-INF, -1.5, -INF, -INF])
    errs = approximation_errors(truth, b, theta, vt([1, 1, 1, 1]), 3)  # d = 2 everywhere
    for name, e in errs.items():
        for kind in ("abs", "rel", "sq", "iw"):
            values = getattr(e, kind)
            assert torch.isfinite(values).all(), (name, kind, values)
            assert (values >= 0).all(), (name, kind)
    # two equal infinities are no error at all
    assert errs["loglinear"].abs[0, 0] == 0 and errs["behav"].abs[0, 0] == 0


def test_approximation_errors_with_huge_logps_stay_finite():
    # Regression: at 7a1ee9b _finite() mapped only +-inf/NaN, so this finite difference of 5e29
    # reached diff.square() and overflowed to inf in float32.
    b = bt([-1e30])
    theta = bt([-1.0])
    truth = bt([-1e30])  # the truth agrees with b; loglinear moves halfway to theta: -5e29
    errs = approximation_errors(truth, b, theta, vt([1]), 3)  # d = 2
    for name, e in errs.items():
        for kind in ("abs", "rel", "sq", "iw"):
            assert torch.isfinite(getattr(e, kind)).all(), (name, kind, getattr(e, kind))

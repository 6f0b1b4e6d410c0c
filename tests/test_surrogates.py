"""The surrogates actor.policy_loss chooses (a3po.algo.surrogates), by hand, alone and inside ppo_loss.

Proves: CISPO's loss value is -A clip(r) and its gradient -A clip(r) per token, so a token whose ratio left
the band still trains (where PPO's clip gives it none); SAPO's gate (4 / tau) sigmoid(tau (r - 1)) with
tau chosen by the sign of A, its slope 1 at r = 1 for any tau, and the gradient at hand-worked points;
the choice reaches ppo_loss through LossSpec, and an unknown name is refused when the spec is built.

Run: .venv/bin/python -m pytest tests/test_surrogates.py -q
"""

from __future__ import annotations

import math

import pytest
import torch

from a3po.algo import LossSpec, ppo_loss
from a3po.algo.surrogates import SurrogateParams, cispo, ppo_clip, sapo

F64 = torch.float64


def bt(*rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=F64)


def test_cispo_clips_the_weight_not_the_gradient():
    # r = [1.5, 0.5, 1.1], A = [1, 1, -1], band [0.8, 1.2]: weight c = [1.2, 0.8, 1.1]
    # s = -A c = [-1.2, -0.8, 1.1]; ds/dlog r = -A c as well (the REINFORCE term's gradient)
    log_r = bt([1.5, 0.5, 1.1]).log().requires_grad_()
    adv = bt([1.0, 1.0, -1.0])
    out = cispo(log_r, adv, SurrogateParams(eps_low=0.2, eps_high=0.2))
    torch.testing.assert_close(out.pg.detach(), bt([-1.2, -0.8, 1.1]))
    assert out.clipped.tolist() == [[True, True, False]]
    out.pg.sum().backward()
    torch.testing.assert_close(log_r.grad, bt([-1.2, -0.8, 1.1]))
    # PPO's clip gives the first token (A > 0, r above 1.2) no gradient at all
    log_r.grad = None
    ppo_clip(log_r, adv, SurrogateParams()).pg.sum().backward()
    assert log_r.grad[0, 0] == 0.0


def test_sapo_gate_hand_values():
    # A = +1, r = 2, tau_pos = 1:     s = -4 sigmoid(1) = -2.924234;  ds/dlog r = -4 sigmoid'(1) r = -1.572895
    # A = -1, r = 0.5, tau_neg = 1.05: s = (4/1.05) sigmoid(-0.525) = 1.415938;
    #                                  ds/dlog r = 4 sigmoid'(-0.525) r = 0.467070
    log_r = bt([2.0, 0.5]).log().requires_grad_()
    out = sapo(log_r, bt([1.0, -1.0]), SurrogateParams(tau_pos=1.0, tau_neg=1.05))
    torch.testing.assert_close(out.pg.detach(), bt([-2.9242343, 1.4159383]))
    assert not out.clipped.any() and not out.dual_clipped.any()
    out.pg.sum().backward()
    torch.testing.assert_close(log_r.grad, bt([-1.5728955, 0.4670699]))


@pytest.mark.parametrize("tau", [0.5, 1.0, 1.05, 4.0])
def test_sapo_has_ppo_slope_at_ratio_one(tau):
    # d/dr of (4 / tau) sigmoid(tau (r - 1)) at r = 1 is 4 sigmoid'(0) = 1, PPO's slope: -A there
    log_r = bt([0.0, 0.0]).requires_grad_()
    sapo(log_r, bt([2.0, -3.0]), SurrogateParams(tau_pos=tau, tau_neg=tau)).pg.sum().backward()
    torch.testing.assert_close(log_r.grad, bt([-2.0, 3.0]))


@pytest.mark.parametrize("name, expected_loss, expected_grad", [
    # theta - p = [log 1.5, 0], A = [1, 1], token mean over 2
    ("ppo", -(1.2 + 1.0) / 2, [0.0, -0.5]),  # token 0 clipped: no gradient
    ("cispo", -(1.2 + 1.0) / 2, [-0.6, -0.5]),  # -A c / 2 each
    ("sapo", -(4 * (1 / (1 + math.exp(-0.5))) + 2.0) / 2,
     [-(4 * 0.6224593 * 0.3775407 * 1.5) / 2, -0.5]),  # 4 sigmoid(0.5), 2 at r = 1
])
def test_the_policy_loss_reaches_ppo_loss(name, expected_loss, expected_grad):
    p = bt([-1.0, -1.0])
    theta = (p + bt([1.5, 1.0]).log()).requires_grad_()
    loss, _ = ppo_loss(theta, p, p, bt([1.0, 1.0]), torch.ones(1, 2, dtype=torch.bool), LossSpec(policy_loss=name))
    torch.testing.assert_close(loss, torch.tensor(expected_loss, dtype=F64))
    loss.backward()
    torch.testing.assert_close(theta.grad, bt(expected_grad))


def test_an_unknown_policy_loss_is_refused_when_the_spec_is_built():
    with pytest.raises(ValueError, match="policy_loss 'grpo'; allowed: ppo, cispo, sapo"):
        LossSpec(policy_loss="grpo")

"""Sampling filters (algo/filters.py): hand-computed kept sets, the sampler drawing from and recording the filtered
distribution, and the trainer's log-probs (value and gradient) of that same distribution, so that at d = 0 the
behaviour weight is 1 and not the kept mass."""

import copy
import math

import pytest
import torch

from a3po.algo.filters import NO_FILTER, SamplingFilter, filter_logits
from a3po.config import load_config
from a3po.models import load_policy
from a3po.rollout.engine import GenerationRequest, generate
from a3po.rollout.local import LocalEngine
from a3po.rollout.sampling import distribution, draw
from a3po.trainer.engine import TrainEngine
from a3po.trainer.logprobs import token_logp_entropy
from a3po.trajectories import Trajectory, collate

P = torch.tensor([0.5, 0.3, 0.15, 0.05])


def kept(top_k=0, top_p=1.0, min_p=0.0, keep=None):
    """The renormalised probabilities `filter_logits` leaves of P, one row."""
    z = filter_logits(P.log()[None], torch.tensor([top_k]), torch.tensor([top_p]), torch.tensor([min_p]),
                      None if keep is None else torch.tensor([keep]))
    return torch.softmax(z, -1)[0]


@pytest.mark.parametrize(("args", "want"), [
    ({"top_p": 0.8}, [0.625, 0.375, 0, 0]),  # ranked above token 2: 0.8, not below 0.8
    ({"top_p": 0.81}, [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0]),
    ({"top_p": 0.1}, [1, 0, 0, 0]),  # the most likely token always stays
    ({"top_k": 3}, [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0]),
    ({"top_k": 1}, [1, 0, 0, 0]),
    ({"min_p": 0.5}, [0.625, 0.375, 0, 0]),  # p >= 0.25
    ({"min_p": 0.2}, [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0]),  # p >= 0.1
    ({"top_k": 3, "top_p": 0.8}, [0.625, 0.375, 0, 0]),  # top-p on the top-k renormalised: 0.526, 0.842 above
    ({"min_p": 0.2, "top_p": 0.84}, [0.625, 0.375, 0, 0]),  # after min-p: 0.526 + 0.316 = 0.842 ranked above token 2
    ({"top_p": 0.8, "keep": 3}, [0.5 / 0.85, 0.3 / 0.85, 0, 0.05 / 0.85]),  # the named token stays whatever
    ({}, [0.5, 0.3, 0.15, 0.05]),
])
def test_kept_sets_by_hand(args, want):
    assert kept(**args).tolist() == pytest.approx(want, abs=1e-6)


def test_rows_filter_on_their_own_settings_and_nothing_filters_when_all_are_off():
    z = P.log().repeat(3, 1)
    out = filter_logits(z, torch.tensor([0, 2, 0]), torch.tensor([1.0, 1.0, 0.6]), torch.tensor([0.0, 0.0, 0.0]))
    assert torch.isinf(out).sum(-1).tolist() == [0, 2, 2]
    off = filter_logits(z, torch.zeros(3, dtype=torch.long), torch.ones(3), torch.zeros(3))
    assert off is z


def test_the_sampler_draws_only_kept_tokens_and_records_their_renormalised_log_prob():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 300, generator=g) * 3
    n = 4
    gens = [torch.Generator().manual_seed(i) for i in range(n)]
    temperature, top_k, top_p, min_p = torch.tensor([0.7] * n), torch.tensor([0, 20, 0, 40]), \
        torch.tensor([0.9, 1.0, 1.0, 0.8]), torch.tensor([0.0, 0.0, 0.1, 0.05])
    want = torch.log_softmax(filter_logits(logits / 0.7, top_k, top_p, min_p), -1)
    for _ in range(200):
        greedy = torch.zeros(n, dtype=torch.bool)
        tokens, logp = draw(distribution(logits, temperature, top_k, top_p, greedy, min_p), greedy, gens)
        chosen = want.gather(1, tokens[:, None])[:, 0]
        assert torch.isfinite(chosen).all(), "a filtered-out token was drawn"
        assert logp.tolist() == pytest.approx(chosen.tolist(), abs=1e-5)


def _direct(h, w, t, temperature, filt):
    """The same log-probs and entropy by plain autograd over the whole (N, V) block: the mask from filter_logits,
    the logits' gradient flowing through the kept ones."""
    z = h @ w.T / temperature
    mask = torch.isinf(filter_logits(z.detach(), *filt.rows(len(z)), keep=t))
    q = torch.log_softmax(z.masked_fill(mask, float("-inf")), -1)
    p = q.exp()
    return q.gather(-1, t[:, None])[:, 0], -(p * q.masked_fill(mask, 0.0)).sum(-1)


@pytest.mark.parametrize("filt", [SamplingFilter(top_p=0.7), SamplingFilter(top_k=5, min_p=0.05),
                                  SamplingFilter(top_k=9, top_p=0.9, min_p=0.01)])
def test_trainer_log_probs_and_gradients_are_those_of_the_filtered_distribution(filt):
    g = torch.Generator().manual_seed(1)
    h = torch.randn(6, 8, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(40, 8, generator=g, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, 40, (6,), generator=g)
    a, b = torch.randn(6, generator=g, dtype=torch.float64), torch.randn(6, generator=g, dtype=torch.float64)
    logp, ent = token_logp_entropy(h, w, t, 0.8, True, filt)
    want_logp, want_ent = _direct(h, w, t, 0.8, filt)
    assert torch.isfinite(logp).all() and torch.allclose(logp, want_logp) and torch.allclose(ent, want_ent)
    grads = torch.autograd.grad((a * logp + b * ent).sum(), (h, w))
    want = torch.autograd.grad((a * want_logp + b * want_ent).sum(), (h, w))
    assert all(torch.allclose(x, y) for x, y in zip(grads, want))
    unfiltered, _ = token_logp_entropy(h, w, t, 0.8, True, NO_FILTER)
    assert (unfiltered <= logp + 1e-12).all() and (logp - unfiltered).max() > 1e-3  # the kept mass, log Z < 0


def test_local_engine_samples_and_the_trainer_agree_at_d_0_only_when_the_trainer_filters_too():
    model, tok = load_policy("tiny")
    filt = SamplingFilter(top_k=50, top_p=0.9, min_p=0.05)
    engine = LocalEngine(copy.deepcopy(model), eos_token_ids=[tok.eos_token_id])
    prompt = tok.encode("1 + 2 =")
    outs = generate(engine, [GenerationRequest(prompt, 12, rid=i, seed=i, temperature=0.8, top_k=filt.top_k,
                                               top_p=filt.top_p, min_p=filt.min_p) for i in range(4)])
    batch = collate([Trajectory(o.prompt_ids, o.output_ids, o.output_logprobs, o.output_versions) for o in outs],
                    pad_id=tok.pad_token_id)
    actor = load_config(None, ["actor.dtype=float32"]).actor
    on = batch.loss_mask
    same = TrainEngine(copy.deepcopy(model), actor, 1, temperature=0.8, sampling=filt).compute_logp(batch)
    assert (same - batch.logp_behav)[on].abs().max().item() < 1e-5
    plain = TrainEngine(copy.deepcopy(model), actor, 1, temperature=0.8).compute_logp(batch)
    gap = (batch.logp_behav - plain)[on]  # -log of the kept mass at each position
    assert (gap >= -1e-5).all() and gap.max().item() > math.log(1 / 0.95)

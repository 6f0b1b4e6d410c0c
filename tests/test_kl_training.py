"""The KL to the reference policy in real training steps (trainer/engine.py, pipeline/loop.py stage 2).

What this file proves, on the tiny model trained on-policy for six steps (the local rollout
engine samples, the trainer's own stage 2 computes advantages, `ppo_update` trains, the
sampler loads the new weights) with a reward it can learn fast, the share of output bytes
below 128:
- with actor.kl_ctl > 0 the policy ends closer to the initial one than with kl_ctl = 0, both
  with the KL in the loss and with the KL in the reward (actor.kl_in_reward=true, which used
  to drop the KL altogether: it trained exactly as kl_ctl = 0);
- both modes log `loss/kl_ref` every step; in the reward it is the mean over tokens of the
  KL that `TrainEngine.reference_kl` returns, and each sequence's reward loses kl_ctl times
  its sum before the advantages are computed.

Run: .venv/bin/python -m pytest tests/test_kl_training.py -q
"""

import copy

import pytest
import torch

from a3po.algo import kl_penalty, masked_mean, masked_sum, normalize_advantages
from a3po.config import load_config
from a3po.pipeline.loop import batch_with_advantages
from a3po.rollout import GenerationRequest, generate
from a3po.rollout.local import LocalEngine
from a3po.trainer.engine import TrainEngine
from a3po.trajectories import Trajectory, collate

STEPS, GROUP = 6, 4


def low_byte_share(ids: list[int]) -> float:
    return sum(i < 128 for i in ids) / max(1, len(ids))


def prompts(tok) -> list[list[int]]:
    chats = [[{"role": "user", "content": f"{i} + {i}"}] for i in range(4)]
    texts = [tok.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in chats]
    return [tok.encode(t, add_special_tokens=False) for t in texts]


def sample(sampler: LocalEngine, tok, seed: int, n: int = GROUP) -> list[Trajectory]:
    reqs = [GenerationRequest(p, 8, rid=(i, j), seed=seed + 10 * i + j)
            for i, p in enumerate(prompts(tok)) for j in range(n)]
    return [Trajectory(c.prompt_ids, c.output_ids, c.output_logprobs, c.output_versions,
                       reward=low_byte_share(c.output_ids)) for c in generate(sampler, reqs)]


def train(model, tok, *overrides: str) -> tuple[float, list[dict[str, float]]]:
    """(KL of the final policy to the initial one on its own fresh samples, each step's statistics)."""
    cfg = load_config(None, ["actor.dtype=float32", "actor.optimizer.lr=1e-2", f"gconfig.n_samples={GROUP}",
                             *overrides])
    engine = TrainEngine(copy.deepcopy(model), cfg.actor, STEPS)
    sampler = LocalEngine(copy.deepcopy(model), eos_token_ids=[tok.eos_token_id])
    history = []
    for step in range(STEPS):
        batch, extra = batch_with_advantages(cfg, engine, sample(sampler, tok, seed=1000 * step), tok.pad_token_id)
        history.append(engine.ppo_update(batch) | extra)
        sampler.update_weights(engine.weights(), engine.version)
    fresh = collate(sample(sampler, tok, seed=99_999, n=8))
    kl = kl_penalty(engine.compute_logp(fresh), engine.compute_logp(fresh, model), "k3")
    return float(masked_mean(kl, fresh.loss_mask)), history


def test_kl_ctl_keeps_the_policy_closer_to_the_reference_in_the_loss_and_in_the_reward(tiny):
    model, tok = tiny
    free, _ = train(model, tok)
    in_loss, loss_history = train(model, tok, "actor.kl_ctl=1.0")
    # k1 in the reward: its score-function gradient is the KL's (algo/kl.py); k3 there pulls far less
    in_reward, reward_history = train(model, tok, "actor.kl_ctl=1.0", "actor.kl_in_reward=true",
                                      "actor.kl_estimator=k1")
    # measured: 0.49 without the KL, 0.17 in the loss, 0.12 in the reward; before the fix the reward
    # mode trained exactly as kl_ctl = 0 did (0.49)
    assert free > 0.2, "the reward must move the policy for the comparison to mean anything"
    assert in_loss < 0.6 * free, (in_loss, free)
    assert in_reward < 0.6 * free, (in_reward, free)
    for history in (loss_history, reward_history):
        assert all("loss/kl_ref" in s for s in history)
        assert history[-1]["loss/kl_ref"] > 0


def test_kl_in_reward_charges_each_sequence_its_summed_reference_kl(tiny):
    # stage 2 by hand: advantages = GRPO of (reward - kl_ctl * sum_t KL_t), KL_t = k3(b_t - ref_t)
    model, tok = tiny
    overrides = ["actor.dtype=float32", "actor.kl_ctl=0.5", "actor.kl_in_reward=true", "actor.kl_estimator=k2"]
    cfg = load_config(None, overrides)
    engine = TrainEngine(copy.deepcopy(model), cfg.actor, 1)
    with torch.no_grad():  # a reference away from the sampler, so that the KL is not 0
        for p in engine.ref_model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    sampler = LocalEngine(copy.deepcopy(model), eos_token_ids=[tok.eos_token_id])
    trajs = sample(sampler, tok, seed=7)
    batch, stats = batch_with_advantages(cfg, engine, trajs, tok.pad_token_id)

    plain = collate(trajs)
    ref = engine.compute_logp(plain, engine.ref_model)
    kl = 0.5 * (plain.logp_behav - ref).square()  # k2 = x^2 / 2 with x = b - ref
    m = plain.loss_mask
    rewards = plain.rewards - 0.5 * masked_sum(kl, m, dim=-1)
    expected = normalize_advantages(rewards, cfg.gconfig.n_samples)
    torch.testing.assert_close(batch.advantages, torch.where(m, expected[:, None], torch.zeros(())))
    assert stats["loss/kl_ref"] == pytest.approx(float(masked_mean(kl, m)), rel=1e-5)
    assert stats["loss/kl_ref"] > 1e-3
    # and the KL is no longer also added to the loss: the update equals kl_ctl = 0's on the same batch
    same = load_config(None, ["actor.dtype=float32"]).actor
    a, b = TrainEngine(copy.deepcopy(model), cfg.actor, 1), TrainEngine(copy.deepcopy(model), same, 1)
    assert a.ppo_update(batch)["loss/total"] == b.ppo_update(batch)["loss/total"]

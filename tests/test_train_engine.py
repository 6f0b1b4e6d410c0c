"""The training engine: log-probs without waste, the PPO update, checkpoints.

Proves: chunked log-probs/entropy and their gradients equal the plain full-vocabulary
computation; micro-batching does not change the update; `loglinear`/`linear`/`reuse`
run no extra forward pass and `recompute` runs exactly one; PPO updates lower the loss
on a fixed batch; save -> load round-trips bit-exactly and a resumed engine continues
exactly as an uninterrupted one.
"""

import copy
import math

import pytest
import torch
from conftest import actor_cfg

import a3po.trainer.logprobs as logprobs_mod
from a3po.algo import normalize_advantages, ppo_loss
from a3po.algo.schedule import lr_schedule
from a3po.trainer.checkpoint import load_engine, save_engine
from a3po.trainer.engine import TrainEngine, micro_batches, minibatches
from a3po.trainer.logprobs import token_logp_entropy
from a3po.trajectories import Trajectory, collate


def fixed_batch(model, vocab, n=8, group=4, seed=1):
    g = torch.Generator().manual_seed(seed)
    trajs = []
    for i in range(n):
        prompt = torch.randint(3, vocab, (4 + i % 3,), generator=g).tolist()
        out = torch.randint(3, vocab, (3 + i % 5,), generator=g).tolist()
        trajs.append(Trajectory(prompt, out, [0.0] * len(out), [0] * len(out), reward=float(i % 2)))
    batch = collate(trajs, normalize_advantages(torch.tensor([t.reward for t in trajs]), group))
    # behaviour log-probs of the initial weights: fresh, on-policy samples (d = 0)
    batch.logp_behav = TrainEngine(copy.deepcopy(model), actor_cfg(), 1).compute_logp(batch)
    return batch


def weights(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_chunked_logp_entropy_and_grads_match_full_vocab(monkeypatch):
    monkeypatch.setattr(logprobs_mod, "CHUNK_ELEMENTS", 40)  # force several chunks
    g = torch.Generator().manual_seed(0)
    h = torch.randn(9, 6, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(13, 6, dtype=torch.float64, generator=g, requires_grad=True)
    t = torch.randint(0, 13, (9,), generator=g)
    logp, ent = token_logp_entropy(h, w, t, 0.8)
    full = torch.log_softmax(h @ w.T / 0.8, -1)
    assert torch.allclose(logp, full.gather(-1, t[:, None]).squeeze(-1))
    assert torch.allclose(ent, -(full.exp() * full).sum(-1))
    assert torch.autograd.gradcheck(lambda h, w: token_logp_entropy(h, w, t, 0.8), (h, w))
    # temperature 1 takes a shorter path; gradients of log-probs alone and of entropy alone
    assert torch.autograd.gradcheck(lambda h, w: token_logp_entropy(h, w, t)[0], (h, w))
    assert torch.autograd.gradcheck(lambda h, w: token_logp_entropy(h, w, t)[1], (h, w))
    # without entropy: the same log-probs, entropy left at zero
    logp2, ent2 = token_logp_entropy(h, w, t, 0.8, with_entropy=False)
    assert torch.equal(logp2, logp) and not ent2.any()


def test_bf16_logp_grads_stay_close_to_fp32():
    # the backward's matmuls run in the compute dtype, as autocast's linear layers do
    g = torch.Generator().manual_seed(0)
    h = torch.randn(40, 32, generator=g)
    w = torch.randn(500, 32, generator=g) * 0.3
    t = torch.randint(0, 500, (40,), generator=g)
    grads = {}
    for dt in (torch.float32, torch.bfloat16):
        hh, ww = h.to(dt).detach().clone().requires_grad_(), w.clone().requires_grad_()
        logp, ent = token_logp_entropy(hh, ww, t)
        (logp.sum() + 0.1 * ent.sum()).backward()
        grads[dt] = (hh.grad.float(), ww.grad)
    for a, b in zip(grads[torch.float32], grads[torch.bfloat16]):
        assert (a - b).norm() / a.norm() < 0.02


def test_micro_batches_respect_the_token_budget(tiny):
    model, tok = tiny
    batch = fixed_batch(model, len(tok))
    groups = micro_batches(batch, 30)
    assert sorted(i for g in groups for i in g) == list(range(len(batch)))
    lengths = batch.attention_mask.sum(-1)
    for g in groups:
        assert len(g) == 1 or len(g) * int(lengths[g].max()) <= 30
    assert minibatches(8, 4) == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_micro_batching_does_not_change_the_update(tiny):
    # Compared on the gradient the optimizer receives: AdamW's first step is lr * g / (|g| + eps),
    # which turns rounding-level differences of near-zero gradient entries into ~1e-6 weight
    # differences (seen on AVX-512 CPUs), while a wrong micro-batch normalisation changes g itself.
    model, tok = tiny
    batch = fixed_batch(model, len(tok))
    results = []
    for budget in (10_000, 24):
        eng = TrainEngine(copy.deepcopy(model), actor_cfg(f"actor.mb_spec.max_tokens_per_mb={budget}"), 4)
        grads = {}
        names = {id(p): n for n, p in eng.model.named_parameters()}

        def keep_grads(opt, *_, grads=grads, names=names):
            params = [p for g in opt.param_groups for p in g["params"] if p.grad is not None]
            grads.update({names[id(p)]: p.grad.clone() for p in params})

        eng.optimizer.register_step_pre_hook(keep_grads)
        stats = eng.ppo_update(batch)
        results.append((grads, weights(eng.model), stats["loss/total"]))
    (g_big, w_big, l_big), (g_small, w_small, l_small) = results
    assert l_big == pytest.approx(l_small, abs=1e-6)
    assert g_big.keys() == g_small.keys() and len(g_big) > 0
    for k in g_big:
        assert torch.allclose(g_big[k], g_small[k], rtol=1e-4, atol=1e-8), k
        assert torch.allclose(w_big[k], w_small[k], atol=1e-5), k  # 1 % of one lr = 1e-3 step


@pytest.mark.parametrize("method, passes",
                         [("loglinear", 1), ("linear", 1), ("reuse", 1), ("recompute", 2), ("metrics", 2)])
def test_only_recompute_and_metrics_run_an_extra_forward_pass(tiny, method, passes):
    model, tok = tiny
    batch = fixed_batch(model, len(tok))
    eng = TrainEngine(copy.deepcopy(model), actor_cfg(f"actor.prox_logp_method={method}"), 4)
    calls = []
    eng.model.base_model.register_forward_hook(lambda *a: calls.append(1))
    stats = eng.ppo_update(batch)
    assert len(calls) == passes  # whole batch fits one micro-batch
    assert ("prox_err/loglinear/abs" in stats) == (method == "metrics")


def test_ppo_updates_lower_the_loss_on_a_fixed_batch(tiny):
    model, tok = tiny
    batch = fixed_batch(model, len(tok))
    eng = TrainEngine(copy.deepcopy(model), actor_cfg("actor.prox_logp_method=recompute", "actor.optimizer.lr=3e-3"),
                      10)

    def surrogate():
        logp = eng.compute_logp(batch)
        loss, _ = ppo_loss(logp, batch.logp_behav, batch.logp_behav, batch.advantages, batch.loss_mask)
        return float(loss)

    before = surrogate()
    for _ in range(5):
        eng.ppo_update(batch)
    after = surrogate()
    assert eng.version == 5
    assert after < before - 0.05, (before, after)


def test_stats_of_a_step(tiny):
    model, tok = tiny
    batch = fixed_batch(model, len(tok))
    eng = TrainEngine(copy.deepcopy(model), actor_cfg(), 4)
    s0 = eng.ppo_update(batch)
    # on-policy samples (d = 0), one minibatch: p = b = theta, so every ratio is 1
    assert s0["loss/ratio_min"] == pytest.approx(1.0, abs=1e-5) and s0["loss/ratio_max"] == pytest.approx(1.0, abs=1e-5)
    assert s0["loss/clipped_frac"] == 0.0 and s0["loss/behav_weight_max"] == pytest.approx(1.0, abs=1e-6)
    # every token was sampled by the weights being trained (d = 0): the numerics gap is nil
    assert s0["mismatch/tokens"] == batch.n_tokens
    assert s0["mismatch/abs_max"] < 1e-5 and 0 <= s0["mismatch/k3"] < 1e-8
    s1 = eng.ppo_update(batch)  # the same samples are now one version old: no d = 0 token left
    assert not any(k.startswith("mismatch/") for k in s1)
    for key in ("loss/clipped_frac", "loss/behav_weight_mean", "loss/entropy", "train/grad_norm", "perf/train_s"):
        assert key in s1
    assert s1["loss/ratio_max"] != pytest.approx(1.0, abs=1e-6)  # the weights moved since sampling
    two = TrainEngine(copy.deepcopy(model), actor_cfg("actor.ppo_n_minibatches=2"), 4).ppo_update(batch)
    # the second minibatch sees weights one optimizer step past the behaviour policy
    assert two["loss/ratio_max"] - two["loss/ratio_min"] > 1e-4


CORRECTED_RUNS = {
    # CISPO with a token TIS and a geometric band, both on the current weights' ratio to the sampler (one update
    # at this learning rate moves the sequences' geometric-mean ratios to 0.72 .. 1.37 on this batch)
    "cispo+tis+geometric": ("actor.policy_loss=cispo", "actor.correction.ratio=current", "actor.correction.tis=token",
                            "actor.correction.tis_cap=1.2", "actor.correction.mis=geometric",
                            "actor.correction.mis_low=0.75", "actor.correction.mis_high=1.25"),
    # SAPO with IcePop on the behaviour weight and off-policy sequence masking
    "sapo+icepop+opsm": ("actor.policy_loss=sapo", "actor.correction.mis=token", "actor.correction.mis_low=0.5",
                         "actor.correction.mis_high=5", "actor.correction.opsm_delta=0.001"),
}


@pytest.mark.parametrize("name", CORRECTED_RUNS)
def test_a_new_loss_with_corrections_trains_and_reports_what_they_did(tiny, name):
    """The keys reach the engine: fresh samples (d = 0, theta = b up to the numerics) pass every correction; one
    update later the same samples are stale, and the corrections act on them while the loss stays finite."""
    model, tok = tiny
    batch = fixed_batch(model, len(tok))
    eng = TrainEngine(copy.deepcopy(model), actor_cfg(*CORRECTED_RUNS[name]), 4)
    s0 = eng.ppo_update(batch)
    s1 = eng.ppo_update(batch)
    for s in (s0, s1):
        assert math.isfinite(s["loss/total"]) and s["train/grad_norm"] > 0
    assert s0["loss/corr_masked_frac"] == 0.0 and s0["loss/tis_truncated_frac"] == 0.0
    if name.startswith("cispo"):
        assert s1["loss/tis_truncated_frac"] > 0 and 0 < s1["loss/corr_masked_seq_frac"] < 1
        assert s1["loss/corr_masked_frac_d1"] == s1["loss/corr_masked_frac"]  # every token is one version old
    else:
        assert 0 < s1["loss/opsm_masked_seq_frac"] <= 0.5  # negative advantages only: half the batch at most
        assert s1["loss/corr_masked_seq_frac"] >= s1["loss/opsm_masked_seq_frac"]


def test_lr_schedules_hand_values():
    # total 6 steps, warm-up 2: (s + 1) / 2 for s = 0, 1, then progress (s - 2) / 4 through the decay
    assert [lr_schedule("constant", 6, 2)(s) for s in range(7)] == [0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    assert [lr_schedule("linear", 6, 2)(s) for s in range(7)] == [0.5, 1.0, 1.0, 0.75, 0.5, 0.25, 0.0]
    # cosine: 0.5 (1 + cos(pi p)) at p = 0, 1/4, 1/2, 3/4, 1 -> 1, 0.853553, 0.5, 0.146447, 0
    cosine = [lr_schedule("cosine", 6, 2)(s) for s in range(2, 7)]
    assert cosine == pytest.approx([1.0, 0.5 + 0.5 ** 1.5, 0.5, 0.5 - 0.5 ** 1.5, 0.0], abs=1e-12)
    with pytest.raises(ValueError, match="constant, linear, cosine"):
        lr_schedule("step", 6, 2)


def test_save_load_round_trips_and_resume_equals_uninterrupted(tiny, tmp_path):
    model, tok = tiny
    batch = fixed_batch(model, len(tok))
    cfg = actor_cfg("actor.optimizer.warmup_steps_proportion=0.5", "actor.optimizer.lr_scheduler_type=cosine")
    a = TrainEngine(copy.deepcopy(model), cfg, 6)
    a.ppo_update(batch)
    save_engine(a, tmp_path / "ckpt", tokenizer=tok)
    b = TrainEngine(copy.deepcopy(model), cfg, 6)
    load_engine(b, tmp_path / "ckpt")
    wa, wb = weights(a.model), weights(b.model)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert b.version == a.version == 1
    assert b.scheduler.get_last_lr() == a.scheduler.get_last_lr()
    for _ in range(2):
        sa, sb = a.ppo_update(batch), b.ppo_update(batch)
        assert sa["loss/total"] == sb["loss/total"]
    wa, wb = weights(a.model), weights(b.model)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert (tmp_path / "ckpt" / "config.json").exists() and (tmp_path / "ckpt" / "model.safetensors").exists()


def test_bfloat16_autocast_trains_and_keeps_fp32_master_weights(tiny):
    model, tok = tiny
    batch = fixed_batch(model, len(tok))
    eng = TrainEngine(copy.deepcopy(model), actor_cfg("actor.dtype=bfloat16"), 4)
    stats = eng.ppo_update(batch)
    assert all(p.dtype == torch.float32 for p in eng.model.parameters())
    assert torch.isfinite(torch.tensor(stats["loss/total"]))
    fp32 = TrainEngine(copy.deepcopy(model), actor_cfg(), 4).compute_logp(batch)
    bf16 = eng.compute_logp(batch)
    m = batch.loss_mask
    assert (fp32[m] - bf16[m]).abs().max() < 0.5  # close, but not the same arithmetic


def test_gradient_checkpointing_gives_the_same_update(tiny):
    model, tok = tiny
    batch = fixed_batch(model, len(tok))
    plain = TrainEngine(copy.deepcopy(model), actor_cfg(), 4)
    ckpt = TrainEngine(copy.deepcopy(model), actor_cfg("actor.gradient_checkpointing=true"), 4)
    plain.ppo_update(batch)
    ckpt.ppo_update(batch)
    wa, wb = weights(plain.model), weights(ckpt.model)
    assert all(torch.allclose(wa[k], wb[k], atol=1e-6) for k in wa)


def test_short_sequences_on_a_cpu_use_plain_attention_with_the_same_logprobs_and_grads(tiny, monkeypatch):
    model, tok = tiny
    batch = collate([Trajectory(list(range(10, 30)), list(range(40, 52)), [0.0] * 12, [0] * 12)] * 2)
    results = {}
    for limit, expected in ((logprobs_mod.CPU_EAGER_ATTENTION_MAX_LEN, "eager"), (0, "sdpa")):
        monkeypatch.setattr(logprobs_mod, "CPU_EAGER_ATTENTION_MAX_LEN", limit)
        engine = TrainEngine(copy.deepcopy(model), actor_cfg(), 1)
        logp = engine.compute_logp(batch)
        assert engine.model.config._attn_implementation == expected  # as the last forward chose
        loss = engine.policy(batch.input_ids, batch.attention_mask, batch.loss_mask[:, 1:])[0].sum()
        loss.backward()
        results[expected] = logp, engine.model.model.layers[0].self_attn.q_proj.weight.grad.clone()
    assert torch.allclose(results["eager"][0], results["sdpa"][0], atol=1e-5)
    assert torch.allclose(results["eager"][1], results["sdpa"][1], atol=1e-5, rtol=1e-4)


def with_dropout(model, p: float = 0.5):
    """Attention dropout on every layer: a pass in train mode then draws a random mask."""
    for m in model.modules():
        if hasattr(m, "attention_dropout"):
            m.attention_dropout = p
    return model


def test_the_proximal_pass_runs_in_eval_mode_so_dropout_leaves_it_exact(tiny):
    model, tok = tiny
    batch = fixed_batch(with_dropout(model), len(tok))  # behaviour log-probs of an eval-mode forward
    eng = TrainEngine(copy.deepcopy(model), actor_cfg("actor.prox_logp_method=recompute"), 1)
    eng.model.train()  # as ppo_update has it when it recomputes the proximal log-probs
    pred_mask = batch.loss_mask[:, 1:]
    train_mode, _ = eng.policy(batch.input_ids, batch.attention_mask, pred_mask)  # the tokens' log-probs, in order
    assert not torch.equal(train_mode, batch.logp_behav[:, 1:][pred_mask]), "dropout is not on: the test proves nothing"
    first, second = eng.compute_logp(batch), eng.compute_logp(batch)
    assert torch.equal(first, second) and torch.equal(first, batch.logp_behav)
    assert eng.model.training, "train mode is restored after the pass"


@pytest.mark.parametrize("kl_in_reward", [False, True])
def test_every_no_grad_pass_of_a_step_runs_in_eval_mode_and_every_grad_pass_in_train_mode(tiny, kl_in_reward):
    model, tok = tiny
    batch = fixed_batch(with_dropout(model), len(tok))
    eng = TrainEngine(copy.deepcopy(model), actor_cfg("actor.prox_logp_method=metrics", "actor.kl_ctl=0.1",
                                                      f"actor.kl_in_reward={kl_in_reward}"), 1)
    passes = []  # (gradient on, train mode) of every forward, the policy's and the reference's
    for m in (eng.model, eng.ref_model):
        m.base_model.register_forward_hook(lambda mod, *_: passes.append((torch.is_grad_enabled(), mod.training)))
    if kl_in_reward:
        eng.reference_kl(batch)
    eng.ppo_update(batch)
    assert (False, False) in passes and (True, True) in passes
    assert all(grad == training for grad, training in passes), passes


def test_the_loss_spec_is_the_actor_configs_loss_settings():
    from a3po.algo import LossSpec
    from a3po.trainer.objective import loss_spec

    spec = loss_spec(actor_cfg("actor.eps_clip_higher=0.28", "actor.m2_threshold=0.5",
                               "actor.importance_sampling_level=sequence", "actor.loss_agg_mode=seq-mean-token-sum",
                               "actor.loss_agg_norm=24", "actor.entropy_coef=0.01", "actor.kl_ctl=0.1"))
    assert spec == LossSpec(eps_clip=0.2, eps_clip_higher=0.28, c_clip=3.0, behav_imp_weight_cap=5.0,
                            behav_imp_weight_mode="token_mask", importance_sampling_level="sequence",
                            m2_threshold=0.5, agg_mode="seq-mean-token-sum", agg_norm=24.0, entropy_coef=0.01,
                            kl_coef=0.1)
    # coupled PPO has w = 1: no cap (the default 5 stays in the config); a KL charged to the rewards is no
    # term of the loss
    coupled = loss_spec(actor_cfg("actor.use_decoupled_loss=false", "actor.kl_ctl=0.1", "actor.kl_in_reward=true"))
    assert (coupled.behav_imp_weight_cap, coupled.m2_threshold, coupled.kl_coef) == (None, None, 0.0)
    from a3po.algo.corrections import CorrectionSpec

    corrected = loss_spec(actor_cfg("actor.policy_loss=sapo", "actor.sapo_tau_neg=2", "actor.correction.ratio=current",
                                    "actor.correction.mis=token", "actor.correction.mis_high=5",
                                    "actor.correction.opsm_delta=0.1"))
    assert (corrected.policy_loss, corrected.sapo_tau_pos, corrected.sapo_tau_neg) == ("sapo", 1.0, 2.0)
    assert corrected.correction == CorrectionSpec(ratio="current", tis="none", tis_cap=2.0, mis="token",
                                                  mis_low=None, mis_high=5.0, opsm_delta=0.1)

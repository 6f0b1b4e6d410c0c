"""LoRA (actor.lora): adapters train, their publication folds into the sampler's weights, the reference is the
model with adapters off, checkpoints are PEFT adapters that resume exactly and load in PEFT.

Proves: with B = 0 the trainer computes the base model; after a step the weights a worker folds from the
published adapter give the trainer's log-probs (fp32, tight) and not the base's, on the local engine too;
the reference with adapters off is the base; only adapters are in the optimizer; save -> resume continues
exactly; a saved adapter loads in PEFT and folds into the same model; bad LoRA settings are one line.
"""

import copy

import pytest
import torch
from test_train_engine import fixed_batch

from a3po.config import ConfigError, load_config
from a3po.config.schema import LORA_LR_FACTOR
from a3po.models import lora
from a3po.rollout.local import LocalEngine
from a3po.trainer.checkpoint import load_engine, save_engine
from a3po.trainer.engine import TrainEngine
from a3po.trajectories import Trajectory, collate


def lora_cfg(*overrides: str):
    return load_config(None, ["actor.dtype=float32", "actor.lora.rank=4", "actor.lora.lr=5e-3", *overrides]).actor


def plain_cfg():
    return load_config(None, ["actor.dtype=float32"]).actor


def folded(base_model, engine: TrainEngine):
    """What a rollout worker holds after loading the engine's published weights: its own base, folded."""
    model = copy.deepcopy(base_model)
    published = {k: v.clone() for k, v in engine.weights().items()}
    model.load_state_dict(lora.Folder(model, published)(published), strict=False)
    return model


def logp_of(model, batch):
    return TrainEngine(copy.deepcopy(model).requires_grad_(True), plain_cfg(), 1).compute_logp(batch)


@pytest.fixture
def setup(tiny):
    model, tok = tiny
    batch = fixed_batch(model, len(tok))
    return model, tok, batch


def test_adapters_start_at_the_base_and_reach_the_sampler_after_a_step(setup):
    model, _, batch = setup
    base = logp_of(model, batch)
    eng = TrainEngine(copy.deepcopy(model), lora_cfg(), 4)
    assert torch.equal(eng.compute_logp(batch), base)  # B = 0: the base model exactly
    eng.ppo_update(batch)
    after = eng.compute_logp(batch)
    m = batch.loss_mask
    assert (after - base)[m].abs().max() > 1e-3  # the step changed the policy
    worker = folded(model, eng)
    assert torch.allclose(logp_of(worker, batch)[m], after[m], atol=1e-5, rtol=0)
    # evaluation's plain copy is the same model, and so is PEFT's own merge of the adapter
    assert torch.allclose(logp_of(eng.sampling_model(), batch)[m], after[m], atol=1e-5, rtol=0)
    assert not lora.has_adapters(eng.sampling_model()) and lora.has_adapters(eng.model)


def test_only_adapters_train_and_publish(setup):
    model, _, batch = setup
    eng = TrainEngine(copy.deepcopy(model), lora_cfg(), 4)
    frozen = {k: v.clone() for k, v in eng.model.state_dict().items() if ".lora_" not in k}
    trainable = {id(p) for g in eng.optimizer.param_groups for p in g["params"]}
    names = [n for n, p in eng.model.named_parameters() if id(p) in trainable]
    assert names and all(".lora_A." in n or ".lora_B." in n for n in names)
    assert eng.optimizer.param_groups[0]["lr"] == 5e-3
    relative = TrainEngine(copy.deepcopy(model), load_config(None, ["actor.lora.rank=4"]).actor, 4)
    assert relative.optimizer.param_groups[0]["lr"] == pytest.approx(LORA_LR_FACTOR * plain_cfg().optimizer.lr)
    stats = eng.ppo_update(batch)
    assert all(torch.equal(v, eng.model.state_dict()[k]) for k, v in frozen.items())
    full = sum(p.numel() for p in model.parameters())
    assert stats["train/trainable_params"] == sum(eng.model.get_parameter(n).numel() for n in names) < full
    published = eng.weights()
    assert set(published) - {lora.SCALE} == set(lora.adapter_state(eng.model))
    assert float(published[lora.SCALE]) == pytest.approx(2.0)  # alpha null = 2 x rank
    # every linear layer of the body has an adapter, the LM head and embeddings none
    targets = lora.targets(published)
    linear = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and not n.endswith("lm_head")]
    assert targets == sorted(linear)


def test_local_engine_samples_the_folded_policy_and_refuses_an_unfolded_one(setup):
    model, tok, batch = setup
    eng = TrainEngine(copy.deepcopy(model), lora_cfg(), 4)
    eng.ppo_update(batch)
    with pytest.raises(ValueError, match="fold the LoRA adapters"):
        LocalEngine(eng.model)
    rollout = LocalEngine(copy.deepcopy(model), eos_token_ids=[tok.eos_token_id])
    published = {k: v.clone() for k, v in eng.weights().items()}
    fold = lora.Folder(rollout.model, published)
    rollout.update_weights(fold(published), 1)
    for _ in range(3):  # folding again from W0, never into the previous fold: no drift
        rollout.update_weights(fold(published), 1)
    want = folded(model, eng).state_dict()
    got = rollout.model.state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_reference_with_adapters_off_is_the_base_model(setup):
    model, _, batch = setup
    base = logp_of(model, batch)
    eng = TrainEngine(copy.deepcopy(model), lora_cfg("actor.kl_ctl=0.1", "actor.kl_in_reward=true"), 4)
    assert eng.ref_model is None  # no second copy
    eng.ppo_update(batch)
    kl = eng.reference_kl(batch)
    full = TrainEngine(copy.deepcopy(model), load_config(None, ["actor.dtype=float32", "actor.kl_ctl=0.1",
                                                                "actor.kl_in_reward=true"]).actor, 4)
    assert torch.allclose(kl, full.reference_kl(batch), atol=1e-6)  # both are KL(behaviour || base)
    # in the loss: the step runs, and the adapters were on again afterwards
    eng2 = TrainEngine(copy.deepcopy(model), lora_cfg("actor.kl_ctl=0.1"), 4)
    stats = eng2.ppo_update(batch)
    assert "loss/kl_ref" in stats
    assert not torch.allclose(eng2.compute_logp(batch)[batch.loss_mask], base[batch.loss_mask], atol=1e-4)


def test_gradient_checkpointing_trains_the_same_adapters(setup):
    model, _, batch = setup
    torch.manual_seed(3)  # A starts random: the same draw for both
    a = TrainEngine(copy.deepcopy(model), lora_cfg(), 4)
    torch.manual_seed(3)
    b = TrainEngine(copy.deepcopy(model), lora_cfg("actor.gradient_checkpointing=true"), 4)
    a.ppo_update(batch)
    b.ppo_update(batch)
    wa, wb = lora.adapter_state(a.model), lora.adapter_state(b.model)
    assert any(t.abs().sum() > 0 for k, t in wb.items() if ".lora_B." in k)
    assert all(torch.allclose(wa[k], wb[k], atol=1e-6) for k in wa)


def test_checkpoint_is_a_peft_adapter_and_resumes_exactly(setup, tmp_path):
    from peft import PeftModel

    model, tok, batch = setup
    eng = TrainEngine(copy.deepcopy(model), lora_cfg(), 4)
    eng.ppo_update(batch)
    save_engine(eng, tmp_path / "ck", tok)
    assert (tmp_path / "ck" / lora.ADAPTER_FILE).is_file() and not (tmp_path / "ck" / "model.safetensors").exists()
    size = (tmp_path / "ck" / lora.ADAPTER_FILE).stat().st_size
    assert size < 0.5 * sum(p.numel() * 4 for p in model.parameters())
    # PEFT loads it as it is, and its merge is our fold
    peft_model = PeftModel.from_pretrained(copy.deepcopy(model), str(tmp_path / "ck")).merge_and_unload()
    m = batch.loss_mask
    assert torch.allclose(logp_of(peft_model, batch)[m], eng.compute_logp(batch)[m], atol=1e-5, rtol=0)
    # resume: the next step equals the uninterrupted one's
    other = TrainEngine(copy.deepcopy(model), lora_cfg(), 4)
    load_engine(other, tmp_path / "ck")
    assert other.version == eng.version
    eng.ppo_update(batch)
    other.ppo_update(batch)
    wa, wb = lora.adapter_state(eng.model), lora.adapter_state(other.model)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_checkpoint_kinds_do_not_mix(setup, tmp_path):
    model, tok, batch = setup
    full = TrainEngine(copy.deepcopy(model), plain_cfg(), 4)
    save_engine(full, tmp_path / "full", tok)
    adapted = TrainEngine(copy.deepcopy(model), lora_cfg(), 4)
    save_engine(adapted, tmp_path / "lora", tok)
    with pytest.raises(ValueError, match="holds full weights.*actor.lora.rank=0"):
        load_engine(TrainEngine(copy.deepcopy(model), lora_cfg(), 4), tmp_path / "full")
    with pytest.raises(ValueError, match="holds a LoRA adapter.*actor.lora.rank=> 0"):
        load_engine(TrainEngine(copy.deepcopy(model), plain_cfg(), 4), tmp_path / "lora")
    with pytest.raises(ValueError, match="rank-4 adapter.*resume it with actor.lora.rank=4"):
        load_engine(TrainEngine(copy.deepcopy(model), lora_cfg("actor.lora.rank=8"), 4), tmp_path / "lora")


@pytest.mark.parametrize("overrides, match", [
    (["actor.lora.rank=-1"], "actor.lora.rank"),
    (["actor.lora.alpha=16"], "actor.lora.alpha.*only used with actor.lora.rank > 0"),
    (["actor.lora.rank=8", "actor.lora.dropout=1.5"], "actor.lora.dropout"),
])
def test_bad_lora_settings_are_one_line(overrides, match):
    with pytest.raises(ConfigError, match=match) as e:
        load_config(None, overrides)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("target, match", [
    ("qkv", "'qkv' names no module.*q_proj"),
    ("embed_tokens", "'embed_tokens' is not a linear layer"),
    ("lm_head", "'lm_head' is the LM head, which this model ties to its embeddings"),
])
def test_a_target_module_must_be_an_untied_linear_layer(tiny, target, match):
    model, _ = tiny
    with pytest.raises(ValueError, match=match):
        TrainEngine(copy.deepcopy(model), lora_cfg(f"actor.lora.target_modules=[{target}]"), 1)


def test_a_sequence_spanning_an_update_keeps_both_versions(setup):
    """The versions per token come from the engine, whatever the weights are: a fold between two decode steps
    tags the tokens after it with the new version."""
    model, tok, batch = setup
    eng = TrainEngine(copy.deepcopy(model), lora_cfg(), 4)
    rollout = LocalEngine(copy.deepcopy(model), eos_token_ids=[], max_batch=4)
    published = {k: v.clone() for k, v in eng.weights().items()}
    fold = lora.Folder(rollout.model, published)
    from a3po.rollout.engine import GenerationRequest

    rollout.submit(GenerationRequest([1, 2, 3], 6, rid=0, seed=1))
    done = []
    for step in range(8):
        done += rollout.step()
        if step == 2:
            eng.ppo_update(batch)
            rollout.update_weights(fold(eng.weights()), eng.version)
    (c,) = done
    assert c.output_versions[0] == 0 and c.output_versions[-1] == 1
    t = Trajectory(c.prompt_ids, c.output_ids, c.output_logprobs, c.output_versions, reward=0.0)
    assert set(collate([t], torch.zeros(1)).versions[0].tolist()) >= {0, 1}


@pytest.mark.slow
def test_a_lora_run_samples_its_adapters_resumes_evaluates_and_exports(tmp_path):
    """A real run: two workers fold each published adapter, so tokens sampled by the version being trained have
    the trainer's log-probs (fp32: no gap) although the adapters moved the policy away from the base; it resumes,
    `a3po eval` reads the adapter checkpoint and `a3po export` writes a plain model that is the same policy."""
    import json

    from procs import TINY, a3po

    from a3po.models import load_policy

    args = [*TINY, "actor.lora.rank=4", "actor.lora.lr=0.05", "rollout.max_head_offpolicyness=0",
            "rollout.n_workers=2", "evaluator.freq_steps=0"]
    res = a3po("train", *args, "total_train_steps=4", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    run = tmp_path / "runs" / "tiny"
    res = a3po("train", "--resume", str(run), "total_train_steps=6", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "stale/max" in r]
    assert [r["step"] for r in steps] == list(range(1, 7))
    full_bytes = 4 * sum(p.numel() for p in load_policy("tiny", seed=1)[0].parameters())
    for r in steps:
        assert r["mismatch/tokens"] > 0 and r["mismatch/abs_max"] < 1e-4, r  # sampled by the trained adapters
        assert 0 < r["sync/published_bytes"] < 0.5 * full_bytes
    out = tmp_path / "merged"
    res = a3po("export", str(run), "--out", str(out), cwd=tmp_path)
    assert res.returncode == 0 and "folded into tiny" in res.stdout, res.stderr[-2000:]
    base, tok = load_policy("tiny", seed=1)
    merged, _ = load_policy(str(out))
    batch = fixed_batch(base, len(tok))
    moved = (logp_of(merged, batch) - logp_of(base, batch))[batch.loss_mask].abs().max()
    assert moved > 1e-2  # the adapters moved the policy: a sampler reading the base would have shown a gap
    res = a3po("export", str(run), "--out", str(out), cwd=tmp_path)  # never over a model already there
    assert res.returncode == 2 and "not empty" in res.stderr and len(res.stderr.strip().splitlines()) == 1
    ckpt = run / "checkpoints" / "step_000006"
    res = a3po("train", *TINY, f"actor.path={ckpt}", cwd=tmp_path)  # an adapter is not a model to start from
    assert res.returncode == 2 and "is a LoRA adapter" in res.stderr and "a3po export" in res.stderr
    res = a3po("eval", str(run), "--out", str(tmp_path / "ev.json"), cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    assert json.loads((tmp_path / "ev.json").read_text())["step"] == 6
    res = a3po("train", "--resume", str(run), "actor.lora.rank=8", "total_train_steps=8", cwd=tmp_path)
    assert res.returncode == 2 and "rank-4 adapter" in res.stderr and len(res.stderr.strip().splitlines()) == 1
    res = a3po("train", *TINY, "actor.lora.rank=4", "actor.lora.target_modules=[qkv]", "fileroot=other", cwd=tmp_path)
    assert res.returncode == 2 and "'qkv' names no module" in res.stderr and len(res.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_smollm2_rank_16_publishes_at_most_3_percent_of_full_training():
    """What one version costs the weight sync: SmolLM2's rank-16 adapters on every body linear against the state
    full training publishes (every weight, the tied embedding under both its names)."""
    from a3po.models import load_policy

    model, _ = load_policy("smollm2-135m-instruct")
    full = sum(t.numel() * 4 for t in model.state_dict().values())  # fp32 in both transports
    lora.attach(model, 16, 32.0, 0.0, [])
    adapters = sum(t.numel() * 4 for t in lora.published(model, 2.0).values())
    assert adapters <= 0.03 * full

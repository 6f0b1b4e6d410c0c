"""The local rollout engine: sampling it can account for, continuous batching, in-flight updates.

Proves: per-token log-probs equal the training engine's within 1e-4 (fp32) with the same
weights and temperature; greedy decoding equals `model.generate`; continuous batching
gives the same samples as one request at a time; after an in-flight weight update the
tokens switch version mid-sequence and follow the new weights; top-k/top-p log-probs
are those of the renormalised distribution that was sampled.
"""

import copy
import math

import torch
from conftest import actor_cfg

from a3po.rollout import GenerationRequest, generate
from a3po.rollout.local import LocalEngine
from a3po.rollout.sampling import draw, sampling_logp
from a3po.train.engine import TrainEngine
from a3po.trajectories import Trajectory, collate


def prompts(tok, n):
    texts = [f"What is {i} + {i + 3}?" for i in range(n)]
    chats = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=False)
             for t in texts]
    return [tok.encode(c, add_special_tokens=False) for c in chats]


def engine_for(model, tok, **kw):
    return LocalEngine(model, eos_token_ids=[tok.eos_token_id], decode=tok.decode, pad_id=tok.pad_token_id, **kw)


def perturbed(model):
    """A copy of `model` with every weight moved a little: the 'next version' of an in-flight update."""
    new = copy.deepcopy(model)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return new


def batch_of(completions):
    return collate([Trajectory(c.prompt_ids, c.output_ids, c.output_logprobs, c.output_versions) for c in completions])


def test_logprobs_match_training_engine_fp32(tiny):
    model, tok = tiny
    reqs = [GenerationRequest(p, 12, rid=i, temperature=0.7, seed=i) for i, p in enumerate(prompts(tok, 6))]
    outs = generate(engine_for(model, tok, max_batch=4), reqs)
    batch = batch_of(outs)
    trainer = TrainEngine(copy.deepcopy(model), actor_cfg(), 1, temperature=0.7)
    logp = trainer.compute_logp(batch)
    m = batch.loss_mask
    assert m.sum() >= 30
    assert (logp[m] - batch.logp_behav[m]).abs().max() < 1e-4


def test_greedy_equals_model_generate(tiny):
    model, tok = tiny
    p = prompts(tok, 1)[0]
    out = generate(engine_for(model, tok), [GenerationRequest(p, 10, greedy=True)])[0]
    ref = model.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    assert out.output_ids == ref[0, len(p):].tolist()


def test_continuous_batching_gives_the_same_samples_as_one_at_a_time(tiny):
    model, tok = tiny
    reqs = [GenerationRequest(p, 4 + 3 * (i % 4), rid=i, seed=10 + i) for i, p in enumerate(prompts(tok, 7))]
    together = generate(engine_for(model, tok, max_batch=3), reqs)  # requests join as rows free up
    for r, c in zip(reqs, together):
        alone = generate(engine_for(model, tok, max_batch=1), [r])[0]
        assert c.output_ids == alone.output_ids
        assert max(abs(a - b) for a, b in zip(c.output_logprobs, alone.output_logprobs)) < 1e-4


def test_requests_join_while_others_run(tiny):
    model, tok = tiny
    ps = prompts(tok, 3)
    e = engine_for(model, tok, max_batch=8)
    e.submit(GenerationRequest(ps[0], 20, rid="early", seed=1))
    for _ in range(5):
        assert e.step() == []
    e.submit(GenerationRequest(ps[1], 3, rid="late", seed=2))
    finished = []
    while e.num_pending:
        finished.append([c.rid for c in e.step()])
    steps = [rids for rids in finished if rids]
    assert steps == [["late"], ["early"]]  # the late, short request finished while the long one ran on
    assert len(finished) > 3


def test_in_flight_update_switches_version_mid_sequence(tiny):
    model, tok = tiny
    new_model = perturbed(model)
    reqs = [GenerationRequest(p, 16, rid=i, seed=i, temperature=1.0) for i, p in enumerate(prompts(tok, 4))]
    e = engine_for(copy.deepcopy(model), tok, max_batch=4)
    for r in reqs:
        e.submit(r)
    done = []
    for _ in range(6):
        done += e.step()
    e.update_weights(new_model.state_dict(), version=1)
    while e.num_pending:
        done += e.step()
    two_versions = [c for c in done if set(c.output_versions) == {0, 1}]
    assert two_versions, "no sequence was in flight across the update"
    for c in done:
        k = c.output_versions.count(0)
        assert c.output_versions == [0] * k + [1] * (len(c.output_versions) - k)
    # tokens before the switch follow the old weights, tokens after it the new ones
    batch = batch_of(two_versions)
    old = TrainEngine(copy.deepcopy(model), actor_cfg(), 1).compute_logp(batch)
    new = TrainEngine(copy.deepcopy(new_model), actor_cfg(), 1).compute_logp(batch)
    m = batch.loss_mask
    v0, v1 = m & (batch.versions == 0), m & (batch.versions == 1)
    assert (old[v0] - batch.logp_behav[v0]).abs().max() < 1e-4
    assert (new[v1] - batch.logp_behav[v1]).abs().max() < 1e-4
    assert (old[v1] - batch.logp_behav[v1]).abs().max() > 1e-3  # the update really changed them


def test_keep_kv_update_labels_each_token_by_the_weights_that_computed_its_logits(tiny):
    model, tok = tiny
    new_model = perturbed(model)
    ps = prompts(tok, 4)

    def run(reprefill: bool):
        e = engine_for(copy.deepcopy(model), tok, max_batch=4, reprefill_on_update=reprefill)
        for i, p in enumerate(ps):
            e.submit(GenerationRequest(p, 16, rid=i, seed=i))
        done = []
        for _ in range(6):
            done += e.step()
        e.update_weights(new_model.state_dict(), version=1)
        e.submit(GenerationRequest(ps[0], 8, rid="late", seed=99))  # starts after the update
        while e.num_pending:
            done += e.step()
        return {c.rid: c for c in done}

    kept, redone = run(False), run(True)
    in_flight = [r for r in range(4) if len(redone[r].output_ids) > 6 and len(kept[r].output_ids) > 6]
    assert in_flight, "no sequence was in flight across the update"
    for r in in_flight:
        # the first six tokens are the same draws; keep_kv samples one more token from the
        # logits the old weights computed before the update, so it carries version 0
        assert kept[r].output_ids[:6] == redone[r].output_ids[:6]
        assert redone[r].output_versions.count(0) == 6 and kept[r].output_versions.count(0) == 7
        k = 7
        assert kept[r].output_versions == [0] * k + [1] * (len(kept[r].output_versions) - k)
    # each log-prob is the exact one its token was drawn with: version-0 tokens follow the old
    # weights, and a sequence that started after the update follows the new weights
    batch = batch_of([kept[r] for r in in_flight])
    old = TrainEngine(copy.deepcopy(model), actor_cfg(), 1).compute_logp(batch)
    v0 = batch.loss_mask & (batch.versions == 0)
    assert (old[v0] - batch.logp_behav[v0]).abs().max() < 1e-4
    late = batch_of([kept["late"]])
    new = TrainEngine(copy.deepcopy(new_model), actor_cfg(), 1).compute_logp(late)
    assert set(kept["late"].output_versions) == {1}
    assert (new[late.loss_mask] - late.logp_behav[late.loss_mask]).abs().max() < 1e-4


def test_stop_string_and_length_finish_reasons(tiny):
    model, tok = tiny
    p = prompts(tok, 1)[0]
    no_eos = dict(decode=tok.decode, pad_id=tok.pad_token_id)  # only the length or a stop string ends a row
    free = generate(LocalEngine(model, **no_eos), [GenerationRequest(p, 12, seed=3)])[0]
    assert free.finish_reason == "length" and len(free.output_ids) == 12
    # stop at the first occurrence of the text sampled as the 6th token (a seeded request draws the same tokens)
    stop_at = tok.decode(free.output_ids[5:6])
    first = tok.decode(free.output_ids).index(stop_at)
    cut = generate(LocalEngine(model, **no_eos), [GenerationRequest(p, 12, seed=3, stop=(stop_at,))])[0]
    assert cut.finish_reason == "stop"
    assert cut.output_ids == free.output_ids[: len(cut.output_ids)]  # the same samples, cut short
    text = tok.decode(cut.output_ids)
    assert stop_at in text and stop_at not in tok.decode(cut.output_ids[:-1])  # ended on the token completing it
    assert len(text) >= first + len(stop_at) and len(cut.output_ids) < 12


def test_top_k_top_p_logprobs_are_the_renormalised_distribution():
    # probs 0.5, 0.3, 0.15, 0.05
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 3))
    lp = sampling_logp(logits, torch.ones(3), torch.tensor([2, 0, 0]), torch.tensor([1.0, 0.7, 1.0]))
    # top-k 2: 0.5/0.8, 0.3/0.8
    assert torch.allclose(lp[0, :2].exp(), torch.tensor([0.625, 0.375])) and torch.isinf(lp[0, 2:]).all()
    # top-p 0.7: mass before token 2 is 0.8 >= 0.7, so tokens 0, 1 kept
    assert torch.allclose(lp[1, :2].exp(), torch.tensor([0.625, 0.375])) and torch.isinf(lp[1, 2:]).all()
    assert torch.allclose(lp[2].exp(), torch.tensor([0.5, 0.3, 0.15, 0.05]))
    gens = [torch.Generator().manual_seed(s) for s in range(3)]
    for _ in range(200):
        t = draw(lp, gens)
        assert (t[:2] < 2).all()


def test_draw_follows_the_distribution():
    lp = torch.log(torch.tensor([[0.1, 0.6, 0.3]]))
    g = [torch.Generator().manual_seed(0)]
    counts = torch.bincount(torch.cat([draw(lp, g) for _ in range(3000)]), minlength=3).float() / 3000
    assert torch.allclose(counts, torch.tensor([0.1, 0.6, 0.3]), atol=0.03)
    assert math.isclose(float(counts.sum()), 1.0)

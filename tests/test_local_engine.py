"""The local rollout engine: sampling it can account for, continuous batching, in-flight updates,
on both forward passes (a3po's KV decoder and the Hugging Face forward).

Proves: per-token log-probs equal the training engine's within 1e-4 (fp32) with the same
weights and temperature; greedy decoding equals `model.generate`; continuous batching
gives the same samples as one request at a time; after an in-flight weight update the
tokens switch version mid-sequence and follow the new weights; top-k/top-p log-probs
are those of the renormalised distribution that was sampled.
"""

import copy
import math

import pytest
import torch
from conftest import actor_cfg

from a3po.rollout import GenerationRequest, generate
from a3po.rollout.local import LocalEngine
from a3po.rollout.sampling import distribution, draw
from a3po.trainer.engine import TrainEngine
from a3po.trajectories import Trajectory, collate


def prompts(tok, n):
    texts = [f"What is {i} + {i + 3}?" for i in range(n)]
    chats = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=False)
             for t in texts]
    return [tok.encode(c, add_special_tokens=False) for c in chats]


@pytest.fixture(params=["a3po", "hf"])
def forward(request):
    """Every engine test runs on both forward passes (rollout.forward)."""
    return request.param


def engine_for(model, tok, forward, **kw):
    return LocalEngine(model, eos_token_ids=[tok.eos_token_id], decode=tok.decode, forward=forward, **kw)


def perturbed(model):
    """A copy of `model` with every weight moved a little: the 'next version' of an in-flight update."""
    new = copy.deepcopy(model)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return new


def batch_of(completions):
    return collate([Trajectory(c.prompt_ids, c.output_ids, c.output_logprobs, c.output_versions) for c in completions])


def test_logprobs_match_training_engine_fp32(tiny, forward):
    model, tok = tiny
    reqs = [GenerationRequest(p, 12, rid=i, temperature=0.7, seed=i) for i, p in enumerate(prompts(tok, 6))]
    outs = generate(engine_for(model, tok, forward, max_batch=4), reqs)
    batch = batch_of(outs)
    trainer = TrainEngine(copy.deepcopy(model), actor_cfg(), 1, temperature=0.7)
    logp = trainer.compute_logp(batch)
    m = batch.loss_mask
    assert m.sum() >= 30
    assert (logp[m] - batch.logp_behav[m]).abs().max() < 1e-4


def test_top_logprobs_are_the_most_likely_tokens_of_the_distribution_each_token_was_drawn_from(tiny, forward):
    """Asked for, each token's k alternatives: sorted, greedy at temperature 1 the model's own top k by a forward
    pass (within fp32 tolerance) with the chosen token first at its recorded log-prob; with top-k 3 only the
    three tokens the filter kept, renormalised. Not asked for: none, and the same tokens."""
    model, tok = tiny
    p = prompts(tok, 1)[0]
    outs = {c.rid: c for c in generate(engine_for(model, tok, forward), [
        GenerationRequest(p, 6, rid="top", greedy=True, top_logprobs=5),
        GenerationRequest(p, 6, rid="plain", greedy=True),
        GenerationRequest(p, 6, rid="filtered", temperature=0.7, top_k=3, seed=1, top_logprobs=5)])}
    top, plain, filtered = outs["top"], outs["plain"], outs["filtered"]
    assert plain.output_top_logprobs == [] and plain.output_ids == top.output_ids
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([p + top.output_ids])).logits[0, len(p) - 1:-1].float(), -1)
    assert len(top.output_top_logprobs) == len(top.output_ids) == 6
    for alts, chosen, lp, row in zip(top.output_top_logprobs, top.output_ids, top.output_logprobs, ref):
        ids, lps = [t for t, _ in alts], torch.tensor([x for _, x in alts])
        assert ids[0] == chosen and lps[0].item() == lp and torch.all(lps[:-1] >= lps[1:])
        assert ids == row.topk(5).indices.tolist() and torch.allclose(lps, row.topk(5).values, atol=1e-4)
        assert lps.exp().sum() <= 1 + 1e-6
    for alts, chosen, lp in zip(filtered.output_top_logprobs, filtered.output_ids, filtered.output_logprobs):
        assert len(alts) == 3 and dict(alts)[chosen] == lp  # the drawn token among them, at its recorded log-prob
        assert abs(sum(math.exp(x) for _, x in alts) - 1) < 1e-5


def test_greedy_equals_model_generate(tiny, forward):
    model, tok = tiny
    p = prompts(tok, 1)[0]
    out = generate(engine_for(model, tok, forward), [GenerationRequest(p, 10, greedy=True)])[0]
    ref = model.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    assert out.output_ids == ref[0, len(p):].tolist()


def test_continuous_batching_gives_the_same_samples_as_one_at_a_time(tiny, forward):
    model, tok = tiny
    reqs = [GenerationRequest(p, 4 + 3 * (i % 4), rid=i, seed=10 + i) for i, p in enumerate(prompts(tok, 7))]
    together = generate(engine_for(model, tok, forward, max_batch=3), reqs)  # requests join as rows free up
    for r, c in zip(reqs, together):
        alone = generate(engine_for(model, tok, forward, max_batch=1), [r])[0]
        assert c.output_ids == alone.output_ids
        assert max(abs(a - b) for a, b in zip(c.output_logprobs, alone.output_logprobs)) < 1e-4


def test_requests_join_while_others_run(tiny, forward):
    model, tok = tiny
    ps = prompts(tok, 3)
    e = engine_for(model, tok, forward, max_batch=8)
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


def test_in_flight_update_switches_version_mid_sequence(tiny, forward):
    model, tok = tiny
    new_model = perturbed(model)
    reqs = [GenerationRequest(p, 16, rid=i, seed=i, temperature=1.0) for i, p in enumerate(prompts(tok, 4))]
    e = engine_for(copy.deepcopy(model), tok, forward, max_batch=4)
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


def test_keep_kv_update_labels_each_token_by_the_weights_that_computed_its_logits(tiny, forward):
    model, tok = tiny
    new_model = perturbed(model)
    ps = prompts(tok, 4)

    def run(reprefill: bool):
        e = engine_for(copy.deepcopy(model), tok, forward, max_batch=4, reprefill_on_update=reprefill)
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


def test_stop_string_and_length_finish_reasons(tiny, forward):
    model, tok = tiny
    p = prompts(tok, 1)[0]
    no_eos = dict(decode=tok.decode, forward=forward)  # only the length or a stop string ends a row
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


def draws(logits, n, **settings):
    """`n` draws (`distribution`, then `draw`) on every row of `logits` (B, V), one generator per row: tokens
    (n, B), log-probs (n, B)."""
    B = logits.shape[0]
    gens = [torch.Generator().manual_seed(100 + r) for r in range(B)]
    args = {"temperature": torch.ones(B), "top_k": torch.zeros(B, dtype=torch.long), "top_p": torch.ones(B),
            "greedy": torch.zeros(B, dtype=torch.bool)}
    args.update(settings)
    p = distribution(logits, **args)  # a function of the logits and settings alone: the same for every draw
    out = [draw(p, args["greedy"], gens) for _ in range(n)]
    return torch.stack([t for t, _ in out]), torch.stack([lp for _, lp in out])


def test_top_k_top_p_logprobs_are_the_renormalised_distribution():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 3))
    tokens, logp = draws(logits, 400, top_k=torch.tensor([2, 0, 0]), top_p=torch.tensor([1.0, 0.7, 1.0]))
    renormalised = torch.log(torch.tensor([0.625, 0.375]))  # top-k 2, and top-p 0.7 (0.8 of mass before token 2)
    for row in (0, 1):
        assert set(tokens[:, row].tolist()) == {0, 1}
        assert torch.allclose(logp[:, row], renormalised[tokens[:, row]])
    assert set(tokens[:, 2].tolist()) == {0, 1, 2, 3}  # untouched row
    assert torch.allclose(logp[:, 2], logits[2, tokens[:, 2]])


@pytest.mark.parametrize("V", [3, 700])  # one block; several blocks with a partial last one
def test_draws_follow_the_distribution_and_report_its_logprob(V):
    g = torch.Generator().manual_seed(V)
    logits = torch.randn(2, V, generator=g) * 3
    logits[1, : V // 2] = float("-inf")  # mass only in the upper half, across block boundaries
    temperature = torch.tensor([1.0, 0.7])
    tokens, logp = draws(logits, 4000, temperature=temperature)
    probs = torch.softmax(logits / temperature[:, None], -1)
    freq = torch.stack([torch.bincount(tokens[:, r], minlength=V) for r in range(2)]).float() / 4000
    assert (freq - probs).abs().max() < 0.03
    assert (freq[1, : V // 2] == 0).all()
    exact = torch.log_softmax(logits / temperature[:, None], -1).gather(1, tokens.T).T
    assert torch.allclose(logp, exact, atol=1e-5)


def test_greedy_rows_take_the_argmax_with_the_raw_logprob():
    logits = torch.randn(3, 600)
    tokens, logp = draws(logits, 3, greedy=torch.tensor([True, False, True]), temperature=torch.tensor([0.5, 1, 2]))
    raw = torch.log_softmax(logits, -1)
    for row in (0, 2):
        assert (tokens[:, row] == logits[row].argmax()).all()
        assert torch.allclose(logp[:, row], raw[row].max())


def tiny_qwen2(tok):
    """A random two-layer Qwen2 (biases on q, k, v) over the tiny tokenizer."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    model = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:  # random biases, so that a forward ignoring them would differ
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    return model


def same_run_on_both_forwards(model, tok):
    """Rows of different lengths joining and finishing at different steps, some prefilled together with
    the same prompt (a group), on each forward: completions by rid."""
    ps = prompts(tok, 3)
    reqs = [GenerationRequest(ps[i % 3][: 20 + 7 * (i % 3)], 5 + 4 * (i % 4), rid=i, seed=i, temperature=0.8)
            for i in range(9)]
    return [{c.rid: c for c in generate(engine_for(model, tok, f, max_batch=4), reqs)} for f in ("a3po", "hf")]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_the_kv_decoder_samples_what_the_hugging_face_forward_samples(tiny, arch):
    model, tok = tiny
    if arch == "qwen2":
        model = tiny_qwen2(tok)
    engine = engine_for(model, tok, "auto")
    assert type(engine.forward).__name__ == "KVDecoder"
    ours, theirs = same_run_on_both_forwards(model, tok)
    assert ours.keys() == theirs.keys()
    for rid, c in ours.items():
        assert c.output_ids == theirs[rid].output_ids
        assert max(abs(a - b) for a, b in zip(c.output_logprobs, theirs[rid].output_logprobs)) < 1e-4


def test_the_kv_decoder_grows_its_cache_and_keeps_an_fp32_head(tiny):
    from a3po.models.head import use_fp32_head
    from a3po.rollout.kv_decoder import KVDecoder

    model, tok = tiny
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    use_fp32_head(bf16)
    long = prompts(tok, 1)[0] * 3  # well past the first capacity of 64 tokens
    engine = engine_for(bf16, tok, "a3po", max_batch=2)
    out = generate(engine, [GenerationRequest(long, 40, rid=0, seed=1), GenerationRequest(long[:10], 3, rid=1)])
    assert isinstance(engine.forward, KVDecoder) and engine.forward.capacity >= len(long) + 40
    assert len(out[0].output_ids) == 40 or out[0].finish_reason == "stop"
    # the fp32 head makes the logits fp32: the log-probs agree with the trainer's bf16 forward
    batch = batch_of(out)
    trainer = TrainEngine(bf16, actor_cfg("actor.dtype=bfloat16", "actor.fp32_lm_head=true"), 1)
    m = batch.loss_mask
    assert (trainer.compute_logp(batch)[m] - batch.logp_behav[m]).abs().max() < 0.1


def test_other_architectures_fall_back_to_the_hugging_face_forward(tiny):
    from transformers import GPT2Config, GPT2LMHeadModel

    _, tok = tiny
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=1, n_head=2)).eval()
    engine = engine_for(gpt2, tok, "auto")
    assert type(engine.forward).__name__ == "HFForward"
    out = generate(engine, [GenerationRequest(prompts(tok, 1)[0], 4, seed=0)])[0]
    assert len(out.output_ids) == 4 or out.finish_reason == "stop"
    with pytest.raises(ValueError, match="rollout.forward=a3po cannot run this model: model_type 'gpt2'"):
        engine_for(gpt2, tok, "a3po")


def test_the_kv_decoder_without_prepacked_weights_computes_the_same_logits(tiny):
    from a3po.rollout import kv_decoder

    model, tok = tiny
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    ps = prompts(tok, 3)
    packed = kv_decoder.KVDecoder(bf16, rows=3)
    assert packed.qkv[0].pack == kv_decoder.can_pack()
    plain = kv_decoder.KVDecoder(bf16, rows=3, pack=False)  # as on a torch without oneDNN's private linear ops
    assert not plain.qkv[0].pack
    a, b = packed.prefill(0, ps), plain.prefill(0, ps)
    assert (a.float() - b.float()).abs().max() < 0.05 * a.float().abs().max()
    t = a.argmax(-1)
    assert torch.allclose(packed.decode(t).float(), plain.decode(t).float(), atol=0.05 * a.float().abs().max())

"""Multi-turn episodes on the real local engine and the tiny model, environments in a real child process.

Proves: observation tokens carry mask 0, log-prob 0 and version -1, and no observation text
is among the tokens the loss sees; every turn's prompt begins with the previous context
exactly, and with the a3po forward turn k >= 2 computes only its new tokens, with the same
log-probs as a fresh prefill; a weight update inside a turn gives the episode two versions
in order; an environment that raises, hangs, returns garbage or a bad first prompt fails
its own episode only (with the reason), the others finish; max_turns and the context budget
end episodes with their reason; a chat template that rewrites earlier turns is one line under
`append`, and under `auto` or `rerender` gives a row per turn whose context is the conversation
rendered whole (a past reply's reasoning dropped, as the template does);
the calculator tool parses arithmetic itself (never eval) and answers errors as observations.
"""

import copy
import functools
import re

import pytest
import torch
from scripted_envs import OBSERVATION, Echo, Misbehaving

from a3po.config.choices import TurnContext
from a3po.data import CallProcess, Example
from a3po.envs import EnvSpec
from a3po.envs.arith import ArithError, evaluate, format_number
from a3po.envs.calculator import CalculatorEnv
from a3po.envs.host import EnvHost
from a3po.rollout import GenerationRequest, generate
from a3po.rollout.episodes import EpisodeRunner, Turns
from a3po.rollout.local import LocalEngine
from a3po.rollout.prompts import ChatTurns, TemplateError, appends, render
from a3po.trajectories import collate


class Recording(LocalEngine):
    """The real engine, remembering every request it was given."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.requests = []

    def submit(self, request):
        self.requests.append(request)
        super().submit(request)


def run_episodes(engine, tok, env_cls, examples, turns=None, timeout_s=5.0, during=None):
    """Run one episode per example to its end; `during(engine, step_count)` is called after every engine step."""
    spec = EnvSpec(env_cls.__name__, env_cls)
    env = CallProcess(EnvHost(env_cls), timeout_s)
    runner = EpisodeRunner(engine, tok, spec, turns or Turns(max_turns=5, max_new_tokens=6, max_context=512), env)
    try:
        for i, ex in enumerate(examples):
            runner.start(i, ex, seed=i)
        ended, steps = [], 0
        while runner.busy:
            for c in engine.step():
                runner.finished_turn(c)
            steps += 1
            if during is not None:
                during(engine, steps)
            ended += runner.poll(block_s=0.05 if engine.num_pending == 0 else 0.0)
        return sorted(ended, key=lambda e: e.eid)
    finally:
        env.close()


def examples(*items):
    return [Example(q, a, i) for i, (q, a) in enumerate(items)]


@pytest.fixture(params=["a3po", "hf"])
def forward(request):
    return request.param


def engine_for(model, tok, forward="a3po", **kw):
    return Recording(model, eos_token_ids=[tok.eos_token_id], decode=tok.decode, forward=forward, **kw)


def test_observation_tokens_are_masked_out_and_turns_extend_the_context(tiny, forward):
    model, tok = tiny
    engine = engine_for(model, tok, forward)
    eps = run_episodes(engine, tok, Echo, examples(("Say something.", "3"), ("Tell me more.", "3")))
    for ep in eps:
        assert ep.finish_reason == "done" and ep.reward == 1.0 and len(ep.actions) == 3
        t = ep.trajectories()[0]
        obs = [i for i, m in enumerate(t.output_mask) if not m]
        assert obs and all(t.output_versions[i] == -1 and t.output_logprobs[i] == 0.0 for i in obs)
        assert set(t.generated_versions) == {0}
        model_text = tok.decode([x for x, m in zip(t.output_ids, t.output_mask) if m])
        env_text = tok.decode([x for x, m in zip(t.output_ids, t.output_mask) if not m])
        assert OBSERVATION not in model_text and env_text.count(OBSERVATION) == 2
        batch = collate([t])
        p = len(t.prompt_ids)
        assert batch.loss_mask[0, p:].tolist() == t.output_mask and not batch.loss_mask[0, :p].any()
        assert (batch.versions[0][~batch.loss_mask[0]] == -1).all()
    for ep in eps:  # each turn's prompt is the previous turn's prompt and output, then the observation
        turns = [r for r in engine.requests if r.rid == ep.eid]
        assert len(turns) == 3
        context = ep.prompt_ids + ep.ids
        for r in turns:
            assert context[:len(r.prompt_ids)] == r.prompt_ids
        lengths, computed = zip(*ep.prefilled)
        if forward == "a3po":  # the kept cache: the previous turn's last token and the observation only
            turn_out = [len(r) for r in "".join("x" if m else " " for m in ep.mask).split()]  # runs of model tokens
            kept = [0] + [n + out - 1 for n, out in zip(lengths, turn_out)]
            assert list(computed) == [n - k for n, k in zip(lengths, kept)], (ep.prefilled, turn_out)
            assert computed[2] < lengths[2] / 2
        else:
            assert computed == lengths


def test_a_kept_cache_gives_the_logprobs_of_a_fresh_prefill(tiny):
    model, tok = tiny
    first = generate(engine := engine_for(model, tok), [
        GenerationRequest(tok.encode(f"What is {10 ** (2 * i)} + 4?"), 10, rid=i, seed=i, session=i)
        for i in range(3)])  # cached lengths differ: the rows continue together, each from its own length
    obs = [tok.encode(" wrong, try again." + "!" * (3 * i)) for i in range(3)]  # new tokens differ in number too
    follow = [GenerationRequest(c.prompt_ids + c.output_ids + obs[i], 10, rid=i, seed=50 + i, session=i)
              for i, c in enumerate(first)]
    kept = generate(engine, follow)
    fresh = generate(engine_for(model, tok), [copy.copy(r) for r in follow])
    assert len({len(c.prompt_ids) for c in first}) == 3
    for a, b, o in zip(kept, fresh, obs):
        assert a.prefilled == len(o) + 1 and b.prefilled == len(b.prompt_ids)
        assert a.output_ids == b.output_ids
        assert max(abs(x - y) for x, y in zip(a.output_logprobs, b.output_logprobs)) < 1e-4


def test_a_weight_update_inside_a_turn_gives_the_episode_two_versions_in_order(tiny):
    model, tok = tiny
    new = copy.deepcopy(model)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(0.05 * torch.randn_like(p))
    weights = new.state_dict()

    seen = []

    def update(engine, steps):  # two engine steps into the second turn (of 6 tokens), whatever the env's timing
        if len(engine.requests) == 2:
            seen.append(steps)
            if len(seen) == 2:
                engine.update_weights(weights, version=1)

    engine = engine_for(model, tok, reprefill_on_update=False)
    (ep,) = run_episodes(engine, tok, Echo, examples(("Say something.", "4")), during=update)
    t = ep.trajectories()[0]
    versions = t.generated_versions
    assert set(versions) == {0, 1} and versions == sorted(versions), versions
    assert all(v == -1 for v, m in zip(t.output_versions, t.output_mask) if not m)


def test_a_misbehaving_environment_fails_its_own_episode_only(tiny):
    model, tok = tiny
    items = examples(("raise", "3"), ("fine", "3"), ("hang", "3"), ("garbage", "3"), ("bad reset", "3"),
                     ("also fine", "3"))
    eps = run_episodes(engine_for(model, tok), tok, Misbehaving, items, timeout_s=1.0)
    by_q = {ep.example.question: ep for ep in eps}
    for q in ("fine", "also fine"):
        assert by_q[q].finish_reason == "done" and by_q[q].reward == 1.0 and by_q[q].failure is None
    expected = {"raise": "RuntimeError: the environment broke", "hang": "timeout after 1s",
                "garbage": "step() returned dict", "bad reset": "reset() returned int"}
    for q, needle in expected.items():
        ep = by_q[q]
        assert ep.finish_reason == "env_error" and ep.reward == 0.0 and needle in ep.failure, ep.failure
        assert ep.trajectories()[0].prompt_ids, "a failed episode still has a prompt for its row"


def test_max_turns_and_the_context_budget_end_episodes_with_their_reason(tiny):
    model, tok = tiny
    never_done = examples(("Keep going.", "99"))
    (ep,) = run_episodes(engine_for(model, tok), tok, Echo, never_done,
                         Turns(max_turns=2, max_new_tokens=6, max_context=512))
    assert ep.finish_reason == "max_turns" and len(ep.actions) == 2 and ep.reward == 0.0
    (ep,) = run_episodes(engine_for(model, tok), tok, Echo, never_done,
                         Turns(max_turns=50, max_new_tokens=6, max_context=80))
    assert ep.finish_reason == "context" and len(ep.prompt_ids) + len(ep.ids) <= 80


def test_a_template_that_rewrites_earlier_turns_is_one_line(tiny):
    _, tok = tiny
    tok = copy.deepcopy(tok)
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n"
                         "{% if m.role == 'assistant' and not loop.last %}(earlier){% else %}{{ m.content }}{% endif %}"
                         "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    with pytest.raises(TemplateError, match="renders earlier messages differently") as e:
        ChatTurns(tok).observation("wrong", "user", inline=False, ended_by_eos=True)
    assert "\n" not in str(e.value)


# drops a past reply's reasoning once a later message follows, as Qwen3's template does
REASONING_DROPPED = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.role == 'assistant' and not loop.last %}"
                     "{{ m.content.split('</think>')[-1].lstrip() }}{% else %}{{ m.content }}{% endif %}<|im_end|>\n"
                     "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def reasoning_dropped(tok):
    tok = copy.deepcopy(tok)
    tok.chat_template = REASONING_DROPPED
    return tok


def test_a_template_that_drops_past_reasoning_trains_a_row_per_turn(tiny):
    model, tok = tiny
    tok = reasoning_dropped(tok)
    assert not appends(tok) and appends(tiny[1])
    with pytest.raises(TemplateError, match="turn_context=rerender"):
        ChatTurns(tok).observation("wrong", "user", inline=False, ended_by_eos=True)
    said = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "<think>\nhmm\n</think>\n\n4"}]
    assert "hmm" not in tok.decode(render(tok, [*said, {"role": "user", "content": "wrong"}], continuing=False))
    continued = tok.decode(render(tok, said, continuing=True))  # an inline observation continues the reply
    assert continued.endswith("<|im_start|>assistant\n<think>\nhmm\n</think>\n\n4")

    engine = engine_for(model, tok)
    eps = run_episodes(engine, tok, Echo, examples(("Say something.", "3"), ("Tell me more.", "2")))
    for ep in eps:
        rows = ep.trajectories()
        turns = [r for r in engine.requests if r.rid == ep.eid]
        assert ep.finish_reason == "done" and len(rows) == len(turns) == len(ep.actions) == int(ep.example.answer)
        assert [t.part for t in rows] == list(range(len(rows))) and rows[0].episode is not None
        assert all(t.episode is None and t.reward == rows[0].reward == 1.0 for t in rows[1:])
        messages = [{"role": "user", "content": ep.example.question}]
        for k, (t, r) in enumerate(zip(rows, turns)):  # each row: the conversation so far, rendered whole, then
            assert t.prompt_ids == r.prompt_ids == render(tok, messages, continuing=False)  # the turn as generated
            assert all(t.output_mask) and 0 < len(t.output_ids) <= 6 and set(t.output_versions) == {0}
            assert OBSERVATION not in tok.decode(t.output_ids)
            messages += [{"role": "assistant", "content": ep.actions[k]}, {"role": "user", "content": OBSERVATION}]
        assert rows[0].episode.rerendered_tokens == sum(len(t.prompt_ids) for t in rows[1:]) > 0
        batch = collate(rows)
        assert batch.loss_mask.sum() == sum(len(t.output_ids) for t in rows)
    # rerender asked of a template that appends: the same rows; append (the default template): one row
    forced = run_episodes(engine_for(model, tiny[1]), tiny[1], Echo, examples(("Say something.", "3")),
                          Turns(max_turns=5, max_new_tokens=6, max_context=512, context=TurnContext.RERENDER))
    assert len(forced[0].trajectories()) == 3
    (one,) = run_episodes(engine_for(model, tiny[1]), tiny[1], Echo, examples(("Say something.", "3")))
    assert len(one.trajectories()) == 1 and one.trajectories()[0].episode.rerendered_tokens == 0


def test_the_calculator_parses_arithmetic_and_never_evaluates_text():
    assert evaluate("12 + 3*(4 - 1)") == 21 and format_number(evaluate("1/3")) == "0.333333"
    assert evaluate("2 × 3 ÷ 4 − 1") == evaluate("2*3/4-1")
    for bad, why in [("__import__('os').system('true')", "unexpected character"), ("1/0", "division by zero"),
                     ("(1+2", "missing ')'"), ("9" * 30, "more than 18 digits"), ("1" + "*99999999" * 30, "longer"),
                     ("-" * 40 + "1", "nested deeper"), ("99999999999*99999999999", "too large")]:
        with pytest.raises(ArithError, match=re.escape(why)):
            evaluate(bad)
    from a3po.data.rewards import ExactReward

    env = CalculatorEnv(Example("What is 123 + 456?", "579", 0), ExactReward())
    assert env.reset().endswith("What is 123 + 456?") and "<calc>" in env.reset()
    step = env.step("Let me compute <calc>123 + 456</calc>")
    assert (step.observation, step.inline, step.tool_call, step.tool_error, step.done) == \
           ("<result>579</result>", True, True, False, False)
    step = env.step("<calc>123 + abc</calc>")
    assert step.tool_error and step.observation.startswith("<result>error: unexpected character")
    assert env.step("The answer is 579.").reward == 1.0
    assert env.step("The answer is 578.").reward == 0.0


def test_the_calculator_is_exact_and_reads_only_plain_ascii_numbers():
    """Past float's 53 bits a result stays exact; a comma that is not a thousands separator (`1,5`), and digits of
    other scripts (Arabic-Indic, fullwidth), are refused with the reason rather than read as something else."""
    assert format_number(evaluate("100000000000000000/3")) == "33333333333333333.333333"  # float said ...332
    assert format_number(evaluate("2/3")) == "0.666667" and format_number(evaluate("-2/3")) == "-0.666667"
    assert format_number(evaluate("1/8")) == "0.125" and format_number(evaluate("-1/3000000")) == "-0.000000"
    assert evaluate("1,500 + 1") == 1501 and evaluate("1,234,567.5*2") == 2469135
    for bad, why in [("1,5 + 1", "'1,5' is not a number"), ("12, + 1", "'12,' is not a number"),
                     ("1,5000", "'1,5000' is not a number"), ("0,500", "'0,500' is not"),
                     ("\u0661\u0662 + \u0663", "unexpected character '\u0661'"),
                     ("\uff11 + 1", "unexpected character")]:
        with pytest.raises(ArithError, match=re.escape(why)):
            evaluate(bad)


def test_inline_observations_continue_the_model_message(tiny):
    _, tok = tiny
    ids = ChatTurns(tok).observation("<result>7</result>", "user", inline=True, ended_by_eos=False)
    assert tok.decode(ids) == "<result>7</result>"
    ids = ChatTurns(tok).observation("wrong", "user", inline=False, ended_by_eos=True)
    assert tok.decode(ids) == "\n<|im_start|>user\nwrong<|im_end|>\n<|im_start|>assistant\n"
    ids = ChatTurns(tok).observation("wrong", "user", inline=False, ended_by_eos=False)  # cut by length: closed here
    assert tok.decode(ids).startswith("<|im_end|>\n<|im_start|>user\n")


def test_an_episode_is_rebuilt_by_replay_after_another_hangs(tiny):
    """The env host's replay, directly: a child that never saw the episode answers its step from the actions."""
    host = EnvHost(functools.partial(Echo))
    ex = Example("q", "3", 0)
    step, _ = host("step", "e", ex, ("a", "b", "c"))  # never reset here: rebuilt from the first two actions
    assert step.done and step.reward == 1.0

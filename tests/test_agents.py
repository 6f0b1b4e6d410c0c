"""Agents against a rollout worker's endpoint: a real tiny model in the local engine, the loopback chat server,
and the agents of scripted_agents.py in a real agent process, driven as a rollout worker drives them.

Proves: what an agent is served trains token in, token out (loss mask 0 on all it sent, behaviour log-probs
equal to the model's at each token's version, a weight update between two calls of one episode carried per
token); conversations that branch become rows that train each generated token once; bad requests are 400s
and a stranger's URL a 404; an agent that raises, returns garbage, hangs or blocks its loop ends its own
episode with the reason; the endpoint listens on loopback only.
"""

import copy
import json
import socket
import time

import pytest
import torch
from scripted_agents import FOLLOW_UP

from a3po.agents.host import AgentProcess
from a3po.data import Example
from a3po.data.rewards import Imported
from a3po.pipeline.loop import episode_stats
from a3po.rollout.agents import AgentRunner, prompt_threads
from a3po.rollout.chat import ChatQueue
from a3po.rollout.episodes import Turns
from a3po.rollout.local import LocalEngine
from a3po.rollout.prompts import encode_messages
from a3po.serving.http import ChatServer
from a3po.serving.protocol import ChatRequest, chat_completion

pytestmark = pytest.mark.slow
QUESTION = "What is 3 + 4?"


class Harness:
    def __init__(self, tiny, timeout_s=30.0, max_turns=4, max_context=512, agent="by_example", max_new_tokens=8):
        self.model, self.tok = tiny
        self.engine = LocalEngine(self.model, eos_token_ids=[self.tok.eos_token_id], decode=self.tok.decode,
                                  max_batch=16, reprefill_on_update=True)
        self.chat = chat = ChatQueue(timeout_s)
        self.server = ChatServer(chat.ask, "tiny").start()
        self.agents = AgentProcess(Imported(f"scripted_agents:{agent}"), timeout_s)
        self.threads = prompt_threads()
        self.runner = AgentRunner(self.engine, self.tok, Turns(max_turns, max_new_tokens, max_context), self.agents,
                                  self.server, chat, self.threads)
        self.n = 0

    def start(self, agent: str, seed: int | None = None, **example):
        self.n += 1
        ex = Example(example.pop("question", QUESTION), "7", self.n, {"agent": agent, **example})
        self.runner.start(("g", self.n), ex, seed=self.n if seed is None else seed)

    def run(self, on_finished=None, timeout=120.0) -> dict:
        ended, deadline = {}, time.monotonic() + timeout
        while self.runner.busy:
            assert time.monotonic() < deadline, "episodes still running at the test's deadline"
            self.runner.pump(block_s=0.002 if self.engine.num_pending == 0 else 0.0)
            for c in self.engine.step():
                self.runner.finished_turn(c)
                if on_finished:
                    on_finished(c)
            ended.update({ep.eid[1]: ep for ep in self.runner.poll()})
        return ended

    def rows(self, ep):
        return ep.trajectories(self.tok, None)

    def close(self):
        self.agents.close()
        self.chat.close()
        self.server.close()
        self.threads.shutdown(wait=False, cancel_futures=True)


@pytest.fixture
def harness(tiny):
    made = []

    def make(**kw):
        made.append(Harness(tiny, **kw))
        return made[-1]

    yield make
    for h in made:
        h.close()


def logprobs_of(model, ids: list[int]) -> torch.Tensor:
    """log p(ids[t] | ids[:t]) under `model` at temperature 1, for t = 1..len-1."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]


def test_two_calls_train_as_one_row_with_masks_log_probs_and_versions_per_token(harness):
    h = harness()
    original, moved = copy.deepcopy(h.model), copy.deepcopy(h.model)  # the engine updates h.model in place
    with torch.no_grad():
        for p in moved.parameters():
            p.add_(0.02 * torch.randn_like(p))
    updated = []

    def update_after_the_first_call(c):
        if not updated:
            h.engine.update_weights(moved.state_dict(), version=1)
            updated.append(c)

    h.start("two_turns")
    ep = h.run(update_after_the_first_call)[1]
    assert ep.failure is None and ep.reward in (0.25, 0.75) and ep.calls == 2
    [t] = h.rows(ep)  # the second call continued the first: one row
    assert t.prompt_ids == encode_messages(h.tok, [{"role": "user", "content": QUESTION}])
    mask, versions = t.output_mask, t.output_versions
    first_turn = mask.index(False)  # the first reply, then what the agent sent, then the second reply
    assert all(mask[:first_turn]) and set(versions[:first_turn]) == {0}
    second = [i for i in range(first_turn, len(mask)) if mask[i]]
    assert second and set(versions[i] for i in second) == {1} and second[-1] == len(mask) - 1
    sent = [i for i in range(len(mask)) if not mask[i]]
    assert all(versions[i] == -1 and t.output_logprobs[i] == 0.0 for i in sent)
    assert "check it" in h.tok.decode([t.output_ids[i] for i in sent])  # the agent's message is masked out ...
    assert "check it" not in h.tok.decode([t.output_ids[i] for i in range(len(mask)) if mask[i]])  # ... all of it
    ids = t.prompt_ids + t.output_ids
    for version, model in ((0, original), (1, moved)):
        expected = logprobs_of(model, ids)[len(t.prompt_ids) - 1:]
        at = [i for i in range(len(mask)) if mask[i] and versions[i] == version]
        got = torch.tensor([t.output_logprobs[i] for i in at])
        assert torch.allclose(got, expected[at], atol=1e-4), (version, got, expected[at])


def test_streams_n_choices_and_completions_on_an_episodes_url_train_what_was_generated(harness):
    """One harness, three runs. Streaming is only how a reply travels: the same seed, streamed or not, trains the
    same tokens. n=3 choices are three branch rows of one question, the continued one extended. /v1/completions:
    a prompt of token ids, then a text that starts with that prompt's text and the reply, continue one row (its
    tokens the ones generated, the added text masked); a text that does not start with it is a new row."""
    h = harness()
    h.start("two_turns", seed=5)
    plain = h.run()[1]
    h.start("two_turns_streamed", seed=5)
    streamed = h.run()[2]
    assert streamed.failure is None and streamed.reward == plain.reward and streamed.calls == 2
    [a], [b] = h.rows(plain), h.rows(streamed)
    assert (a.prompt_ids, a.output_ids, a.output_mask, a.output_logprobs) == \
           (b.prompt_ids, b.output_ids, b.output_mask, b.output_logprobs)

    text = "Question: 3 + 4 ="
    ids = h.tok.encode(text, add_special_tokens=False)
    served = {3: [], 4: []}
    h.start("three_choices_then_continue")
    h.start("completes", ids=ids, text=text)
    ended = h.run(lambda c: served[c.rid[1][1]].append(c.output_ids))
    choices, completes = ended[3], ended[4]
    rows = h.rows(choices)
    assert choices.failure is None and choices.reward == 1.0 and choices.calls == 4 and len(rows) == 3
    assert len({tuple(r.prompt_ids) for r in rows}) == 1  # each choice a row of the same question
    assert sum(r.n_generated for r in rows) == sum(map(len, served[3]))  # every generated token in exactly one row
    assert sorted(r.output_mask.count(False) > 0 for r in rows) == [False, False, True]  # one choice continued

    assert completes.failure is None and completes.calls == 3, completes.failure
    first, other = h.rows(completes)
    assert first.prompt_ids == ids and [i for i, m in zip(first.output_ids, first.output_mask) if m] == \
        served[4][0] + served[4][1]
    assert h.tok.decode([i for i, m in zip(first.output_ids, first.output_mask) if not m]) == " Next:"
    assert other.prompt_ids == h.tok.encode("Other: " + text, add_special_tokens=False)


def test_a_stream_of_a_tool_call_puts_together_as_the_openai_client_reads_it():
    """The chunks of a reply with text and two calls, read with the openai client's own chunk type: the role
    first, the text, each call at its index, finish_reason tool_calls, then the usage."""
    from openai.types.chat import ChatCompletionChunk

    from a3po.serving.protocol import ChatReply, stream_chunks
    from a3po.serving.toolcalls import ToolCall

    calls = (ToolCall("call_1", "add", '{"a": 1}'), ToolCall("call_2", "mul", "{}"))
    reply = ChatReply("Adding.", "stop", 7, 20, tool_calls=calls)
    chunks = [ChatCompletionChunk.model_validate(c) for c in stream_chunks([reply], "tiny", False, True)]
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas[0].role == "assistant" and "".join(d.content or "" for d in deltas) == "Adding."
    got = [(t.index, t.id, t.function.name, t.function.arguments) for d in deltas for t in d.tool_calls or []]
    assert got == [(0, "call_1", "add", '{"a": 1}'), (1, "call_2", "mul", "{}")]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == 27


def test_a_conversation_that_branches_becomes_rows_that_train_each_token_once(harness):
    h = harness()
    served = []
    h.start("retry_then_continue")
    ep = h.run(lambda c: served.append(len(c.output_ids)))[1]
    rows = h.rows(ep)
    assert ep.calls == 3 and len(rows) == 2
    assert [r.part for r in rows] == [0, 1] and rows[0].episode is not None and rows[1].episode is None
    assert sum(r.n_generated for r in rows) == sum(served)  # every generated token in exactly one row
    assert rows[1].prompt_ids == rows[0].prompt_ids  # the retry: the same question, its own answer
    assert rows[0].output_mask.count(False) > 0  # the continuation extended the first row
    assert all(r.reward == 1.0 for r in rows)


def test_a_template_that_rewrites_a_past_reply_by_its_text_gets_the_request_rendered_whole(tiny):
    """As Qwen3's template drops a past reply's reasoning, this one drops a past reply's spaces: the follow-up
    cannot extend the first row (its context would not be what the template shows), so it is a row of its own."""
    model, tok = tiny
    tok = copy.deepcopy(tok)
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.role == 'assistant' and not "
                         "loop.last %}{{ m.content | replace(' ', '') }}{% else %}{{ m.content }}{% endif %}"
                         "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    h = Harness((model, tok))
    try:
        h.start("two_turns", seed=28)  # a seed whose first reply holds a space (asserted below)
        ep = h.run()[1]
    finally:
        h.close()
    first, second = h.rows(ep)
    reply = tok.decode(first.output_ids, skip_special_tokens=True)
    assert " " in reply, f"the test needs a first reply with a space, got {reply!r}: choose another seed"
    assert ep.calls == 2 and all(first.output_mask) and all(second.output_mask)
    said = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": reply}]
    assert second.prompt_ids == encode_messages(tok, [*said, {"role": "user", "content": FOLLOW_UP}])


def test_calls_in_flight_together_are_rows_of_their_own(harness):
    h = harness()
    h.start("parallel")
    ep = h.run()[1]
    rows = h.rows(ep)
    assert ep.calls == 3 and len(rows) == 3 and all(all(r.output_mask) for r in rows)
    assert sorted(h.tok.decode(r.prompt_ids).count("(") for r in rows) == [1, 1, 1]


def test_a_plain_function_agent_gets_a_blocking_client(harness):
    h = harness(agent="sync_agent")
    h.start("sync_agent")
    ep = h.run()[1]
    assert ep.failure is None and ep.reward == 1.0 and ep.calls == 1


def test_bad_requests_are_400s_and_a_strangers_url_is_a_404(harness):
    h = harness()
    h.start("malformed")
    h.start("wrong_url")
    ended = h.run()
    assert ended[1].reward == 1.0 and ended[1].calls == 1  # the four bad requests never reached the engine
    assert ended[2].reward == 1.0 and ended[2].calls == 0
    assert [t.n_generated for t in h.rows(ended[2])] == [0]  # no model call: the question stands in


def test_a_small_call_is_not_held_up_while_a_5_mb_one_is_refused(harness):
    h = harness(max_turns=64)
    h.start("huge_beside_small")
    ended = h.run()
    assert ended[1].failure is None and ended[1].reward == 1.0


@pytest.mark.parametrize("agent, why", [
    ("raises", "ValueError: the agent broke"),
    ("returns_text", "the agent returned a non-numeric reward 'high'"),
])
def test_an_agent_that_raises_or_returns_garbage_fails_its_own_episode(harness, agent, why):
    h = harness()
    h.start(agent)
    h.start("two_turns")
    ended = h.run()
    assert why in ended[1].failure and ended[1].reward == 0.0 and ended[1].finish_reason == "env_error"
    assert ended[2].failure is None and ended[2].calls == 2


def test_a_hung_agent_ends_its_episode_at_the_deadline(harness):
    h = harness(timeout_s=2.0)
    h.start("hangs")
    t0 = time.monotonic()
    ep = h.run()[1]
    assert "did not finish within train_dataset.agent_timeout_s=2s" in ep.failure
    assert 2.0 <= time.monotonic() - t0 < 10 and ep.calls == 1
    assert [t.n_generated > 0 for t in h.rows(ep)] == [True]  # what it was served still trains (reward 0)
    assert h.agents.restarts == 0  # cancelled on its loop, nothing restarted


def test_an_agent_blocking_its_loop_gets_its_process_replaced_and_the_next_episode_runs(harness):
    h = harness(timeout_s=2.0)
    h.start("blocks_its_loop")
    ep = h.run()[1]
    assert "did not finish within" in ep.failure
    deadline = time.monotonic() + 60
    while h.agents.restarts == 0:  # the cancel goes unanswered: the process is replaced after its grace
        assert time.monotonic() < deadline, "the stuck agent process was not replaced"
        assert h.runner.poll(block_s=0.1) == []
    assert h.agents.restarts == 1
    h.agents.timeout_s = h.chat.reply_timeout_s = 60.0  # the next episode: no deadline a loaded machine could miss
    h.start("two_turns")
    ep = h.run()[2]
    assert ep.failure is None and ep.calls == 2


def test_an_episode_makes_at_most_max_turns_calls_and_its_context_stays_in_bounds(harness):
    h = harness(max_turns=2)
    h.start("too_many_calls")
    ep = h.run()[1]
    assert ep.calls == 2 and "max_turns" in ep.failure and "BadRequestError" in ep.failure
    h = harness(max_context=12)
    h.start("two_turns")
    ep = h.run()[1]
    assert ep.calls == 0 and "train_dataset.max_context_tokens=12" in ep.failure


def test_the_endpoint_listens_on_loopback_only(harness):
    h = harness()
    assert h.server.url.startswith("http://127.0.0.1:")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))
            outward = s.getsockname()[0]
        except OSError:
            outward = "127.0.0.1"
    if outward.startswith("127."):
        pytest.skip("no non-loopback interface on this machine")
    with pytest.raises(OSError):
        socket.create_connection((outward, h.server.port), timeout=5).close()


def test_an_episode_of_several_rows_is_one_sample_of_its_group():
    """Group statistics over episodes, not rows: an agent's episode in three rows weighs as much as one in one,
    and every row gets its episode's advantage."""
    from a3po.algo import normalize_advantages
    from a3po.config import load_config
    from a3po.pipeline.loop import batch_with_advantages
    from a3po.trajectories import Trajectory

    def row(reward, part):
        return Trajectory([1, 2], [3, 4], [-0.5, -0.5], [0, 0], reward=reward, part=part)

    cfg = load_config(None, ["gconfig.n_samples=2"])
    rewards = [1.0, 0.0, 0.5, 0.25]  # two groups of two episodes; the first episode has three rows
    trajs = [row(1.0, 0), row(1.0, 1), row(1.0, 2), row(0.0, 0), row(0.5, 0), row(0.25, 0)]
    batch, _ = batch_with_advantages(cfg, None, trajs, pad_id=0)
    expected = normalize_advantages(torch.tensor(rewards), 2)
    assert torch.equal(batch.advantages[:, -1], expected[[0, 0, 0, 1, 2, 3]])  # per token: the last one


def test_a_reply_is_cut_before_the_stop_string_that_ended_it(tiny):
    from a3po.rollout.chat import reply_of
    from a3po.rollout.engine import Completion

    _, tok = tiny
    ids = tok.encode("<calc>12 + 3</calc>", add_special_tokens=False)
    c = Completion("r", [1], ids, [-0.1] * len(ids), [0] * len(ids), finish_reason="stop")
    plain, with_logprobs = ChatRequest([]), ChatRequest([], logprobs=True)
    assert reply_of(c, tok, plain, ("</calc>", "zz")).text == "<calc>12 + 3"
    assert reply_of(c, tok, plain, ()).text == "<calc>12 + 3</calc>"
    long = Completion("r", [1], ids, [-0.1] * len(ids), [0] * len(ids), finish_reason="length")
    assert reply_of(long, tok, with_logprobs, ("</calc>",)).text == "<calc>12 + 3</calc>"  # not ended by it: whole
    assert reply_of(c, tok, with_logprobs, ()).completion_tokens == len(ids)


def test_tool_calls_are_read_from_the_reply_text_and_the_tokens_stay_as_generated(tiny):
    """Hermes-format calls become the protocol's tool_calls (finish_reason "tool_calls"), text around them the
    content; malformed call text comes back as the text it is; tool_choice "none", no tools offered, or a template
    with no known format leave the text alone. The completion's ids are never touched."""
    from a3po.rollout.chat import reply_of
    from a3po.rollout.engine import Completion
    from a3po.serving.toolcalls import format_of

    _, tok = tiny
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    asked, refused = ChatRequest([], tools=tools), ChatRequest([], tools=tools, tool_choice="none")
    assert format_of("{% for t in tools %}<tool_call>{{ t }}</tool_call>{% endfor %}") == "hermes"
    assert format_of(tok.chat_template) is None and format_of(None) is None

    def reply(text, request=asked, fmt="hermes"):
        ids = tok.encode(text, add_special_tokens=False)
        c = Completion("r", [1], ids, [-0.1] * len(ids), [0] * len(ids), finish_reason="stop")
        got = reply_of(c, tok, request, (), fmt)
        assert c.output_ids == ids and got.completion_tokens == len(ids)
        return got, chat_completion([got], "tiny")["choices"][0]

    got, choice = reply('Adding. <tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
                        '<tool_call>{"name": "add", "arguments": {"a": 3, "b": 4}}</tool_call>')
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Adding."
    calls = choice["message"]["tool_calls"]
    assert [(c["type"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
           [("function", "add", {"a": 1, "b": 2}), ("function", "add", {"a": 3, "b": 4})]
    assert len({c["id"] for c in calls}) == 2 and not got.malformed_tool_call
    _, choice = reply('<tool_call>{"name": "add", "arguments": {}}</tool_call>')
    assert choice["message"]["content"] is None and choice["finish_reason"] == "tool_calls"
    for bad in ('<tool_call>{"name": "add", "arguments": {"a": 1</tool_call>',
                '<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"name": "add", "arguments": [1]}</tool_call>',
                'Adding. <tool_call>{"name": "add"'):
        got, choice = reply(bad)
        assert got.malformed_tool_call and choice["message"] == {"role": "assistant", "content": bad}, bad
        assert choice["finish_reason"] == "stop"
    text = '<tool_call>{"name": "add", "arguments": {}}</tool_call>'
    for request, fmt in ((refused, "hermes"), (ChatRequest([]), "hermes"), (asked, None)):
        got, choice = reply(text, request, fmt)
        assert choice["message"]["content"] == text and "tool_calls" not in choice["message"]


HERMES = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content or '' }}{% for c in m.tool_calls or [] %}"
          "<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")  # Hermes calls, tools not shown
CALL = '<tool_call>{"name": "add"}</tool_call>'


def test_a_tool_call_comes_back_as_tool_calls_and_its_echo_continues_the_row(tiny):
    """The tiny model taught, by a few supervised steps, to answer in the Hermes format its template shows: the
    reply is tool_calls; the agent's next request carries that assistant message and a tool result, and continues
    the same row, whose trained tokens are exactly the two completions' ids."""
    model, tok = tiny[0], copy.deepcopy(tiny[1])
    tok.chat_template = HERMES
    prompt = tok.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True,
                                     tokenize=False)
    ids = tok.encode(prompt + CALL, add_special_tokens=False) + [tok.eos_token_id]
    n_prompt = len(tok.encode(prompt, add_special_tokens=False))
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(40):
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].float(), -1)
        loss = -logp.gather(-1, torch.tensor(ids[1:])[:, None])[n_prompt - 1:].mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    h = Harness((model, tok), max_new_tokens=48)
    try:
        generated = []
        h.runner.start(("g", 1), Example(QUESTION, "7", 1, {"agent": "calls_a_tool"}), seed=1, greedy=True)
        ep = h.run(lambda c: generated.append(c.output_ids))[1]
        cut = len(tok.encode('<tool_call>{"name', add_special_tokens=False))  # the call opened, never closed
        h.runner.start(("g", 2), Example(QUESTION, "7", 2, {"agent": "cuts_its_call", "max_tokens": cut}), seed=2,
                       greedy=True)
        short = h.run()[2]
    finally:
        h.close()
    assert tok.decode(generated[0], skip_special_tokens=True) == CALL  # the taught answer, as tokens
    assert ep.failure is None and ep.reward == 1.0 and ep.calls == 2, (ep.failure, ep.reward)
    assert (h.rows(ep)[0].episode.tool_calls, h.rows(ep)[0].episode.malformed_tool_calls) == (1, 0)
    assert short.failure is None and short.reward == 1.0  # the malformed call came back as text ...
    assert h.rows(short)[0].episode.malformed_tool_calls == 1  # ... and is counted
    assert episode_stats(h.rows(ep) + h.rows(short))["episode/tool_calls_malformed_mean"] == 0.5
    [t] = h.rows(ep)  # the echo of the call continued the row
    assert [i for i, m in zip(t.output_ids, t.output_mask) if m] == generated[0] + generated[1]
    sent = [i for i, m in zip(t.output_ids, t.output_mask) if not m]  # the call is not rendered again from tool_calls
    assert tok.decode(sent) == "\n<|im_start|>tool\n7<|im_end|>\n<|im_start|>assistant\n"

"""Agent episodes: an agent's chat requests served by the engine and recorded token in, token out.

    runner = AgentRunner(engine, tokenizer, turns, AgentProcess(agent, timeout), server, chat)
    runner.start(eid, example, seed)          # the agent runs in its process, calling the server
    while runner.busy:
        runner.pump()                          # requests that arrived -> engine
        for c in engine.step():
            runner.finished_turn(c)            # completions -> replies, recorded
        for episode in runner.poll(): ...      # episodes whose agent returned

As a `GroupRunner` (rollout/groups.py), `start_group` starts a group's episodes and
`poll_groups` serves the requests that arrived and returns each group once all of its agents
have returned.

Each episode gets its own base URL (`/<route>/v1`, an unguessable route) on the worker's
loopback server. A request is matched against what the episode was already served: when its
messages begin with an earlier request's messages followed by the reply the server gave
(content equal to the reply's text), its prompt is that earlier context's token ids (the
model's tokens as it generated them, never re-tokenised) followed by the chat template's delta
for the new messages, as in rollout/episodes.py. Otherwise it starts a new row from the
rendered messages. The loop only matches and submits: rendering and tokenising happen on a
few threads of their own (`pump` hands a request there and takes it back once its ids are
made), so a long request never holds up the engine or the other episodes' replies. A
`max_tokens` above `gconfig.max_new_tokens` is a 400 naming that limit. Tool calls in a reply
are read into `tool_calls` as `a3po serve` reads them (serving/toolcalls.py); an assistant
message carrying them, sent back, matches the reply it came from, and the template's delta is
taken around the text the model generated (its call text included), never re-rendered calls.
A request for `n` choices arrives as n requests in flight at once (rollout/chat.py), so each
choice is a branch row. A completions request (a prompt the agent rendered) continues the row
whose earlier completion prompt and reply it starts with: as ids, the row's ids themselves
(matched on the loop: a comparison, no tokenising); as text, that prompt's text and the reply's
decoded text, the rest tokenised on a prompt thread. Streaming is the server's concern
(serving/http.py): it never reaches this module, so what trains cannot depend on it.

An episode is recorded as rows: a conversation that only grows is one row; a request that
branches (a retry from an earlier point, a sub-call with other messages, two calls in flight
at once) starts a new row whose prompt holds the shared prefix as context. Every generated
token is trained in exactly one row, with loss mask 1, its behaviour log-prob and version;
everything the agent sent gets mask 0, log-prob 0 and version -1. All rows of an episode get
the agent's reward, and the episode's advantage (pipeline/loop.py): they are one sample of
the group.
"""

from __future__ import annotations

import json
import queue
import secrets
import time
from collections.abc import Hashable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from a3po.config.choices import AUTO
from a3po.data import Example
from a3po.episode_end import EpisodeEnd
from a3po.rollout.chat import ChatQueue, Pending, reply_of
from a3po.rollout.engine import Completion, GenerationRequest, RolloutEngine
from a3po.rollout.episodes import Turns
from a3po.rollout.groups import Gathering, Group
from a3po.rollout.prompts import chars_per_token, encode_prompt, encode_within
from a3po.serving.http import ChatServer, NotFound
from a3po.serving.protocol import BadRequest
from a3po.serving.toolcalls import resolve
from a3po.trajectories import EpisodeInfo, Trajectory

_SLOT = "\x00a3po-reply\x00"  # stands for the model's reply while the template renders around it
PROMPT_THREADS = 4  # render and tokenise requests beside the loop; more only queue for the same cores


def prompt_threads() -> ThreadPoolExecutor:
    """The pool an AgentRunner renders and tokenises its requests in; its owner shuts it down."""
    return ThreadPoolExecutor(PROMPT_THREADS, thread_name_prefix="a3po-agent-prompt")
_TEXT = (None,)  # the key of a completions request: no chat conversation continues it
_GONE = "no running episode at this URL: an agent talks to the base URL its client was given, while its episode runs"


def _key(messages: list[dict], tools) -> tuple:
    """What makes two conversations the same: every message's fields, and the tools offered."""
    tools_key = json.dumps(tools, sort_keys=True) if tools else ""
    return (tools_key, *(json.dumps(m, sort_keys=True) for m in messages))


@dataclass
class Mark:
    """A point a later request may continue from: the conversation up to a reply, and the row's length there."""

    key: tuple
    n_ids: int
    ended_by_eos: bool
    text: str | None = None  # a completions request's prompt text and the reply's decoded tokens (None for chat)


@dataclass
class Row:
    ids: list[int]  # prompt and everything after
    logprobs: list[float]
    versions: list[int]
    mask: list[bool]
    marks: list[Mark] = field(default_factory=list)
    busy: bool = False  # a request of this row is generating

    def add(self, ids: list[int], logprobs=None, versions=None, generated: bool = False) -> None:
        self.ids += ids
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)
        self.versions += versions if versions is not None else [-1] * len(ids)
        self.mask += [generated] * len(ids)

    def trajectory(self, reward: float, finish: str, part: int, info: EpisodeInfo | None) -> Trajectory:
        first = self.mask.index(True) if True in self.mask else len(self.ids)
        return Trajectory(self.ids[:first], self.ids[first:], self.logprobs[first:], self.versions[first:],
                          reward=reward, finish_reason=finish, output_mask=self.mask[first:], episode=info,
                          part=part)


@dataclass
class _Call:
    pending: Pending
    row: int
    key: tuple  # the request's conversation, without the reply
    text: str | None = None  # a completions request's prompt as text (ids decoded)


@dataclass
class _Prompt:
    """A request on its way through a prompt thread: what the loop saw of its episode, then the ids made from it."""

    pending: Pending
    eid: Hashable
    marks: list[tuple[int, int, Mark]]  # (row, index in the row, mark): the episode's points to continue from
    key: tuple = ()
    row: int = -1  # the row whose mark it continues, -1 for a new row
    mark: int = -1
    ids: list[int] = field(default_factory=list)  # after the mark's n_ids (all of the prompt for a new row)
    error: BadRequest | None = None


@dataclass
class AgentEpisode:
    eid: Hashable
    example: Example
    seed: int
    greedy: bool
    route: str
    rows: list[Row] = field(default_factory=list)
    calls: int = 0  # requests submitted to the engine
    tool_calls: int = 0  # calls read from its replies
    malformed_tool_calls: int = 0  # replies whose call text could not be read (returned to the agent as text)
    preparing: int = 0  # requests on a prompt thread
    in_flight: int = 0  # requests the agent is waiting for (preparing or generating)
    agent_s: float = 0.0  # time with no call of its in flight: the agent's own work (its "environment" time)
    waiting_since: float = field(default_factory=time.perf_counter)
    reward: float = 0.0
    finish_reason: str | None = None
    failure: str | None = None
    started_at: float = field(default_factory=time.perf_counter)
    ended_at: float = 0.0

    def trajectories(self, tokenizer, system_prompt: str | None) -> list[Trajectory]:
        rows = [r for r in self.rows if any(r.mask)]
        info = EpisodeInfo(turns=self.calls, tool_calls=self.tool_calls, success=self.reward >= 1.0 - 1e-6,
                           env_s=self.agent_s, wall_s=self.ended_at - self.started_at,
                           malformed_tool_calls=self.malformed_tool_calls)
        if not rows:  # no model token to train: the question stands in, so the group keeps its sample
            rows = [Row(encode_prompt(tokenizer, self.example, system_prompt), [], [], [])]
        return [r.trajectory(self.reward, self.finish_reason, i, info if i == 0 else None) for i, r in enumerate(rows)]


class AgentRunner:
    poll_s = 0.002  # an agent's next request waits in the chat queue until a poll submits it

    def __init__(self, engine: RolloutEngine, tokenizer, turns: Turns, agents, server: ChatServer, chat: ChatQueue,
                 threads: ThreadPoolExecutor, tool_call_format: str = AUTO):
        """`threads`: where requests are rendered and tokenised beside the loop (`prompt_threads`), owned by the
        caller, as the agents' process, chat server and queue are. `tool_call_format`: a ToolCallFormat choice
        (train_dataset.tool_call_format)."""
        self.engine, self.tok, self.turns, self.agents, self.server, self.chat = \
            engine, tokenizer, turns, agents, server, chat
        eos = tokenizer.eos_token_id
        self.eos_text = tokenizer.decode([eos]) if eos is not None else None
        self.running: dict[Hashable, AgentEpisode] = {}
        self.routes: dict[str, Hashable] = {}
        self.calls: dict[tuple, _Call] = {}  # engine rid -> the request it answers
        self._done: list[AgentEpisode] = []
        self._groups = Gathering()
        self.per_token = chars_per_token(tokenizer)
        self.tool_format = resolve(tool_call_format, getattr(tokenizer, "chat_template", None))
        self._threads = threads
        self._made: queue.SimpleQueue[_Prompt] = queue.SimpleQueue()  # from the prompt threads to the loop

    @property
    def busy(self) -> bool:
        return bool(self.running)

    sampling = busy  # a running agent may send another request

    def start_group(self, key: Hashable, example: Example, seeds: list[int], greedy: bool = False) -> None:
        for eid, seed in zip(self._groups.open(key, len(seeds)), seeds):
            self.start(eid, example, seed, greedy)

    def poll_groups(self, block_s: float = 0.0) -> list[Group]:
        """Submit the requests that arrived (waiting up to block_s for one); the groups whose agents all returned."""
        self.pump(block_s)
        return self._groups.ended(self.poll(), lambda ep: ep.trajectories(self.tok, self.turns.system_prompt))

    def start(self, eid: Hashable, example: Example, seed: int, greedy: bool = False) -> None:
        route = secrets.token_hex(8)
        self.running[eid] = AgentEpisode(eid, example, seed, greedy, route)
        self.routes[route] = eid
        self.agents.start(eid, example, self.server.route_url(route))

    def pump(self, block_s: float = 0.0) -> None:
        """Hand the requests that arrived (waiting up to block_s for one) to the prompt threads; submit those
        whose prompts are made."""
        for p in self.chat.take(block_s):
            if p.abandoned:  # its agent stopped waiting: nobody would read the reply
                continue
            try:
                self._accept(p)
            except (BadRequest, NotFound) as e:
                p.fail(e)
        while True:
            try:
                made = self._made.get_nowait()
            except queue.Empty:
                break
            self._submit(made)

    def finished_turn(self, c: Completion) -> None:
        call = self.calls.pop(c.rid)
        ep = self.running.get(c.rid[1])
        if ep is None:  # its episode ended meanwhile (the agent returned or ran out of time)
            self.engine.release((c.rid[1], call.row))
            return
        row = ep.rows[call.row]
        row.busy = False
        ep.in_flight -= 1
        if not ep.in_flight:
            ep.waiting_since = time.perf_counter()
        row.add(c.output_ids, c.output_logprobs, c.output_versions, generated=True)
        reply = reply_of(c, self.tok, call.pending.request, (*self.turns.stop, *call.pending.request.stop),
                         self.tool_format)
        ep.tool_calls += len(reply.tool_calls)
        ep.malformed_tool_calls += reply.malformed_tool_call
        ended_by_eos = c.finish_reason == "stop" and bool(c.output_ids) and c.output_ids[-1] == self.tok.eos_token_id
        if call.pending.request.is_text:  # continued by a prompt that starts with these ids, or with this text
            text = None if call.text is None else call.text + self.tok.decode(c.output_ids, skip_special_tokens=True)
            row.marks.append(Mark(_TEXT, len(row.ids), ended_by_eos, text))
        else:
            said = {"role": "assistant", "content": reply.text}  # as the agent sends it back (protocol._messages)
            if reply.tool_calls:
                said["tool_calls"] = [t.as_message_field() for t in reply.tool_calls]
            row.marks.append(Mark((*call.key, json.dumps(said, sort_keys=True)), len(row.ids), ended_by_eos))
        call.pending.reply(reply)

    def poll(self, block_s: float = 0.0) -> list[AgentEpisode]:
        """Episodes whose agent returned, failed or ran out of time since the last poll."""
        self.pump()
        for eid, reward, failure in self.agents.poll(block_s):
            ep = self.running.pop(eid, None)
            if ep is None:
                continue
            del self.routes[ep.route]
            ep.reward, ep.failure, ep.ended_at = (0.0 if failure else reward), failure, time.perf_counter()
            if not ep.in_flight:
                ep.agent_s += ep.ended_at - ep.waiting_since
            ep.finish_reason = EpisodeEnd.ENV_ERROR if failure else EpisodeEnd.DONE
            for i, row in enumerate(ep.rows):
                if not row.busy:  # a busy row's cache goes when its completion comes back
                    self.engine.release((eid, i))
            self._done.append(ep)
        done, self._done = self._done, []
        return done

    # -- one request ------------------------------------------------------------------

    def _accept(self, p: Pending) -> None:
        """On the loop: the request's episode and budget checked, its prompt handed to a prompt thread."""
        eid = self.routes.get(p.route) if p.route is not None else None
        ep = self.running.get(eid) if eid is not None else None
        if ep is None:
            raise NotFound(_GONE)
        t = self.turns
        if p.refused is not None:
            raise p.refused
        if ep.calls + ep.preparing >= t.max_turns:
            raise BadRequest(f"this episode has made its {t.max_turns} model calls (train_dataset.max_turns)")
        left = t.max_turns - ep.calls - ep.preparing
        if p.choice == 0 and p.request.n > left:  # the first choice checks for all: none is generated unserved
            raise BadRequest(f"n={p.request.n} choices are {p.request.n} model calls, and this episode has {left} of "
                             f"its {t.max_turns} left (train_dataset.max_turns); ask for fewer")
        marks = [(i, j, mark) for i, row in enumerate(ep.rows) for j, mark in enumerate(row.marks)]
        job = _Prompt(p, eid, marks)
        if isinstance(p.request.prompt, tuple):  # token ids: matched here, against the rows as they are now
            job.key = _TEXT
            job.row, job.mark, job.ids = self._id_prompt(ep, marks, p.request.prompt)
        if not ep.in_flight:
            ep.agent_s += time.perf_counter() - ep.waiting_since
        ep.in_flight += 1
        ep.preparing += 1
        if isinstance(p.request.prompt, tuple):
            self._made.put(job)
        else:
            self._threads.submit(self._make, job)

    def _make(self, job: _Prompt) -> None:
        """On a prompt thread: the request's key and prompt ids, from the marks the loop gave (they never change)."""
        try:
            r = job.pending.request
            if r.is_text:
                job.key = _TEXT
                job.row, job.mark, job.ids = self._text_prompt(job.marks, r.prompt)
            else:
                job.key = _key(r.messages, r.tools)
                job.row, job.mark, job.ids = self._prompt(job.marks, job.key, r.messages, r.tools)
        except BadRequest as e:
            job.error = e
        except Exception as e:  # noqa: BLE001 - a tokenizer's own failure fails this request, not the loop
            job.error = BadRequest(f"the request's prompt could not be made: {type(e).__name__}: {e}")
        finally:
            self._made.put(job)

    def _submit(self, job: _Prompt) -> None:
        """On the loop: a made prompt onto its row (extended, or a new one) and into the engine."""
        p, ep = job.pending, self.running.get(job.eid)
        if ep is None:  # the episode ended while its prompt was made
            p.fail(NotFound(_GONE))
            return
        ep.preparing -= 1
        if job.error is not None or p.abandoned:  # abandoned: its agent stopped waiting, nobody reads a reply
            ep.in_flight -= 1
            if not ep.in_flight:
                ep.waiting_since = time.perf_counter()
            if job.error is not None:
                p.fail(job.error)
            return
        t, r = self.turns, p.request
        i = job.row
        if i < 0:
            ids, extends = job.ids, False
        else:
            row, mark = ep.rows[i], ep.rows[i].marks[job.mark]
            ids = row.ids[:mark.n_ids] + job.ids
            extends = not row.busy and job.mark == len(row.marks) - 1
        if extends:
            row = ep.rows[i]
            row.add(ids[len(row.ids):])
        else:
            row = Row([], [], [], [])
            row.add(ids)
            ep.rows.append(row)
            i = len(ep.rows) - 1
        row.busy = True
        ep.calls += 1
        rid = ("agent", job.eid, ep.calls)
        text = self.tok.decode(list(r.prompt)) if isinstance(r.prompt, tuple) else r.prompt  # a text continues it
        self.calls[rid] = _Call(p, i, job.key, text)
        self.engine.submit(GenerationRequest(
            ids, min(r.max_tokens or t.max_new_tokens, t.max_new_tokens, t.max_context - len(ids)), rid=rid,
            temperature=t.temperature, top_p=t.top_p, top_k=t.top_k, min_p=t.min_p, greedy=ep.greedy,
            stop=(*t.stop, *r.stop), seed=ep.seed * 64 + ep.calls, session=(job.eid, i)))

    def _prompt(self, marks: list[tuple[int, int, Mark]], key: tuple, messages: list[dict],
                tools) -> tuple[int, int, list[int]]:
        """(row, mark, ids after the mark's n_ids): the template's delta after the longest earlier conversation the
        request continues, else (-1, -1, the messages rendered whole) for a new row. Either way the prompt fits
        train_dataset.max_context_tokens with room for a reply, or it is a BadRequest."""
        best = None
        for i, j, mark in marks:
            if len(mark.key) < len(key) and key[:len(mark.key)] == mark.key and \
                    (best is None or len(mark.key) > len(best[2].key)):
                best = (i, j, mark)
        if best is not None:
            i, j, mark = best
            delta = self._delta(messages, len(mark.key) - 1, tools, mark.ended_by_eos, mark.n_ids)
            if delta is not None:
                return i, j, delta
        try:
            text = self.tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
        except Exception as e:  # the template's own error (a role order it refuses)
            raise BadRequest(f"the model's chat template cannot render these messages: {e}") from None
        return -1, -1, self._fit(text, 0)

    def _text_prompt(self, marks: list[tuple[int, int, Mark]], prompt: str) -> tuple[int, int, list[int]]:
        """A completions prompt given as text: (row, mark, the ids of the text after the mark's) when it starts with
        the text of the longest earlier completion it continues, else (-1, -1, the text's ids) for a new row."""
        best = max(((i, j, m) for i, j, m in marks if m.text is not None and prompt.startswith(m.text)),
                   key=lambda b: len(b[2].text), default=None)
        if best is not None:
            i, j, mark = best
            return i, j, self._fit(prompt[len(mark.text):], mark.n_ids)
        return -1, -1, self._fit(prompt, 0)

    def _id_prompt(self, ep: AgentEpisode, marks: list[tuple[int, int, Mark]],
                   prompt: tuple[int, ...]) -> tuple[int, int, list[int]]:
        """A completions prompt given as token ids: (row, mark, the ids after the mark's) when it starts with the
        ids of the longest earlier point of a row (any request's reply), else (-1, -1, the ids) for a new row."""
        t, vocab = self.turns, len(self.tok)
        if len(prompt) >= t.max_context:
            raise BadRequest(f"the prompt does not fit an episode's context with room for a reply "
                             f"(train_dataset.max_context_tokens={t.max_context})")
        if max(prompt) >= vocab:
            raise BadRequest(f"prompt: token id {max(prompt)} is not in this model's vocabulary of {vocab}")
        best = max(((i, j, m) for i, j, m in marks
                    if m.n_ids <= len(prompt) and list(prompt[:m.n_ids]) == ep.rows[i].ids[:m.n_ids]),
                   key=lambda b: b[2].n_ids, default=None)
        if best is not None:
            return best[0], best[1], list(prompt[best[2].n_ids:])
        return -1, -1, list(prompt)

    def _fit(self, text: str, before: int) -> list[int]:
        """text's ids, when `before` ids and they leave room for a reply in the context."""
        t = self.turns
        ids = encode_within(self.tok, text, t.max_context - before, self.per_token)
        if ids is None:
            raise BadRequest(f"the conversation does not fit an episode's context with room for a reply "
                             f"(train_dataset.max_context_tokens={t.max_context})")
        return ids

    def _delta(self, messages: list[dict], n: int, tools, ended_by_eos: bool, before: int) -> list[int] | None:
        """Ids after the model's reply (message n - 1) for messages n..: the rest of the template's closing of the
        reply and the new messages, from the template's own text; None if the template renders earlier messages
        differently once more follow (then the request is rendered whole)."""
        # the reply as the text the model generated: its calls are in that text, not rendered again from tool_calls
        reply = {k: v for k, v in messages[n - 1].items() if k != "tool_calls"}
        said = [*messages[:n - 1], {**reply, "content": _SLOT}]
        try:
            base = self.tok.apply_chat_template(said, tools=tools, tokenize=False)
            full = self.tok.apply_chat_template([*said, *messages[n:]], tools=tools, add_generation_prompt=True,
                                                tokenize=False)
        except Exception:
            return None
        if not full.startswith(base) or _SLOT not in base:
            return None
        try:  # and with the reply itself: a template may rewrite a reply by what it holds (Qwen3 drops reasoning)
            said = [*messages[:n - 1], reply]
            if not self.tok.apply_chat_template([*said, *messages[n:]], tools=tools, add_generation_prompt=True,
                                                tokenize=False).startswith(
                    self.tok.apply_chat_template(said, tools=tools, tokenize=False)):
                return None
        except Exception:
            return None
        closing = base[base.rindex(_SLOT) + len(_SLOT):]
        if ended_by_eos and self.eos_text and closing.startswith(self.eos_text):
            closing = closing[len(self.eos_text):]
        return self._fit(closing + full[len(base):], before)

"""Multi-turn episodes as state machines beside the engine: model turn, environment step, model turn, ...

    runner = EpisodeRunner(engine, tokenizer, spec, Turns.from_config(cfg), CallProcess(EnvHost(...), timeout))
    runner.start(eid, example, seed)
    while runner.busy:            # the caller steps the engine and hands finished turns back
        for c in engine.step():
            runner.finished_turn(c)
        for episode in runner.poll():
            ...                   # episode.trajectory()

As a `GroupRunner` (rollout/groups.py), `start_group` starts a group's episodes and
`poll_groups` returns each group once all of its episodes have ended.

An episode's context is token ids that only grow (token in, token out): the engine's output
ids are appended verbatim, the environment's observation as the chat template's delta
(rollout/prompts.py), and each turn's prompt is the whole context, which begins with the
previous turn's exactly (asserted). Observation tokens carry log-prob 0, version -1 and
mask 0, like prompt tokens. Each turn is a request under the episode's session, so the
engine keeps its KV cache between turns.

A template that renders earlier messages differently once more follow (Qwen3's drops a past
reply's reasoning) cannot grow a context by appending; with `rerender` (train_dataset.turn_context,
or auto for such a template) each turn is its own row instead: its prompt is the conversation
so far rendered whole by the template (the model's earlier replies as the text it wrote, the
observations as messages), all of it context with mask 0, and its output the turn's tokens as
generated. The rows are one sample of the group, as an agent's rows are (part 0 first), sharing
the episode's reward; what the re-rendering costs (context tokens prefilled and trained again)
is counted in `episode/rerendered_tokens_mean`.

Environment calls run in a child process (data/scoring.py) with a deadline: an environment
that raises, hangs or returns the wrong type fails its own episode (finish reason
`env_error`, the reason kept for the failure count) and no other. An episode ends when the
environment says done, after `max_turns` model turns, or when the next observation would
not fit the context budget (its reward is then what the environment gave so far).

With `rounds` (rollout.lockstep) turns go to the engine in rounds: a turn waits until no
turn is generating and no environment call is out, then every waiting turn is submitted at
once, in episode order. The engine's batches are then the same whatever the timing of the
environment's answers (continuous batching otherwise joins each turn when its answer lands).
"""

from __future__ import annotations

import time
from collections.abc import Hashable
from dataclasses import dataclass, field

from a3po.config.choices import AUTO, TurnContext
from a3po.data import CallProcess, Example
from a3po.envs import EnvSpec
from a3po.envs.host import CLOSE, RESET, STEP
from a3po.episode_end import EpisodeEnd
from a3po.rollout.engine import Completion, GenerationRequest, RolloutEngine
from a3po.rollout.groups import Gathering, Group
from a3po.rollout.prompts import ChatTurns, appends, encode_messages, encode_prompt, render
from a3po.trajectories import EpisodeInfo, Trajectory

DONE, MAX_TURNS, CONTEXT, ENV_ERROR = EpisodeEnd.DONE, EpisodeEnd.MAX_TURNS, EpisodeEnd.CONTEXT, EpisodeEnd.ENV_ERROR


@dataclass(frozen=True)
class Turns:
    """How turns are sampled and bounded (from gconfig and train_dataset)."""

    max_turns: int
    max_new_tokens: int  # per turn
    max_context: int  # prompt + every turn + every observation
    stop: tuple[str, ...] = ()
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    system_prompt: str | None = None
    context: str = AUTO  # TurnContext: how the next turn's context is made

    @classmethod
    def from_config(cls, cfg, spec: EnvSpec | None) -> Turns:
        """spec: the environment (its stop strings end a turn too); None for an agent's calls."""
        g, d = cfg.gconfig, cfg.train_dataset
        return cls(d.max_turns, g.max_new_tokens, d.max_context_tokens, (*g.stop, *(spec.stop if spec else ())),
                   g.temperature, g.top_p, g.top_k, g.min_p, d.system_prompt, d.turn_context)


@dataclass
class Episode:
    eid: Hashable
    example: Example
    seed: int
    greedy: bool
    prompt_ids: list[int] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)  # everything after the prompt: turns and observations
    # rerender: the conversation as messages, whether its last message is the model's still being continued
    # (an inline observation went into it), the rows of the turns before this one, the context tokens rendered
    # again for them
    messages: list[dict] = field(default_factory=list)
    continuing: bool = False
    rows: list[tuple] = field(default_factory=list)
    rerendered: int = 0
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    mask: list[bool] = field(default_factory=list)
    actions: list[str] = field(default_factory=list)  # each turn's text, as the environment saw it
    prefilled: list[tuple[int, int]] = field(default_factory=list)  # per turn: (prompt tokens, of them computed)
    reward: float = 0.0  # discounted by turn
    raw_reward: float = 0.0  # undiscounted
    tool_calls: int = 0
    tool_errors: int = 0
    last_ended_by_eos: bool = False
    finish_reason: str | None = None
    failure: str | None = None
    env_s: float = 0.0
    sent_at: float = 0.0
    started_at: float = field(default_factory=time.perf_counter)
    ended_at: float = 0.0

    @property
    def context(self) -> list[int]:
        return self.prompt_ids + self.ids

    @property
    def info(self) -> EpisodeInfo:
        return EpisodeInfo(turns=len(self.actions), tool_calls=self.tool_calls, tool_errors=self.tool_errors,
                           success=self.raw_reward >= 1.0 - 1e-6, env_s=self.env_s,
                           wall_s=self.ended_at - self.started_at, rerendered_tokens=self.rerendered)

    @property
    def row(self) -> tuple:
        return self.prompt_ids, self.ids, self.logprobs, self.versions, self.mask

    def trajectories(self) -> list[Trajectory]:
        """The episode's rows: one, or (rerender) one per turn that generated a token, the first carrying the
        episode's info."""
        rows = [r for r in (*self.rows, self.row) if any(r[4])] or [self.row]
        return [Trajectory(p, ids, lps, vs, reward=self.reward, finish_reason=self.finish_reason or ENV_ERROR,
                           output_mask=mask, episode=self.info if i == 0 else None, part=i)
                for i, (p, ids, lps, vs, mask) in enumerate(rows)]


class EpisodeRunner:
    poll_s = 0.002  # an environment's answer starts the episode's next turn: poll again soon

    def __init__(self, engine: RolloutEngine, tokenizer, spec: EnvSpec, turns: Turns, env: CallProcess,
                 rounds: bool = False):
        self.engine, self.tok, self.spec, self.turns, self.env = engine, tokenizer, spec, turns, env
        self.chat = ChatTurns(tokenizer)
        self.eos = tokenizer.eos_token_id
        self.rounds = rounds
        self.rerender = turns.context == TurnContext.RERENDER or (turns.context == AUTO and not appends(tokenizer))
        self.running: dict[Hashable, Episode] = {}
        self._done: list[Episode] = []
        self._generating = 0  # turns in the engine
        self._awaiting: set[Hashable] = set()  # episodes with an environment call out (reset or step)
        self._next: list[GenerationRequest] = []  # rounds: turns waiting for the round to end
        self._groups = Gathering()

    @property
    def busy(self) -> bool:
        return bool(self.running)

    sampling = busy  # a running episode's next turn is still to come

    def start_group(self, key: Hashable, example: Example, seeds: list[int], greedy: bool = False) -> None:
        for eid, seed in zip(self._groups.open(key, len(seeds)), seeds):
            self.start(eid, example, seed, greedy)

    def poll_groups(self, block_s: float = 0.0) -> list[Group]:
        """The groups whose episodes have all ended (waiting up to block_s for the environment's answer)."""
        return self._groups.ended(self.poll(block_s), Episode.trajectories)

    def start(self, eid: Hashable, example: Example, seed: int, greedy: bool = False) -> None:
        ep = Episode(eid, example, seed, greedy)
        self.running[eid] = ep
        self._call(ep, RESET, eid, example)

    def finished_turn(self, c: Completion) -> None:
        """A model turn the engine finished (its rid is the episode's id): the environment answers it next."""
        ep = self.running[c.rid]
        self._generating -= 1
        assert c.prompt_ids == ep.context, "a turn's prompt must be the episode's context"
        ep.ids += c.output_ids
        ep.logprobs += c.output_logprobs
        ep.versions += c.output_versions
        ep.mask += [True] * len(c.output_ids)
        ep.last_ended_by_eos = c.finish_reason == "stop" and bool(c.output_ids) and c.output_ids[-1] == self.eos
        ep.actions.append(self.tok.decode(c.output_ids, skip_special_tokens=True))
        if ep.continuing:
            ep.messages[-1] = {**ep.messages[-1], "content": ep.messages[-1]["content"] + ep.actions[-1]}
        else:
            ep.messages.append({"role": "assistant", "content": ep.actions[-1]})
        ep.prefilled.append((len(c.prompt_ids), c.prefilled))
        self._call(ep, STEP, ep.eid, ep.example, tuple(ep.actions))

    def poll(self, block_s: float = 0.0) -> list[Episode]:
        """Apply the environment's answers that arrived (waiting up to block_s for one); the episodes that ended."""
        for key, value, failure in self.env.wait(block_s) if block_s else self.env.poll():
            ep = self.running.get(key)
            if ep is None:  # the answer to a close
                continue
            self._awaiting.discard(key)
            ep.env_s += time.perf_counter() - ep.sent_at
            if failure is not None:
                which = "reset" if not ep.prompt_ids else f"step {len(ep.actions)}"
                self._end(ep, ENV_ERROR, f"environment {self.spec.name} {which}: {failure}")
            elif not ep.prompt_ids:
                self._begin(ep, value)
            else:
                self._stepped(ep, value)
        if self._next and not self._generating and not self._awaiting:
            for request in sorted(self._next, key=lambda r: r.rid):
                self._submit(request)
            self._next = []
        done, self._done = self._done, []
        return done

    # -- transitions ----------------------------------------------------------------------

    def _begin(self, ep: Episode, prompt) -> None:
        messages = prompt if isinstance(prompt, list) else [
            *([{"role": "system", "content": self.turns.system_prompt}] if self.turns.system_prompt else []),
            {"role": "user", "content": prompt}]
        ep.prompt_ids = encode_messages(self.tok, messages)
        ep.messages = list(messages)
        if len(ep.prompt_ids) >= self.turns.max_context:
            self._end(ep, ENV_ERROR, f"environment {self.spec.name}: the first prompt has {len(ep.prompt_ids)} tokens, "
                                     f"not fewer than train_dataset.max_context_tokens={self.turns.max_context}")
            return
        self._turn(ep)

    def _stepped(self, ep: Episode, step) -> None:
        k = len(ep.actions)
        ep.reward += step.reward * self.spec.discount ** (k - 1)
        ep.raw_reward += step.reward
        ep.tool_calls += step.tool_call
        ep.tool_errors += step.tool_error
        if step.done:
            self._end(ep, DONE)
            return
        if k >= self.turns.max_turns:
            self._end(ep, MAX_TURNS)
            return
        if self.rerender:
            self._rerendered(ep, step)
            return
        obs = self.chat.observation(step.observation, step.role, step.inline, ep.last_ended_by_eos)
        if len(ep.context) + len(obs) >= self.turns.max_context:
            self._end(ep, CONTEXT)
            return
        ep.ids += obs
        ep.logprobs += [0.0] * len(obs)
        ep.versions += [-1] * len(obs)
        ep.mask += [False] * len(obs)
        self._turn(ep)

    def _rerendered(self, ep: Episode, step) -> None:
        """The next turn as a row of its own: the conversation with the observation, rendered whole."""
        if step.inline:
            last = ep.messages[-1]
            messages = [*ep.messages[:-1], {**last, "content": last["content"] + step.observation}]
        else:
            messages = [*ep.messages, {"role": step.role, "content": step.observation}]
        context = render(self.tok, messages, continuing=step.inline)
        if len(context) >= self.turns.max_context:
            self._end(ep, CONTEXT)
            return
        ep.messages, ep.continuing = messages, step.inline
        ep.rows.append(ep.row)
        ep.prompt_ids, ep.ids, ep.logprobs, ep.versions, ep.mask = context, [], [], [], []
        ep.rerendered += len(context)
        self._turn(ep)

    def _turn(self, ep: Episode) -> None:
        t = self.turns
        context = ep.context
        request = GenerationRequest(
            context, min(t.max_new_tokens, t.max_context - len(context)), rid=ep.eid, temperature=t.temperature,
            top_p=t.top_p, top_k=t.top_k, min_p=t.min_p, greedy=ep.greedy, stop=t.stop,
            seed=ep.seed * 64 + len(ep.actions), session=ep.eid,
        )
        if self.rounds:
            self._next.append(request)
        else:
            self._submit(request)

    def _submit(self, request: GenerationRequest) -> None:
        self._generating += 1
        self.engine.submit(request)

    def _end(self, ep: Episode, reason: str, failure: str | None = None) -> None:
        ep.finish_reason, ep.failure, ep.ended_at = reason, failure, time.perf_counter()
        if failure is not None:
            ep.reward = ep.raw_reward = 0.0
            if not ep.prompt_ids:  # no prompt from the environment: the question stands in, so the row has tokens
                ep.prompt_ids = encode_prompt(self.tok, ep.example, self.turns.system_prompt)
        del self.running[ep.eid]
        self.engine.release(ep.eid)
        if reason != DONE:
            self.env.submit(("close", ep.eid), CLOSE, ep.eid)
        self._done.append(ep)

    def _call(self, ep: Episode, *args) -> None:
        ep.sent_at = time.perf_counter()
        self._awaiting.add(ep.eid)
        self.env.submit(ep.eid, *args)

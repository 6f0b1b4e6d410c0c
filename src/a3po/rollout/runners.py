"""Which `GroupRunner` a run's inputs call for, made in one place for the rollout workers and the evaluator.

    runners = Runners(cfg, Scoring(reward_fn, env, agent), service=True)   # owns the child processes
    runner = runners.build(engine, tokenizer)                               # a GroupRunner over `engine`
    ...
    runners.close()                                                         # ends the child processes

With an agent (train_dataset.agent) a group is runs of the user's agent, which runs in a child
process and talks to the engine through a loopback chat server (rollout/agents.py); with an
environment (train_dataset.env) it is multi-turn episodes whose environment steps run in a
child process (rollout/episodes.py); otherwise it is completions scored by the reward
function in a child process, and by reward_service too when `service` (rollout/completions.py).

The child processes, the chat server and the service's client belong to `Runners`, not to a
runner: each process starts with the first sample that needs it and lives until `close`, however
many runners are built over it. A rollout worker builds one runner; the evaluator builds one per
evaluation, over the engine of the model it is given then, and keeps its children between them.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

from a3po.agents.host import AgentProcess
from a3po.config import Config
from a3po.data import CallProcess, RewardFn, RewardProcess
from a3po.data.rewards import Imported
from a3po.envs import EnvSpec
from a3po.envs.host import EnvHost
from a3po.rollout.agents import AgentRunner, prompt_threads
from a3po.rollout.chat import ChatQueue
from a3po.rollout.completions import Completions
from a3po.rollout.engine import RolloutEngine
from a3po.rollout.episodes import EpisodeRunner, Turns
from a3po.rollout.groups import GroupRunner
from a3po.services import build_service
from a3po.serving.http import ChatServer


@dataclass(frozen=True)
class Scoring:
    """How a run's groups are scored: completions by a reward function, or episodes in an environment or of an agent."""

    reward_fn: RewardFn
    env: EnvSpec | None = None
    agent: Imported | None = None  # train_dataset.agent, imported in each worker's agent process


class Runners:
    """Runners of `scoring`'s kind over any engine, all sharing the child processes made here and ended by `close`.
    `service`: completions are scored by reward_service as well (training); without it by the reward function alone
    (held-out evaluation measures the task's own reward)."""

    def __init__(self, cfg: Config, scoring: Scoring, service: bool = False):
        d = cfg.train_dataset
        self._owned = contextlib.ExitStack()  # closed last made first, each even if one before it raised
        if scoring.agent is not None:
            chat = ChatQueue(reply_timeout_s=d.agent_timeout_s)
            server = self._own(ChatServer(chat.ask, model=cfg.actor.path).start())
            threads = prompt_threads()
            self._owned.callback(threads.shutdown, wait=False, cancel_futures=True)
            self._make = functools.partial(AgentRunner, turns=Turns.from_config(cfg, None), server=server,
                                           chat=self._own(chat),
                                           agents=self._own(AgentProcess(scoring.agent, d.agent_timeout_s)),
                                           threads=threads, tool_call_format=d.tool_call_format)
        elif scoring.env is not None:
            env = CallProcess(EnvHost(scoring.env.factory), d.env_timeout_s, what="environment")
            self._make = functools.partial(EpisodeRunner, spec=scoring.env, turns=Turns.from_config(cfg, scoring.env),
                                           env=self._own(env), rounds=cfg.rollout.lockstep)
        else:
            reward = self._own(RewardProcess(scoring.reward_fn, d.reward_timeout_s))
            client = self._own(build_service(cfg.reward_service)) if service else None
            self._make = functools.partial(Completions, g=cfg.gconfig, system_prompt=d.system_prompt, reward=reward,
                                           service=client, rs=cfg.reward_service)

    def build(self, engine: RolloutEngine, tokenizer) -> GroupRunner:
        """A runner over `engine` that scores in this object's child processes; it owns nothing to close."""
        return self._make(engine, tokenizer)

    def close(self) -> None:
        """End the child processes (each is waited for, or killed) and the agents' chat server."""
        self._owned.close()

    def _own(self, part):
        if part is not None:
            self._owned.callback(part.close)
        return part

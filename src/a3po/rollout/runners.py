"""Which `GroupRunner` a run's inputs call for, built in one place for the rollout workers and the evaluator.

    runner = build_runner(engine, tokenizer, cfg, Scoring(reward_fn, env, agent), service=True)

With an agent (train_dataset.agent) a group is runs of the user's agent, which runs in a child
process and talks to the engine through a loopback chat server (rollout/agents.py); with an
environment (train_dataset.env) it is multi-turn episodes whose environment steps run in a
child process (rollout/episodes.py); otherwise it is completions scored by the reward
function in a child process, and by reward_service too when `service` (rollout/completions.py).
Child processes start with the first sample that needs them.
"""

from __future__ import annotations

from dataclasses import dataclass

from a3po.agents.host import AgentProcess
from a3po.config import Config
from a3po.data import CallProcess, RewardFn, RewardProcess
from a3po.data.rewards import Imported
from a3po.envs import EnvSpec
from a3po.envs.host import EnvHost
from a3po.rollout.agents import AgentRunner
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


def build_runner(engine: RolloutEngine, tokenizer, cfg: Config, scoring: Scoring, service: bool = False) -> GroupRunner:
    """The runner of `scoring`'s kind over `engine`. `service`: completions are scored by reward_service as well
    (training); without it by the reward function alone (held-out evaluation measures the task's own reward)."""
    d = cfg.train_dataset
    if scoring.agent is not None:
        chat = ChatQueue(reply_timeout_s=d.agent_timeout_s)
        server = ChatServer(chat.ask, model=cfg.actor.path).start()
        agents = AgentProcess(scoring.agent, d.agent_timeout_s)
        return AgentRunner(engine, tokenizer, Turns.from_config(cfg, None), agents, server, chat)
    if scoring.env is not None:
        env = CallProcess(EnvHost(scoring.env.factory), d.env_timeout_s, what="environment")
        return EpisodeRunner(engine, tokenizer, scoring.env, Turns.from_config(cfg, scoring.env), env,
                             rounds=cfg.rollout.lockstep)
    reward = RewardProcess(scoring.reward_fn, d.reward_timeout_s)
    return Completions(engine, tokenizer, cfg.gconfig, d.system_prompt, reward,
                       build_service(cfg.reward_service) if service else None, cfg.reward_service)

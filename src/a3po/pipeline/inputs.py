"""What a run reads before it starts anything, loaded and checked before torch is imported.

A mistyped model folder or tiny-model name, a wrong dataset file, reward, environment, agent, reward service,
logging backend, launcher or missing extra is the commonest bad input. Checked here, its one-line error comes at
once instead of after torch's start-up (seconds), and the run goes on with what was loaded instead of loading it
twice.
"""

from __future__ import annotations

from dataclasses import dataclass

from a3po.agents import build_agent
from a3po.config import Config, ConfigError, extras
from a3po.data import RewardFn, TaskData, build_reward, load_task
from a3po.data.rewards import Imported
from a3po.envs import EnvSpec, build_env
from a3po.launch import check as check_launcher
from a3po.models.paths import check_path
from a3po.pipeline.sinks import check_backends
from a3po.services import ServiceConfigError, check_service


@dataclass
class RunInputs:
    data: TaskData
    reward_fn: RewardFn
    env: EnvSpec | None
    agent: Imported | None


def load_inputs(cfg: Config) -> RunInputs:
    check_path(cfg.actor.path)
    check_backends(tensorboard=cfg.logging.tensorboard, wandb=cfg.logging.wandb)
    check_launcher(cfg)
    extras.check(cfg)
    data = load_task(cfg.train_dataset, cfg.evaluator.size, cfg.seed)
    reward_fn = build_reward(cfg.train_dataset, data)
    try:
        check_service(cfg.reward_service)
    except ServiceConfigError as e:
        raise ConfigError(str(e)) from None
    return RunInputs(data, reward_fn, build_env(cfg.train_dataset, data, reward_fn), build_agent(cfg.train_dataset))

"""Environments for multi-turn episodes (`train_dataset.env`): the interface, the built-in ones,
and the child-process side that runs them (host.py).

    spec = build_env(cfg.train_dataset, task, reward_fn)   # None: single-turn training
    env = spec.factory(example); env.reset(); env.step("42")

A new built-in environment is one file here and one line in BUILTIN_ENVS.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from a3po.config.choices import TEXTARENA
from a3po.config.load import suggest
from a3po.config.schema import DatasetConfig
from a3po.data import DataError, TaskData
from a3po.data.rewards import import_spec
from a3po.envs.base import Env, EnvOutputError, Step
from a3po.envs.calculator import CalculatorEnv
from a3po.envs.guess import GuessEnv
from a3po.envs.retry import RetryEnv
from a3po.envs.textarena import TextArenaEnv, check_game

BUILTIN_ENVS = {"retry": RetryEnv, "calculator": CalculatorEnv, "guess": GuessEnv}


@dataclass(frozen=True)
class EnvSpec:
    """What the rollout worker needs of the configured environment; it travels to the worker (picklable)."""

    name: str
    factory: Callable[[Any], Any]  # example -> environment object
    stop: tuple[str, ...] = ()  # stop strings ending a turn, besides gconfig.stop
    discount: float = 1.0  # weight of turn k's reward: discount ** (k - 1)


def build_env(cfg: DatasetConfig, task: TaskData, reward_fn) -> EnvSpec | None:
    """The environment `cfg.env` names (a built-in, a TextArena game, or module:Class), or None without one."""
    if cfg.env is None:
        return None
    if cfg.env == TEXTARENA:
        check_game(cfg.env_id)
        cls = TextArenaEnv
        factory = functools.partial(cls, game_id=cfg.env_id)
    elif cfg.env in BUILTIN_ENVS:
        cls = BUILTIN_ENVS[cfg.env]
        factory: Callable = functools.partial(cls, reward_fn=reward_fn)
    elif ":" in cfg.env:
        factory, cls = import_spec(cfg.env, "train_dataset.env", "environment as module:Class")
        missing = [m for m in ("reset", "step") if not callable(getattr(cls, m, None))]
        if missing or not callable(cls):
            raise DataError(f"train_dataset.env={cfg.env!r} is not an environment class: it needs "
                            f"{' and '.join(missing or ['to be callable'])}; define a class with "
                            f"__init__(self, example), reset(self) and step(self, action)")
    else:
        raise DataError(f"train_dataset.env={cfg.env!r} is unknown{suggest(cfg.env, [*BUILTIN_ENVS, TEXTARENA])}; "
                        f"use {', '.join([*BUILTIN_ENVS, TEXTARENA])} or module:Class")
    stop = getattr(cls, "stop", ())
    if isinstance(stop, str) or not all(isinstance(s, str) and s for s in stop):
        raise DataError(f"train_dataset.env={cfg.env!r}: its stop attribute must be a tuple of non-empty strings, "
                        f"got {stop!r}")
    discount = cfg.turn_discount if cfg.turn_discount is not None else getattr(cls, "discount", 1.0)
    if not 0.0 <= float(discount) <= 1.0:
        raise DataError(f"train_dataset.env={cfg.env!r}: its discount {discount!r} must lie in [0, 1]")
    return EnvSpec(cfg.env, factory, tuple(stop), float(discount))


__all__ = ["BUILTIN_ENVS", "TEXTARENA", "Env", "EnvOutputError", "EnvSpec", "Step", "build_env"]

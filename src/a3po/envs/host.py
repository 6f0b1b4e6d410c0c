"""The environment's side of an episode, in the child process that runs environment code (data/scoring.py).

The child holds one environment object per running episode. Each step call also carries
the episode's actions so far: a child started afresh (the previous one was killed because
some episode's environment hung) rebuilds an episode it does not hold by replaying them,
so one hung environment fails its own episode only. Replay assumes what most environments
are: deterministic given the example and the actions (seed any randomness from the example).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

from a3po.data.scoring import warm_up
from a3po.envs.base import checked_prompt, checked_step

RESET, STEP, CLOSE = "reset", "step", "close"


class EnvHost:
    def __init__(self, factory: Callable[[Any], Any]):
        self.factory = factory
        self.envs: dict[Hashable, Any] = {}

    def warm_up(self) -> None:
        warm_up(self.factory)

    def __call__(self, op: str, eid: Hashable, example: Any = None, actions: tuple[str, ...] = ()):
        if op == RESET:
            env = self.factory(example)
            prompt = checked_prompt(env.reset())
            self.envs[eid] = env
            return prompt, None
        if op == STEP:
            env = self.envs.get(eid)
            if env is None:  # this child is newer than the episode: rebuild it
                env = self.factory(example)
                env.reset()
                for action in actions[:-1]:
                    env.step(action)
                self.envs[eid] = env
            step = checked_step(env.step(actions[-1]))
            if step.done:
                del self.envs[eid]
            return step, None
        if op == CLOSE:
            self.envs.pop(eid, None)
            return None, None
        raise ValueError(f"unknown environment call {op!r}")

"""What an environment is: an object per episode that answers the model's turns.

    class Guess:
        def __init__(self, example):          # one dataset example per episode
            self.secret = int(example.answer)
        def reset(self):                       # the first prompt: text (a user message) or chat messages
            return "Guess my number."
        def step(self, action):                # the model's turn as text
            if int(action) == self.secret:
                return Step(reward=1.0, done=True)
            return Step("higher" if int(action) < self.secret else "lower")

Class attributes an environment may set: `stop` (stop strings that end a turn, e.g. a tool
call's closing tag) and `discount` (the episode's reward is the sum of its steps' rewards,
the reward of turn k weighted by discount ** (k - 1); train_dataset.turn_discount overrides it).

An observation is a new user message by default (`role`), turned into tokens as the chat
template's delta after the context; `inline=True` appends it to the model's own message
instead (a tool result inside its turn, which the model then continues).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol

MESSAGE_ROLES = ("system", "user", "assistant", "tool")


@dataclass
class Step:
    observation: str = ""  # what the environment answers; unused once done
    reward: float = 0.0
    done: bool = False
    inline: bool = False  # the observation continues the model's message (a tool result) rather than a new message
    role: str = "user"  # the role of the new message when not inline (user or tool)
    tool_call: bool = False  # this turn called a tool (counted per episode)
    tool_error: bool = False  # ... and the call was bad (counted per episode)


class Env(Protocol):
    def reset(self) -> str | list[dict]: ...

    def step(self, action: str) -> Step: ...


class EnvOutputError(TypeError):
    """An environment returned something a3po cannot use; the episode fails with this message."""


def checked_prompt(value: Any) -> str | list[dict]:
    """reset()'s result: a non-empty string, or chat messages {'role', 'content'} with string contents."""
    if isinstance(value, str):
        if not value.strip():
            raise EnvOutputError("reset() returned an empty prompt")
        return value
    if isinstance(value, list) and value and all(isinstance(m, dict) for m in value):
        for m in value:
            if m.get("role") not in MESSAGE_ROLES or not isinstance(m.get("content"), str):
                raise EnvOutputError(f"reset() returned the message {str(m)[:80]}: each message needs a role "
                                     f"({', '.join(MESSAGE_ROLES)}) and a string content")
        return value
    raise EnvOutputError(f"reset() returned {type(value).__name__} {str(value)[:60]!r}: return the first prompt as "
                         f"text or a list of chat messages")


def checked_step(value: Any) -> Step:
    """step()'s result as a Step: a Step, or a tuple (observation, reward, done)."""
    if isinstance(value, tuple) and len(value) == 3:
        value = Step(*value)
    if not isinstance(value, Step):
        raise EnvOutputError(f"step() returned {type(value).__name__} {str(value)[:60]!r}: return "
                             f"Step(observation, reward, done) or a tuple (observation, reward, done)")
    if not isinstance(value.observation, str):
        raise EnvOutputError(f"step() returned an observation of type {type(value.observation).__name__}: "
                             f"it must be text")
    if isinstance(value.reward, (str, bytes, bool)) or not hasattr(value.reward, "__float__") \
            or not math.isfinite(float(value.reward)):
        raise EnvOutputError(f"step() returned the reward {value.reward!r:.60}: it must be a finite number")
    if not value.inline and value.role not in ("user", "tool"):
        raise EnvOutputError(f"step() returned role {value.role!r}: an observation message is 'user' or 'tool'")
    value.reward = float(value.reward)
    value.done = bool(value.done)
    return value

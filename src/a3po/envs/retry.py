"""`retry`: the dataset's question, and "wrong, try again" until the answer is right or the turns run out.

The reward of the turn that succeeds is 1, discounted by the turns it took (`discount`), so
the model learns to be right early and to use the feedback when it was not.
"""

from __future__ import annotations

from a3po.envs.base import Step

FEEDBACK = "Your answer is wrong. Try again: give only the final answer."


class RetryEnv:
    discount = 0.5
    stop = ()

    def __init__(self, example, reward_fn):
        self.example, self.reward_fn = example, reward_fn

    def reset(self) -> str:
        return self.example.question

    def step(self, action: str) -> Step:
        if self.reward_fn(action, self.example) >= 1.0 - 1e-6:
            return Step(reward=1.0, done=True)
        return Step(FEEDBACK)

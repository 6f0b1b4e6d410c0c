"""`guess`: find a secret integer from "higher" / "lower" feedback.

Unlike `retry`, the feedback carries information: a policy that halves the range wins in
at most ceil(log2(range)) turns, and episodes take very different numbers of turns (a source
of staleness). The secret comes from the example (its reference answer), so the held-out
split is the dataset's.
"""

from __future__ import annotations

from a3po.data import extract_final_answer
from a3po.data.rewards import as_number
from a3po.envs.base import Step

LOW, HIGH = 1, 32


class GuessEnv:
    discount = 0.8
    stop = ()

    def __init__(self, example, reward_fn=None):
        value = as_number(example.answer)
        seed = int(value) if value is not None else sum(map(ord, example.answer))
        self.secret = LOW + seed % (HIGH - LOW + 1)

    def reset(self) -> str:
        return (f"I am thinking of an integer from {LOW} to {HIGH}. Guess it. After each guess I will say "
                f"'higher' or 'lower'. Answer with just one number.")

    def step(self, action: str) -> Step:
        value = as_number(extract_final_answer(action))
        if value is None:
            return Step("Answer with just one number.")
        if value == self.secret:
            return Step(reward=1.0, done=True)
        return Step("higher" if value < self.secret else "lower")

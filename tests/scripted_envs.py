"""Environments (and a reward) the tests script: picklable by reference (this folder is on the path of every a3po
process the tests start, and of the environment's or reward's child process)."""

import os
import time

from a3po.envs import Step

OBSERVATION = "zebra quartz feedback"  # text no model turn of the tiny model writes by chance


class Echo:
    """Answers every turn with OBSERVATION; done with reward 1 after `done_after` turns (from the example's answer)."""

    def __init__(self, example):
        self.example, self.turns = example, 0
        self.done_after = int(example.answer) if example.answer.isdigit() else 3

    def reset(self):
        return self.example.question

    def step(self, action):
        self.turns += 1
        if self.turns >= self.done_after:
            return Step(reward=1.0, done=True)
        return Step(OBSERVATION)


class Misbehaving(Echo):
    """By the example's question: 'raise', 'hang' or 'garbage' at the first step, 'bad reset'; else Echo."""

    def reset(self):
        if self.example.question == "bad reset":
            return 17
        return super().reset()

    def step(self, action):
        what = self.example.question
        if what == "raise":
            raise RuntimeError("the environment broke")
        if what == "hang":
            time.sleep(3600)
        if what == "garbage":
            return {"observation": "x"}
        return super().step(action)


class NoStep:
    def __init__(self, example):
        pass

    def reset(self):
        return "hi"


def scorer_pid(completion, example) -> float:
    """A reward that says which process scored: the pid of the reward's child process."""
    return float(os.getpid())

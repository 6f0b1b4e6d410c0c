"""`calculator`: the dataset's question with a calculator tool the model may call inside its answer.

The model writes <calc>expression</calc>; generation stops at the closing tag and the tool
appends <result>value</result> to the model's own message (an inline observation), after
which the model continues. A turn without a call is its final answer, scored by the run's
reward. The expression is parsed by envs/arith.py (numbers and + - * /), never evaluated as
code; a bad one gets <result>error: why</result>.
"""

from __future__ import annotations

import re

from a3po.envs.arith import calculate
from a3po.envs.base import Step

OPEN, CLOSE = "<calc>", "</calc>"
# Before the question, in the user's message: the 135M model follows it there about one sample in ten, and never
# from a system message (docs/results.md).
INSTRUCTIONS = ("Use the calculator by writing <calc>expression</calc>, e.g. <calc>12 + 34</calc>; its result "
                "follows as <result>value</result>. Then give the final answer as a number.")
_CALL = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.S)


class CalculatorEnv:
    discount = 1.0
    stop = (CLOSE,)

    def __init__(self, example, reward_fn):
        self.example, self.reward_fn = example, reward_fn

    def reset(self) -> str:
        return f"{INSTRUCTIONS} {self.example.question}"

    def step(self, action: str) -> Step:
        calls = _CALL.findall(action)
        if calls and action.rstrip().endswith(CLOSE):
            result, error = calculate(calls[-1])
            return Step(f"<result>{result}</result>", inline=True, tool_call=True, tool_error=error)
        return Step(reward=self.reward_fn(action, self.example), done=True)

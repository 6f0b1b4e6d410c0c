"""A judge: an OpenAI-compatible chat model that grades each completion, its score parsed from its answer.

The judge gets one user message, `reward_service.template` with {question}, {answer} (the
example's reference) and {completion} filled in, and answers greedily (temperature 0) in at
most `max_tokens`. The score is the last match of `score_regex`'s first group in the answer,
divided by `score_max`. An answer without one is a failure (Refused: asking again at
temperature 0 gives the same answer).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from a3po.services.client import Refused, post_json


@dataclass(frozen=True)
class JudgeItem:
    question: str
    answer: str
    completion: str


class Judge:
    batch_size = 1  # one chat request per completion

    def __init__(self, url: str, model: str, template: str, score_regex: str, score_max: float, max_tokens: int,
                 api_key: str | None = None):
        self.url, self.api_key = url.rstrip("/") + "/chat/completions", api_key
        self.model, self.template, self.score_max, self.max_tokens = model, template, score_max, max_tokens
        self.pattern = re.compile(score_regex)

    def prompt(self, item: JudgeItem) -> str:
        # plain replacement, not str.format: a template may hold other braces (JSON, code)
        return (self.template.replace("{question}", item.question).replace("{answer}", item.answer)
                .replace("{completion}", item.completion))

    def __call__(self, items: list[JudgeItem], timeout_s: float) -> list[float]:
        return [self._one(item, timeout_s) for item in items]

    def _one(self, item: JudgeItem, timeout_s: float) -> float:
        answer = post_json(self.url, {"model": self.model, "messages": [{"role": "user", "content": self.prompt(item)}],
                                      "temperature": 0, "max_tokens": self.max_tokens}, timeout_s, self.api_key)
        try:
            text = answer["choices"][0]["message"]["content"] or ""
        except (KeyError, IndexError, TypeError):
            raise Refused(f"the judge's answer has no choices[0].message.content: {str(answer)[:80]}") from None
        found = self.pattern.findall(text)
        if not found:
            raise Refused(f"no score in the judge's answer {text[:80]!r} (reward_service.score_regex)")
        last = found[-1]
        try:
            score = float(last[0] if isinstance(last, tuple) else last)
        except ValueError:
            raise Refused(f"the judge's score {last!r} is not a number") from None
        if not math.isfinite(score):
            raise Refused(f"the judge's score {score} is not finite")
        return score / self.score_max

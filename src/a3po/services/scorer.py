"""A scorer: a server (a reward model) that scores batches of completions in one POST.

Request:  {"model": M, "items": [{"prompt": question, "completion": text, "answer": reference}, ...]}
Answer:   {"scores": [s, ...]}, {"rewards": [...]} or {"data": [{"score": s}, ...]} (vLLM's score route's
          shape), one finite number per item, in order.
"""

from __future__ import annotations

import math

from a3po.services.client import Refused, post_json
from a3po.services.judge import JudgeItem


class Scorer:
    def __init__(self, url: str, model: str, api_key: str | None = None):
        self.url, self.model, self.api_key = url, model, api_key

    def __call__(self, items: list[JudgeItem], timeout_s: float) -> list[float]:
        answer = post_json(self.url, {"model": self.model, "items": [
            {"prompt": i.question, "completion": i.completion, "answer": i.answer} for i in items]}, timeout_s,
            self.api_key)
        scores = read_scores(answer)
        if len(scores) != len(items):
            raise Refused(f"{len(scores)} scores for {len(items)} completions")
        return scores


def read_scores(answer) -> list[float]:
    if isinstance(answer, dict) and isinstance(answer.get("data"), list):
        values = [d.get("score") if isinstance(d, dict) else None for d in answer["data"]]
    elif isinstance(answer, dict):
        values = answer.get("scores", answer.get("rewards"))
    else:
        values = answer
    if not isinstance(values, list):
        raise Refused(f"no scores in the answer {str(answer)[:80]} (expected {{'scores': [...]}})")
    out = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise Refused(f"the score {v!r:.40} is not a finite number")
        out.append(float(v))
    return out

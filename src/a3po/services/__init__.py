"""Reward services: a reward from a model behind HTTP (`reward_service` in the configuration).

    service = build_service(cfg.reward_service)      # None when reward_service.kind=none
    service.submit(slot, [JudgeItem(question, answer, completion), ...])
    for got in service.poll(): ...                   # Scored(slot, scores, failures, seconds)

A new kind of service is one file with a callable `(items, timeout_s) -> scores` (judge.py,
scorer.py) and one line in KINDS; the client behaviour is client.py's.
"""

from __future__ import annotations

import os
import re

from a3po.config.choices import ServiceKind
from a3po.config.schema import RewardServiceConfig
from a3po.services.client import Scored, ServiceClient
from a3po.services.judge import Judge, JudgeItem
from a3po.services.scorer import Scorer


class ServiceConfigError(ValueError):
    """A reward_service setting that cannot work (one line, for the user)."""


def _judge(c: RewardServiceConfig) -> Judge:
    try:
        pattern = re.compile(c.score_regex)
    except re.error as e:
        raise ServiceConfigError(f"reward_service.score_regex={c.score_regex!r} is not a regular expression: "
                                 f"{e}") from None
    if pattern.groups < 1:
        raise ServiceConfigError(f"reward_service.score_regex={c.score_regex!r} needs a group, e.g. ([0-9]+)")
    if "{completion}" not in c.template:
        raise ServiceConfigError("reward_service.template has no {completion}: the judge would not see the answer")
    return Judge(c.url, c.model, c.template, c.score_regex, c.score_max, c.max_tokens, _api_key(c))


def _api_key(c: RewardServiceConfig) -> str | None:
    if c.api_key_env is None:
        return None
    key = os.environ.get(c.api_key_env)
    if not key:
        raise ServiceConfigError(f"reward_service.api_key_env={c.api_key_env!r}: that environment variable is not "
                                 f"set; export it with the service's key, or set api_key_env=null")
    return key


KINDS = {ServiceKind.JUDGE: _judge, ServiceKind.SCORER: lambda c: Scorer(c.url, c.model, _api_key(c))}


def check_service(c: RewardServiceConfig) -> None:
    """Raise ServiceConfigError for a setting that cannot work; at start-up, before any worker starts."""
    if c.kind != ServiceKind.NONE:
        KINDS[c.kind](c)


def build_service(c: RewardServiceConfig) -> ServiceClient | None:
    if c.kind == ServiceKind.NONE:
        return None
    score = KINDS[c.kind](c)
    return ServiceClient(score, max_concurrency=c.max_concurrency,
                         batch_size=getattr(score, "batch_size", c.batch_size), timeout_s=c.timeout_s,
                         retries=c.retries, backoff_s=c.backoff_s, name=f"reward service ({c.kind} at {c.url})")


__all__ = ["JudgeItem", "Scored", "ServiceClient", "ServiceConfigError", "build_service", "check_service"]

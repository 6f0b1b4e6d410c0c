"""Why a multi-turn episode ended: the values of its trajectory's finish_reason and of the
episode/finish/<reason> metrics, spelled once.

Not a configuration key, so not in config/choices.py: the rollout workers set these values, the
loop counts them and the metric registry (metrics.py) documents them. Leaf module (no a3po imports).
"""

from __future__ import annotations


class EpisodeEnd:
    DONE = "done"  # the environment said so
    MAX_TURNS = "max_turns"  # train_dataset.max_turns model turns
    CONTEXT = "context"  # the next observation would not fit train_dataset.max_context_tokens
    ENV_ERROR = "env_error"  # the environment raised, hung or returned the wrong type
    CHOICES = (DONE, MAX_TURNS, CONTEXT, ENV_ERROR)

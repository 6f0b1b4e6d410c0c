"""Agents written against a chat-completions client (`train_dataset.agent=module:function`).

    async def run(example, client) -> float:          # client: openai.AsyncOpenAI
        reply = await client.chat.completions.create(model="policy", messages=[...])
        ...
        return reward

The function runs in a child process of each rollout worker (host.py); its client talks to
the policy through the worker's loopback endpoint, which records every completion token in,
token out for training (rollout/agents.py). `build_agent` imports it once in the trainer, so
that a missing module or a wrong signature is one line before anything starts.
"""

from __future__ import annotations

import inspect

from a3po.config.schema import DatasetConfig
from a3po.data import DataError
from a3po.data.rewards import Imported, import_spec


def build_agent(cfg: DatasetConfig) -> Imported | None:
    if cfg.agent is None:
        return None
    ref, fn = import_spec(cfg.agent, "train_dataset.agent", "agent as module:function")
    attr = cfg.agent.partition(":")[2]
    if not callable(fn) or inspect.isclass(fn):
        raise DataError(f"train_dataset.agent={cfg.agent!r}: {attr!r} is a {type(fn).__name__}, not a function; "
                        f"define async def {attr.rsplit('.', 1)[-1]}(example, client) -> float")
    try:
        inspect.signature(fn).bind("example", "client")
    except TypeError:
        raise DataError(f"train_dataset.agent={cfg.agent!r}: {attr} must accept (example, client); define it as "
                        f"async def {attr.rsplit('.', 1)[-1]}(example, client) -> float") from None
    except ValueError:  # no signature to read (a builtin): let the call say
        pass
    return ref


__all__ = ["build_agent"]

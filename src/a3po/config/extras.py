"""Features whose package is an extra of pyproject.toml, installed by `make` but not by a plain pip install.

    extra   package     the feature
    plots   matplotlib  the PNG plots of `a3po bench e2e` and `a3po bench staleness`
    agents  openai      the client an agent gets (train_dataset.agent)
    lora    peft        LoRA adapter layers and their file format, to train them (actor.lora.rank > 0)
    textarena textarena TextArena's games as environments (train_dataset.env=textarena)

Where a feature is asked for and its package is missing, it is refused before anything starts,
in one line naming the pip command (a ConfigError: exit code 2), not with an ImportError deep in
a worker or after hours of benchmark runs. A saved adapter is folded into its base without peft
(models/lora.py), so `a3po eval` and `a3po export` of a LoRA run need only the agents extra, and
that only for an agent's task. Ray (cluster.launcher=ray) and vLLM have checks of their own
(launch/__init__.py, rollout/vllm_engine.py).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

from a3po.config.choices import TEXTARENA
from a3po.config.load import ConfigError
from a3po.config.schema import Config

# extra -> the package it installs
PACKAGES = {"plots": "matplotlib", "agents": "openai", "lora": "peft", "textarena": "textarena"}


def installed(package: str) -> bool:
    """Whether `package` can be imported here, without importing it (matplotlib and peft take seconds)."""
    return importlib.util.find_spec(package) is not None


def missing_line(extra: str, feature: str) -> str:
    return (f"{feature} needs the {PACKAGES[extra]} package, which is not installed here: "
            f"pip install 'a3po[{extra}]'")


def require(extra: str, feature: str, have: Callable[[str], bool] | None = None) -> None:
    """A ConfigError naming the pip command when `extra`'s package is missing (`have`: `installed`)."""
    if not (have or installed)(PACKAGES[extra]):
        raise ConfigError(missing_line(extra, feature))


def check(cfg: Config, training: bool = True, have: Callable[[str], bool] | None = None) -> None:
    """The extras `cfg` needs: an agent's openai and TextArena wherever they run; peft only to train adapters."""
    if cfg.train_dataset.agent is not None:
        require("agents", f"train_dataset.agent={cfg.train_dataset.agent}", have)
    if cfg.train_dataset.env == TEXTARENA:
        require("textarena", f"train_dataset.env={TEXTARENA}", have)
    if training and cfg.actor.lora.rank > 0:
        require("lora", f"actor.lora.rank={cfg.actor.lora.rank}", have)

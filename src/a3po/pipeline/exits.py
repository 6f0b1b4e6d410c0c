"""How an `a3po` command ends on an error: one table from exception type to exit code and the line printed.

    code  meaning                                                            where
    0     done
    1     training failed: a worker, the reward, the staleness bound, a NaN;  RUN (and the lost rank and full
          a trainer rank lost; no space left to write the run                 disk of pipeline/run.py)
    2     bad input: configuration, resume folder, data, model, extra         every phase
    130   SIGINT (Ctrl-C); 143 SIGTERM: workers stopped                       signals.Stopped.exit_code

docs/operations.md "Exit codes" is the table users read. The words before the error's text depend
on the phase the command was in, as they did before this table existed: a configuration error read
from the command line is a "config error", the same error raised once `a3po train` runs is an
"error"; a run folder or checkpoint named to `a3po eval` or `a3po export` is a "config error", one
named to `--resume` an "error". Rows are tried in order, the first whose types match wins
(CheckpointError and ModelSourceError are ValueErrors: their rows come first).

The command line reads this table before torch is imported, so it imports no module that imports
torch. A type defined in one is named "module:Class" and looked up among the modules already
imported: an exception of a type whose module was never imported cannot have been raised.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from a3po.config import ConfigError
from a3po.data import DataError
from a3po.files import DiskFullError, causes, no_space
from a3po.models import ModelSourceError as MODEL
from a3po.signals import Stopped
from a3po.trainer.checkpoint import CheckpointError, latest_checkpoint

FAILED, BAD_INPUT = 1, 2

# phases: what the command was doing when the exception came
CONFIG = "config"  # `a3po train` and `a3po config`: reading the configuration (or --resume's)
INPUTS = "inputs"  # `a3po train`: loading the dataset, reward, environment, agent ... (pipeline/inputs.py)
RUN = "run"  # `a3po train` after torch's import: setting up and training (pipeline/run.py)
EVAL, EXPORT, SERVE, BENCH = "eval", "export", "serve", "bench"  # those commands, whole

TRAINING = ("a3po.pipeline.pool:WorkerError", "a3po.pipeline.loop:RewardFailureError",
            "a3po.pipeline.loop:StalenessError", FloatingPointError)


@dataclass(frozen=True)
class Row:
    types: tuple[type[BaseException] | str, ...]  # a str names "module:Class" of a module that imports torch
    code: int
    head: str  # the words between "a3po: " and the error's text; {step}: the step the run stopped at
    one_line: bool = True  # a multi-line message (a library's) joined into one line


TABLE: dict[str, tuple[Row, ...]] = {
    CONFIG: (Row((ConfigError,), BAD_INPUT, "config error"), Row((CheckpointError,), BAD_INPUT, "error")),
    INPUTS: (Row((ConfigError, DataError, MODEL), BAD_INPUT, "error"),),
    RUN: (Row((ConfigError, DataError, MODEL, CheckpointError), BAD_INPUT, "error"),
          Row(TRAINING, FAILED, "training stopped at step {step}", one_line=False)),
    EVAL: (Row((ConfigError, CheckpointError), BAD_INPUT, "config error"), Row((DataError, MODEL), BAD_INPUT, "error")),
    EXPORT: (Row((ConfigError, CheckpointError), BAD_INPUT, "config error"),
             Row((MODEL, ValueError), BAD_INPUT, "error")),
    SERVE: (Row((MODEL, ValueError, OSError), BAD_INPUT, "error"),),
    BENCH: (Row((ConfigError,), BAD_INPUT, "config error"), Row((MODEL,), BAD_INPUT, "error")),
}


@dataclass(frozen=True)
class Ending:
    code: int
    line: str  # printed alone on stderr


def ending(error: BaseException, phase: str, step: int = 0) -> Ending | None:
    """How `error` ends the command in `phase`, or None: not in the table (a bug: its traceback)."""
    for row in TABLE[phase]:
        if isinstance(error, resolved(row.types)):
            text = " ".join(str(error).splitlines()) if row.one_line else str(error)
            return Ending(row.code, f"a3po: {row.head.format(step=step)}: {text}")
    return None


def usage_error(text: str) -> Ending:
    """A command-line value argparse cannot check (a range)."""
    return Ending(BAD_INPUT, f"a3po: usage error: {text}")


def resolved(types: tuple[type[BaseException] | str, ...]) -> tuple[type[BaseException], ...]:
    """The row's types, a named one only once its module is imported."""
    out = []
    for t in types:
        if isinstance(t, str):
            module, _, name = t.partition(":")
            if module not in sys.modules:
                continue
            t = getattr(sys.modules[module], name)
        out.append(t)
    return tuple(out)


@dataclass
class Progress:
    """How far a run of `a3po train` got: what the line printed when it stops early reports."""

    run_dir: Path | None = None
    step: int = 0
    training: bool = False  # start-up is over: the progress bar is up
    workers: bool = False  # rollout workers were started (so the clean-up stopped them)
    finished: bool = False  # the last step is done: follower ranks are told to stop, not ended

    def where(self) -> str:
        return f"at step {self.step}" if self.training else "during start-up"

    def checkpoint_part(self) -> str:
        ckpt = latest_checkpoint(self.run_dir) if self.run_dir is not None else None
        return (f"last checkpoint {ckpt} (continue with: a3po train --resume {self.run_dir})" if ckpt
                else "no checkpoint yet")

    def stopped_line(self, stop: Stopped) -> str:
        parts = [f"a3po: interrupted by {stop.name} {self.where()}"]
        if self.workers:
            parts.append("rollout workers stopped")
        parts.append(self.checkpoint_part())
        return "; ".join(parts)

    def disk_full_line(self, full: DiskFullError) -> str:
        return (f"a3po: error: {full} {self.where()}; free space there, or set fileroot=<a folder with room> "
                f"for a new run; {self.checkpoint_part()}")


def disk_full(error: BaseException, folder: Path) -> DiskFullError | None:
    """The full disk `error` comes of, if it does: the DiskFullError in its chain (a later error in
    the clean-up, such as closing a file whose write failed, can stand in front of it), else one
    naming `folder` for a write that `files.writing` did not wrap."""
    found = next((e for e in causes(error) if isinstance(e, DiskFullError)), None)
    if found is not None:
        return found
    code = no_space(error)
    return DiskFullError(code, "the run", folder) if code is not None else None

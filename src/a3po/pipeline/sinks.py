"""Where per-step metrics go: metrics.jsonl (always), TensorBoard, Weights & Biases.

`Sinks.log(step, metrics)` writes one JSON line per step and forwards scalars to the
enabled backends; call sites never branch on which backends are on. metrics.jsonl is
flushed after every line, so a crash loses at most the step in progress.
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

from a3po.config import ConfigError
from a3po.files import atomic_write_text, writing

METRICS = "metrics.jsonl"  # in the run folder: one JSON line per step
HELD_OUT = "held_out.jsonl"  # per evaluation: each held-out example solved or not, for paired comparisons
BACKENDS = {"tensorboard": "pip install tensorboard", "wandb": "pip install wandb (then wandb login)"}


def check_backends(**enabled: bool) -> None:
    """Refuse an enabled backend whose package is missing while nothing is started or written yet.

    Found out only when Sinks opens it, the run folder and the workers already exist;
    `a3po train` calls this in its set-up, and Sinks again for anyone else who opens one."""
    for name, on in enabled.items():
        if on and importlib.util.find_spec(name) is None:
            raise ConfigError(f"logging.{name}=true needs the {name} package: {BACKENDS[name]}, "
                              f"or set logging.{name}=false")


class Sinks:
    def __init__(self, run_dir: Path, tensorboard: bool = True, wandb: bool = False, wandb_project: str = "a3po",
                 config: dict | None = None, resume_step: int | None = None):
        check_backends(tensorboard=tensorboard, wandb=wandb)
        self.path = Path(run_dir) / METRICS
        if resume_step is not None:  # what came after the checkpoint is made again
            truncate_after(self.path, resume_step)
            truncate_after(Path(run_dir) / HELD_OUT, resume_step)
        self._file = self.path.open("a")
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(Path(run_dir) / "tb"),
                                     purge_step=resume_step + 1 if resume_step is not None else None)
        self._wandb = None
        if wandb:
            import wandb as wandb_mod

            self._wandb = wandb_mod.init(project=wandb_project, config=config, dir=str(run_dir), resume="allow")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """A full disk is DiskFullError naming the run folder (a line it cut short, resume drops)."""
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in metrics.items()}
        with writing(self.path.name, self.path.parent):
            self._file.write(json.dumps({"step": step, **clean}) + "\n")
            self._file.flush()
        for k, v in metrics.items():
            if isinstance(v, (int, float)) and math.isfinite(v):
                if self._tb is not None:
                    self._tb.add_scalar(k, v, step)
        if self._wandb is not None:
            self._wandb.log(metrics, step=step)

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def read_metrics(path: Path) -> list[dict]:
    """The records of a metrics.jsonl, in order; a line cut short by a crash is left out."""
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            records.append(record)
    return records


def truncate_after(path: Path, step: int) -> None:
    """Keep only the records of steps <= step: a resumed run rewrites what came after its checkpoint."""
    if not path.exists():
        return
    kept = [json.dumps(r) for r in read_metrics(path) if r["step"] <= step]
    atomic_write_text(path, "".join(line + "\n" for line in kept))  # a crash now must not lose the rest


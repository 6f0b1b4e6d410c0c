"""`a3po eval`: a model's accuracy on a task's (or an environment's) held-out split, with its interval.

    a3po eval runs/a3po                          # a run folder: its newest checkpoint, its task, its seed
    a3po eval runs/a3po/checkpoints/step_000016  # one checkpoint of it
    a3po eval smollm2-135m-instruct evaluator.size=256 train_dataset.env=retry   # any model, any task
    a3po eval runs/a3po --samples 8              # 8 sampled completions per problem instead of greedy

The held-out split is the one a run with the same train_dataset, evaluator.size and seed holds
out (data/tasks.py), and the evaluation is the run's own (pipeline/evaluate.py), so the accuracy
of a run's last checkpoint is the accuracy the run logged at its last step. The record (JSON,
--out) keeps every problem's result, for paired comparisons between models.
"""

from __future__ import annotations

import json
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from a3po.config import Config, ConfigError, extras, load_config, to_dict
from a3po.files import write_json
from a3po.intervals import accuracy_interval
from a3po.machine import machine
from a3po.trainer.checkpoint import RUN_STATE, latest_checkpoint

RUN_CONFIG = "config.yaml"


@dataclass
class Target:
    """What is evaluated: the model folder (or built-in name) and the configuration that names the task."""

    model: str
    cfg: Config
    run_dir: Path | None = None  # the run it comes from, if any
    step: int | None = None  # the checkpoint's step, if it is one


def resolve(target: str, config: str | None, preset: str | None, overrides: list[str]) -> Target:
    """A run folder, one of its checkpoints, or a model (folder, hub id or built-in name); a ConfigError if it is
    none of them. A run's own configuration is used for its checkpoints: --config and --preset are refused."""
    path = Path(target)
    run_dir = path if (path / RUN_CONFIG).is_file() else None
    ckpt = None
    if run_dir is not None:
        ckpt = latest_checkpoint(run_dir)
        if ckpt is None:
            raise ConfigError(f"{target}: this run saved no checkpoint; evaluate a run that did (saver.freq_steps)")
    elif (path / RUN_STATE).is_file():  # a checkpoint: <run>/checkpoints/step_N
        ckpt = path
        run_dir = path.parent.parent if (path.parent.parent / RUN_CONFIG).is_file() else None
    elif path.is_dir() and not (path / "config.json").is_file():
        raise ConfigError(f"{target}: not a run folder (no {RUN_CONFIG}), a checkpoint (no {RUN_STATE}) or a model "
                          "folder (no config.json); pass one of those, or a built-in model name")
    if run_dir is not None:
        if config or preset:
            raise ConfigError(f"{target} is a run: its own configuration names the task; drop --config/--preset "
                              "(key=value overrides are allowed, e.g. evaluator.size=256)")
        cfg = load_config(run_dir / RUN_CONFIG, overrides)
    else:
        cfg = load_config(config, [*overrides, f"actor.path={target}"] if ckpt is None else overrides, preset=preset)
    step = json.loads((ckpt / RUN_STATE).read_text())["step"] if ckpt is not None else None
    return Target(str(ckpt) if ckpt is not None else cfg.actor.path, cfg, run_dir, step)


def evaluate(t: Target, samples: int) -> dict:
    """The evaluation record: accuracy, its interval, every problem's result, what was evaluated and where."""
    import transformers

    from a3po.agents import build_agent
    from a3po.data import build_reward, load_task
    from a3po.envs import build_env
    from a3po.models import load_policy, lora
    from a3po.pipeline.evaluate import Evaluator
    from a3po.rollout.runners import Scoring

    cfg = t.cfg
    extras.check(cfg, training=False)
    transformers.utils.logging.disable_progress_bar()
    data = load_task(cfg.train_dataset, cfg.evaluator.size, cfg.seed)
    reward_fn = build_reward(cfg.train_dataset, data)
    scoring = Scoring(reward_fn, build_env(cfg.train_dataset, data, reward_fn), build_agent(cfg.train_dataset))
    if lora.is_adapter_dir(t.model):  # a checkpoint of a LoRA run: its adapter on the run's base
        model, tok = lora.load_merged(t.model, cfg.actor.path, seed=cfg.seed)
    else:
        model, tok = load_policy(t.model, seed=cfg.seed)
    evaluator = Evaluator(cfg, scoring)
    try:
        ev = evaluator(model, tok, data.eval, samples=samples, greedy=samples == 1)
    finally:
        evaluator.close()
    lo, hi = accuracy_interval(ev.solved)
    d = cfg.train_dataset
    return {
        "command": shlex.join(["a3po", "eval", *sys.argv[2:]]), "model": t.model,
        "run_dir": str(t.run_dir) if t.run_dir else None, "step": t.step,
        "task": d.task, "task_params": d.task_params, "env": d.env, "seed": cfg.seed, "problems": len(ev.solved),
        "samples": samples, "greedy": samples == 1, "temperature": None if samples == 1 else cfg.gconfig.temperature,
        "accuracy": ev.metrics["eval/accuracy"], "interval": [lo, hi], "metrics": ev.metrics, "solved": ev.solved,
        "config": to_dict(cfg), **machine(),
    }


def main(target: str, config: str | None, preset: str | None, overrides: list[str], samples: int,
         out: str | None) -> int:
    t = resolve(target, config, preset, overrides)
    record = evaluate(t, samples)
    lo, hi = record["interval"]
    how = "greedy" if samples == 1 else f"{samples} samples each at temperature {record['temperature']}"
    where = f"step {t.step} of {t.run_dir}" if t.run_dir is not None and t.step is not None else t.model
    print(f"a3po eval: held-out accuracy {record['accuracy']:.3f}, 95 % interval [{lo:.3f}, {hi:.3f}] "
          f"({record['problems']} problems of {record['task']}{' in ' + record['env'] if record['env'] else ''}, "
          f"{how}; {where})")
    path = Path(out) if out else (t.run_dir / f"eval_step{t.step}.json" if t.run_dir and t.step is not None
                                  else Path("a3po-eval.json"))
    write_json(path, record)
    print(f"a3po eval: record written to {path}")
    return 0

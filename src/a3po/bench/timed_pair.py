"""The timed pair of tools/gpu_check.sh: two finished `a3po train` runs that differ only in
`actor.prox_logp_method` (recompute against loglinear), as one JSON record that names the device.

    python -m a3po.bench.timed_pair RUN_RECOMPUTE RUN_LOGLINEAR --out docs/results/gpu-check/timed-pair.json

What a step of each method costs in a real run, where the recompute arm's extra forward pass is the
cost A-3PO removes. Per run, over its training steps after the first `--skip` (the device's start-up,
the allocator filling, the first weight publication), the median of: the step (`perf/step_s`), the
proximal forward pass (`perf/prox_logp_s`), the update (`perf/train_s`), generated tokens consumed per
second (`perf/tokens_per_s`), and the proximal share, prox / step of each step. Then recompute's median
step over loglinear's. Medians, because two runs of one asynchronous pipeline differ step by step
(rollout waits, weight loads), and the pair is one run each: a measurement, not an interval.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import yaml

from a3po.bench.runs import read_metrics, training_steps
from a3po.config import ConfigError
from a3po.devices import device_name, resolve_device
from a3po.files import write_json
from a3po.machine import git, machine
from a3po.models.paths import parse_tiny_name
from a3po.models.tiny import tiny_params

METHODS = ("recompute", "loglinear")  # the pair, in this order
WARM_STEPS = 2  # steps left out by default: start-up costs, not a step's
KEYS = {"step_s": "perf/step_s", "prox_logp_s": "perf/prox_logp_s", "train_s": "perf/train_s",
        "tokens_per_s": "perf/tokens_per_s"}


def arm_summary(rows: list[dict], skip: int) -> dict:
    """Medians of one run's timed steps (its training steps after the first `skip`)."""
    steps = training_steps(rows)[skip:]
    if not steps:
        raise ConfigError(f"the run has no training step after the first {skip}: train more steps or lower --skip")
    out = {"timed_steps": len(steps)}
    out.update({name: statistics.median(r[key] for r in steps) for name, key in KEYS.items()})
    out["prox_share"] = statistics.median(r["perf/prox_logp_s"] / r["perf/step_s"] for r in steps)
    return out


def pair_record(configs: list[dict], metrics: list[list[dict]], skip: int) -> dict:
    """The record of the pair: `configs` (each run's resolved config.yaml) and `metrics` (its metrics.jsonl rows),
    recompute's first. Refuses a pair that differs in anything but the method and the run's name and folder."""
    methods = [c["actor"]["prox_logp_method"] for c in configs]
    if methods != list(METHODS):
        raise ConfigError(f"the pair's methods are {', '.join(methods)}: give the recompute run, "
                          "then the loglinear one")
    rest = [_without_method(c) for c in configs]
    if rest[0] != rest[1]:
        raise ConfigError("the two runs differ in more than actor.prox_logp_method: " + ", ".join(_differences(*rest)))
    cfg = configs[0]
    arms = {m: arm_summary(rows, skip) for m, rows in zip(METHODS, metrics)}
    device = resolve_device(cfg["actor"]["device"], "actor.device")
    path = cfg["actor"]["path"]
    return {
        "benchmark": "timed-pair", "model": path, "params": _params(path),
        "actor_dtype": cfg["actor"]["dtype"], "rollout_dtype": cfg["rollout"]["dtype"],
        "device": str(device), "device_name": device_name(device), "rollout_device": cfg["rollout"]["device"],
        "torch": torch.__version__, "cuda": torch.version.cuda, "machine": machine(),
        "batch_size": cfg["train_dataset"]["batch_size"], "n_samples": cfg["gconfig"]["n_samples"],
        "max_new_tokens": cfg["gconfig"]["max_new_tokens"], "eta": cfg["rollout"]["max_head_offpolicyness"],
        "minibatches": cfg["actor"]["ppo_n_minibatches"], "skipped_steps": skip, "arms": arms,
        "recompute_over_loglinear": arms["recompute"]["step_s"] / arms["loglinear"]["step_s"],
        "commit": _commit(), "config": rest[0],  # what both runs trained with, but the method and names
    }


def _without_method(cfg: dict) -> dict:
    out = {k: v for k, v in cfg.items() if k not in ("experiment_name", "fileroot")}
    out["actor"] = {k: v for k, v in cfg["actor"].items() if k != "prox_logp_method"}
    return out


def _differences(a: dict, b: dict, prefix: str = "") -> list[str]:
    """The dotted keys where a and b differ."""
    out = []
    for k in sorted(set(a) | set(b)):
        x, y = a.get(k), b.get(k)
        if isinstance(x, dict) and isinstance(y, dict):
            out += _differences(x, y, f"{prefix}{k}.")
        elif x != y:
            out.append(f"{prefix}{k}")
    return out


def _commit() -> str | None:
    """The checkout's commit, where this is a git checkout (a copy without .git: None)."""
    return git(["rev-parse", "HEAD"], Path(__file__).parent) or None


def _params(path: str) -> int | None:
    """Parameter count of a built-in tiny model, from its name; None for any other model."""
    try:
        return tiny_params(*parse_tiny_name(path))
    except ValueError:
        return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m a3po.bench.timed_pair", description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs=2, metavar="RUN_DIR", help="the recompute run's folder, then the loglinear run's")
    p.add_argument("--out", required=True, help="the JSON record to write")
    p.add_argument("--skip", type=int, default=WARM_STEPS, help="leading training steps left out of the medians")
    args = p.parse_args(argv)
    try:
        configs = [yaml.safe_load((Path(r) / "config.yaml").read_text()) for r in args.runs]
        metrics = [read_metrics(Path(r) / "metrics.jsonl") for r in args.runs]
        record = pair_record(configs, metrics, args.skip)
    except (ConfigError, OSError) as e:
        print(f"a3po timed pair: {e}", file=sys.stderr)
        return 2
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    write_json(Path(args.out), record)
    a = record["arms"]
    print(f"{record['model']} on {record['device']} ({record['device_name']}), {record['actor_dtype']}: step "
          f"{a['recompute']['step_s']:.3f} s recompute (proximal share {a['recompute']['prox_share']:.1%}), "
          f"{a['loglinear']['step_s']:.3f} s loglinear; "
          f"recompute / loglinear {record['recompute_over_loglinear']:.2f}x; "
          f"tokens/s {a['recompute']['tokens_per_s']:.0f} against {a['loglinear']['tokens_per_s']:.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

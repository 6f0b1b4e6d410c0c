"""`a3po bench e2e`: the paper's comparison as real training runs, side by side.

Each arm is a complete `a3po train` in its own process, on one configuration that
differs between arms only in the keys the arm names (below): same model, task, seeds,
number of steps and data order (DataOrder depends on the seed alone). Arms alternate
within each seed so that drifting machine load falls on all of them.

Time is the training loop's own (the sum of `perf/step_s`: collecting the batch, the
update, weight sync), without process start-up and evaluation; held-out accuracy is
measured at step 0 and after the last step only, so that evaluation pauses never hand
the asynchronous arms free generation time. Results are written after every finished
run: an interrupted benchmark keeps what it measured, and `--out DIR` on the same
directory continues it, skipping the runs already done.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import yaml
from tqdm import tqdm

from a3po.bench.args import ARM_NAMES, E2EArgs
from a3po.bench.common import progress, write_json
from a3po.config import Config, ConfigError, dump_yaml, load_config
from a3po.train.run import unique_dir


@dataclass(frozen=True)
class Arm:
    name: str
    label: str
    overrides: tuple[str, ...]


ARMS = {a.name: a for a in (
    Arm("sync", "synchronous GRPO (eta = 0, coupled loss)",
        ("rollout.max_head_offpolicyness=0", "actor.use_decoupled_loss=false")),
    Arm("recompute", "async decoupled PPO, proximal policy recomputed", ("actor.prox_logp_method=recompute",)),
    Arm("loglinear", "async A-3PO (loglinear interpolation)", ("actor.prox_logp_method=loglinear",)),
    Arm("linear", "async, linear interpolation in probability", ("actor.prox_logp_method=linear",)),
    Arm("reuse", "async, p = sg(theta), one minibatch", ("actor.prox_logp_method=reuse", "actor.ppo_n_minibatches=1")),
    Arm("metrics", "async recompute, logging every approximation's error", ("actor.prox_logp_method=metrics",)),
)}
assert tuple(ARMS) == ARM_NAMES
RESULTS = "results.json"


def arm_configs(args: E2EArgs) -> list[tuple[Arm, int, Config]]:
    """Every (arm, seed) configuration, validated before anything runs."""
    unknown = [a for a in args.arms if a not in ARMS]
    if unknown:
        raise ConfigError(f"--arms: unknown arm '{unknown[0]}'; choose from {', '.join(ARMS)}")
    if args.seeds < 1:
        raise ConfigError(f"--seeds {args.seeds}: must be at least 1")
    base = load_config(args.config, args.overrides, preset=args.preset)
    out = []
    for i in range(args.seeds):
        seed = base.seed + i
        for name in args.arms:
            arm = ARMS[name]
            extra = [*arm.overrides, f"seed={seed}", f"evaluator.freq_steps={base.total_train_steps}"]
            try:
                cfg = load_config(args.config, [*args.overrides, *extra], preset=args.preset)
            except ConfigError as e:
                raise ConfigError(f"arm '{name}' ({' '.join(arm.overrides)}): {e}") from None
            out.append((arm, seed, cfg))
    return out


def run_key(arm: Arm, seed: int) -> str:
    return f"{arm.name}-seed{seed}"


def run_arm(arm: Arm, seed: int, cfg: Config, bench_dir: Path, label: str) -> dict:
    """One `a3po train` in a child process; its step count is followed from metrics.jsonl."""
    key = run_key(arm, seed)
    run_dir = bench_dir / "runs" / key
    if run_dir.exists():
        shutil.rmtree(run_dir)  # an unfinished earlier attempt
    cfg.fileroot, cfg.experiment_name = str(bench_dir / "runs"), key
    cfg_path = bench_dir / "configs" / f"{key}.yaml"
    cfg_path.parent.mkdir(exist_ok=True)
    cfg_path.write_text(dump_yaml(cfg))
    log_path = bench_dir / "logs" / f"{key}.log"
    log_path.parent.mkdir(exist_ok=True)
    cmd = [sys.executable, "-m", "a3po.cli", "train", "--config", str(cfg_path)]
    t0 = time.perf_counter()
    bar = tqdm(total=cfg.total_train_steps, desc=f"{label} {key}", unit="step", dynamic_ncols=True, file=sys.stderr)
    with open(log_path, "w") as log:
        log.write(f"$ {shlex.join(cmd)}\n")
        log.flush()
        child = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            while child.poll() is None:
                time.sleep(1.0)
                done = min(cfg.total_train_steps, _steps_done(run_dir))
                if done != bar.n:
                    bar.update(done - bar.n)
        except KeyboardInterrupt:
            child.send_signal(signal.SIGINT)
            child.wait()
            bar.close()
            raise
    bar.n = _steps_done(run_dir)
    bar.close()
    wall = time.perf_counter() - t0
    if child.returncode != 0:
        tail = [line for line in log_path.read_text().splitlines() if line.strip()][-1:]
        return {"arm": arm.name, "seed": seed, "ok": False, "returncode": child.returncode,
                "error": tail[0] if tail else "", "log": str(log_path)}
    rows = read_metrics(run_dir / "metrics.jsonl")
    return {"arm": arm.name, "seed": seed, "ok": True, "returncode": 0, "run_dir": str(run_dir),
            "log": str(log_path), "process_wall_s": wall, **summarize_run(rows)}


def _steps_done(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return 0
    return sum(1 for line in path.read_text().splitlines() if '"stale/max"' in line)


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _mean(xs) -> float:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else math.nan


def summarize_run(rows: list[dict]) -> dict:
    """The table's columns and the plots' curves from one run's metrics.jsonl."""
    steps = [r for r in rows if "stale/max" in r]
    evals = [r for r in rows if "eval/accuracy" in r]
    col = lambda k: [r.get(k) for r in steps]
    step_s = col("perf/step_s")
    tail = steps[-min(4, len(steps)):]
    clipped = [r["loss/clipped_frac"] * r["train/n_tokens"] for r in steps]
    out = {
        "steps": len(steps),
        "train_wall_s": sum(step_s),
        "prox_s_per_step": _mean(col("perf/prox_logp_s")),
        "train_s_per_step": _mean(col("perf/train_s")),
        "rollout_wait_s_per_step": _mean(col("perf/rollout_wait_s")),
        "reward_final": _mean(r["rollout/reward_mean"] for r in tail),
        "reward_mean": _mean(col("rollout/reward_mean")),
        "eval_initial": evals[0]["eval/accuracy"] if evals else math.nan,
        "eval_final": evals[-1]["eval/accuracy"] if evals and evals[-1]["step"] == len(steps) else math.nan,
        "ratio_max": max(col("loss/ratio_max"), default=math.nan),
        "clipped_tokens_per_step": _mean(clipped),
        "capped_frac": _mean(col("loss/behav_capped_frac")),
        "stale_mean": _mean(col("stale/mean")),
        "stale_max": max(col("stale/max"), default=math.nan),
        "curves": {
            "step": col("step"),
            "time_s": [sum(step_s[: i + 1]) for i in range(len(step_s))],
            "reward": col("rollout/reward_mean"),
            "clipped_tokens": clipped,
            "ratio_max": col("loss/ratio_max"),
        },
    }
    if steps and any(k.startswith("prox_err/") for k in steps[-1]):
        out["prox_err_steps"] = [{k: v for k, v in r.items() if k.startswith("prox_err/")} for r in steps]
    return out


def _load_previous(bench_dir: Path, header: dict) -> tuple[list[dict], float]:
    """Finished runs of an earlier invocation on the same folder that this one would repeat
    exactly (same arm, seed and configuration), and the time it spent; any other
    configuration is refused."""
    path = bench_dir / RESULTS
    if not path.exists():
        return [], 0.0
    old = json.loads(path.read_text())
    keep = []
    for r in old.get("runs", []):
        key = f"{r['arm']}-seed{r['seed']}"
        if key not in header["configs"]:
            continue  # an arm or seed this invocation does not ask for
        if old["configs"].get(key) != header["configs"][key]:
            raise ConfigError(f"--out {bench_dir}: its run {key} used a different configuration; "
                              "choose a new --out (or delete it)")
        if r.get("ok"):
            keep.append(r)
    return keep, old.get("wall_s") or 0.0


def run(args: E2EArgs, argv: list[str]) -> tuple[dict, int]:
    plan = arm_configs(args)
    if args.out:
        bench_dir = Path(args.out)
        bench_dir.mkdir(parents=True, exist_ok=True)
    else:
        bench_dir = unique_dir(Path(plan[0][2].fileroot) / "bench-e2e")
    header = {
        "benchmark": "e2e", "command": shlex.join(["a3po", "bench", "e2e", *argv]),
        "args": asdict(args), "cpu_count": os.cpu_count(), "torch": torch.__version__,
        "configs": {run_key(a, s): yaml.safe_load(dump_yaml(c)) for a, s, c in plan},
    }
    # the run directories differ between arms by design: leave them out of the comparison
    for c in header["configs"].values():
        c.pop("fileroot"), c.pop("experiment_name")
    done, earlier_s = _load_previous(bench_dir, header)
    finished = {(r["arm"], r["seed"]) for r in done}
    runs = list(done)
    progress(f"bench e2e: {len(plan)} runs ({', '.join(args.arms)} x {args.seeds} seed(s)) in {bench_dir}"
             + (f"; {len(finished)} already done" if finished else ""))
    status = 0
    t_start = time.perf_counter() - earlier_s  # the benchmark's wall time counts every invocation
    try:
        for i, (arm, seed, cfg) in enumerate(plan):
            if (arm.name, seed) in finished:
                continue
            r = run_arm(arm, seed, cfg, bench_dir, f"[{i + 1}/{len(plan)}]")
            if r["ok"] and not args.keep_checkpoints:
                shutil.rmtree(Path(r["run_dir"]) / "checkpoints", ignore_errors=True)
            if not r["ok"]:
                progress(f"bench e2e: {run_key(arm, seed)} failed (exit {r['returncode']}): {r['error']}  [log: {r['log']}]")
                status = 1
            runs.append(r)
            write_results(bench_dir, header, runs, time.perf_counter() - t_start)
    except KeyboardInterrupt:
        progress(f"\nbench e2e: interrupted; the finished runs are kept in {bench_dir} "
                 f"(continue with --out {bench_dir})")
        status = 130
    record = write_results(bench_dir, header, runs, time.perf_counter() - t_start)
    return record, status


def write_results(bench_dir: Path, header: dict, runs: list[dict], wall_s: float) -> dict:
    from a3po.bench.report import aggregate, approx_quality, markdown, plot

    runs = sorted(runs, key=lambda r: (r["seed"], list(ARMS).index(r["arm"])))
    record = {**header, "wall_s": wall_s, "runs": runs, "table": aggregate(runs), "approx": approx_quality(runs)}
    record["plots"] = plot(runs, bench_dir / "plots")
    write_json(bench_dir / RESULTS, record)
    (bench_dir / "results.md").write_text(markdown(record, bench_dir))
    record["out"] = str(bench_dir)
    return record


def main(args: E2EArgs, argv: list[str]) -> int:
    record, status = run(args, argv)
    if record["runs"]:
        print((Path(record["out"]) / "results.md").read_text())
        print(f"written: {record['out']}/results.md, {RESULTS}, plots/")
    return status


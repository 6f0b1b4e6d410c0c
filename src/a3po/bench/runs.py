"""Benchmarks made of real training runs: what `a3po bench e2e` and `a3po bench staleness` share.

A benchmark is a plan of runs, each a complete `a3po train` in its own process on a
validated configuration; this module runs the plan, follows each run's progress from its
metrics.jsonl, summarises the finished run from that file, writes the benchmark's results
after every run (an interrupted benchmark keeps what it measured), and continues an earlier
invocation on the same `--out` folder, skipping runs it already finished with the same
configuration. Not run directly: `a3po bench e2e ...` or `a3po bench staleness ...`.
"""

from __future__ import annotations

import json
import math
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from importlib.metadata import version
from pathlib import Path

import yaml
from tqdm import tqdm

from a3po.algo.variants import prox_traits
from a3po.bench.args import TrainBenchArgs
from a3po.bench.common import progress
from a3po.config import Config, ConfigError, dump_yaml
from a3po.files import unique_dir
from a3po.machine import code_commit
from a3po.machine import machine as common_machine
from a3po.pipeline.sinks import HELD_OUT
from a3po.trainer.checkpoint import latest_checkpoint, load_run_state

RESULTS = "results.json"
CHILD_STOP_S = 60.0  # a signalled `a3po train` is out within seconds (docs/operations.md)


@dataclass(frozen=True)
class Arm:
    """A named set of overrides; everything else is the same for every arm of a benchmark."""

    name: str
    label: str
    overrides: tuple[str, ...]
    method: str | None = None  # the actor.prox_logp_method the overrides set (`trains_with`), if any

    @classmethod
    def trains_with(cls, name: str, label: str, method: str, *extra: str, one_step: bool = False) -> Arm:
        """An arm on prox_logp_method=`method` and the `extra` overrides; with `one_step`, a method that is
        exact only with one gradient step per sample (variants.py) also gets actor.ppo_n_minibatches=1."""
        pin = ("actor.ppo_n_minibatches=1",) if one_step and prox_traits(method).single_step_only else ()
        return cls(name, label, (f"actor.prox_logp_method={method}", *pin, *extra), method)

    @property
    def single_step_only(self) -> bool:
        """Does the arm's proximal method allow only one gradient step per sample (variants.py)?"""
        return self.method is not None and prox_traits(self.method).single_step_only


@dataclass(frozen=True)
class PlannedRun:
    key: str  # also the run's folder name under runs/
    cfg: Config
    fields: dict  # what identifies the run in the results (arm, seed, ...), copied into its record


Summarizer = Callable[[list[dict], Config], dict]
Writer = Callable[[Path, dict, list[dict], float], dict]  # (bench dir, header, runs, wall s) -> record


@dataclass(frozen=True)
class Benchmark:
    """What differs between the benchmarks built on this module."""

    name: str  # `a3po bench <name>`; the default output folder is <fileroot>/bench-<name>
    plan: list[PlannedRun]
    summarize: Summarizer  # one finished run's metrics.jsonl rows -> its summary
    write: Writer
    description: str  # shape of the plan, for the first progress line
    key_of: Callable[[dict], str] = lambda r: r["key"]  # a stored run record's key (older files lack "key")


# ----------------------------------------------------------------------------- one run


def run_one(planned: PlannedRun, bench_dir: Path, label: str, summarize: Summarizer) -> dict:
    """One `a3po train` in a child process; its step count is followed from metrics.jsonl.

    An unfinished earlier attempt of the same configuration that saved a checkpoint is resumed from it (under
    rollout.lockstep that is the run an uninterrupted attempt makes, bit for bit); any other is started afresh."""
    key, cfg = planned.key, planned.cfg
    run_dir = bench_dir / "runs" / key
    cfg.fileroot, cfg.experiment_name = str(bench_dir / "runs"), key
    cfg_path = bench_dir / "configs" / f"{key}.yaml"
    cfg_path.parent.mkdir(exist_ok=True)
    text = dump_yaml(cfg)
    resumed_from = _resumable(run_dir, cfg_path, text)
    if resumed_from is None and run_dir.exists():
        shutil.rmtree(run_dir)  # an unfinished earlier attempt with nothing to continue from
    cfg_path.write_text(text)
    log_path = bench_dir / "logs" / f"{key}.log"
    log_path.parent.mkdir(exist_ok=True)
    cmd = [sys.executable, "-m", "a3po.cli", "train",
           *(["--config", str(cfg_path)] if resumed_from is None else ["--resume", str(run_dir)])]
    t0 = time.perf_counter()
    bar = tqdm(total=cfg.total_train_steps, desc=f"{label} {key}", unit="step", dynamic_ncols=True, file=sys.stderr)
    with open(log_path, "w" if resumed_from is None else "a") as log:
        log.write(f"$ {shlex.join(cmd)}\n")
        log.flush()
        child = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            while child.poll() is None:
                time.sleep(1.0)
                done = min(cfg.total_train_steps, _steps_done(run_dir))
                if done != bar.n:
                    bar.update(done - bar.n)
        except KeyboardInterrupt as e:  # Ctrl-C or SIGTERM (a3po.signals.Stopped): the run is stopped the same way
            child.send_signal(getattr(e, "signum", signal.SIGINT))
            try:
                child.wait(timeout=CHILD_STOP_S)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
            bar.close()
            raise
    bar.n = _steps_done(run_dir)
    bar.close()
    wall = time.perf_counter() - t0
    head = {**planned.fields, "key": key, "code_commit": code_commit()}
    if resumed_from is not None:  # process_wall_s is then this attempt's alone
        head["resumed_from_step"] = resumed_from
    if child.returncode != 0:
        tail = [line for line in log_path.read_text().splitlines() if line.strip()][-1:]
        return {**head, "ok": False, "returncode": child.returncode, "error": tail[0] if tail else "",
                "log": str(log_path)}
    rows = read_metrics(run_dir / "metrics.jsonl")
    return {**head, "ok": True, "returncode": 0, "run_dir": str(run_dir), "log": str(log_path),
            "process_wall_s": wall, **summarize(rows, cfg), **held_out(run_dir, cfg.total_train_steps)}


def held_out(run_dir: Path, last_step: int) -> dict:
    """Each held-out example's result at the first and the last evaluation (HELD_OUT), for paired intervals."""
    path = run_dir / HELD_OUT
    if not path.exists():
        return {}
    by_step = {r["step"]: r["solved"] for r in map(json.loads, path.read_text().splitlines()) if r}
    return {"held_out_initial": by_step.get(0), "held_out_final": by_step.get(last_step)}


def _resumable(run_dir: Path, cfg_path: Path, text: str) -> int | None:
    """The step an unfinished earlier attempt can resume from: it was configured as `text` and saved a readable
    run state; else None."""
    ckpt = latest_checkpoint(run_dir)  # None where the attempt left no folder or no checkpoint
    if ckpt is None or not cfg_path.is_file() or cfg_path.read_text() != text:
        return None
    try:
        return load_run_state(ckpt)["step"]
    except (OSError, ValueError):
        return None


def _steps_done(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return 0
    return sum(1 for line in path.read_text().splitlines() if '"stale/max"' in line)


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# ----------------------------------------------------------------------------- summaries


def mean(xs) -> float:
    """Mean of the values that are there: a metric a step did not log is not a zero."""
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else math.nan


def training_steps(rows: list[dict]) -> list[dict]:
    """The rows of training steps (evaluation-only rows, such as step 0's, carry no staleness)."""
    return [r for r in rows if "stale/max" in r]


def summarize_run(rows: list[dict], cfg: Config | None = None) -> dict:
    """The e2e table's columns and the plots' curves from one run's metrics.jsonl."""
    steps = training_steps(rows)
    evals = [r for r in rows if "eval/accuracy" in r]
    col = lambda k: [r.get(k) for r in steps]
    step_s = col("perf/step_s")
    tail = steps[-min(4, len(steps)):]
    clipped = [r["loss/clipped_frac"] * r["train/n_tokens"] for r in steps]
    out = {
        "steps": len(steps),
        "train_wall_s": sum(step_s),
        "prox_s_per_step": mean(col("perf/prox_logp_s")),
        "train_s_per_step": mean(col("perf/train_s")),
        "rollout_wait_s_per_step": mean(col("perf/rollout_wait_s")),
        "weight_sync_s_per_step": mean(col("perf/weight_sync_s")),
        "idle_frac": mean(col("rollout/idle_frac")),
        "service_s_per_group": mean(col("rollout/reward_service_s")),  # nan without a reward service
        "ranks_sync_s_per_step": mean(col("perf/ranks_sync_s")),  # nan with one trainer rank
        "reward_final": mean(r["rollout/reward_mean"] for r in tail),
        "reward_mean": mean(col("rollout/reward_mean")),
        "eval_initial": evals[0]["eval/accuracy"] if evals and evals[0]["step"] == 0 else math.nan,
        "eval_final": evals[-1]["eval/accuracy"] if evals and evals[-1]["step"] == len(steps) else math.nan,
        "tool_use_initial": evals[0].get("eval/tool_use_frac", math.nan) if evals and evals[0]["step"] == 0
        else math.nan,
        "tool_use_final": evals[-1].get("eval/tool_use_frac", math.nan) if evals and evals[-1]["step"] == len(steps)
        else math.nan,
        "first_turn_final": evals[-1].get("eval/first_turn_accuracy", math.nan)  # in an environment
        if evals and evals[-1]["step"] == len(steps) else math.nan,
        "ratio_max": max(col("loss/ratio_max"), default=math.nan),
        "clipped_tokens_per_step": mean(clipped),
        "capped_frac": mean(col("loss/behav_capped_frac")),
        "stale_mean": mean(col("stale/mean")),
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


# ----------------------------------------------------------------------------- the plan


def run_benchmark(bench: Benchmark, args: TrainBenchArgs, argv: list[str]) -> tuple[dict, int]:
    """Run every planned run not already finished in --out; (results record, exit status)."""
    plan = bench.plan
    if args.out:
        bench_dir = Path(args.out)
        bench_dir.mkdir(parents=True, exist_ok=True)
    else:
        bench_dir = unique_dir(Path(plan[0].cfg.fileroot) / f"bench-{bench.name}")
    command = shlex.join(["a3po", "bench", bench.name, *argv])
    header = {
        "benchmark": bench.name, "command": command, "commands": [command],
        "args": asdict(args), **machine(),
        "configs": {p.key: yaml.safe_load(dump_yaml(p.cfg)) for p in plan},
    }
    # the run directories differ between runs by design: leave them out of the comparison
    for c in header["configs"].values():
        c.pop("fileroot"), c.pop("experiment_name")
    done, earlier_s = _load_previous(bench_dir, header, bench.key_of)
    finished = {bench.key_of(r) for r in done}
    runs = list(done)
    # finished runs keep their place; this invocation's new runs follow in plan order
    order = {k: i for i, k in enumerate([*(bench.key_of(r) for r in done),
                                         *(p.key for p in plan if p.key not in finished)])}
    name = f"bench {bench.name}"
    planned_done = len(finished & {p.key for p in plan})
    progress(f"{name}: {len(plan)} runs ({bench.description}) in {bench_dir}"
             + (f"; {planned_done} already done" if planned_done else "")
             + (f"; {len(finished) - planned_done} more kept from earlier invocations"
                if len(finished) > planned_done else ""))
    status = 0
    t_start = time.perf_counter() - earlier_s  # the benchmark's wall time counts every invocation

    def save() -> dict:
        ordered = sorted(runs, key=lambda r: order[bench.key_of(r)])
        return bench.write(bench_dir, header, ordered, time.perf_counter() - t_start)

    try:
        for i, planned in enumerate(plan):
            if planned.key in finished:
                continue
            r = run_one(planned, bench_dir, f"[{i + 1}/{len(plan)}]", bench.summarize)
            if r["ok"] and not args.keep_checkpoints:
                shutil.rmtree(Path(r["run_dir"]) / "checkpoints", ignore_errors=True)
            if not r["ok"]:
                progress(f"{name}: {planned.key} failed (exit {r['returncode']}): {r['error']}  [log: {r['log']}]")
                status = 1
            runs.append(r)
            save()
    except KeyboardInterrupt as e:
        progress(f"\n{name}: interrupted; the finished runs are kept in {bench_dir} (continue with --out {bench_dir})")
        status = getattr(e, "exit_code", 130)
    record = save()
    record["out"] = str(bench_dir)
    return record, status


def _load_previous(bench_dir: Path, header: dict, key_of: Callable[[dict], str]) -> tuple[list[dict], float]:
    """Finished runs of earlier invocations on the same folder, and the time they spent. A run this
    invocation plans too must have been made with the same configuration (same_configuration;
    anything else is refused, so that one table never mixes two); a run it does not plan is kept
    with its own configuration, so a study grows over invocations that each ask for a part.
    The header gains their configurations and `commands`, every invocation's command line."""
    path = bench_dir / RESULTS
    if not path.exists():
        return [], 0.0
    old = json.loads(path.read_text())
    if old.get("benchmark", header["benchmark"]) != header["benchmark"]:
        raise ConfigError(f"--out {bench_dir}: it holds a bench {old['benchmark']}, not a bench {header['benchmark']}; "
                          "choose a new --out")
    header["commands"] = _union(_commands_of(old), [header["command"]])
    header["machines"] = _union(machines_of(old), [machine_of(header)])
    keep = []
    for r in old.get("runs", []):
        key = key_of(r)
        if key not in header["configs"]:  # a run this invocation does not ask for: kept as it was
            if r.get("ok") and key in old.get("configs", {}):
                header["configs"][key] = old["configs"][key]
                keep.append(r)
            continue
        if not same_configuration(old["configs"].get(key), header["configs"][key]):
            raise ConfigError(f"--out {bench_dir}: its run {key} used a different configuration; "
                              "choose a new --out (or delete it)")
        if r.get("ok"):
            keep.append(r)
    return keep, old.get("wall_s") or 0.0


def join_records(into: dict, other: dict, where: str) -> tuple[dict, list[dict], float]:
    """`into`'s results.json with the finished runs of `other` added: two copies of one study folder continued
    apart (side by side on one machine, or on two) made into one. A run both hold must be the same record (the
    copied part they share); anything else is refused, as is a run made with another configuration than one of
    the same key in `into`. A run that failed in `into` and finished in `other` is kept finished. The wall time
    grows by the added runs' process times (the other folder's own invocation overhead is not known apart from
    the shared part's). Returns (header, runs, wall_s) for the benchmark's writer; `where` names the two folders
    in errors."""
    if other.get("benchmark") != into.get("benchmark"):
        raise ConfigError(f"{where}: one holds a bench {into.get('benchmark')}, the other a bench "
                          f"{other.get('benchmark')}; only two folders of one benchmark join")
    mine = {r["key"]: r for r in into["runs"]}
    header = {k: v for k, v in into.items() if k not in ("runs", "wall_s")}
    header["configs"] = dict(into["configs"])
    header["commands"] = _union(_commands_of(into), _commands_of(other))
    header["machines"] = _union(machines_of(into), machines_of(other))
    runs, added_s = list(into["runs"]), 0.0
    for r in other["runs"]:
        key = r["key"]
        if not r.get("ok") or mine.get(key) == r:
            continue
        if mine.get(key, {}).get("ok"):
            raise ConfigError(f"{where}: both hold a run {key} with different results; keep one (delete the "
                              "other's entry from its results.json) and join again")
        cfg = other["configs"][key]
        if key in into["configs"] and not same_configuration(into["configs"][key], cfg):
            raise ConfigError(f"{where}: run {key} was configured differently in the two; they are not one study")
        header["configs"][key] = cfg
        runs = [r if x["key"] == key else x for x in runs] if key in mine else [*runs, r]
        added_s += r.get("process_wall_s") or 0.0
    return header, runs, (into.get("wall_s") or 0.0) + added_s


def _commands_of(record: dict) -> list:
    return record.get("commands") or [record["command"]]  # records before `commands` held one


def machines_of(record: dict) -> list:
    """The machines a record's runs were made on: records before `machines` named one in their header, and a record
    that names none (written by hand) has none."""
    return record.get("machines") or ([machine_of(record)] if record.get("cpu_model") else [])


def _union(first: list, then: list) -> list:
    """`first`, then what `then` adds to it, in order."""
    return [*first, *(x for x in then if x not in first)]


def same_configuration(old: dict | None, new: dict) -> bool:
    """Would `new` repeat the run recorded with `old`? Equal, except that a key the old record lacks (added to
    a3po since) counts as the same when `new` holds its default: a key's default keeps the behaviour from before
    it existed. A changed default is a different configuration. A reward service's URL may differ (the service
    arm's stub listens on a new port each invocation)."""
    if old is None:
        return False
    defaults = yaml.safe_load(dump_yaml(Config()))

    def same(o: dict, n: dict, d: dict) -> bool:
        for k, v in n.items():
            if k == "url" and o.get("kind", "none") != "none":  # a reward service's address: where, not what
                continue
            if k not in o:
                if not (isinstance(d, dict) and k in d and d[k] == v):
                    return False
            elif isinstance(v, dict) and isinstance(o[k], dict):
                if not same(o[k], v, d.get(k, {}) if isinstance(d, dict) else {}):
                    return False
            elif o[k] != v:
                return False
        return all(k in n for k in o)

    return same(old, new, defaults)


def machine_of(record: dict) -> dict:
    """The machine fields of a results header (machine()'s keys), so that a folder continued on
    another machine keeps naming every machine its runs were made on."""
    return {k: record.get(k) for k in ("cpu_model", "avx512_bf16", "cpu_count", "torch")}


def machine() -> dict:
    """What the timings were measured on, as header keys of results.json: CPU model, whether it
    computes bf16 natively, cores, torch (a3po/machine.py reads the CPU)."""
    m = common_machine()
    return {"cpu_model": m["cpu"], "avx512_bf16": m["avx512_bf16"], "cpu_count": m["cores"], "torch": version("torch")}

"""`a3po train`: a built run (pipeline/build.py) driven step by step, and what it produced kept.

A run directory (RUN_DIR = <fileroot>/<experiment_name>, suffixed -2, -3, ... if taken)
holds config.yaml (the resolved configuration), metrics.jsonl (one line per step),
tb/ (TensorBoard) and checkpoints/ (Hugging Face format plus resume state).
`a3po train --resume RUN_DIR` reloads its config and newest checkpoint and continues with
the same step count, version, optimizer, scheduler, RNG and data position.

Every way a run ends is an exit code and, unless it finished, one line on stderr: the table of
pipeline/exits.py (0 done, 1 failed during training or no space left, 2 bad input, 130 SIGINT,
143 SIGTERM), which docs/operations.md "Exit codes" renders for users.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from pathlib import Path

from tqdm import tqdm

from a3po import signals, startup
from a3po.config import Config
from a3po.files import writing
from a3po.pipeline import carry, exits
from a3po.pipeline.build import Run, build_run, say
from a3po.pipeline.evaluate import Evaluation
from a3po.pipeline.exits import Ending, Progress
from a3po.pipeline.inputs import RunInputs
from a3po.pipeline.pool import split_threads
from a3po.pipeline.progress import ProgressBar
from a3po.pipeline.sinks import HELD_OUT, METRICS, read_metrics
from a3po.trainer import ranks
from a3po.trainer.checkpoint import save_checkpoint


def train(cfg: Config, resume: str | None = None, inputs: RunInputs | None = None) -> int:
    """Run `a3po train`; every way it ends is an exit code and, unless it finished, one line on stderr.

    The line is printed after the clean-up (progress bar closed, workers stopped), so it
    stands on its own line and what it says about the workers is true."""
    progress = Progress()
    rank, world = ranks.torchrun_rank()
    if rank > 0:  # under torchrun: this process trains beside rank 0 and does nothing else
        threads = split_threads(cfg.rollout.n_workers, cfg.rollout.torch_threads)[1]
        return ranks.follow(cfg, rank, world, None, None, threads)
    try:
        return _train(cfg, resume, progress, inputs)
    except (Exception, KeyboardInterrupt) as e:
        end = _ending(e, progress, Path(cfg.fileroot))
        if end is None:
            raise  # a bug: its traceback
        say(end.line)
        return end.code


def _ending(error: BaseException, progress: Progress, fileroot: Path) -> Ending | None:
    """A stop signal first (any error once one arrived is part of the stop), then a full disk, then the table's
    rows for a running run, then a trainer rank that stopped answering."""
    stop = signals.stop_behind(error)
    if stop is not None:
        return Ending(stop.exit_code, progress.stopped_line(stop))
    full = exits.disk_full(error, progress.run_dir or fileroot)
    if full is not None:
        return Ending(exits.FAILED, progress.disk_full_line(full))
    end = exits.ending(error, exits.RUN, progress.step)
    if end is not None:
        return end
    lost = ranks.lost_rank(error)
    if lost is not None:
        resume = f"; continue with: a3po train --resume {progress.run_dir}" if progress.run_dir else ""
        return Ending(exits.FAILED, f"a3po: training stopped at step {progress.step}: {lost}{resume}")
    return None


def _train(cfg: Config, resume: str | None, progress: Progress, inputs: RunInputs | None) -> int:
    t_start = time.perf_counter()
    with contextlib.ExitStack() as stack:  # closes what was built in reverse, however the block is left
        with startup.collector_held():
            run = build_run(cfg, resume, inputs, progress, stack)
        if not run.resumed and cfg.evaluator.initial:
            say("a3po: evaluating the initial policy on the held-out split ...")
            run.sinks.log(0, _evaluation(run, 0))
        run.pool.wait_ready(cfg.rollout.stall_timeout_s)
        bar = stack.enter_context(contextlib.closing(  # first to close: what is printed next starts a line
            ProgressBar(total=cfg.total_train_steps, initial=run.start_step, file=sys.stderr)))
        progress.training = True
        warned_cut = False
        last_acc = next((r["eval/accuracy"] for r in reversed(read_metrics(run.sinks.path))  # a resumed run's too
                         if r.get("eval/accuracy") is not None), None)
        step = run.start_step
        while step < cfg.total_train_steps:
            signals.check()
            stats = run.trainer.step()
            step = progress.step = run.engine.version
            if cfg.evaluator.freq_steps and (step % cfg.evaluator.freq_steps == 0 or step == cfg.total_train_steps):
                stats.update(_evaluation(run, step))
                last_acc = stats["eval/accuracy"]
            stats["perf/borrowed_frac"] = run.lender.borrowed_frac()
            if not warned_cut and stats["rollout/truncated_frac"] > TRUNCATED_WARN:
                warned_cut = True  # once a run: the share is in metrics.jsonl for every step
                tqdm.write(truncation_warning(stats["rollout/truncated_frac"], step, cfg.gconfig.max_new_tokens),
                           file=sys.stderr)
            run.sinks.log(step, stats)
            if step == cfg.total_train_steps or (cfg.saver.freq_steps and step % cfg.saver.freq_steps == 0):
                _checkpoint(run, step)
            bar.show(_facts(stats, last_acc))
            bar.update(1)
        progress.finished = True
    # the whole run's records, a resumed run's from before its resume included (its step-0 evaluation first)
    print(summary(read_metrics(run.run_dir / METRICS), run.run_dir, time.perf_counter() - t_start))
    return 0


TRUNCATED_WARN = 0.5  # a share of completions cut at gconfig.max_new_tokens above this is warned of, once


def truncation_warning(frac: float, step: int, max_new_tokens: int) -> str:
    return (f"a3po: warning: {frac:.0%} of step {step}'s completions were cut at gconfig.max_new_tokens="
            f"{max_new_tokens} before they ended, so their answers are missing and score as wrong; raise "
            f"gconfig.max_new_tokens (or ask for shorter answers with train_dataset.system_prompt)")


def _evaluation(run: Run, step: int) -> dict[str, float]:
    """The held-out evaluation of the policy at `step`: its metrics and how long it took, once its per-example
    results are appended to the run's HELD_OUT file."""
    t0 = time.perf_counter()
    ev: Evaluation = run.evaluate(run.engine.sampling_model(), run.tok, run.data.eval)
    with writing(HELD_OUT, run.run_dir), open(run.run_dir / HELD_OUT, "a") as f:
        f.write(json.dumps({"step": step, "solved": ev.solved}) + "\n")
    return {**ev.metrics, "perf/eval_s": time.perf_counter() - t0}


def _checkpoint(run: Run, step: int) -> None:
    """A checkpoint once begun is finished, a stop signal taking effect after it: leaving one
    half-written would waste the work, and a half-updated `latest` pointer would break --resume."""
    with signals.deferred():
        carried = run.trainer.carried()
        save_checkpoint(run.run_dir, step, run.engine, run.tok, {
            "step": step, "version": run.engine.version, "data_cursor": carried.first_cursor,
        }, keep=run.cfg.saver.keep_last, files={carry.ROLLOUT_FILE: carry.dumps(carried, run.cfg)})


def _facts(stats: dict, acc: float | None) -> list[str]:
    """What the progress bar says of the step, most important first (a narrow terminal drops the last)."""
    parts = [f"reward {stats['rollout/reward_mean']:.2f}"]
    if acc is not None:
        parts.append(f"eval {acc:.2f}")
    parts += [
        f"stale {stats['stale/mean']:.1f}/{stats['stale/max']:.0f} ahead {stats['rollout/groups_ahead']:.0f}",
        f"{stats['perf/tokens_per_s']:.0f} tok/s",
        f"wait {stats['perf/rollout_wait_s']:.1f}s train {stats['perf/train_s']:.1f}s "
        f"prox {stats['perf/prox_logp_s']:.2f}s sync {stats['perf/weight_sync_s']:.2f}s",
    ]
    return parts


def summary(history: list[dict], run_dir: Path, wall_s: float) -> str:
    """The table printed at the end of a run, from its metrics records (metrics.jsonl: steps before a
    resume included); a value logged as null (not finite) is left out of its mean."""
    steps = [h for h in history if h["step"] > 0 and "rollout/reward_mean" in h]
    evals = [h for h in history if h.get("eval/accuracy") is not None]
    mean = lambda rows, k: (sum(v for r in rows if (v := r.get(k)) is not None)
                            / max(1, sum(r.get(k) is not None for r in rows)))
    head, tail = steps[:5], steps[-5:]
    lines = [
        "",
        "a3po run summary",
        f"  run directory            {run_dir}",
        f"  steps                    {steps[-1]['step'] if steps else 0}",
        f"  wall time                {wall_s:.0f} s",
    ]
    if evals:
        lines.append(f"  held-out accuracy        {evals[0]['eval/accuracy']:.3f} (step {evals[0]['step']}) -> "
                     f"{evals[-1]['eval/accuracy']:.3f} (step {evals[-1]['step']})")
    if steps:
        lines += [
            f"  task reward (first/last 5 steps)  {mean(head, 'rollout/reward_mean'):.3f} -> "
            f"{mean(tail, 'rollout/reward_mean'):.3f}",
            f"  staleness mean / max     {mean(steps, 'stale/mean'):.2f} / "
            f"{max((s.get('stale/max') or 0) for s in steps):.0f}",
            f"  rollout idle             {mean(steps, 'rollout/idle_frac'):.0%} of the workers' time",
            f"  time per step            {mean(steps, 'perf/step_s'):.2f} s "
            f"(rollout wait {mean(steps, 'perf/rollout_wait_s'):.2f}, "
            f"prox logp {mean(steps, 'perf/prox_logp_s'):.2f}, train {mean(steps, 'perf/train_s'):.2f}, "
            f"weight sync {mean(steps, 'perf/weight_sync_s'):.2f})",
            f"  generated tokens/s       {mean(steps, 'perf/tokens_per_s'):.0f}",
        ]
    return "\n".join(lines)

"""`a3po train`: set up a run, drive the training loop, keep what it produced.

A run directory (RUN_DIR = <fileroot>/<experiment_name>, suffixed -2, -3, ... if taken)
holds config.yaml (the resolved configuration), metrics.jsonl (one line per step),
tb/ (TensorBoard) and checkpoints/ (Hugging Face format plus resume state).
`a3po train --resume RUN_DIR` reloads its config and newest checkpoint and continues with
the same step count, version, optimizer, scheduler, RNG and data position.

Exit codes: 0 done, 1 failed during training or no space left to write the run (one line;
last checkpoint intact), 2 bad configuration, resume folder, data or model (one line), 130
SIGINT (Ctrl-C) and 143 SIGTERM (one line; workers stopped, last checkpoint intact).
docs/operations.md "Exit codes" is the table users read.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from tqdm import tqdm

from a3po import signals
from a3po.config import Config, ConfigError, dump_yaml, to_dict
from a3po.config.choices import Backend, Launcher
from a3po.data import DataError
from a3po.data.order import DataOrder
from a3po.devices import resolve_device
from a3po.files import DiskFullError, atomic_write_text, causes, no_space, unique_dir, writing
from a3po.launch import make_launcher
from a3po.models import ModelSourceError, load_policy
from a3po.pipeline.cores import CoreLender, lends_cores
from a3po.pipeline.evaluate import Evaluation, Evaluator
from a3po.pipeline.inputs import RunInputs, load_inputs
from a3po.pipeline.loop import RewardFailureError, StalenessError, Trainer
from a3po.pipeline.pool import WorkerError, WorkerPool, split_threads
from a3po.pipeline.progress import ProgressBar
from a3po.pipeline.sinks import HELD_OUT, METRICS, Sinks, read_metrics
from a3po.rollout import vllm_engine
from a3po.rollout.prompts import ChatTurns, TemplateError
from a3po.rollout.worker import Scoring
from a3po.signals import Stopped
from a3po.trainer import parallel, ranks
from a3po.trainer.checkpoint import CheckpointError, latest_checkpoint, save_checkpoint
from a3po.trainer.checkpoint import resume as resume_checkpoint
from a3po.trainer.engine import TrainEngine

USER_ERRORS = (ConfigError, DataError, ModelSourceError, CheckpointError)
TRAINING_ERRORS = (WorkerError, RewardFailureError, StalenessError, FloatingPointError)


def new_run_dir(cfg: Config) -> Path:
    return unique_dir(Path(cfg.fileroot) / cfg.experiment_name)


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@dataclass
class Progress:
    """How far a run got: what the one line printed when it stops early reports."""

    run_dir: Path | None = None
    step: int = 0
    training: bool = False  # start-up is over: the progress bar is up
    workers: bool = False  # rollout workers were started (so the clean-up stopped them)

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
        stop = signals.stop_behind(e)
        if stop is not None:
            say(progress.stopped_line(stop))
            return stop.exit_code
        full = _disk_full(e, progress.run_dir or Path(cfg.fileroot))
        if full is not None:
            say(progress.disk_full_line(full))
            return 1
        if isinstance(e, USER_ERRORS):
            say(f"a3po: error: {' '.join(str(e).splitlines())}")  # one line even when a library's message is not
            return 2
        if isinstance(e, TRAINING_ERRORS):
            say(f"a3po: training stopped at step {progress.step}: {e}")
            return 1
        lost = ranks.lost_rank(e)
        if lost is not None:
            resume = f"; continue with: a3po train --resume {progress.run_dir}" if progress.run_dir else ""
            say(f"a3po: training stopped at step {progress.step}: {lost}{resume}")
            return 1
        raise  # a bug: its traceback


def _disk_full(error: BaseException, folder: Path) -> DiskFullError | None:
    """The full disk `error` comes of, if it does: the DiskFullError in its chain (a later error in
    the clean-up, such as closing a file whose write failed, can stand in front of it), else one
    naming `folder` for a write that `files.writing` did not wrap."""
    found = next((e for e in causes(error) if isinstance(e, DiskFullError)), None)
    if found is not None:
        return found
    code = no_space(error)
    return DiskFullError(code, "the run", folder) if code is not None else None


def _open_run_dir(cfg: Config, resume: str | None, engine: TrainEngine) -> tuple[Path, int, int]:
    """(run directory, first step, data cursor): a new directory, or the resumed one with its checkpoint loaded."""
    if not resume:
        return new_run_dir(cfg), 0, 0
    run_dir = Path(resume)
    ckpt, state = resume_checkpoint(run_dir, engine, warn=say)
    say(f"a3po: resuming {run_dir} from {ckpt.name} (step {state['step']})")
    return run_dir, state["step"], state["data_cursor"]


def _train(cfg: Config, resume: str | None, progress: Progress, inputs: RunInputs | None) -> int:
    t_start = time.perf_counter()
    transformers.utils.logging.disable_progress_bar()  # our own bar is the one to watch
    # Setup: everything that can fail on bad input fails here, before any process starts.
    inputs = inputs or load_inputs(cfg)  # `a3po train` loaded them before importing torch
    data = inputs.data
    device = ranks.rank_device(cfg.actor.device, 0)
    rollout_device = resolve_device(cfg.rollout.device, "rollout.device")  # here: a worker's error comes later
    if cfg.rollout.backend == Backend.VLLM and not vllm_engine.installed():
        raise ConfigError(vllm_engine.MISSING)
    scoring = Scoring(inputs.reward_fn, inputs.env, inputs.agent)
    model, tok = load_policy(cfg.actor.path, seed=cfg.seed)  # a bad model is one line before any rank starts
    if scoring.env is not None:
        try:  # a template that cannot extend an episode by appending fails here, not in every worker
            ChatTurns(tok).observation("ok", "user", inline=False, ended_by_eos=True)
        except TemplateError as e:
            raise ConfigError(f"actor.path={cfg.actor.path}: {e}") from None
    per_worker, trainer_threads = split_threads(cfg.rollout.n_workers, cfg.rollout.torch_threads)
    world, by_torchrun = ranks.world_size(cfg)
    if device.type == "cuda" and cfg.cluster.launcher == Launcher.LOCAL and not by_torchrun:
        ranks.check_rank_gpus(cfg.actor.device, world, torch.cuda.device_count())
    finished = False
    # Clean-up in reverse order of creation, however the block is left: error, signal or the end.
    with contextlib.ExitStack() as cleanup:
        dp = None
        spawned = 0 if by_torchrun else world - 1  # ranks the launcher starts
        launcher = make_launcher(cfg, spawned, per_worker, trainer_threads)
        cleanup.callback(launcher.close)
        if world > 1:
            addr = None if by_torchrun else launcher.host()  # torchrun set MASTER_ADDR and MASTER_PORT
            port = None if by_torchrun else parallel.free_port(addr)
            followers = ranks.start_followers(launcher, cfg, world, addr, port, trainer_threads) if spawned else []
            cleanup.callback(parallel.close)
            cleanup.callback(lambda: ranks.end_followers(followers, dp, finished))
            dp = parallel.init(0, world, cfg.cluster.data_parallel, cfg.cluster.timeout_s, device, addr=addr,
                               port=port)
        engine = ranks.build_engine(cfg, model, device, dp)
        signals.check()  # a stop the loading swallowed takes effect here (signals.check says where one was)

        run_dir, start_step, cursor = _open_run_dir(cfg, resume, engine)
        progress.run_dir, progress.step = run_dir, start_step
        with writing("config.yaml", run_dir):
            atomic_write_text(run_dir / "config.yaml", dump_yaml(cfg))
        order = DataOrder(len(data.train), cfg.seed, cursor)

        say(f"a3po: run directory {run_dir}")
        say(f"a3po: {len(data.train)} training / {len(data.eval)} held-out examples of {data.name}; "
            f"model {cfg.actor.path} ({engine.dtype} on {device}"
            f"{f', {world} ranks, {cfg.cluster.data_parallel}' if world > 1 else ''}); "
            f"{cfg.rollout.n_workers} rollout worker(s) x {per_worker} thread(s), trainer {trainer_threads}"
            f"{f'; Ray actors on {launcher.where}' if launcher.name == 'ray' else ''}")
        step = start_step
        weights = launcher.weights(engine.weights())
        pool = WorkerPool(cfg, scoring, weights, engine.version, per_worker, launcher)
        cleanup.callback(pool.close)
        progress.workers = True
        pool.start()
        lendable = cfg.rollout.n_workers * per_worker if lends_cores(cfg, rollout_device) else 0
        lender = CoreLender(trainer_threads, lendable, pool.idle)
        for m in (engine.model, engine.ref_model):
            if m is not None:
                lender.attach(m)
        trainer = Trainer(cfg, engine, pool, weights, data, order, tok.pad_token_id,
                          log=lambda line: tqdm.write(line, file=sys.stderr), run_dir=run_dir)  # above the bar
        cleanup.callback(trainer.close)
        evaluate = Evaluator(cfg, scoring)
        cleanup.callback(evaluate.close)
        sinks = Sinks(run_dir, cfg.logging.tensorboard, cfg.logging.wandb, cfg.logging.wandb_project,
                      to_dict(cfg), resume_step=start_step if resume else None)
        cleanup.callback(sinks.close)
        if not resume and cfg.evaluator.initial:
            say("a3po: evaluating the initial policy on the held-out split ...")
            t0 = time.perf_counter()
            first = _evaluated(evaluate(engine.sampling_model(), tok, data.eval), run_dir, 0)
            first["perf/eval_s"] = time.perf_counter() - t0
            sinks.log(0, first)
        pool.wait_ready(cfg.rollout.stall_timeout_s)
        bar = ProgressBar(total=cfg.total_train_steps, initial=start_step, file=sys.stderr)
        cleanup.callback(bar.close)  # first to run: whatever is printed next starts a line of its own
        progress.training = True
        warned_cut = False
        last_acc = next((r["eval/accuracy"] for r in reversed(read_metrics(sinks.path))  # a resumed run's too
                         if r.get("eval/accuracy") is not None), None)
        while step < cfg.total_train_steps:
            signals.check()
            stats = trainer.step()
            step = progress.step = engine.version
            if cfg.evaluator.freq_steps and (step % cfg.evaluator.freq_steps == 0 or step == cfg.total_train_steps):
                t0 = time.perf_counter()
                stats.update(_evaluated(evaluate(engine.sampling_model(), tok, data.eval), run_dir, step))
                stats["perf/eval_s"] = time.perf_counter() - t0
                last_acc = stats["eval/accuracy"]
            stats["perf/borrowed_frac"] = lender.borrowed_frac()
            if not warned_cut and stats["rollout/truncated_frac"] > TRUNCATED_WARN:
                warned_cut = True  # once a run: the share is in metrics.jsonl for every step
                tqdm.write(truncation_warning(stats["rollout/truncated_frac"], step, cfg.gconfig.max_new_tokens),
                           file=sys.stderr)
            sinks.log(step, stats)
            if step == cfg.total_train_steps or (cfg.saver.freq_steps and step % cfg.saver.freq_steps == 0):
                _checkpoint(run_dir, step, engine, tok, trainer, cfg.saver.keep_last)
            bar.show(_facts(stats, last_acc))
            bar.update(1)
        finished = True
    # the whole run's records, a resumed run's from before its resume included (its step-0 evaluation first)
    print(summary(read_metrics(run_dir / METRICS), run_dir, time.perf_counter() - t_start))
    return 0


TRUNCATED_WARN = 0.5  # a share of completions cut at gconfig.max_new_tokens above this is warned of, once


def truncation_warning(frac: float, step: int, max_new_tokens: int) -> str:
    return (f"a3po: warning: {frac:.0%} of step {step}'s completions were cut at gconfig.max_new_tokens="
            f"{max_new_tokens} before they ended, so their answers are missing and score as wrong; raise "
            f"gconfig.max_new_tokens (or ask for shorter answers with train_dataset.system_prompt)")


def _evaluated(ev: Evaluation, run_dir: Path, step: int) -> dict[str, float]:
    """The evaluation's metrics, once its per-example results are appended to the run's HELD_OUT file."""
    with writing(HELD_OUT, run_dir), open(run_dir / HELD_OUT, "a") as f:
        f.write(json.dumps({"step": step, "solved": ev.solved}) + "\n")
    return ev.metrics


def _checkpoint(run_dir: Path, step: int, engine: TrainEngine, tok, trainer: Trainer, keep: int) -> None:
    """A checkpoint once begun is finished, a stop signal taking effect after it: leaving one
    half-written would waste the work, and a half-updated `latest` pointer would break --resume."""
    with signals.deferred():
        save_checkpoint(run_dir, step, engine, tok, {
            "step": step, "version": engine.version, "data_cursor": trainer.resume_cursor(),
        }, keep=keep)


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

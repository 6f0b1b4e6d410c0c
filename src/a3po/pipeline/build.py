"""Build a run of `a3po train`: every component its loop drives, each entered into one exit stack as it is made.

    with contextlib.ExitStack() as stack:
        run = build_run(cfg, resume, inputs, progress, stack)
        ...                                  # pipeline/run.py: the loop over run.trainer.step()

What can fail on bad input fails first, before any process starts: the devices, vLLM, the model, the
chat template, the GPUs for the trainer ranks. Then, in this order: the launcher, the data-parallel
group and its follower ranks, the training engine, the run folder and its config.yaml, the rollout
workers, core lending, the trainer (its controller thread), the evaluator and the metric sinks. The
stack closes them in the reverse order, however the block is left (an error, a signal or the end),
so nothing is closed before what uses it: the sinks before the evaluator, the workers before the
follower ranks, those before the process group, the launcher last.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from tqdm import tqdm

from a3po import signals
from a3po.config import Config, ConfigError, dump_yaml, to_dict
from a3po.config.choices import Backend, Launcher, TurnContext
from a3po.data import TaskData
from a3po.data.order import DataOrder
from a3po.devices import resolve_device
from a3po.files import atomic_write_text, unique_dir, writing
from a3po.launch import make_launcher
from a3po.models import load_policy
from a3po.pipeline import carry
from a3po.pipeline.cores import CoreLender, lends_cores
from a3po.pipeline.evaluate import Evaluator
from a3po.pipeline.exits import Progress
from a3po.pipeline.inputs import RunInputs, load_inputs
from a3po.pipeline.loop import Trainer
from a3po.pipeline.pool import WorkerPool, split_threads
from a3po.pipeline.sinks import Sinks
from a3po.rollout import vllm_engine
from a3po.rollout.prompts import ChatTurns, TemplateError
from a3po.rollout.runners import Scoring
from a3po.trainer import parallel, ranks
from a3po.trainer.checkpoint import resume as resume_checkpoint
from a3po.trainer.engine import TrainEngine


@dataclass
class Run:
    """What the loop of `a3po train` drives; every part with a close() is in the stack it was built into."""

    cfg: Config
    run_dir: Path
    start_step: int
    resumed: bool
    data: TaskData
    tok: object  # the policy's tokenizer
    engine: TrainEngine
    pool: WorkerPool
    trainer: Trainer
    evaluate: Evaluator
    sinks: Sinks
    lender: CoreLender


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def new_run_dir(cfg: Config) -> Path:
    return unique_dir(Path(cfg.fileroot) / cfg.experiment_name)


def build_run(cfg: Config, resume: str | None, inputs: RunInputs | None, progress: Progress,
              stack: contextlib.ExitStack) -> Run:
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
    if scoring.env is not None and cfg.train_dataset.turn_context != TurnContext.RERENDER:
        try:  # a template that cannot extend an episode by appending: here, not in every worker
            ChatTurns(tok).observation("ok", "user", inline=False, ended_by_eos=True)
        except TemplateError as e:
            if cfg.train_dataset.turn_context == TurnContext.APPEND:
                raise ConfigError(f"actor.path={cfg.actor.path}: {e}") from None
            say(f"a3po: the chat template of {cfg.actor.path} does not extend a conversation by appending: each "
                f"turn of an episode trains as its own row, the conversation rendered whole as its context "
                f"(train_dataset.turn_context=auto; episode/rerendered_tokens_mean counts the cost)")
    per_worker, trainer_threads = split_threads(cfg.rollout.n_workers, cfg.rollout.torch_threads)
    world, by_torchrun = ranks.world_size(cfg)
    if device.type == "cuda" and cfg.cluster.launcher == Launcher.LOCAL and not by_torchrun:
        ranks.check_rank_gpus(cfg.actor.device, world, torch.cuda.device_count())

    spawned = 0 if by_torchrun else world - 1  # ranks the launcher starts
    launcher = stack.enter_context(contextlib.closing(make_launcher(cfg, spawned, per_worker, trainer_threads)))
    dp = None
    if world > 1:
        dp = stack.enter_context(_data_parallel(cfg, launcher, world, by_torchrun, device, trainer_threads, progress))
    engine = ranks.build_engine(cfg, model, device, dp)
    signals.check()  # a stop the loading swallowed takes effect here (signals.check says where one was)

    run_dir, start_step, cursor, carried = _open_run_dir(cfg, resume, engine)
    progress.run_dir, progress.step = run_dir, start_step
    with writing("config.yaml", run_dir):
        atomic_write_text(run_dir / "config.yaml", dump_yaml(cfg))
    say(f"a3po: run directory {run_dir}")
    say(f"a3po: {len(data.train)} training / {len(data.eval)} held-out examples of {data.name}; "
        f"model {cfg.actor.path} ({engine.dtype} on {device}"
        f"{f', {world} ranks, {cfg.cluster.data_parallel}' if world > 1 else ''}); "
        f"{cfg.rollout.n_workers} rollout worker(s) x {per_worker} thread(s), trainer {trainer_threads}"
        f"{f'; Ray actors on {launcher.where}' if launcher.name == 'ray' else ''}")

    weights = launcher.weights(engine.weights())
    pool = stack.enter_context(contextlib.closing(
        WorkerPool(cfg, scoring, weights, engine.version, per_worker, launcher)))
    progress.workers = True
    pool.start()
    lendable = cfg.rollout.n_workers * per_worker if lends_cores(cfg, rollout_device) else 0
    lender = CoreLender(trainer_threads, lendable, pool.idle)
    for m in (engine.model, engine.ref_model):
        if m is not None:
            lender.attach(m)
    trainer = stack.enter_context(contextlib.closing(Trainer(
        cfg, engine, pool, weights, data, DataOrder(len(data.train), cfg.seed, cursor), tok.pad_token_id,
        log=lambda line: tqdm.write(line, file=sys.stderr), run_dir=run_dir, carried=carried)))  # above the bar
    evaluate = stack.enter_context(contextlib.closing(Evaluator(cfg, scoring)))
    log = cfg.logging
    sinks = stack.enter_context(contextlib.closing(Sinks(run_dir, log.tensorboard, log.wandb, log.wandb_project,
                                                         to_dict(cfg), resume_step=start_step if resume else None)))
    return Run(cfg, run_dir, start_step, bool(resume), data, tok, engine, pool, trainer, evaluate, sinks, lender)


@contextlib.contextmanager
def _data_parallel(cfg: Config, launcher, world: int, by_torchrun: bool, device: torch.device, threads: int,
                   progress: Progress) -> Iterator[parallel.DataParallel]:
    """The process group of `world` trainer ranks, this one rank 0. On the way out its follower ranks are told to
    stop after a finished run, else ended outright (they may be inside a collective rank 0 left); then the group
    is closed."""
    addr = None if by_torchrun else launcher.host()  # torchrun set MASTER_ADDR and MASTER_PORT
    port = None if by_torchrun else parallel.free_port(addr)
    followers = [] if by_torchrun else ranks.start_followers(launcher, cfg, world, addr, port, threads)
    dp = None
    try:
        dp = parallel.init(0, world, cfg.cluster.data_parallel, cfg.cluster.timeout_s, device, addr=addr, port=port)
        yield dp
    finally:
        try:
            ranks.end_followers(followers, dp, progress.finished)
        finally:
            parallel.close()


def _open_run_dir(cfg: Config, resume: str | None, engine: TrainEngine) -> tuple[Path, int, int, carry.Carried | None]:
    """(run directory, first step, data cursor, the finished groups it carried): a new directory, or the resumed
    one with its checkpoint loaded."""
    if not resume:
        return new_run_dir(cfg), 0, 0, None
    run_dir = Path(resume)
    ckpt, state = resume_checkpoint(run_dir, engine, warn=say)
    step = state["step"]
    try:
        carried = carry.load(ckpt, engine.version, cfg)
    except ValueError as e:
        say(f"a3po: warning: {ckpt.name} keeps no usable finished groups ({e}); the batches after step "
            f"{step} are sampled again by its weights")
        carried = None
    say(f"a3po: resuming {run_dir} from {ckpt.name} (step {step})"
        f"{f'; {len(carried.groups)} finished prompt groups carried over' if carried and carried.groups else ''}")
    if carried is None:
        return run_dir, step, state["data_cursor"], None
    return run_dir, step, carried.cursor, carried

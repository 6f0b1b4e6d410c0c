"""A rollout worker process: its own inference engine, fed prompt groups, returning scored groups.

The trainer starts one process per worker (`rollout.n_workers`), each with its own torch
thread count (docs/design.md §9: separate processes with their own threads barely slow each other,
threads in one process fight over the GIL in the decode loop). A worker's inbox is FIFO,
so weights published for version v are loaded before any prompt admitted at version v
is started: a token never carries a version older than the one its group was admitted at.

A group is `gconfig.n_samples` samples of one prompt: completions scored by the reward function
(and a reward service), multi-turn episodes in an environment, or runs of the user's agent.
The worker holds one `GroupRunner` of the run's kind (rollout/groups.py, built by
rollout/runners.py, whose child processes live as long as the worker), starts each Work's group
on it, hands it the engine's finished completions and sends the groups it returns.

Messages in:  Work (one prompt group), LoadWeights (version), Stop.
Messages out: Ready, GroupDone (the scored trajectories), WeightsLoaded, Heartbeat, WorkerFailed.

Each worker writes into a pipe of its own whose other end only the trainer holds, so a
worker killed halfway through a message leaves the trainer an end of file on that pipe,
never a torn message in a channel the other workers share. The main loop sends a
Heartbeat whenever it has sent nothing for HEARTBEAT_S: a worker whose loop stops (hung in
native code, stopped, deadlocked) falls silent and is replaced (rollout.worker_timeout_s).
"""

from __future__ import annotations

import contextlib
import os
import queue
import sys
import time
import traceback
from dataclasses import dataclass, field

import torch

from a3po import child, startup
from a3po.allocator import keep_freed_memory
from a3po.config import Config
from a3po.config.choices import Backend, WeightUpdate
from a3po.data import Example
from a3po.rollout.groups import Group, group_seeds
from a3po.rollout.runners import Runners, Scoring
from a3po.trajectories import Trajectory

HEARTBEAT_S = 0.5  # the longest the main loop stays silent, unless one decode step takes longer


@dataclass
class Work:
    slot: int  # admission index; the group is trained on at version slot // batch_size
    example: Example
    cohort: int = 0  # rollout.lockstep: this many groups of the batch come to this worker, generated together


@dataclass
class LoadWeights:
    version: int
    weights: object  # where to read them: sync/shm.InBuffer or sync/object_store.StoredVersion


@dataclass
class Stop:
    pass


@dataclass
class Ready:
    worker_id: int
    version: int  # of the weights it loaded from the shared buffer while starting


@dataclass
class Heartbeat:
    worker_id: int


@dataclass
class GroupDone:
    worker_id: int
    slot: int
    trajectories: list[Trajectory]
    reward_failures: list[str] = field(default_factory=list)
    dropped: bool = False  # reward_service.on_failure=drop: the service failed on it; refill its slot
    service_s: float = 0.0  # the reward service's time on this group (submit to last answer)
    idle_s: float = 0.0  # the worker's cumulative idle time (nothing to generate) ...
    alive_s: float = 0.0  # ... and time since it became ready, for rollout/idle_frac


@dataclass
class WeightsLoaded:
    worker_id: int
    version: int
    seconds: float
    idle_s: float = 0.0
    alive_s: float = 0.0


@dataclass
class WorkerFailed:
    worker_id: int
    message: str


class Outbox:
    """The worker's end of its pipe to the trainer; remembers when it last sent, for the heartbeat."""

    def __init__(self, conn):
        self.conn, self.last = conn, time.monotonic()

    def put(self, msg) -> None:
        self.conn.send(msg)
        self.last = time.monotonic()

    def beat(self, worker_id: int) -> None:
        if time.monotonic() - self.last > HEARTBEAT_S:
            self.put(Heartbeat(worker_id))


class _Worker:
    def __init__(self, worker_id: int, cfg: Config, scoring: Scoring, weights, version: int, outbox):
        import transformers

        from a3po.devices import resolve_device, resolve_dtype, torch_dtype
        from a3po.models import end_ids, load_policy
        from a3po.models.head import use_fp32_head
        from a3po.rollout.local import LocalEngine

        transformers.utils.logging.disable_progress_bar()  # a replaced worker would draw it over the trainer's bar
        self.id, self.cfg, self.outbox = worker_id, cfg, outbox
        device = resolve_device(cfg.rollout.device, "rollout.device")
        dtype = resolve_dtype(cfg.rollout.dtype, device)
        max_batch = max(cfg.gconfig.n_samples, 64)
        self.given = weights  # what LoadWeights payloads are read against (the shared buffers)
        weights = weights.take()
        self.fold = None  # with LoRA: published adapters -> this worker's weights (models/lora.py)
        reprefill = cfg.rollout.weight_update == WeightUpdate.REPREFILL
        if cfg.rollout.backend == Backend.VLLM:
            from a3po.rollout.vllm_engine import VLLMEngine

            model, self.tok = load_policy(cfg.actor.path, seed=cfg.seed)
            self._folding(model, weights)
            model.load_state_dict(self._plain(weights), strict=False)  # vLLM starts from the published weights
            self.engine = VLLMEngine.from_model(
                model, self.tok, dtype=dtype, version=version, max_batch=max_batch, seed=cfg.seed,
                reprefill_on_update=reprefill, fp32_head=cfg.actor.fp32_lm_head,
                gpu_memory=cfg.rollout.vllm_gpu_memory, compiled=cfg.rollout.vllm_compile,
            )
            del model
        else:
            model, self.tok = load_policy(cfg.actor.path, dtype=torch_dtype(dtype), seed=cfg.seed)
            model = model.to(device)
            if cfg.actor.fp32_lm_head:
                use_fp32_head(model)
            self._folding(model, weights)
            self.engine = LocalEngine(
                model, eos_token_ids=end_ids(model, self.tok), decode=self.tok.decode, max_batch=max_batch,
                version=version, forward=cfg.rollout.forward,
                reprefill_on_update=reprefill,
            )
            self.engine.update_weights(self._plain(weights), version)
        self.runners = Runners(cfg, scoring, service=True)  # its reward, environment or agent process, for its life
        self.runner = self.runners.build(self.engine, self.tok)
        self.held: dict[int, list[Work]] = {}  # lockstep: batch -> its groups received, until the cohort is whole
        self.t_ready = time.perf_counter()
        self.idle_s = 0.0

    def _folding(self, model, published) -> None:
        """With LoRA the trainer publishes adapters only: keep this model's base weights to fold them into."""
        if self.cfg.actor.lora.rank > 0:
            from a3po.models import lora

            self.fold = lora.Folder(model, published)

    def _plain(self, published):
        """Weights the engine loads: as published, or with LoRA the adapters folded into the base (from W0)."""
        return published if self.fold is None else self.fold(published)

    def clock(self) -> dict[str, float]:
        return {"idle_s": self.idle_s, "alive_s": time.perf_counter() - self.t_ready}

    def start(self, work: Work) -> None:
        seeds = group_seeds(self.cfg.seed, work.slot, self.cfg.gconfig.n_samples)
        self.runner.start_group(work.slot, work.example, seeds)

    def hold(self, work: Work) -> None:
        """Lockstep: keep a group until its batch's cohort is here (`release` starts it)."""
        self.held.setdefault(work.slot // self.cfg.train_dataset.batch_size, []).append(work)

    def release(self) -> None:
        """Lockstep: once nothing is generating, start the oldest batch's cohort if it is whole, in slot order, so
        that its groups are one engine batch whatever the timing of their arrival."""
        if not self.held or self.engine.num_pending or self.runner.sampling:
            return
        batch = min(self.held)
        works = self.held[batch]
        if len(works) < works[0].cohort:
            return
        del self.held[batch]
        for work in sorted(works, key=lambda w: w.slot):
            self.start(work)

    @property
    def idle_wait(self) -> float:
        """How long to wait for a message with nothing to generate: the runner's poll interval while its groups are
        scored or its episodes wait for their environment or agent, else a heartbeat."""
        return self.runner.poll_s if self.runner.busy else HEARTBEAT_S

    def group_done(self, group: Group) -> GroupDone:
        return GroupDone(self.id, group.key, group.trajectories, group.failures, dropped=group.dropped,
                         service_s=group.service_s, **self.clock())

    def handle(self, msg) -> bool:
        """Apply one control message; False means stop."""
        if isinstance(msg, Stop):
            return False
        if isinstance(msg, LoadWeights):
            t0 = time.perf_counter()
            self.engine.update_weights(self._plain(msg.weights.tensors(self.given)), msg.version)
            self.outbox.put(WeightsLoaded(self.id, msg.version, time.perf_counter() - t0, **self.clock()))
        elif isinstance(msg, Work) and msg.cohort:
            self.hold(msg)
        elif isinstance(msg, Work):
            self.start(msg)
        return True


def newest_weights_first(msgs: list) -> list:
    """With several versions waiting, load only the newest, before any prompt group that arrived with them: a
    group admitted at version P needs weights >= P, and newer ones only make its tokens fresher."""
    loads = [m for m in msgs if isinstance(m, LoadWeights)]
    if len(loads) < 2:
        return msgs
    return [loads[-1], *(m for m in msgs if not isinstance(m, LoadWeights))]


def worker_imports() -> None:
    """Import what building a worker imports (the local engine; transformers' Llama classes, the built-in models'),
    for a process that forks its workers once its own imports are done (launch/forked.py): they then start with
    all of it imported."""
    import a3po.models.tiny  # noqa: F401
    import a3po.rollout.local  # noqa: F401


def worker_main(worker_id: int, cfg: Config, scoring: Scoring, weights, version: int, threads: int, inbox,
                conn) -> None:
    """Entry point of a rollout worker process; `conn` is the write end of its own pipe to the trainer."""
    child.take_signals()
    child.name_process(f"a3po-rollout-{worker_id}")
    child.exit_when_orphaned()  # within ORPHAN_POLL_S, and at once through the parent's pipe
    if serve(worker_id, cfg, scoring, weights, version, threads, inbox, conn):
        _exit_now()


def serve(worker_id: int, cfg: Config, scoring: Scoring, weights, version: int, threads: int, inbox, conn) -> bool:
    """A worker's life after its process is set up: load, report Ready, then generate and answer until Stop
    (True) or a failure, reported to the trainer through `conn.send` (False). `inbox` is read like a queue.Queue."""
    keep_freed_memory()
    torch.set_num_threads(threads)
    w = None
    outbox = Outbox(conn)
    try:
        with startup.collector_held():
            w = _Worker(worker_id, cfg, scoring, weights, version, outbox)
        outbox.put(Ready(worker_id, version))
        running = True
        while running:
            idle = w.engine.num_pending == 0
            msgs = []
            t0 = time.perf_counter()
            try:  # with nothing to generate, wait for messages (briefly while rewards or environments compute)
                wait = w.idle_wait if idle else 0.0
                msgs.append(inbox.get(timeout=wait) if wait else inbox.get_nowait())
                while True:
                    msgs.append(inbox.get_nowait())
            except queue.Empty:
                pass
            if idle:
                w.idle_s += time.perf_counter() - t0
            for m in newest_weights_first(msgs):
                running = running and w.handle(m)
            w.release()
            for c in w.engine.step():
                w.runner.finished_turn(c)
            for group in w.runner.poll_groups():
                outbox.put(w.group_done(group))
            outbox.beat(worker_id)
    except Exception as e:  # reported to the trainer, which stops the run with this message
        with contextlib.suppress(OSError):  # the trainer may be gone: the watchdog ends us then
            outbox.put(WorkerFailed(worker_id, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        return False
    finally:
        if w is not None:
            w.runners.close()
            w.engine.close()
    return True


def _exit_now() -> None:
    """Leave at once after Stop. The trainer reads nothing more, so results still buffered for it
    are dropped, and the interpreter's own clean-up is skipped: collecting torch's and
    transformers' objects takes seconds, which the trainer would spend waiting for us."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

"""A rollout worker process: its own inference engine, fed prompt groups, returning scored groups.

The trainer spawns one process per worker (`rollout.n_workers`), each with its own torch
thread count (docs/design.md §9: separate processes with their own threads barely slow each other,
threads in one process fight over the GIL in the decode loop). A worker's inbox is FIFO,
so weights published for version v are loaded before any prompt admitted at version v
is started: a token never carries a version older than the one its group was admitted at.

A group is `gconfig.n_samples` completions of one prompt scored by the reward function, or,
with an environment (train_dataset.env), as many multi-turn episodes of one example
(rollout/episodes.py), whose environment steps run in a child process of the worker, or, with
an agent (train_dataset.agent), as many runs of the user's agent (rollout/agents.py), which
runs in a child process and talks to the worker's engine through a loopback chat server.

Messages in:  Work (one prompt group), LoadWeights (version), Stop.
Messages out: Ready, GroupDone (the scored trajectories), WeightsLoaded, Heartbeat, WorkerFailed.

With a reward service (reward_service.kind, a3po/services/) a finished group's completions go
to it at the same time as to the reward function; its requests run on the service client's
threads, so the decode loop never waits on them, and the group is sent once both have answered
(reward = rule_weight x rule + weight x service). A completion the service could not score
follows reward_service.on_failure: its service score is 0, its group is dropped (refilled
from the dataset), or the worker fails and the run stops with the reason.

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

from a3po import child
from a3po.agents.host import AgentProcess
from a3po.allocator import keep_freed_memory
from a3po.config import Config
from a3po.config.choices import Backend, OnFailure, WeightUpdate
from a3po.data import CallProcess, Example, RewardFn, RewardProcess
from a3po.data.rewards import Imported
from a3po.envs import EnvSpec
from a3po.envs.host import EnvHost
from a3po.rollout.agents import AgentEpisode, AgentRunner
from a3po.rollout.chat import ChatQueue
from a3po.rollout.engine import Completion, GenerationRequest
from a3po.rollout.episodes import Episode, EpisodeRunner, Turns
from a3po.rollout.prompts import encode_prompt
from a3po.services import JudgeItem, Scored, build_service
from a3po.serving.http import ChatServer
from a3po.trajectories import Trajectory

HEARTBEAT_S = 0.5  # the longest the main loop stays silent, unless one decode step takes longer


@dataclass(frozen=True)
class Scoring:
    """How a worker's groups are scored: completions by a reward function, or episodes in an environment."""

    reward_fn: RewardFn
    env: EnvSpec | None = None
    agent: Imported | None = None  # train_dataset.agent, imported in each worker's agent process


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


def request_seed(seed: int, slot: int, sample: int) -> int:
    """Each sample's random stream depends on the run seed and its slot only, not on the worker."""
    return (seed * 1_000_003 + slot) * 1024 + sample


class _Worker:
    def __init__(self, worker_id: int, cfg: Config, scoring: Scoring, weights, version: int, outbox):
        import transformers

        from a3po.devices import resolve_device, resolve_dtype, torch_dtype
        from a3po.models import load_policy
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
                gpu_memory=cfg.rollout.vllm_gpu_memory,
            )
            del model
        else:
            model, self.tok = load_policy(cfg.actor.path, dtype=torch_dtype(dtype), seed=cfg.seed)
            model = model.to(device)
            if cfg.actor.fp32_lm_head:
                use_fp32_head(model)
            self._folding(model, weights)
            self.engine = LocalEngine(
                model, eos_token_ids=[self.tok.eos_token_id], decode=self.tok.decode, max_batch=max_batch,
                version=version, forward=cfg.rollout.forward,
                reprefill_on_update=reprefill,
            )
            self.engine.update_weights(self._plain(weights), version)
        self.reward = RewardProcess(scoring.reward_fn, cfg.train_dataset.reward_timeout_s)
        self.service = build_service(cfg.reward_service)
        self.episodes = None
        if scoring.env is not None:
            env = CallProcess(EnvHost(scoring.env.factory), cfg.train_dataset.env_timeout_s, what="environment")
            self.episodes = EpisodeRunner(self.engine, self.tok, scoring.env, Turns.from_config(cfg, scoring.env), env,
                                          rounds=cfg.rollout.lockstep)
        self.agents = None
        if scoring.agent is not None:
            self.agents = start_agents(self.engine, self.tok, cfg, scoring.agent)
        self.groups: dict[int, tuple[Work, list]] = {}  # slot -> its completions or ended episodes so far
        self.held: dict[int, list[Work]] = {}  # lockstep: batch -> its groups received, until the cohort is whole
        self.scoring: dict[int, tuple[Work, list[Completion], dict[int, tuple[float, str | None]]]] = {}
        self.service_scores: dict[int, Scored] = {}
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
        g = self.cfg.gconfig
        runner = self.episodes or self.agents
        if runner is not None:
            for i in range(g.n_samples):
                runner.start((work.slot, i), work.example, request_seed(self.cfg.seed, work.slot, i))
            self.groups[work.slot] = (work, [])
            return
        ids = encode_prompt(self.tok, work.example, self.cfg.train_dataset.system_prompt)
        for i in range(g.n_samples):
            self.engine.submit(GenerationRequest(
                ids, g.max_new_tokens, rid=(work.slot, i), temperature=g.temperature, top_p=g.top_p, top_k=g.top_k,
                min_p=g.min_p, stop=tuple(g.stop), seed=request_seed(self.cfg.seed, work.slot, i),
            ))
        self.groups[work.slot] = (work, [])

    def hold(self, work: Work) -> None:
        """Lockstep: keep a group until its batch's cohort is here (`release` starts it)."""
        self.held.setdefault(work.slot // self.cfg.train_dataset.batch_size, []).append(work)

    def release(self) -> None:
        """Lockstep: once nothing is generating, start the oldest batch's cohort if it is whole, in slot order, so
        that its groups are one engine batch whatever the timing of their arrival."""
        if not self.held or self.engine.num_pending or (self.episodes is not None and self.episodes.busy):
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
        """How long to wait for a message with nothing to generate: briefly while rewards are scored (by the reward
        process or a service), very briefly while episodes wait for their environment or agent (its answer starts
        the next turn), else a heartbeat."""
        if (self.episodes is not None and self.episodes.busy) or (self.agents is not None and self.agents.busy):
            return 0.002
        return 0.02 if self.reward.pending or self.scoring else HEARTBEAT_S

    def finish(self, c: Completion) -> None:
        if self.episodes is not None:
            self.episodes.finished_turn(c)
            return
        if self.agents is not None:
            self.agents.finished_turn(c)
            return
        slot, i = c.rid
        group = self._gathered(slot, i, c)
        if group is None:
            return
        work, done = group
        self.scoring[slot] = (work, done, {})
        texts = [self.tok.decode(comp.output_ids, skip_special_tokens=True) for comp in done]
        for comp, text in zip(done, texts):  # scored in the reward process while generation goes on
            self.reward.submit(comp.rid, text, work.example)
        if self.service is not None:  # and by the service, on its client's threads
            self.service.submit(slot, [JudgeItem(work.example.question, work.example.answer, t) for t in texts])

    def scored(self) -> None:
        """Send every group whose rewards have all arrived (whose episodes have all ended)."""
        if self.episodes is not None:
            self.ended(self.episodes.poll())
            return
        if self.agents is not None:
            self.ended(self.agents.poll())
            return
        ready = set()
        for (slot, i), reward, failure in self.reward.poll():
            rewards = self.scoring[slot][2]
            rewards[i] = (reward, failure)
            ready.add(slot)
        if self.service is not None:
            for got in self.service.poll():
                self.service_scores[got.key] = got
                ready.add(got.key)
        for slot in sorted(ready):
            work, done, rewards = self.scoring[slot]
            if len(rewards) < len(done) or (self.service is not None and slot not in self.service_scores):
                continue
            del self.scoring[slot]
            self.outbox.put(self._scored_group(slot, done, rewards))

    def _scored_group(self, slot: int, done: list[Completion], rule: dict[int, tuple[float, str | None]]) -> GroupDone:
        """The group with its rewards: the rule's, or with a service the weighted sum of both."""
        rewards = [rule[c.rid[1]][0] for c in done]
        failures = [f for _, f in (rule[c.rid[1]] for c in done) if f]
        dropped, service_s = False, 0.0
        if self.service is not None:
            rs = self.cfg.reward_service
            got = self.service_scores.pop(slot)
            scores, service_s = got.scores, got.seconds
            bad = [f for f in got.failures if f]
            if bad and rs.on_failure == OnFailure.STOP:
                raise RuntimeError(f"{bad[0]} (reward_service.on_failure=stop)")
            dropped = bool(bad) and rs.on_failure == OnFailure.DROP
            failures += bad
            rewards = [rs.rule_weight * r + rs.weight * (s or 0.0) for r, s in zip(rewards, scores)]
        trajs = [Trajectory(c.prompt_ids, c.output_ids, c.output_logprobs, c.output_versions, reward=r,
                            finish_reason=c.finish_reason) for c, r in zip(done, rewards)]
        return GroupDone(self.id, slot, trajs, failures, dropped=dropped, service_s=service_s, **self.clock())

    def ended(self, episodes: list[Episode] | list[AgentEpisode]) -> None:
        for ep in episodes:
            slot, i = ep.eid
            group = self._gathered(slot, i, ep)
            if group is not None:
                done = group[1]
                failures = [e.failure for e in done if e.failure]
                trajs = [t for e in done for t in (
                    e.trajectories(self.tok, self.cfg.train_dataset.system_prompt) if isinstance(e, AgentEpisode)
                    else [e.trajectory()])]
                self.outbox.put(GroupDone(self.id, slot, trajs, failures, **self.clock()))

    def _gathered(self, slot: int, sample: int, item) -> tuple[Work, list] | None:
        """Add one finished sample (a completion, an episode) to its group: the group in sample order once complete."""
        work, done = self.groups[slot]
        done.append((sample, item))
        if len(done) < self.cfg.gconfig.n_samples:
            return None
        del self.groups[slot]
        return work, [x for _, x in sorted(done, key=lambda pair: pair[0])]

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


def start_agents(engine, tokenizer, cfg: Config, agent: Imported) -> AgentRunner:
    """An agent runner over `engine`: its chat server on loopback, its agents' process (started with the first)."""
    d = cfg.train_dataset
    chat = ChatQueue(reply_timeout_s=d.agent_timeout_s)
    server = ChatServer(chat.ask, model=cfg.actor.path).start()
    return AgentRunner(engine, tokenizer, Turns.from_config(cfg, None), AgentProcess(agent, d.agent_timeout_s),
                       server, chat)


def newest_weights_first(msgs: list) -> list:
    """With several versions waiting, load only the newest, before any prompt group that arrived with them: a
    group admitted at version P needs weights >= P, and newer ones only make its tokens fresher."""
    loads = [m for m in msgs if isinstance(m, LoadWeights)]
    if len(loads) < 2:
        return msgs
    return [loads[-1], *(m for m in msgs if not isinstance(m, LoadWeights))]


def worker_main(worker_id: int, cfg: Config, scoring: Scoring, weights, version: int, threads: int, inbox,
                conn) -> None:
    """Entry point of a spawned rollout worker; `conn` is the write end of its own pipe to the trainer."""
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
            if w.agents is not None:
                w.agents.pump()
            for c in w.engine.step():
                w.finish(c)
            w.scored()
            outbox.beat(worker_id)
    except Exception as e:  # reported to the trainer, which stops the run with this message
        with contextlib.suppress(OSError):  # the trainer may be gone: the watchdog ends us then
            outbox.put(WorkerFailed(worker_id, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        return False
    finally:
        if w is not None:
            w.reward.close()  # its reward process reads end of file and exits
            if w.service is not None:
                w.service.close()
            if w.episodes is not None:
                w.episodes.env.close()
            if w.agents is not None:
                w.agents.close()
            w.engine.close()
    return True


def _exit_now() -> None:
    """Leave at once after Stop. The trainer reads nothing more, so results still buffered for it
    are dropped, and the interpreter's own clean-up is skipped: collecting torch's and
    transformers' objects takes seconds, which the trainer would spend waiting for us."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

"""The rollout controller: a thread beside the trainer that keeps rollout going while it trains.

    ctl = Controller(cfg, pool, data, order, version=engine.version)
    ctl.start()
    got = ctl.take_batch(v)            # the groups of slots [vB, (v+1)B), in slot order
    ...                                # PPO update: workers keep generating meanwhile
    ctl.wait_loaded(v - 1)             # every worker is past v - 1: its buffer may be overwritten
    weights.publish(...); ctl.publish(v + 1)

It owns admission (pipeline/admission.py), the buffer of finished groups, dynamic-filtering
refills and the data position of every group in flight; the trainer reaches them only
through the methods above, each under one lock. Because admission runs on this thread,
new groups start while the trainer computes advantages, the update, weight sync,
evaluation or a checkpoint, so the pipeline can run a full eta versions ahead: with
rollout faster than training, consumed tokens reach staleness eta, never more.

Bound (stated once, enforced by `Admission.take` with the *published* version): a group
admitted while version P is published has every token sampled by weights >= P (a worker's
inbox is FIFO and `publish` queues LoadWeights(P) before any later Work; a worker that finds
several versions waiting loads the newest first), and it is
consumed at version slot // B <= P + eta, so d <= eta.

Lockstep (rollout.lockstep): the trainer publishes v + 1 only once every group of batch
v + eta is finished (`wait_sampled`), so batch k is sampled whole by weights max(0, k - eta),
the version the bound allows at steady state. Batches are admitted whole and their groups
routed by slot, (slot mod B) mod n_workers, each Work naming how many groups of its batch
its worker gets (`cohort`), so that the worker can generate them as one closed engine batch.
Which weights sample what, and with what, is then a function of the step, not of timing.

Worker restart: a worker whose pipe closes (it died) or that falls silent for
rollout.worker_timeout_s (hung: it is killed) is replaced by a fresh process in the same
place, started with the published version P' >= P, and the groups it had in flight are
queued again under their own slots, so the bound above holds for them unchanged and no
step is lost or done twice. The new process reads the shared weight buffer while it starts,
so the trainer must not overwrite it meanwhile: its acknowledged version is -2 until its
Ready arrives (wait_loaded waits for it), and a restart is put off while the trainer is
between wait_loaded and publish, writing the buffer. After rollout.max_worker_restarts
replacements, the next failure stops the run.

Invariants (`check_invariants`, asserted after every change of state when the controller is made
with debug=True, as tests/test_controller.py makes it; tests/test_controller_schedules.py runs them
over generated schedules of losses, refills and lockstep):
    I1  admission never ran past the bound: next_slot <= (published + eta + 1) * B
    I2  every admitted slot not yet taken by the trainer is in exactly one place: in flight, finished
        (the buffer), or queued for a refill; and it keeps the data position it was first admitted at
        (so the data position of the first slot not finished is where a resume admits it again: carried)
    I3  admission counts as running exactly the groups in flight
    I4  a worker lost and not yet replaced, or replaced and not yet Ready, acknowledges NOT_LOADED, and
        only such a worker does; every other acknowledged version is at most the published one
    I5  while the trainer writes the buffer (wait_loaded .. publish) no worker that reads it is older
        than published - 1, the version the buffer's other half holds
    I6  lockstep: a group is in flight on the worker its slot routes it to
    I7  restarts never exceed rollout.max_worker_restarts
"""

from __future__ import annotations

import dataclasses
import threading
import time
from dataclasses import dataclass

from a3po import signals
from a3po.config import Config
from a3po.data import TaskData
from a3po.data.order import DataOrder
from a3po.pipeline.admission import Admission
from a3po.pipeline.carry import Carried
from a3po.pipeline.pool import Lost, WorkerError
from a3po.rollout.worker import GroupDone, Ready, WeightsLoaded, Work

MAX_REFILLS_PER_SLOT = 4  # a slot is refilled at most this often (dynamic filtering, groups dropped by a service)
NOT_LOADED = -2  # acknowledged version of a worker that is being replaced: below every version waited for
MAX_SEQUENCES_IN_FLIGHT = 1024  # cap of max_concurrent_rollouts=null, in sequences (groups x n_samples)
POLL_S = 0.05  # how long the controller blocks on the workers' queue before it looks at admission again


def max_running_groups(cfg: Config) -> int:
    """rollout.max_concurrent_rollouts, or by default as many groups as the bound allows:
    (eta + 1) * B, capped at MAX_SEQUENCES_IN_FLIGHT sequences (queued requests cost
    little memory, but every admitted group's prompt and results are held)."""
    r, B = cfg.rollout, cfg.train_dataset.batch_size
    if r.max_concurrent_rollouts is not None:
        return r.max_concurrent_rollouts
    cap = max(r.n_workers, B, MAX_SEQUENCES_IN_FLIGHT // cfg.gconfig.n_samples)
    return min((r.max_head_offpolicyness + 1) * B, cap)


@dataclass
class Collected:
    groups: list[GroupDone]
    wait_s: float
    filtered: int
    dropped: int = 0  # groups the reward service failed on, refilled (reward_service.on_failure=drop)


@dataclass
class WorkerClock:
    """A worker's cumulative idle and alive seconds, as last reported."""

    idle_s: float = 0.0
    alive_s: float = 0.0


@dataclass(frozen=True)
class Snapshot:
    """The controller's running totals at one moment; the trainer's step statistics difference two."""

    groups_done: int  # prompt groups finished since the start
    next_slot: int  # admission slots handed out: how far rollout has been admitted ahead
    worker_restarts: int  # workers replaced over the run
    clocks: tuple[WorkerClock, ...]  # one per worker, in worker order


class Controller:
    def __init__(self, cfg: Config, pool, data: TaskData, order: DataOrder, version: int, log=print,
                 clock=time.monotonic, debug: bool = False, carried: Carried | None = None):
        """`pool` is a pipeline/pool.py WorkerPool or anything with its interface; `clock` (seconds) times the
        stall and restart timeouts; `debug` asserts the invariants of the module docstring after every change;
        `carried`: a resumed run's finished groups (`order` then stands at carried.cursor)."""
        self.cfg, self.pool, self.data, self.order, self.log, self.clock = cfg, pool, data, order, log, clock
        self.debug = debug
        self.B = cfg.train_dataset.batch_size
        self.lockstep = cfg.rollout.lockstep
        self.admission = Admission(self.B, cfg.rollout.max_head_offpolicyness, max_running_groups(cfg), version,
                                   whole_batches=self.lockstep)
        self.stall_timeout_s = cfg.rollout.stall_timeout_s
        self._cond = threading.Condition()
        self._published = version  # newest version whose LoadWeights has been queued
        self._done: dict[int, GroupDone] = {}
        self._slot_cursor: dict[int, int] = {}  # data cursor when each in-flight slot was first admitted
        self._inflight: dict[int, tuple[int, Work]] = {}  # slot -> (worker, its group) until the group is back
        self._replace: dict[int, str] = {}  # workers lost and not yet replaced -> why
        self._restarted_at: dict[int, float] = {}  # replaced workers not ready yet -> when
        self._writing = False  # the trainer is writing the shared weight buffer (wait_loaded .. publish)
        self.restarts = 0
        self._refills: dict[int, int] = {}
        self._acked = [version] * cfg.rollout.n_workers  # newest version each worker loaded
        self._clocks = [WorkerClock() for _ in range(cfg.rollout.n_workers)]
        self._filtered = 0
        self._dropped = 0
        self._groups_done = 0
        self._load_s: list[float] = []
        self._last_msg = clock()
        self._error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="a3po-controller", daemon=True)
        if carried is not None:
            self.admission.next_slot = carried.next_slot
            for g, cursor in zip(carried.groups, carried.cursors):
                self._done[g.slot] = g
                self._slot_cursor[g.slot] = cursor

    # -- the trainer's side -----------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def close(self, timeout: float = 1.0) -> None:
        """The thread is out within POLL_S (it never blocks on a worker: pool.py reads each pipe on a thread
        of its own); a daemon, so a join that times out leaves it behind rather than hanging the stop."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def take_batch(self, version: int) -> Collected:
        """Block until every group of `version`'s slots is finished; hand them over in slot order."""
        slots = self.admission.batch_slots(version)
        t0 = time.perf_counter()
        with self._cond:
            self._wait(lambda: all(s in self._done for s in slots), f"the prompt groups of step {version + 1}")
            groups = [self._done.pop(s) for s in slots]
            for s in slots:
                self._slot_cursor.pop(s, None)
                self._refills.pop(s, None)
            filtered, self._filtered = self._filtered, 0
            dropped, self._dropped = self._dropped, 0
            self._checked()
        return Collected(groups, time.perf_counter() - t0, filtered, dropped)

    def wait_loaded(self, version: int) -> None:
        """Block until every worker has loaded `version` (the shared buffer is then free)."""
        with self._cond:
            self._wait(lambda: min(self._acked) >= version, f"the workers to load weights v{version}")
            self._writing = True
            self._checked()

    def wait_sampled(self, batch: int) -> None:
        """Block until every group of batches <= `batch` is finished (lockstep: the weights that sample them may
        then be replaced)."""
        end = (batch + 1) * self.B
        with self._cond:
            self._wait(lambda: self.admission.next_slot >= end and all(s >= end for s in self._inflight),
                       f"the prompt groups of step {batch + 1}")

    def publish(self, version: int) -> None:
        """Weights `version` are in the shared buffer: tell the workers, then admit against it."""
        with self._cond:
            self.pool.load_weights(version)
            self._published = version
            self._writing = False
            self._checked()
            self._cond.notify_all()

    def snapshot(self) -> Snapshot:
        """Counters the step statistics difference: groups finished, admitted slots, worker clocks."""
        with self._cond:
            return Snapshot(self._groups_done, self.admission.next_slot, self.restarts, tuple(self._clocks))

    def weight_load_s(self) -> float:
        """Slowest weight load since the last call."""
        with self._cond:
            out = max(self._load_s, default=0.0)
            self._load_s.clear()
            return out

    def carried(self, version: int) -> Carried:
        """What a checkpoint at `version` keeps (pipeline/carry.py): the finished groups from slot version x B on,
        up to the first slot not finished, and the data position that slot was (or will be) admitted at. Lockstep:
        whole batches only, since a worker starts a batch's share once all of it has come (its cohort)."""
        with self._cond:
            slot = version * self.B
            groups = []
            while slot in self._done:
                groups.append(self._done[slot])
                slot += 1
            if self.lockstep:
                whole = len(groups) // self.B * self.B
                slot, groups = slot - (len(groups) - whole), groups[:whole]
            return Carried(groups, [self._slot_cursor[g.slot] for g in groups], slot,
                           self._slot_cursor.get(slot, self.order.cursor))

    def _wait(self, ready, what: str) -> None:
        """Wait on the condition (lock held) until ready(); raise if the controller failed or the
        workers stalled: no progress from any of them (heartbeats aside) for stall_timeout_s while work is due."""
        start = self.clock()
        while not ready():
            signals.check()
            if self._error is not None:
                raise self._error
            if self.clock() - max(start, self._last_msg) > self.stall_timeout_s:
                raise WorkerError(f"no rollout worker reported progress for {self.stall_timeout_s:.0f}s while waiting "
                                  f"for {what}; a worker is stuck (raise rollout.stall_timeout_s if it is only slow)")
            self._cond.wait(timeout=0.5)

    # -- the invariants (module docstring) ----------------------------------------------------

    def _checked(self) -> None:
        if self.debug:
            self.check_invariants()

    def check_invariants(self) -> None:
        """Assert I1-I7 of the module docstring; call with the lock held (or with no thread running)."""
        adm, B = self.admission, self.B
        assert adm.next_slot <= (self._published + adm.eta + 1) * B, ("I1", adm.next_slot, self._published)
        inflight, done, refills = set(self._inflight), set(self._done), adm.refills
        places = [*inflight, *done, *refills]
        assert len(places) == len(set(places)), ("I2: a slot in two places", self._inflight.keys(), done, refills)
        assert set(places) == set(self._slot_cursor), ("I2: a slot lost or kept", places, self._slot_cursor.keys())
        assert all(s < adm.next_slot for s in places), ("I2: a slot never admitted", places, adm.next_slot)
        assert adm.running == len(inflight), ("I3", adm.running, len(inflight))
        waiting = set(self._replace) | set(self._restarted_at)
        for w, acked in enumerate(self._acked):
            assert (acked == NOT_LOADED) <= (w in waiting), ("I4: NOT_LOADED but not being replaced", w)
            assert (acked == NOT_LOADED) >= (w in self._replace), ("I4: lost but acknowledging", w, acked)
            assert acked <= self._published, ("I4: ahead of the published version", w, acked, self._published)
            if self._writing and acked != NOT_LOADED:
                assert acked >= self._published - 1, ("I5", w, acked, self._published)
        if self.lockstep:
            for slot, (w, _) in self._inflight.items():
                assert w == self._route(slot), ("I6", slot, w)
        assert self.restarts <= self.cfg.rollout.max_worker_restarts, ("I7", self.restarts)

    # -- the controller thread --------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                with self._cond:
                    for i, why in self.pool.silent(self.cfg.rollout.worker_timeout_s, self.stall_timeout_s):
                        self._lost(i, why)
                    self._replace_lost()
                    self._admit()
                    self._checked()
                msg = self.pool.receive(timeout=POLL_S)
                if msg is not None:
                    with self._cond:
                        self._handle(msg)
                        self._checked()
                        self._cond.notify_all()
        except BaseException as e:  # handed to the trainer, which stops the run with it
            with self._cond:
                self._error = e
                self._cond.notify_all()

    def _admit(self) -> None:
        while (slot := self.admission.take(self._published)) is not None:
            self._slot_cursor.setdefault(slot, self.order.cursor)
            self._send(Work(slot, self.data.train[self.order.next()], self._cohort(self._route(slot))))

    def _route(self, slot: int) -> int | None:
        """Lockstep: the worker a slot's group goes to, fixed by its place in its batch; else the pool chooses."""
        return (slot % self.B) % len(self._acked) if self.lockstep else None

    def _cohort(self, worker: int | None) -> int:
        """How many groups of one batch `worker` is sent (lockstep), 0 otherwise."""
        return 0 if worker is None else sum(i % len(self._acked) == worker for i in range(self.B))

    def _send(self, work: Work) -> None:
        self._inflight[work.slot] = (self.pool.submit(work, self._route(work.slot)), work)

    def _lost(self, worker_id: int, why: str) -> None:
        """A worker died or hung: take it out now, replace it when the shared buffer may be read.
        Not while the run is stopping: a group-wide SIGTERM ends the workers too, and that is no fault."""
        self.pool.kill(worker_id)
        if signals.received() is not None:
            return
        limit = self.cfg.rollout.max_worker_restarts
        if self.restarts >= limit:
            raise WorkerError(f"rollout worker {why}; no restart left ({self.restarts} done, "
                              f"rollout.max_worker_restarts={limit})")
        self.restarts += 1
        self._acked[worker_id] = NOT_LOADED
        self._replace[worker_id] = why

    def _replace_lost(self) -> None:
        if self._writing or not self._replace:
            return
        for worker_id, why in list(self._replace.items()):
            self.pool.restart(worker_id, self._published)
            again = [work for w, work in self._inflight.values() if w == worker_id]
            for work in again:  # a cohort is what is sent again of its batch: some of its groups may be done
                cohort = sum(other.slot // self.B == work.slot // self.B for other in again) if work.cohort else 0
                self._send(dataclasses.replace(work, cohort=cohort))
            del self._replace[worker_id]
            self._restarted_at[worker_id] = self.clock()
            self.log(f"a3po: rollout worker {why}; replaced (restart {self.restarts} of rollout.max_worker_restarts="
                     f"{self.cfg.rollout.max_worker_restarts}), {len(again)} prompt group(s) in flight started again")

    def _handle(self, msg) -> None:
        if isinstance(msg, Lost):
            self._lost(msg.worker_id, msg.why)
            return
        self._last_msg = self.clock()
        if isinstance(msg, Ready):
            self._acked[msg.worker_id] = msg.version
            if (t0 := self._restarted_at.pop(msg.worker_id, None)) is not None:
                self.log(f"a3po: rollout worker a3po-rollout-{msg.worker_id} ready again, "
                         f"{self.clock() - t0:.1f}s after its restart")
            return
        if isinstance(msg, (GroupDone, WeightsLoaded)):
            self._clocks[msg.worker_id] = WorkerClock(msg.idle_s, msg.alive_s)
        if isinstance(msg, WeightsLoaded):
            self._acked[msg.worker_id] = max(self._acked[msg.worker_id], msg.version)
            self._load_s.append(msg.seconds)
            return
        if not isinstance(msg, GroupDone):
            return
        self.pool.group_finished(msg.worker_id)
        self._inflight.pop(msg.slot, None)
        self._groups_done += 1
        rewards = [t.reward for t in msg.trajectories]
        uninformative = max(rewards) == min(rewards)
        refills = self._refills.get(msg.slot, 0)
        filtered = self.cfg.train_dataset.dynamic_filtering and uninformative
        if (filtered or msg.dropped) and refills < MAX_REFILLS_PER_SLOT:
            self._refills[msg.slot] = refills + 1
            if msg.dropped:  # past the cap it trains, its failures counted against max_reward_failure_frac
                self._dropped += 1
            else:
                self._filtered += 1
            self.admission.done(msg.slot, refill=True)
            return
        self.admission.done(msg.slot)
        self._done[msg.slot] = msg

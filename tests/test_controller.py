"""The rollout controller (pipeline/controller.py) against a scripted worker pool, and once on real worker processes.

The scripted pool has WorkerPool's interface and behaves like rollout/worker.py where it matters
to the controller: a FIFO inbox read between two sampled tokens (LoadWeights loads at once,
Work joins the groups being generated), every token tagged with the version loaded when it was
sampled, a WeightsLoaded for every load, a Ready from a replacement, a Lost from a worker that
died. Its workers run inside `receive`, on the controller's own thread, and a group can be held
until the test releases it; `settle()` returns once the controller and the workers have done all
they can (two polls in a row with nothing to do). So nothing happens between two statements of a
test but what the test does: no test sleeps, no assertion depends on how fast anything ran, and
every assertion is exact. The stall timeout runs on an injected clock the test advances.

Proves: with rollout faster than training every token of step v has staleness min(v, eta), the
bound reached and never passed, and every group the bound allows is generated before the trainer
publishes the next version (eta = 0: none ahead, synchronous); dynamic filtering refills a slot
in place; a checkpoint carries the finished groups not yet trained on, and a resumed controller
trains them as they were and admits again from the first unfinished slot at its data position; silent workers stop the
wait exactly when the stall timeout has passed, not before; a lost worker is replaced with the
published version, never while the trainer writes the weight buffer, and its groups run again in
their slots, the run ending as a run without the fault ends; with no restart left the trainer's
wait raises. On real worker processes of the tiny model, one of them killed with SIGKILL: every
slot is consumed once, in order, within the bound.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections import deque

import pytest

from a3po.config import load_config
from a3po.data import TaskData, build_reward, load_task
from a3po.data.order import DataOrder
from a3po.data.tasks import Example
from a3po.launch.local import LocalLauncher
from a3po.models import load_policy
from a3po.pipeline import carry
from a3po.pipeline.controller import Controller
from a3po.pipeline.pool import Lost, WorkerError, WorkerPool
from a3po.rollout.runners import Scoring
from a3po.rollout.worker import GroupDone, LoadWeights, Ready, WeightsLoaded, Work
from a3po.sync import SharedWeights
from a3po.trajectories import Trajectory

SETTLE_S = 60  # a deadline only: a controller that never comes to rest is a failure, not a wait
STALL_S = 20  # likewise: a trainer waiting on a group that never comes fails in 20 s instead of hanging


class ScriptedWorker:
    """What one scripted worker holds and knows."""

    def __init__(self, version: int):
        self.version = version  # loaded last
        self.inbox: deque = deque()
        self.generating: list[tuple[Work, list[int]]] = []  # each group and its tokens' versions so far
        self.running = 0  # groups the controller has in flight here
        self.dead = False  # its process is gone: it does nothing more
        self.lost = False  # taken out by the controller (kill)


class ScriptedPool:
    """WorkerPool's interface over scripted workers that run only inside `receive` (module docstring)."""

    def __init__(self, n_workers: int, n_samples: int, tokens: int = 4, reward=None):
        self.cv = threading.Condition()
        self.workers = [ScriptedWorker(0) for _ in range(n_workers)]
        self.outbox: deque = deque()  # (the worker that sent it, a message for the controller), in order
        self.n_samples, self.tokens = n_samples, tokens
        self.reward = reward or (lambda slot, attempt, i: float(i % 2))
        self.attempts: dict[int, int] = {}  # slot -> groups generated for it
        self.done: list[int] = []  # slot of every GroupDone handed over, in order
        self.hold_new = False  # groups submitted while it is set sample nothing until released
        self.hold_slots: set[int] = set()  # groups of these slots sample nothing until released, whenever submitted
        self.held: set[int] = set()
        self.restarts: list[tuple[int, int]] = []  # (worker, version it started with)
        self.hung: list[int] = []  # workers the next silent() reports
        self.controller_thread: threading.Thread | None = None
        self.settling, self.idle_polls = False, 0

    # -- the test's side --------------------------------------------------------------------

    def settle(self) -> None:
        """Return once the controller has polled twice in a row with nothing to do (or its thread has ended): every
        group not held is generated and handed over, and a whole pass of its loop (admission, restarts) ran after
        this call began and changed nothing."""
        deadline = time.monotonic() + SETTLE_S
        with self.cv:
            self.settling, self.idle_polls = True, 0
            self.cv.notify_all()
            while self.idle_polls < 2 and self.controller_thread and self.controller_thread.is_alive():
                assert time.monotonic() < deadline, f"the controller did not come to rest within {SETTLE_S}s"
                self.cv.wait(0.1)
            self.settling = False

    def handed_over(self) -> list[int]:
        """Slot of every GroupDone the controller received, in order."""
        with self.cv:
            return list(self.done)

    def hang(self, i: int) -> None:
        """Worker i falls silent: the next silent() reports it."""
        with self.cv:
            self.hung.append(i)

    def in_flight(self, i: int) -> list[int]:
        """Slots worker i has been sent and not finished (in its inbox or being generated)."""
        with self.cv:
            w = self.workers[i]
            return [m.slot for m in w.inbox if isinstance(m, Work)] + [work.slot for work, _ in w.generating]

    def hold(self) -> None:
        """Groups submitted from now on sample nothing until released."""
        with self.cv:
            self.hold_new = True

    def release(self) -> None:
        """Held groups sample from now on, and new ones are not held."""
        with self.cv:
            self.hold_new = False
            self.held.clear()
            self.cv.notify_all()

    def lose(self, i: int) -> None:
        """Worker i's process dies: what it had is gone, and its pipe reports the end."""
        with self.cv:
            self.workers[i].dead = True
            self.outbox.append((self.workers[i], Lost(i, f"a3po-rollout-{i} died (test)")))
            self.cv.notify_all()

    # -- WorkerPool's interface, called by the controller -----------------------------------

    def submit(self, work: Work, worker: int | None = None) -> int:
        with self.cv:
            live = [i for i, w in enumerate(self.workers) if not w.lost] or list(range(len(self.workers)))
            i = worker if worker is not None else min(live, key=lambda k: self.workers[k].running)
            self.workers[i].running += 1
            self.workers[i].inbox.append(work)
            if self.hold_new or work.slot in self.hold_slots:
                self.held.add(work.slot)
            return i

    def group_finished(self, worker_id: int) -> None:
        with self.cv:
            self.workers[worker_id].running -= 1

    def load_weights(self, version: int) -> None:
        with self.cv:
            for w in self.workers:
                w.inbox.append(LoadWeights(version, None))

    def silent(self, heartbeat_s: float, start_s: float) -> list[tuple[int, str]]:
        with self.cv:
            hung, self.hung = self.hung, []
            return [(i, f"a3po-rollout-{i} hung (test)") for i in hung]

    def kill(self, i: int) -> None:
        with self.cv:
            self.workers[i].dead = self.workers[i].lost = True

    def restart(self, i: int, version: int) -> None:
        with self.cv:
            self.restarts.append((i, version))
            self.workers[i] = ScriptedWorker(version)
            self.outbox.append((self.workers[i], Ready(i, version)))

    def receive(self, timeout: float):
        deadline = time.monotonic() + timeout
        with self.cv:
            self.controller_thread = threading.current_thread()
            while True:
                msg = self._next()
                if msg is not None:
                    self.idle_polls = 0
                    return msg
                if self.settling:
                    self.idle_polls += 1
                    self.cv.notify_all()
                    return None
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self.cv.wait(left)

    def close(self) -> None:
        pass

    # -- the workers ------------------------------------------------------------------------

    def _next(self):
        """The next message for the controller; the workers step until there is one or none can. As in WorkerPool,
        what a worker sent is dropped once the controller took it out (kill) or replaced it."""
        while True:
            while self.outbox:
                sender, msg = self.outbox.popleft()
                if sender is self.workers[msg.worker_id] and not sender.lost:
                    if isinstance(msg, GroupDone):
                        self.done.append(msg.slot)
                    return msg
            if not any([self._step(i, w) for i, w in enumerate(self.workers) if not w.dead]):
                return None

    def _step(self, i: int, w: ScriptedWorker) -> bool:
        """Read one message, else sample one token of every group not held; False if there was nothing to do."""
        if w.inbox:
            msg = w.inbox.popleft()
            if isinstance(msg, LoadWeights):
                w.version = msg.version
                self.outbox.append((w, WeightsLoaded(i, w.version, 0.0)))
            else:
                w.generating.append((msg, []))
            return True
        sampling = [(work, versions) for work, versions in w.generating if work.slot not in self.held]
        for work, versions in sampling:
            versions.append(w.version)
            if len(versions) == self.tokens:
                w.generating.remove((work, versions))
                attempt = self.attempts[work.slot] = self.attempts.get(work.slot, 0) + 1
                trajs = [Trajectory([1, 2], [3] * self.tokens, [-1.0] * self.tokens, list(versions),
                                    reward=self.reward(work.slot, attempt, k)) for k in range(self.n_samples)]
                self.outbox.append((w, GroupDone(i, work.slot, trajs)))
        return bool(sampling)


class FakeClock:
    """Seconds that pass only when the test advances them; counts its reads, so a test can wait until it was read."""

    def __init__(self):
        self.cv = threading.Condition()
        self.now, self.reads = 0.0, 0

    def __call__(self) -> float:
        with self.cv:
            self.reads += 1
            self.cv.notify_all()
            return self.now

    def advance(self, seconds: float) -> None:
        with self.cv:
            self.now += seconds

    def wait_reads(self, n: int, reader: threading.Thread) -> None:
        """Until n more reads than now, or until the reader thread has ended."""
        with self.cv:
            target = self.reads + n
            done = lambda: self.reads >= target or not reader.is_alive()
            while not done():
                assert self.cv.wait(SETTLE_S) or done(), "the clock is not read"


def make(eta: int, *overrides: str, B: int = 2, n_samples: int = 2, clock=time.monotonic, **pool_kw):
    cfg = load_config(None, [f"rollout.max_head_offpolicyness={eta}", f"train_dataset.batch_size={B}",
                             f"gconfig.n_samples={n_samples}", f"rollout.stall_timeout_s={STALL_S}", *overrides])
    data = TaskData("count", [Example(f"q{i}", str(i), i) for i in range(1000)], [])
    pool = ScriptedPool(cfg.rollout.n_workers, n_samples, **pool_kw)
    log: list[str] = []
    ctl = Controller(cfg, pool, data, DataOrder(len(data.train), seed=0), version=0, log=log.append, clock=clock,
                     debug=True)  # the invariants of controller.py's docstring asserted after every change
    return pool, ctl, log


def train(ctl: Controller, pool: ScriptedPool, steps: int, training=None, writing=None, settle_first=False):
    """The trainer's side of the protocol, rollout as fast as it may be: while the trainer trains version v the pool
    settles. training(v) and writing(v) run while it trains v and while it writes the weights of v + 1.
    Returns per step (its Collected, the staleness of every token, the slots handed over by the end of training)."""
    out = []
    ctl.start()
    for v in range(steps):
        if settle_first:
            pool.settle()
        got = ctl.take_batch(v)
        if training:
            training(v)
        pool.settle()  # the PPO update
        done_by_then = sorted(pool.handed_over())
        ctl.wait_loaded(v)
        if writing:
            writing(v)
        ctl.publish(v + 1)
        out.append((got, [v - ver for g in got.groups for t in g.trajectories for ver in t.output_versions],
                    done_by_then))
    return out


def staleness(steps) -> list[set[int]]:
    return [set(ds) for _, ds, _ in steps]


def slots(steps) -> list[list[int]]:
    return [[g.slot for g in got.groups] for got, _, _ in steps]


@pytest.mark.parametrize("eta", [0, 1, 2, 4])
def test_fast_rollout_reaches_eta_never_passes_it_and_runs_ahead_while_the_trainer_trains(eta):
    B = 2
    pool, ctl, _ = make(eta, B=B)
    try:
        steps = train(ctl, pool, eta + 4)
    finally:
        ctl.close()
    assert slots(steps) == [[B * v, B * v + 1] for v in range(eta + 4)]  # every slot once, in order
    # the groups of step v were admitted, and so generated, at version max(0, v - eta): per token
    assert staleness(steps) == [{min(v, eta)} for v in range(eta + 4)]
    # by the end of step v's update every group the bound allows is back, eta steps ahead; eta = 0: none
    assert [done for _, _, done in steps] == [list(range((eta + v + 1) * B)) for v in range(eta + 4)]


def test_dynamic_filtering_refills_the_same_slot():
    # every slot's first group has all-equal rewards (no signal), the second is informative
    reward = lambda slot, attempt, i: 1.0 if attempt == 1 else float(i % 2)
    pool, ctl, _ = make(1, "train_dataset.dynamic_filtering=true", reward=reward)
    try:
        steps = train(ctl, pool, 3, settle_first=True)
    finally:
        ctl.close()
    assert slots(steps) == [[0, 1], [2, 3], [4, 5]]
    for got, _, _ in steps:
        assert all(len({t.reward for t in g.trajectories}) > 1 for g in got.groups)
    # one refill per slot: the first step's count covers the 4 slots admitted at version 0 (eta = 1: two batches),
    # then each version admits one batch
    assert [got.filtered for got, _, _ in steps] == [4, 2, 2]
    assert {s: pool.attempts[s] for s in range(6)} == dict.fromkeys(range(6), 2)


def test_a_checkpoint_carries_the_finished_groups_and_a_resume_trains_them_as_they_were(tmp_path):
    pool, ctl, _ = make(2, B=2)
    try:
        ctl.start()
        pool.settle()  # version 0 admits and finishes slots 0..5 (eta 2: three batches)
        ctl.take_batch(0)
        pool.hold()
        ctl.wait_loaded(0)
        ctl.publish(1)  # slots 6 and 7 are admitted for version 1 and held: not finished
        pool.settle()
        carried = ctl.carried(1)
        assert [g.slot for g in carried.groups] == [2, 3, 4, 5] and carried.cursors == [2, 3, 4, 5]
        assert (carried.next_slot, carried.cursor, carried.first_cursor) == (6, 6, 2)
        sent = {work.slot: work.example for w in pool.workers for work, _ in w.generating}
        assert sorted(sent) == [6, 7]
    finally:
        ctl.close()
    # what the checkpoint writes, read back as a resume reads it, into a fresh controller at version 1
    cfg = ctl.cfg
    (tmp_path / carry.ROLLOUT_FILE).write_text(carry.dumps(carried, cfg))
    back = carry.load(tmp_path, 1, cfg)
    assert [g.trajectories for g in back.groups] == [g.trajectories for g in carried.groups]
    assert (back.cursors, back.next_slot, back.cursor) == (carried.cursors, 6, 6)
    pool2 = ScriptedPool(cfg.rollout.n_workers, 2)
    pool2.hold()
    ctl2 = Controller(cfg, pool2, ctl.data, DataOrder(len(ctl.data.train), seed=0, cursor=back.cursor), version=1,
                      debug=True, carried=back)
    try:
        ctl2.start()
        got = [ctl2.take_batch(1), ctl2.take_batch(2)]
        assert [[g.trajectories for g in c.groups] for c in got] == [[g.trajectories for g in carried.groups[:2]],
                                                                      [g.trajectories for g in carried.groups[2:]]]
        pool2.settle()
        # nothing carried is sampled again; slots 6 and 7 are, at the data positions they had
        assert {work.slot: work.example for w in pool2.workers for work, _ in w.generating} == sent
    finally:
        ctl2.close()


def test_under_lockstep_a_checkpoint_carries_whole_batches_only():
    pool, ctl, _ = make(2, "rollout.lockstep=true", B=2)
    pool.hold_slots = {7}  # batch 3's second group never finishes: its first is done alone
    try:
        ctl.start()
        pool.settle()
        ctl.take_batch(0)
        ctl.wait_sampled(2)
        ctl.wait_loaded(0)
        ctl.publish(1)
        pool.settle()
        assert 6 in pool.handed_over() and 7 not in pool.handed_over()
        carried = ctl.carried(1)
    finally:
        ctl.close()
    # slot 6 is finished but its batch is not: a resumed worker would wait for slot 6's group to make its cohort
    assert [g.slot for g in carried.groups] == [2, 3, 4, 5]
    assert (carried.next_slot, carried.cursor) == (6, 6)


@pytest.mark.parametrize("changed, why", [
    ("train_dataset.batch_size=4", "batch_size 2 -> 4"),
    ("rollout.max_head_offpolicyness=1", "eta 2 -> 1"),
    ("gconfig.n_samples=4", "n_samples 2 -> 4"),
])
def test_carried_groups_made_under_other_settings_are_not_used(tmp_path, changed, why):
    cfg = make(2, B=2)[1].cfg
    group = GroupDone(0, 2, [Trajectory([1], [2], [-0.5], [0])])
    (tmp_path / carry.ROLLOUT_FILE).write_text(carry.dumps(carry.Carried([group], [2], 3, 3), cfg))
    assert carry.load(tmp_path, 1, cfg).groups[0].trajectories == group.trajectories
    other = load_config(None, ["rollout.max_head_offpolicyness=2", "train_dataset.batch_size=2",
                               "gconfig.n_samples=2", changed])
    with pytest.raises(ValueError, match=why):
        carry.load(tmp_path, 1, other)
    with pytest.raises(ValueError, match="without a gap"):
        carry.load(tmp_path, 2, cfg)  # a checkpoint at version 2 starts at slot 4
    (tmp_path / carry.ROLLOUT_FILE).write_text('{"next_slot": 3}\n{"slot": "x"}\n')
    with pytest.raises(ValueError, match="not a list of finished groups"):
        carry.load(tmp_path, 1, cfg)


def test_silent_workers_stop_the_wait_once_the_stall_timeout_has_passed_not_before():
    clock = FakeClock()
    pool, ctl, _ = make(1, "rollout.stall_timeout_s=30", clock=clock)
    pool.hold()  # no group ever comes back
    error: list[BaseException] = []

    def trainer():
        try:
            ctl.take_batch(0)
        except BaseException as e:
            error.append(e)

    waiter = threading.Thread(target=trainer, daemon=True)
    try:
        ctl.start()
        pool.settle()
        waiter.start()
        clock.wait_reads(2, waiter)  # the wait began (its start) and checked once
        clock.advance(30)  # exactly the timeout: not passed
        clock.wait_reads(2, waiter)  # a check after the advance returned without raising, or there would be no second
        assert waiter.is_alive() and error == []
        clock.advance(0.1)
        waiter.join(SETTLE_S)
    finally:
        clock.advance(3600)  # whatever happened, the waiter ends
        ctl.close()
    assert not waiter.is_alive()
    (e,) = error
    assert isinstance(e, WorkerError) and "no rollout worker reported progress for 30s" in str(e)
    assert "the prompt groups of step 1" in str(e)


def test_a_lost_worker_is_replaced_and_its_groups_run_again_in_their_slots():
    eta, B = 2, 2
    pool, ctl, log = make(eta, "rollout.n_workers=2", B=B)
    lost_in_flight = []

    def hold(v):
        if v == 2:
            pool.hold()  # what publishing version 3 admits stays in flight on the workers

    def lose(v):
        if v == 3:
            pool.settle()
            lost_in_flight.extend(pool.in_flight(0))
            pool.lose(0)
            pool.release()

    try:
        steps = train(ctl, pool, 10, training=lose, writing=hold)
    finally:
        ctl.close()
    assert lost_in_flight == [10]  # publishing 3 admitted slots 10 and 11, one to each worker
    assert pool.restarts == [(0, 3)]  # replaced at once, with the version published then
    assert ctl.restarts == 1
    assert log[0] == ("a3po: rollout worker a3po-rollout-0 died (test); replaced (restart 1 of "
                      "rollout.max_worker_restarts=3), 1 prompt group(s) in flight started again")
    assert log[1].startswith("a3po: rollout worker a3po-rollout-0 ready again")
    assert pool.attempts[10] == 1  # the lost group was never handed over: generated once, by the replacement
    # no step lost or done twice, and the staleness a run without the fault has
    assert slots(steps) == [[B * v, B * v + 1] for v in range(10)]
    assert staleness(steps) == [{min(v, eta)} for v in range(10)]


def test_a_hung_worker_is_killed_and_replaced():
    pool, ctl, log = make(1, B=2)

    def hang(v):
        if v == 1:
            pool.hang(0)

    try:
        steps = train(ctl, pool, 4, training=hang)
    finally:
        ctl.close()
    assert pool.restarts == [(0, 1)] and ctl.restarts == 1
    assert log[0].startswith("a3po: rollout worker a3po-rollout-0 hung (test); replaced (restart 1 of")
    assert slots(steps) == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_no_worker_is_replaced_while_the_trainer_writes_the_weight_buffer():
    """Replaced while the trainer writes v + 1, a worker would read a half-written buffer as version v."""
    pool, ctl, _ = make(1)
    restarts_while_writing = []

    def lose_while_writing(v):
        if v == 2:
            pool.lose(0)
            pool.settle()  # the controller took the loss in, and went round its loop again
            restarts_while_writing.extend(pool.restarts)

    try:
        steps = train(ctl, pool, 5, writing=lose_while_writing)
    finally:
        ctl.close()
    assert restarts_while_writing == []
    assert pool.restarts == [(0, 3)]  # right after v + 1 = 3 was published, with it
    assert slots(steps) == [[2 * v, 2 * v + 1] for v in range(5)]


def test_with_no_restart_left_the_waiting_trainer_gets_the_error():
    pool, ctl, _ = make(1, "rollout.max_worker_restarts=0")
    try:
        with pytest.raises(WorkerError, match=r"a3po-rollout-0 died \(test\); no restart left .*max_worker_restarts=0"):
            train(ctl, pool, 5, training=lambda v: v == 1 and pool.lose(0))
    finally:
        ctl.close()
    assert pool.restarts == []


# ----------------------------------------------------------------------------- real worker processes


@pytest.mark.slow
def test_on_real_worker_processes_a_killed_worker_is_replaced_and_every_slot_is_consumed_once_within_the_bound():
    eta, B, steps = 1, 2, 6
    cfg = load_config(None, ["actor.path=tiny", "actor.dtype=float32", "rollout.dtype=float32", "rollout.n_workers=2",
                             f"rollout.max_head_offpolicyness={eta}", f"train_dataset.batch_size={B}",
                             "train_dataset.size=100", "gconfig.n_samples=2", "gconfig.max_new_tokens=4",
                             "rollout.stall_timeout_s=120"])  # a bug fails in minutes, not hangs
    data = load_task(cfg.train_dataset, 4, cfg.seed)
    model, _ = load_policy("tiny", seed=cfg.seed)
    weights = SharedWeights(model.state_dict())
    pool = WorkerPool(cfg, Scoring(build_reward(cfg.train_dataset, data)), weights, 0, threads=1,
                      launcher=LocalLauncher())
    log: list[str] = []
    ctl = Controller(cfg, pool, data, DataOrder(len(data.train), cfg.seed), version=0, log=log.append, debug=True)
    consumed = []
    try:
        pool.start()
        pool.wait_ready(300)
        ctl.start()
        for v in range(steps):
            got = ctl.take_batch(v)
            consumed.append([(g.slot, min(t.output_versions)) for g in got.groups for t in g.trajectories
                             if t.output_versions])
            if v == 1:  # the groups of step 2 are likely in flight
                os.kill(pool.slots[0].proc.pid, signal.SIGKILL)
            ctl.wait_loaded(v)
            weights.publish(model.state_dict())
            ctl.publish(v + 1)
    finally:
        ctl.close()
        pool.close()
    assert ctl.restarts == 1, log
    assert log[0].startswith("a3po: rollout worker a3po-rollout-0 died (killed by SIGKILL"), log
    assert [sorted({s for s, _ in step}) for step in consumed] == [[B * v, B * v + 1] for v in range(steps)]
    assert all(0 <= v - oldest <= eta for v, step in enumerate(consumed) for _, oldest in step)

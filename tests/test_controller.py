"""The rollout controller without a model: scripted workers on threads, a trainer that sleeps.

The workers behave like rollout/worker.py where it matters for the pipeline: a FIFO
inbox read between two generated tokens, every token tagged with the version loaded
at that moment (so weights change mid-sequence), a WeightsLoaded acknowledgement.

Proves: with rollout faster than training the consumed staleness reaches eta and never
exceeds it (checked per token), and workers finish groups while the trainer trains;
eta = 0 is synchronous (nothing runs during training); dynamic filtering refills a slot
in place; the resume cursor points at the first group not trained on; a silent worker
stops the wait with a clear error after the stall timeout instead of hanging; a worker that
died halfway through a message (the controller thread waits for the rest forever) is
reported by the trainer's own wait.
"""

from __future__ import annotations

import queue
import threading
import time

import pytest

from a3po.config import load_config
from a3po.data import TaskData
from a3po.data.order import DataOrder
from a3po.data.tasks import Example
from a3po.rollout.pool import WorkerError
from a3po.rollout.worker import GroupDone, LoadWeights, Stop, WeightsLoaded, Work
from a3po.train.controller import DEAD_GRACE_S, Controller
from a3po.trajectories import Trajectory


class ThreadPool:
    """WorkerPool's interface over worker threads that 'generate' `tokens` tokens per sample."""

    def __init__(self, n_workers: int, n_samples: int, token_s: float, tokens: int = 4, reward=None, silent=False):
        self.inboxes = [queue.Queue() for _ in range(n_workers)]
        self.outbox: queue.Queue = queue.Queue()
        self.running = [0] * n_workers
        self.n_samples, self.token_s, self.tokens, self.silent = n_samples, token_s, tokens, silent
        self.reward = reward or (lambda slot, attempt, i: float(i % 2))
        self.attempts: dict[int, int] = {}
        self.threads = [threading.Thread(target=self._work, args=(i,), daemon=True) for i in range(n_workers)]
        for t in self.threads:
            t.start()

    def submit(self, work: Work) -> None:
        i = min(range(len(self.running)), key=lambda k: self.running[k])
        self.running[i] += 1
        self.inboxes[i].put(work)

    def group_finished(self, worker_id: int) -> None:
        self.running[worker_id] -= 1

    def load_weights(self, version: int) -> None:
        for q in self.inboxes:
            q.put(LoadWeights(version))

    def dead(self) -> list[str]:
        return []

    def receive(self, timeout: float):
        try:
            return self.outbox.get(timeout=timeout)
        except queue.Empty:
            return None

    def close(self) -> None:
        for q in self.inboxes:
            q.put(Stop())

    def _work(self, wid: int) -> None:
        version, pending = 0, []

        def handle(msg) -> bool:
            nonlocal version
            if isinstance(msg, Stop):
                return False
            if isinstance(msg, LoadWeights):
                version = msg.version
                if not self.silent:
                    self.outbox.put(WeightsLoaded(wid, version, 0.0))
            elif isinstance(msg, Work):
                pending.append(msg)
            return True

        while True:
            if not pending and not handle(self.inboxes[wid].get()):
                return
            while pending:
                work = pending.pop(0)
                versions = []
                for _ in range(self.tokens):
                    time.sleep(self.token_s)
                    versions.append(version)
                    while True:  # messages are read between two tokens, in order
                        try:
                            msg = self.inboxes[wid].get_nowait()
                        except queue.Empty:
                            break
                        if not handle(msg):
                            return
                if self.silent:
                    continue
                attempt = self.attempts[work.slot] = self.attempts.get(work.slot, 0) + 1
                trajs = [Trajectory([1, 2], [3] * self.tokens, [-1.0] * self.tokens, list(versions),
                                    reward=self.reward(work.slot, attempt, i)) for i in range(self.n_samples)]
                self.outbox.put(GroupDone(wid, work.slot, trajs))


class CutOffPool(ThreadPool):
    """Its worker died halfway through writing a message: receive() waits for the rest forever, only dead() tells."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.release = threading.Event()

    def dead(self) -> list[str]:
        return ["a3po-rollout-0 (killed by SIGKILL)"]

    def receive(self, timeout: float):
        self.release.wait()
        return None


def make(eta: int, *overrides: str, B: int = 2, n_samples: int = 2, token_s: float = 0.002, pool_cls=None,
         **pool_kw):
    cfg = load_config(None, [f"rollout.max_head_offpolicyness={eta}", f"train_dataset.batch_size={B}",
                             f"gconfig.n_samples={n_samples}", *overrides])
    data = TaskData("count", [Example(f"q{i}", str(i), i) for i in range(1000)], [])
    pool = (pool_cls or ThreadPool)(cfg.rollout.n_workers, n_samples, token_s, **pool_kw)
    ctl = Controller(cfg, pool, data, DataOrder(len(data.train), seed=0), version=0)
    return cfg, pool, ctl


def train(ctl: Controller, steps: int, train_s: float):
    """The trainer's side of the protocol; returns per step (staleness of every token, groups done while training)."""
    out = []
    ctl.start()
    for v in range(steps):
        got = ctl.take_batch(v)
        before = ctl.snapshot()["groups_done"]
        time.sleep(train_s)  # the PPO update
        during = ctl.snapshot()["groups_done"] - before
        ctl.wait_loaded(v)
        ctl.publish(v + 1)
        out.append(([v - ver for g in got.groups for t in g.trajectories for ver in t.output_versions], during, got))
    return out


@pytest.mark.parametrize("eta", [1, 2, 4])
def test_fast_rollout_reaches_eta_and_never_exceeds_it(eta):
    _, pool, ctl = make(eta)
    try:
        steps = train(ctl, eta + 8, train_s=0.15)
    finally:
        ctl.close()
        pool.close()
    d_all = [d for ds, _, _ in steps for d in ds]
    assert min(d_all) >= 0 and max(d_all) == eta  # the ceiling is reached, never passed
    steady = [d for ds, _, _ in steps[eta + 2:] for d in ds]
    assert sum(d == eta for d in steady) / len(steady) > 0.9
    assert sum(during for _, during, _ in steps) > 0  # rollout kept going while the trainer trained


def test_eta_zero_generates_nothing_while_training():
    _, pool, ctl = make(0)
    try:
        steps = train(ctl, 5, train_s=0.1)
    finally:
        ctl.close()
        pool.close()
    assert all(d == 0 for ds, _, _ in steps for d in ds)
    assert all(during == 0 for _, during, _ in steps)


def test_dynamic_filtering_refills_the_same_slot():
    # every slot's first attempt has all-equal rewards (no signal), the second is informative
    reward = lambda slot, attempt, i: 1.0 if attempt == 1 else float(i % 2)
    _, pool, ctl = make(1, "train_dataset.dynamic_filtering=true", reward=reward)
    try:
        steps = train(ctl, 3, train_s=0.05)
    finally:
        ctl.close()
        pool.close()
    for v, (_, _, got) in enumerate(steps):
        assert [g.slot for g in got.groups] == [2 * v, 2 * v + 1]
        assert all(len({t.reward for t in g.trajectories}) > 1 for g in got.groups)
    assert sum(got.filtered for _, _, got in steps) == 6  # one refill per slot consumed


def test_resume_cursor_is_the_first_group_not_trained_on():
    _, pool, ctl = make(2, B=2)
    try:
        train(ctl, 1, train_s=0.2)  # slots 0, 1 trained; slots 2.. admitted ahead
        # slot 2 was the third group admitted (cursor 2), whatever else is in flight
        assert ctl.resume_cursor() == 2
    finally:
        ctl.close()
        pool.close()


def test_silent_workers_stop_the_wait_after_the_stall_timeout():
    _, pool, ctl = make(1, "rollout.stall_timeout_s=0.5", silent=True)
    ctl.start()
    t0 = time.monotonic()
    try:
        with pytest.raises(WorkerError, match="stall_timeout_s"):
            ctl.take_batch(0)
    finally:
        ctl.close()
        pool.close()
    assert time.monotonic() - t0 < 5


def test_a_worker_dead_mid_message_is_reported_by_the_waiting_trainer():
    """The controller thread is stuck on the half message; the trainer's own wait notices the dead worker,
    after DEAD_GRACE_S (so an error message the controller thread reads first would win)."""
    _, pool, ctl = make(1, pool_cls=CutOffPool)
    ctl.start()
    t0 = time.monotonic()
    try:
        with pytest.raises(WorkerError, match="killed by SIGKILL"):
            ctl.take_batch(0)
    finally:
        pool.release.set()
        ctl.close()
        pool.close()
    assert DEAD_GRACE_S <= time.monotonic() - t0 < DEAD_GRACE_S + 2

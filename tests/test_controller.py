"""The rollout controller without a model: scripted workers on threads, a trainer that sleeps.

The workers behave like rollout/worker.py where it matters for the pipeline: a FIFO
inbox read between two generated tokens, every token tagged with the version loaded
at that moment (so weights change mid-sequence), a WeightsLoaded acknowledgement.

Proves: with rollout faster than training the consumed staleness reaches eta and never
exceeds it (checked per token), and workers finish groups while the trainer trains;
eta = 0 is synchronous (nothing runs during training); dynamic filtering refills a slot
in place; the resume cursor points at the first group not trained on; a silent worker
stops the wait with a clear error after the stall timeout instead of hanging; a lost
worker is replaced, with the published version, never while the trainer writes the weight
buffer, and its groups run again in their slots with the bound intact; with no restart
left the trainer's wait raises.
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
from a3po.pipeline.controller import Controller
from a3po.pipeline.pool import Lost, WorkerError
from a3po.rollout.worker import GroupDone, LoadWeights, Ready, Stop, WeightsLoaded, Work
from a3po.trajectories import Trajectory


class ThreadPool:
    """WorkerPool's interface over worker threads that 'generate' `tokens` tokens per sample."""

    def __init__(self, n_workers: int, n_samples: int, token_s: float, tokens: int = 4, reward=None, mute=False):
        self.inboxes = [queue.Queue() for _ in range(n_workers)]
        self.outbox: queue.Queue = queue.Queue()
        self.running = [0] * n_workers
        self.n_samples, self.token_s, self.tokens, self.mute = n_samples, token_s, tokens, mute
        self.reward = reward or (lambda slot, attempt, i: float(i % 2))
        self.attempts: dict[int, int] = {}
        self.gens = [0] * n_workers  # a lost worker's thread stops sending once its generation is old
        self.lost: set[int] = set()
        self.restarts: list[tuple[int, int]] = []  # (worker, version it started with)
        for i in range(n_workers):
            threading.Thread(target=self._work, args=(i, 0, 0), daemon=True).start()

    def submit(self, work: Work) -> int:
        i = min((k for k in range(len(self.running)) if k not in self.lost), key=lambda k: self.running[k])
        self.running[i] += 1
        self.inboxes[i].put(work)
        return i

    def group_finished(self, worker_id: int) -> None:
        self.running[worker_id] -= 1

    def load_weights(self, version: int) -> None:
        for q in self.inboxes:
            q.put(LoadWeights(version, None))

    def lose(self, i: int) -> None:
        """As if worker i had been killed: it goes silent and its pipe reports the end."""
        self.gens[i] += 1
        self.outbox.put(Lost(i, f"a3po-rollout-{i} died (test)"))

    def silent(self, heartbeat_s: float, start_s: float) -> list:
        return []

    def kill(self, i: int) -> None:
        self.lost.add(i)

    def restart(self, i: int, version: int) -> None:
        self.restarts.append((i, version))
        self.gens[i] += 1
        self.inboxes[i], self.running[i] = queue.Queue(), 0
        self.lost.discard(i)
        threading.Thread(target=self._work, args=(i, self.gens[i], version), daemon=True).start()
        self.outbox.put(Ready(i, version))

    def receive(self, timeout: float):
        try:
            return self.outbox.get(timeout=timeout)
        except queue.Empty:
            return None

    def close(self) -> None:
        for q in self.inboxes:
            q.put(Stop())

    def _work(self, wid: int, gen: int, version: int) -> None:
        pending, inbox = [], self.inboxes[wid]

        def handle(msg) -> bool:
            nonlocal version
            if isinstance(msg, Stop):
                return False
            if isinstance(msg, LoadWeights):
                version = msg.version
                if not self.mute and self.gens[wid] == gen:
                    self.outbox.put(WeightsLoaded(wid, version, 0.0))
            elif isinstance(msg, Work):
                pending.append(msg)
            return True

        while True:
            if self.gens[wid] != gen:
                return
            if not pending and not handle(inbox.get()):
                return
            while pending:
                work = pending.pop(0)
                versions = []
                for _ in range(self.tokens):
                    time.sleep(self.token_s)
                    versions.append(version)
                    while True:  # messages are read between two tokens, in order
                        try:
                            msg = inbox.get_nowait()
                        except queue.Empty:
                            break
                        if not handle(msg):
                            return
                if self.mute or self.gens[wid] != gen:
                    continue
                attempt = self.attempts[work.slot] = self.attempts.get(work.slot, 0) + 1
                trajs = [Trajectory([1, 2], [3] * self.tokens, [-1.0] * self.tokens, list(versions),
                                    reward=self.reward(work.slot, attempt, i)) for i in range(self.n_samples)]
                self.outbox.put(GroupDone(wid, work.slot, trajs))


def make(eta: int, *overrides: str, B: int = 2, n_samples: int = 2, token_s: float = 0.002, pool_cls=None,
         **pool_kw):
    cfg = load_config(None, [f"rollout.max_head_offpolicyness={eta}", f"train_dataset.batch_size={B}",
                             f"gconfig.n_samples={n_samples}", *overrides])
    data = TaskData("count", [Example(f"q{i}", str(i), i) for i in range(1000)], [])
    pool = (pool_cls or ThreadPool)(cfg.rollout.n_workers, n_samples, token_s, **pool_kw)
    ctl = Controller(cfg, pool, data, DataOrder(len(data.train), seed=0), version=0)
    return cfg, pool, ctl


def train(ctl: Controller, steps: int, train_s: float, training=None, writing=None):
    """The trainer's side of the protocol; returns per step (staleness of every token, groups done while training).
    training(v) and writing(v) run while the trainer trains version v and while it writes the weights of v + 1."""
    out = []
    ctl.start()
    for v in range(steps):
        got = ctl.take_batch(v)
        before = ctl.snapshot()["groups_done"]
        if training:
            training(v)
        time.sleep(train_s)  # the PPO update
        during = ctl.snapshot()["groups_done"] - before
        ctl.wait_loaded(v)
        if writing:
            writing(v)
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
    _, pool, ctl = make(1, "rollout.stall_timeout_s=0.5", mute=True)
    ctl.start()
    t0 = time.monotonic()
    try:
        with pytest.raises(WorkerError, match="stall_timeout_s"):
            ctl.take_batch(0)
    finally:
        ctl.close()
        pool.close()
    assert time.monotonic() - t0 < 5


def test_a_lost_worker_is_replaced_and_its_groups_run_again_in_their_slots():
    eta = 2
    _, pool, ctl = make(eta, "rollout.n_workers=2", token_s=0.03)  # a group takes 0.12 s, a step 0.3 s
    lost_in = {}

    def lose_worker_0(v):
        if v == 3:
            time.sleep(0.1)  # the controller admits the groups v + 1 allows
            lost_in["groups"] = sum(w == 0 for w, _ in ctl._inflight.values())
            pool.lose(0)

    try:
        steps = train(ctl, 10, train_s=0.3, training=lose_worker_0)
    finally:
        ctl.close()
        pool.close()
    assert lost_in["groups"] > 0, "worker 0 had nothing in flight: the test shows nothing"
    assert pool.restarts == [(0, 4)] or pool.restarts == [(0, 3)]  # the version published when it was replaced
    assert ctl.restarts == 1 and ctl.snapshot()["worker_restarts"] == 1
    for v, (ds, _, got) in enumerate(steps):
        assert [g.slot for g in got.groups] == [2 * v, 2 * v + 1]  # every slot once, in order
        assert all(0 <= d <= eta for d in ds)
    assert max(d for ds, _, _ in steps[6:] for d in ds) == eta  # the pipeline filled up again


def test_no_worker_is_replaced_while_the_trainer_writes_the_weight_buffer():
    """Replaced while the trainer writes v + 1, a worker would read a half-written buffer as version v."""
    _, pool, ctl = make(1, token_s=0.005)

    def lose_while_writing(v):
        if v == 2:
            pool.lose(0)
            time.sleep(0.5)  # many controller polls: none may replace it yet
            assert pool.restarts == []

    try:
        train(ctl, 5, train_s=0.05, writing=lose_while_writing)
    finally:
        ctl.close()
        pool.close()
    assert pool.restarts == [(0, 3)]  # right after v + 1 = 3 was published, with it


def test_with_no_restart_left_the_waiting_trainer_gets_the_error():
    _, pool, ctl = make(1, "rollout.max_worker_restarts=0", token_s=0.005)
    try:
        with pytest.raises(WorkerError, match=r"a3po-rollout-0 died \(test\); no restart left .*max_worker_restarts=0"):
            train(ctl, 5, train_s=0.05, training=lambda v: v == 1 and pool.lose(0))
    finally:
        ctl.close()
        pool.close()
    assert pool.restarts == []

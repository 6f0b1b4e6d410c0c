"""The trainer's handle on its rollout workers: spawn, send work and weights, collect, shut down.

Workers are spawned (never forked: a forked child would inherit the trainer's torch
threads and locks). Shutdown is always attempted in full: Stop to every worker, a join
with a deadline, then terminate and kill for any that did not exit, so no process
outlives the run, including after Ctrl-C or SIGTERM. A trainer that dies without
shutting down (SIGKILL) is noticed by the workers themselves (worker.py:
_exit_when_orphaned). Every wait here on another process has a deadline.
"""

from __future__ import annotations

import os
import queue
import signal
import time

import torch.multiprocessing as mp

from a3po import signals
from a3po.config import Config
from a3po.rollout.worker import LoadWeights, Ready, Stop, Work, WorkerFailed, worker_main
from a3po.sync import SharedWeights


class WorkerError(RuntimeError):
    """A rollout worker failed; the message says which and why."""


def split_threads(n_workers: int, per_worker: int | None, cores: int | None = None) -> tuple[int, int]:
    """(threads per worker, threads for the trainer): by default the cores are split evenly."""
    cores = cores or os.cpu_count() or 1
    per_worker = per_worker or max(1, cores // (n_workers + 1))
    return per_worker, max(1, cores - n_workers * per_worker)


STOP_GRACE_S = 5.0  # a worker reads Stop between two decode steps, then gives its reward process up to 2 s to end
TERM_GRACE_S = 2.0  # after SIGTERM (a worker still importing holds it until it is done: signals.blocked_in_children)
KILL_GRACE_S = 1.0  # after SIGKILL
READY_POLL_S = 1.0  # how soon wait_ready notices a worker that died while starting


def describe_exit(exitcode: int | None) -> str:
    """How a worker process ended, in words: 'killed by SIGKILL' says more than -9."""
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"killed by {name}" + (", e.g. out of memory" if name == "SIGKILL" else "")
    return f"exit code {exitcode}"


class WorkerPool:
    """Created, then started: `close` must be able to stop whatever part of it was started.

        pool = WorkerPool(...); stack.callback(pool.close); pool.start(); pool.wait_ready(timeout)
    """

    def __init__(self, cfg: Config, reward_fn, weights: SharedWeights, version: int, threads: int):
        ctx = mp.get_context("spawn")
        self.outbox = ctx.Queue()
        self.inboxes = [ctx.Queue() for _ in range(cfg.rollout.n_workers)]
        self.running = [0] * cfg.rollout.n_workers  # groups in flight per worker
        self.procs = [
            ctx.Process(target=worker_main, name=f"a3po-rollout-{i}", daemon=True,
                        args=(i, cfg, reward_fn, weights.tensors, version, threads, self.inboxes[i], self.outbox))
            for i in range(cfg.rollout.n_workers)
        ]
        self.ready: set[int] = set()  # workers whose Ready arrived

    def start(self) -> None:
        """Start every worker; a stop signal waits until they all are, so none is left unknown to close()."""
        with signals.deferred(), signals.blocked_in_children():
            for p in self.procs:
                p.start()

    def wait_ready(self, timeout: float = 600.0) -> None:
        """Wait for every worker's Ready; a worker that dies meanwhile is reported within READY_POLL_S."""
        ready = self.ready
        deadline = time.monotonic() + timeout
        while len(ready) < len(self.procs):
            signals.check()
            left = deadline - time.monotonic()
            if left <= 0:
                raise WorkerError(f"rollout workers not ready after {timeout:.0f}s (rollout.stall_timeout_s)")
            msg = self.receive(min(READY_POLL_S, left))
            if isinstance(msg, Ready):
                ready.add(msg.worker_id)

    def submit(self, work: Work) -> None:
        i = min(range(len(self.running)), key=lambda k: self.running[k])  # least loaded
        self.running[i] += 1
        self.inboxes[i].put(work)

    def group_finished(self, worker_id: int) -> None:
        self.running[worker_id] -= 1

    def idle(self) -> bool:
        """No worker has a group in flight (read without a lock: a stale answer costs one layer's work)."""
        return not any(self.running)

    def load_weights(self, version: int) -> None:
        for q in self.inboxes:
            q.put(LoadWeights(version))

    def dead(self) -> list[str]:
        """'name (how it ended)' for every started worker that is no longer running."""
        return [f"{p.name} ({describe_exit(p.exitcode)})" for p in self.procs if p.pid is not None and not p.is_alive()]

    def receive(self, timeout: float) -> object | None:
        """The next message from any worker, or None after `timeout` seconds; a failure raises."""
        try:
            msg = self.outbox.get(timeout=timeout)
        except queue.Empty:
            dead = self.dead()
            if dead:
                raise WorkerError(f"rollout worker {', '.join(dead)} exited unexpectedly") from None
            return None
        if isinstance(msg, WorkerFailed):
            first = msg.message.splitlines()[0]
            raise WorkerError(f"rollout worker {msg.worker_id} failed: {first}")
        return msg

    def close(self) -> None:
        """Stop every started worker within STOP_GRACE_S + TERM_GRACE_S + KILL_GRACE_S seconds, whatever it is doing.

        Stop first (a clean exit), then SIGTERM, then SIGKILL. A worker that never reported
        Ready is killed at once: it is still importing or loading the model, would read Stop
        only once that is done, and has nothing to lose. The queues' feeder threads are not
        waited for: a worker that is gone never reads what is still buffered for it."""
        started = [p for p in self.procs if p.pid is not None]
        for q in self.inboxes:
            try:
                q.put(Stop())
            except (ValueError, OSError):
                pass
        for i, p in enumerate(self.procs):
            if p in started and i not in self.ready:
                p.kill()
        self._join(started, STOP_GRACE_S)
        for p in started:
            if p.is_alive():
                p.terminate()
        self._join(started, TERM_GRACE_S)
        for p in started:
            if p.is_alive():
                p.kill()
        self._join(started, KILL_GRACE_S)
        for q in [self.outbox, *self.inboxes]:
            q.cancel_join_thread()
            q.close()

    @staticmethod
    def _join(procs, timeout: float) -> None:
        """Join them all within one deadline, not one timeout each."""
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))

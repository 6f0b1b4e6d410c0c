"""The trainer's handle on its rollout workers: spawn, send work and weights, collect, shut down.

Workers are spawned (never forked: a forked child would inherit the trainer's torch
threads and locks). Shutdown is always attempted in full: Stop to every worker, a join
with a deadline, then terminate and kill for any that did not exit, so no process
outlives the run, including after Ctrl-C.
"""

from __future__ import annotations

import os
import queue
import time

import torch.multiprocessing as mp

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


class WorkerPool:
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
        for p in self.procs:
            p.start()

    def wait_ready(self, timeout: float = 600.0) -> None:
        ready = set()
        deadline = time.monotonic() + timeout
        while len(ready) < len(self.procs):
            msg = self.receive(max(0.1, deadline - time.monotonic()))
            if msg is None:
                raise WorkerError(f"rollout workers not ready after {timeout:.0f}s")
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

    def receive(self, timeout: float) -> object | None:
        """The next message from any worker, or None after `timeout` seconds; a failure raises."""
        try:
            msg = self.outbox.get(timeout=timeout)
        except queue.Empty:
            dead = [p.name for p in self.procs if not p.is_alive()]
            if dead:
                raise WorkerError(f"rollout worker(s) {', '.join(dead)} exited unexpectedly") from None
            return None
        if isinstance(msg, WorkerFailed):
            first = msg.message.splitlines()[0]
            raise WorkerError(f"rollout worker {msg.worker_id} failed: {first}")
        return msg

    def close(self, timeout: float = 10.0) -> None:
        for q in self.inboxes:
            try:
                q.put(Stop())
            except (ValueError, OSError):
                pass
        deadline = time.monotonic() + timeout
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.terminate()
                p.join(2.0)
            if p.is_alive():
                p.kill()
                p.join(1.0)
        for q in [self.outbox, *self.inboxes]:
            q.cancel_join_thread()
            q.close()

"""The trainer's handle on its rollout workers: start, send work and weights, collect, replace, shut down.

Workers are started by the run's launcher (launch/: local processes or Ray actors), which
hands back a process handle, an inbox and a message reader of the same shape for both.
Shutdown is always attempted in full: Stop to every worker, a join
with a deadline, then terminate and kill for any that did not exit, so no process
outlives the run, including after Ctrl-C or SIGTERM. A trainer that dies without
shutting down (SIGKILL) is noticed by the workers themselves (worker.py:
_exit_when_orphaned). Every wait here on another process has a deadline.

Each worker answers through a channel of its own, read by a thread of its own here: a worker
killed halfway through a message ends in an end of file on its channel (reported as `Lost`),
and at worst leaves its own reader thread waiting, never the controller or another worker's
messages. Replacing a worker (`restart`) starts a new process with a new inbox and channel in
the same place; anything the old one still had buffered is dropped.
"""

from __future__ import annotations

import os
import queue
import signal
import threading
import time
from dataclasses import dataclass

from a3po import signals
from a3po.config import Config
from a3po.rollout.worker import Heartbeat, LoadWeights, Ready, Stop, Work, WorkerFailed


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


@dataclass
class Lost:
    """A worker's pipe closed without a Stop: it died. `why` names it and how it ended:
    'a3po-rollout-1 died (killed by SIGKILL, e.g. out of memory)'."""

    worker_id: int
    why: str


class _Closed:
    """What a reader thread reports when its pipe reads end of file (or an unreadable message)."""


class _Slot:
    """One place in the pool: the process now in it, its channels, and what the trainer knows of it."""

    def __init__(self, channels, gen: int):
        self.channels, self.gen = channels, gen
        self.proc, self.inbox, self.reader = channels.proc, channels.inbox, channels.reader
        self.running = 0  # groups in flight
        self.ready = False  # its Ready arrived
        self.lost = False  # dead or killed, not yet replaced
        self.heard = time.monotonic()  # last message of any kind (or when it was started)


class WorkerPool:
    """Created, then started: `close` must be able to stop whatever part of it was started.

        pool = WorkerPool(...); stack.callback(pool.close); pool.start(); pool.wait_ready(timeout)
    """

    def __init__(self, cfg: Config, scoring, weights, version: int, threads: int, launcher):
        self._cfg, self._scoring, self._weights, self._threads = cfg, scoring, weights, threads
        self._launcher = launcher
        self._messages: queue.Queue = queue.Queue()  # (worker, generation, message) from every reader thread
        self._lock = threading.Lock()  # restart (controller thread) against close (main thread)
        self._closed = False
        self._retired: list = []  # processes that were replaced, joined by close()
        self.slots = [self._new_slot(i, version, gen=0) for i in range(cfg.rollout.n_workers)]

    def _new_slot(self, i: int, version: int, gen: int) -> _Slot:
        """A worker that starts from the weights published last (`version`)."""
        args = (self._cfg, self._scoring, self._weights.at_start(), version, self._threads)
        return _Slot(self._launcher.worker(i, args), gen)

    def _launch(self, i: int, slot: _Slot) -> None:
        """Start its process and read its messages."""
        slot.proc.start()
        slot.channels.started()
        slot.heard = time.monotonic()
        threading.Thread(target=self._read, args=(i, slot), name=f"a3po-read-{i}", daemon=True).start()

    def _read(self, i: int, slot: _Slot) -> None:
        while True:
            try:
                msg = slot.reader.recv()
            except Exception:  # end of file, a message cut off by the writer's death, or one that cannot be read
                self._messages.put((i, slot.gen, _Closed()))
                return
            slot.heard = time.monotonic()
            self._messages.put((i, slot.gen, msg))

    def start(self) -> None:
        """Start every worker; a stop signal waits until they all are, so none is left unknown to close()."""
        with signals.deferred(), signals.blocked_in_children():
            for i, slot in enumerate(self.slots):
                self._launch(i, slot)

    def wait_ready(self, timeout: float = 600.0) -> None:
        """Wait for every worker's Ready; a worker that dies meanwhile is reported within READY_POLL_S."""
        deadline = time.monotonic() + timeout
        while not all(s.ready for s in self.slots):
            signals.check()
            left = deadline - time.monotonic()
            if left <= 0:
                raise WorkerError(f"rollout workers not ready after {timeout:.0f}s (rollout.stall_timeout_s)")
            msg = self.receive(min(READY_POLL_S, left))
            if isinstance(msg, Lost):
                raise WorkerError(f"rollout worker {msg.why} while starting")

    def submit(self, work: Work, worker: int | None = None) -> int:
        """Queue a group on `worker`, or else on the least loaded worker that is not lost; returns its index."""
        live = [i for i, s in enumerate(self.slots) if not s.lost] or list(range(len(self.slots)))
        i = worker if worker is not None else min(live, key=lambda k: self.slots[k].running)
        self.slots[i].running += 1
        self.slots[i].inbox.put(work)
        return i

    def group_finished(self, worker_id: int) -> None:
        self.slots[worker_id].running -= 1

    def idle(self) -> bool:
        """No worker has a group in flight (read without a lock: a stale answer costs one layer's work)."""
        return not any(s.running for s in self.slots)

    def load_weights(self, version: int) -> None:
        for s in self.slots:
            s.inbox.put(LoadWeights(version, self._weights.for_load()))

    def silent(self, heartbeat_s: float, start_s: float) -> list[tuple[int, str]]:
        """(index, why) of every worker taken for hung: started, not lost, and silent for longer than it may be."""
        now, out = time.monotonic(), []
        for i, s in enumerate(self.slots):
            if s.lost or s.proc.pid is None:
                continue
            silent = now - s.heard
            if s.ready and silent > heartbeat_s:
                out.append((i, f"{s.proc.name} hung (no heartbeat for {silent:.0f}s, "
                               f"rollout.worker_timeout_s={heartbeat_s:g})"))
            elif not s.ready and silent > start_s:
                out.append((i, f"{s.proc.name} hung (not ready {silent:.0f}s after it started, "
                               f"rollout.stall_timeout_s={start_s:g})"))
        return out

    def receive(self, timeout: float) -> object | None:
        """The next message from any worker, a `Lost` for one whose pipe closed, or None after `timeout`
        seconds. Heartbeats and anything from a replaced process are consumed here; WorkerFailed raises."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                i, gen, msg = self._messages.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                return None
            slot = self.slots[i]
            if gen != slot.gen or slot.lost or isinstance(msg, Heartbeat):
                continue  # from a process that was replaced or taken out, or only a sign of life
            if isinstance(msg, _Closed):
                slot.lost = True
                slot.proc.join(KILL_GRACE_S)  # its exit code says how it ended
                return Lost(i, f"{slot.proc.name} died ({describe_exit(slot.proc.exitcode)})")
            if isinstance(msg, WorkerFailed):
                first = msg.message.splitlines()[0]
                raise WorkerError(f"rollout worker {msg.worker_id} failed: {first}")
            if isinstance(msg, Ready):
                slot.ready = True
            return msg

    def kill(self, worker_id: int) -> None:
        """Take a worker out (hung, or already dead): SIGKILL; its messages from now on are dropped."""
        slot = self.slots[worker_id]
        slot.lost = True
        if slot.proc.pid is not None and slot.proc.is_alive():
            slot.proc.kill()

    def restart(self, worker_id: int, version: int) -> None:
        """Put a fresh process in a lost worker's place; it loads `version`, the weights published last, while
        starting."""
        with self._lock:
            if self._closed:
                return
            old = self.slots[worker_id]
            self.kill(worker_id)
            self._retired.append(old.proc)
            old.inbox.cancel_join_thread()
            old.inbox.close()
            new = self._new_slot(worker_id, version, gen=old.gen + 1)
            with signals.blocked_in_children():
                self._launch(worker_id, new)
            self.slots[worker_id] = new

    def close(self) -> None:
        """Stop every started worker within STOP_GRACE_S + TERM_GRACE_S + KILL_GRACE_S seconds, whatever it is doing.

        Stop first (a clean exit), then SIGTERM, then SIGKILL. A worker that never reported
        Ready is killed at once: it is still importing or loading the model, would read Stop
        only once that is done, and has nothing to lose. The queues' feeder threads are not
        waited for: a worker that is gone never reads what is still buffered for it."""
        with self._lock:
            self._closed = True
        started = [s.proc for s in self.slots if s.proc.pid is not None] + self._retired
        for s in self.slots:
            try:
                s.inbox.put(Stop())
            except (ValueError, OSError):
                pass
        for s in self.slots:
            if s.proc.pid is not None and not s.ready:
                s.proc.kill()
        self._join(started, STOP_GRACE_S)
        for p in started:
            if p.is_alive():
                p.terminate()
        self._join(started, TERM_GRACE_S)
        for p in started:
            if p.is_alive():
                p.kill()
        self._join(started, KILL_GRACE_S)
        for s in self.slots:  # the reader threads end on their own, at the end of file of a gone worker
            s.inbox.cancel_join_thread()
            s.inbox.close()

    @staticmethod
    def _join(procs, timeout: float) -> None:
        """Join them all within one deadline, not one timeout each."""
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))

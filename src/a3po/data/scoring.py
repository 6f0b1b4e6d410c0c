"""Calls into user code in a child process, so that a timeout really ends a call.

A reward function or an environment is user code: it can raise, return NaN, loop forever, or
hold the GIL in a catastrophic regex, where no thread-based timeout can interrupt it. Each
`CallProcess` owns one child Python process that unpickles a handler once and then answers
calls one at a time over a pipe; `RewardProcess` is one whose handler scores completions
(environments use another, a3po/envs/host.py). The caller never blocks on it: a rollout
worker submits a finished group's completions and keeps decoding, collecting answers with
`poll()` between decode steps. A call that runs past `timeout_s` scores 0, and the child is
killed and started afresh for the calls behind it; so a hung reward costs its timeout once,
not the worker. A child that dies (os._exit, a crash) is replaced the same way. A fresh child's
start-up (Python, then the handler's module: a reward may import a heavy library) is not the
first call's time: the child says when it is ready, and start-up has a deadline of its own.

Every failure is an answer, never an exception: (None, reason) (a reward: (0.0, reason)),
counted by the caller.
The child's own stdout is sent to stderr, so a reward that prints cannot break the pipe's
framing, and it exits when its parent closes the pipe (end of file), or within a second of
its parent's death if it is stuck in a call (a3po/child.py); it ignores a terminal's Ctrl-C,
which its parent handles.
"""

from __future__ import annotations

import functools
import math
import os
import pickle
import queue
import struct
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, BinaryIO

from a3po import child, signals

# not `-m a3po.data.scoring`: the package imports this module first, and runpy warns about that
CHILD = "from a3po.data.scoring import _serve; _serve()"
HEADER = struct.Struct("<I")  # length prefix of each pickled frame
START_GRACE_S = 60.0  # a child's start-up (Python, the handler's module) before its first call's timeout runs
READY = 0  # the call id of the frame a child sends once its handler is loaded (calls count from 1)
Answer = tuple[Any, Any, "str | None"]  # (key, value, failure reason or None); value is FAILED on a failure


@dataclass
class _Call:
    key: Any
    args: tuple
    frame: bytes = b""  # pickled once sent, kept to send again to a new child


class CallProcess:
    """Calls `handler(*args) -> (value, failure or None)` in a child process, in order, each bounded by
    `timeout_s` from when the child starts it. An exception in the handler is the failure "Type: message";
    a child not ready within START_GRACE_S fails the call it was to start with.

    Calls are written to the child ahead of its answers (up to AHEAD_BYTES of them), so a poll
    collects every answer that is ready rather than one per round trip; the call the child
    works on is the first unanswered one. When it overruns or the child dies, the child is
    replaced and the calls behind it are sent again to the new one."""

    AHEAD_BYTES = 32 << 10  # less than a pipe's buffer: a write never blocks on a busy (or hung) child
    FAILED = None  # the value of a failed call's answer, whether poll or wait returns it

    def __init__(self, handler, timeout_s: float, what: str = "call"):
        self._fn_blob = pickle.dumps(handler)  # fails here, in the caller, if the handler cannot travel
        self.timeout_s = float(timeout_s)
        self.restarts = 0  # children killed for a timeout or found dead
        self.what = what  # named in the failure of a child that died, and in its reader thread
        self._waiting: deque[_Call] = deque()  # not yet written to the child
        self._sent: deque[tuple[int, _Call]] = deque()  # written, unanswered, in order: the first is running
        self._sent_bytes = 0
        self._head_since = 0.0  # when the child started the first of _sent (once it is ready)
        self._started_at = 0.0  # when the child was started
        self._ready = False  # the child has loaded its handler
        self._gen = 0  # which child an answer came from: a killed child's answers are dropped
        self._call_id = 0
        self._answers: queue.Queue = queue.Queue()
        self._proc: subprocess.Popen | None = None

    # -- the caller's side ----------------------------------------------------------------

    def submit(self, key: Any, *args) -> None:
        self._waiting.append(_Call(key, args))
        self._send()

    @property
    def pending(self) -> int:
        return len(self._waiting) + len(self._sent)

    def poll(self) -> list[Answer]:
        """Answers that have arrived, without blocking; enforces the timeout of the call running."""
        out = []
        while self._sent:
            answer = self._next_answer(block_s=0.0)
            if answer is None:
                break
            out.append(answer)
        return out

    def wait(self, block_s: float) -> list[Answer]:
        """Like poll, but waits up to `block_s` for the first answer when none has arrived yet."""
        first = self._next_answer(block_s=block_s) if self._sent else None
        return ([first] if first is not None else []) + self.poll()

    def close(self) -> None:
        self._waiting.clear()
        self._sent.clear()
        self._stop_child(kill=False)

    # -- the calls in the child ----------------------------------------------------------

    def _next_answer(self, block_s: float) -> Answer | None:
        """The running call's answer, or its failure once it overran or the child died; None if still running."""
        deadline = time.monotonic() + block_s
        while True:
            try:
                gen, (call_id, value, failure) = self._answers.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if gen != self._gen:
                continue  # from a killed child: stale
            if call_id == READY:  # the child starts the first of _sent now
                self._ready, self._head_since = True, time.monotonic()
            elif self._sent and call_id == self._sent[0][0]:
                return self._answered((self._sent[0][1].key, self.FAILED if failure else value, failure))
        now = time.monotonic()
        if not self._ready and now - self._started_at > START_GRACE_S:
            return self._replace_child(f"{self.what} process not ready within {START_GRACE_S:g}s of its start")
        if self._ready and now - self._head_since > self.timeout_s:
            return self._replace_child(f"timeout after {self.timeout_s:g}s")
        if self._proc is not None and self._proc.poll() is not None and self._answers.empty():
            return self._replace_child(f"{self.what} process exited with status {self._proc.returncode}")
        return None

    def _answered(self, answer: Answer) -> Answer:
        _, call = self._sent.popleft()
        self._sent_bytes -= len(call.frame)
        self._head_since = time.monotonic()  # the child goes on to the next call now
        self._send()
        return answer

    def _replace_child(self, why: str) -> Answer:
        """Fail the running call, start a new child and send it the calls that were behind it."""
        _, call = self._sent.popleft()
        self._waiting.extendleft(reversed([c for _, c in self._sent]))
        self._sent.clear()
        self._sent_bytes = 0
        self._restart()
        self._send()
        return call.key, self.FAILED, why

    def _send(self) -> None:
        while self._waiting:
            call = self._waiting[0]
            call.frame = call.frame or pickle.dumps(call.args)
            if self._sent and self._sent_bytes + len(call.frame) > self.AHEAD_BYTES:
                return
            if self._proc is None:
                self._start_child()
            self._waiting.popleft()
            self._call_id += 1
            if not self._sent:
                self._head_since = time.monotonic()
            self._sent.append((self._call_id, call))
            self._sent_bytes += len(call.frame)
            try:
                write_frame(self._proc.stdin, HEADER.pack(self._call_id) + call.frame, raw=True)
            except (BrokenPipeError, OSError):
                pass  # the child is gone: the next poll sees it exit and answers for it

    def _restart(self) -> None:
        self.restarts += 1
        self._stop_child(kill=True)

    # -- the child ------------------------------------------------------------------------

    def _start_child(self) -> None:
        # the caller's import path, so that the reward's module is found where the caller found it
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        with signals.blocked_in_children():  # a Ctrl-C while it starts is dropped by it, not a traceback
            self._proc = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, bufsize=0, env=env)
        write_frame(self._proc.stdin, self._fn_blob, raw=True)
        self._gen += 1
        self._started_at, self._ready = time.monotonic(), False
        threading.Thread(target=read_answers, args=(self._proc.stdout, self._answers, self._gen),
                         name=f"a3po-{self.what}-reader", daemon=True).start()

    def _stop_child(self, kill: bool) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if kill:
            proc.kill()
        else:
            proc.stdin.close()  # end of file: the child exits after its current call
        try:
            proc.wait(timeout=2.0)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def __del__(self):
        if getattr(self, "_proc", None) is not None:
            self._proc.kill()


class RewardProcess(CallProcess):
    """Scores completions with a reward function `fn(completion, example) -> float`; a failure scores 0.0."""

    FAILED = 0.0

    def __init__(self, fn, timeout_s: float):
        super().__init__(ScoreCall(fn), timeout_s, what="reward")


class ScoreCall:
    """The child's side of a reward: the function's value checked to be a finite number."""

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, completion: str, example: Any) -> tuple[float, str | None]:
        return checked(self.fn(completion, example))

    def warm_up(self) -> None:
        warm_up(self.fn)


def warm_up(obj: Any) -> None:
    """Load what calls of `obj` need (a user's module, a library imported on first use) where `obj` says how,
    with a `warm_up()` that takes no argument; a functools.partial warms up its function and arguments."""
    if isinstance(obj, functools.partial):
        for part in (obj.func, *obj.args, *obj.keywords.values()):
            warm_up(part)
    elif callable(hook := getattr(obj, "warm_up", None)):
        hook()


def read_answers(stream: BinaryIO, answers: queue.Queue, gen: int) -> None:
    """A reader thread's loop: each frame from a child as (gen, the unpickled frame), until end of file."""
    while (frame := read_frame(stream)) is not None:
        answers.put((gen, pickle.loads(frame)))


def write_frame(stream: BinaryIO, obj: Any, raw: bool = False) -> None:
    data = obj if raw else pickle.dumps(obj)
    stream.write(HEADER.pack(len(data)) + data)
    stream.flush()


def read_frame(stream: BinaryIO) -> bytes | None:
    head = stream.read(HEADER.size)
    if len(head) < HEADER.size:
        return None
    (n,) = HEADER.unpack(head)
    data = b""
    while len(data) < n:
        chunk = stream.read(n - len(data))
        if not chunk:
            return None
        data += chunk
    return data


def checked(value: Any) -> tuple[float, str | None]:
    """A reward function's return value as (reward, None), or (0.0, why it is not a finite number)."""
    if isinstance(value, (str, bytes)) or not hasattr(value, "__float__"):
        return 0.0, f"non-numeric reward {value!r:.80} ({type(value).__name__})"
    try:
        reward = float(value)
    except (TypeError, ValueError) as e:
        return 0.0, f"non-numeric reward {value!r:.80} ({type(e).__name__}: {e})"
    if not math.isfinite(reward):
        return 0.0, f"non-finite reward {reward}"
    return reward, None


def child_pipes() -> tuple[BinaryIO, BinaryIO]:
    """In a child that runs user code for its parent: (requests, answers), the frames' two streams. The user
    code's prints go to stderr, not into the answers; the parent's Ctrl-C is the parent's to handle; the
    child exits when its parent dies, even in the middle of a call that never returns (no end of file would
    ever be read then)."""
    child.take_signals()
    child.exit_when_orphaned()
    answers = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return sys.stdin.buffer, answers


def _serve() -> None:
    """The child: answer frames (a call id, then the pickled args) until the parent closes the pipe."""
    requests, answers = child_pipes()
    if (first := read_frame(requests)) is None:
        return  # the parent closed the pipe before it sent the handler (stopped during start-up): nothing to serve
    handler = pickle.loads(first)
    try:
        warm_up(handler)
    except BaseException:  # noqa: S110 - the calls meet the same error and answer with it, one by one
        pass
    write_frame(answers, (READY, None, None))
    while (frame := read_frame(requests)) is not None:
        (call_id,), args = HEADER.unpack(frame[:HEADER.size]), pickle.loads(frame[HEADER.size:])
        try:
            value, failure = handler(*args)
        except BaseException as e:  # user code may raise anything, SystemExit included
            value, failure = None, f"{type(e).__name__}: {e}"[:300]
        try:
            write_frame(answers, (call_id, value, failure))
        except Exception as e:  # a value that cannot be pickled back
            write_frame(answers, (call_id, None, f"unpicklable result ({type(e).__name__}: {e})"[:300]))



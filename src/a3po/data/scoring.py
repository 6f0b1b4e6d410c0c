"""Reward calls in a child process, so that a timeout really ends a call.

A reward function is user code: it can raise, return NaN, loop forever, or hold the GIL in
a catastrophic regex, where no thread-based timeout can interrupt it. Each `RewardProcess`
owns one child Python process that unpickles the reward function once and
then answers calls one at a time over a pipe. The caller never blocks on it: a rollout
worker submits a finished group's completions and keeps decoding, collecting answers with
`poll()` between decode steps. A call that runs past `timeout_s` scores 0, and the child is
killed and started afresh for the calls behind it; so a hung reward costs its timeout once,
not the worker. A child that dies (os._exit, a crash) is replaced the same way.

Every failure is an answer, never an exception: (0.0, reason), counted by the caller.
The child's own stdout is sent to stderr, so a reward that prints cannot break the pipe's
framing, and it exits when its parent closes the pipe (end of file), or within a second of
its parent's death if it is stuck in a call (a3po/child.py); it ignores a terminal's Ctrl-C,
which its parent handles.
"""

from __future__ import annotations

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
Answer = tuple[Any, float, "str | None"]  # (key, reward, failure reason or None)


@dataclass
class _Call:
    key: Any
    completion: str
    example: Any


class RewardProcess:
    def __init__(self, fn, timeout_s: float):
        self._fn_blob = pickle.dumps(fn)  # fails here, in the caller, if the function cannot travel
        self.timeout_s = float(timeout_s)
        self.restarts = 0  # children killed for a timeout or found dead
        self._waiting: deque[_Call] = deque()
        self._current: _Call | None = None
        self._call_id = 0
        self._sent_at = 0.0
        self._answers: queue.Queue = queue.Queue()
        self._proc: subprocess.Popen | None = None

    # -- the caller's side ----------------------------------------------------------------

    def submit(self, key: Any, completion: str, example: Any) -> None:
        self._waiting.append(_Call(key, completion, example))
        self._send_next()

    @property
    def pending(self) -> int:
        return len(self._waiting) + (self._current is not None)

    def poll(self) -> list[Answer]:
        """Answers that have arrived, without blocking; enforces the timeout of the call running."""
        out = []
        while self._current is not None:
            answer = self._next_answer(block_s=0.0)
            if answer is None:
                break
            out.append(answer)
        return out

    def score_all(self, items: list[tuple[str, Any]]) -> list[tuple[float, str | None]]:
        """Score (completion, example) pairs in order, blocking; each call is bounded by the timeout."""
        for i, (completion, example) in enumerate(items):
            self.submit(i, completion, example)
        got: dict[int, tuple[float, str | None]] = {}
        while self._current is not None:
            answer = self._next_answer(block_s=min(0.5, self.timeout_s))
            if answer is not None:
                got[answer[0]] = answer[1:]
        return [got[i] for i in range(len(items))]

    def close(self) -> None:
        self._waiting.clear()
        self._current = None
        self._stop_child(kill=False)

    # -- one call at a time ---------------------------------------------------------------

    def _next_answer(self, block_s: float) -> Answer | None:
        """The current call's answer, or its failure once it overran or the child died; None if still running."""
        call = self._current
        deadline = time.monotonic() + block_s
        while True:
            try:
                call_id, reward, failure = self._answers.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if call_id == self._call_id:  # an answer from a killed child is stale
                return self._finish((call.key, reward, failure))
        if time.monotonic() - self._sent_at > self.timeout_s:
            self._restart()
            return self._finish((call.key, 0.0, f"timeout after {self.timeout_s:g}s"))
        if self._proc is not None and self._proc.poll() is not None and self._answers.empty():
            code = self._proc.returncode
            self._restart()
            return self._finish((call.key, 0.0, f"reward process exited with status {code}"))
        return None

    def _finish(self, answer: Answer) -> Answer:
        self._current = None
        self._send_next()
        return answer

    def _send_next(self) -> None:
        if self._current is not None or not self._waiting:
            return
        if self._proc is None:
            self._start_child()
        self._current = self._waiting.popleft()
        self._call_id += 1
        self._sent_at = time.monotonic()
        try:
            _write_frame(self._proc.stdin, (self._call_id, self._current.completion, self._current.example))
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
        _write_frame(self._proc.stdin, self._fn_blob, raw=True)
        answers = self._answers
        threading.Thread(target=_read_answers, args=(self._proc.stdout, answers), name="a3po-reward-reader",
                         daemon=True).start()

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


def _read_answers(stream: BinaryIO, answers: queue.Queue) -> None:
    while (frame := _read_frame(stream)) is not None:
        answers.put(pickle.loads(frame))


def _write_frame(stream: BinaryIO, obj: Any, raw: bool = False) -> None:
    data = obj if raw else pickle.dumps(obj)
    stream.write(HEADER.pack(len(data)) + data)
    stream.flush()


def _read_frame(stream: BinaryIO) -> bytes | None:
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


def _serve() -> None:
    """The child: answer (call id, completion, example) frames until the parent closes the pipe.

    The parent may also die in the middle of a call that never returns; exit_when_orphaned
    ends the child then, since no end of file would ever be read."""
    child.take_signals()
    child.exit_when_orphaned()
    answers = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)  # the reward's prints go to stderr, not into the answers
    sys.stdout = sys.stderr
    requests = sys.stdin.buffer
    fn = pickle.loads(_read_frame(requests))
    while (frame := _read_frame(requests)) is not None:
        call_id, completion, example = pickle.loads(frame)
        try:
            reward, failure = checked(fn(completion, example))
        except BaseException as e:  # a user function may raise anything, SystemExit included
            reward, failure = 0.0, f"{type(e).__name__}: {e}"[:300]
        _write_frame(answers, (call_id, reward, failure))



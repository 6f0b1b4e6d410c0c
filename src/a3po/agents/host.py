"""Agents run in a child process of the rollout worker, many at once on one asyncio loop.

    agents = AgentProcess(Imported("my_agent:run"), timeout_s=60)
    agents.start(eid, example, base_url)       # the agent's client talks to base_url
    for eid, reward, failure in agents.poll(): ...

An agent is user code: `async def run(example, client) -> float`, where `client` is an
`openai.AsyncOpenAI` pointed at the episode's own URL on the worker's loopback server (a plain
`def run(example, client)` gets an `openai.OpenAI` and runs on a thread). It may raise, return
garbage, or hang; each of those ends its own episode with a reason, never the worker:

- raises, or returns anything but a finite number: the failure "Type: message".
- runs past `timeout_s`: its task is cancelled and the episode fails at its deadline. An agent
  that blocks the whole loop (time.sleep, a busy loop) cannot be cancelled: when a cancel is not
  acknowledged within CANCEL_GRACE_S the child is killed and replaced, and the other episodes it
  held fail too (an agent cannot be replayed the way an environment can).
- the child dies: every episode it held fails with its exit status.

Frames on the pipes are data.scoring's (length-prefixed pickles). In: ("run", eid, example, url,
timeout_s) or ("cancel", eid). Out: (eid, reward, failure), ("started", eid) (its deadline runs from here:
a fresh child's start-up is not the agent's time) and ("cancelled", eid).
"""

from __future__ import annotations

import asyncio
import inspect
import os
import pickle
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Hashable
from typing import Any

from a3po import signals
from a3po.data.scoring import START_GRACE_S, checked, child_pipes, read_answers, read_frame, write_frame

CHILD = "from a3po.agents.host import _serve; _serve()"
CANCEL_GRACE_S = 2.0  # a cancelled agent's loop must answer within this, else the child is replaced
API_KEY = "a3po"  # the worker's endpoint checks none; the client insists on one
CANCELLED, STARTED = "cancelled", "started"


class AgentProcess:
    def __init__(self, agent, timeout_s: float):
        self._blob = pickle.dumps(agent)  # fails here, in the caller, if the reference cannot travel
        self.timeout_s = float(timeout_s)
        self.restarts = 0
        self._proc: subprocess.Popen | None = None
        self._gen = 0  # which child an answer came from: a killed child's answers are dropped
        self._answers: queue.Queue = queue.Queue()
        self._deadline: dict[Hashable, float] = {}  # running episodes
        self._cancelled: dict[Hashable, float] = {}  # cancels sent, not yet acknowledged: when sent
        self._failed: list[tuple[Hashable, float, str]] = []  # episodes of a replaced child, for the next poll

    def start(self, eid: Hashable, example: Any, url: str) -> None:
        self._check_child()  # never hand a new episode to a child that is dead or stuck
        if self._proc is None:
            self._start_child()
        self._deadline[eid] = time.monotonic() + START_GRACE_S + self.timeout_s  # until the child says it started
        self._send(("run", eid, example, url, self.timeout_s))

    def cancel(self, eid: Hashable) -> None:
        """Stop an episode's agent (its episode ended another way); no answer for it follows."""
        if self._deadline.pop(eid, None) is not None:
            self._cancelled[eid] = time.monotonic()
            self._send(("cancel", eid))

    def poll(self, block_s: float = 0.0) -> list[tuple[Hashable, float, str | None]]:
        """Episodes whose agent finished, failed or ran out of time: (eid, reward, failure or None)."""
        out = []
        try:
            while True:
                gen, msg = self._answers.get(timeout=block_s) if block_s > 0 and not out else \
                    self._answers.get_nowait()
                block_s = 0.0
                if gen != self._gen:
                    continue
                if msg[0] == STARTED:
                    if msg[1] in self._deadline:
                        self._deadline[msg[1]] = time.monotonic() + self.timeout_s
                elif msg[0] == CANCELLED:
                    self._cancelled.pop(msg[1], None)
                elif self._deadline.pop(msg[0], None) is not None:
                    out.append(msg)
        except queue.Empty:
            pass
        now = time.monotonic()
        for eid in [e for e, t in self._deadline.items() if now > t]:
            self.cancel(eid)
            out.append((eid, 0.0, f"the agent did not finish within train_dataset.agent_timeout_s="
                                  f"{self.timeout_s:g}s"))
        self._check_child()
        out += self._failed
        self._failed = []
        return out

    def _check_child(self) -> None:
        """Replace a child that died, or whose loop has not acknowledged a cancel within its grace."""
        now = time.monotonic()
        stuck = [e for e, t in self._cancelled.items() if now - t > CANCEL_GRACE_S]
        if self._proc is not None and self._proc.poll() is not None and self._answers.empty():
            self._replace(f"the agent process exited with status {self._proc.returncode}")
        elif stuck:
            self._replace(f"the agent process was replaced: the agent of episode {stuck[0]} blocked its event loop "
                          f"past its deadline (use await, not blocking calls, in an async agent)")

    def close(self) -> None:
        self._deadline.clear()
        self._cancelled.clear()
        self._stop_child()

    def _replace(self, why: str) -> None:
        self._failed += [(eid, 0.0, why) for eid in self._deadline]
        self._deadline.clear()
        self._cancelled.clear()
        self.restarts += 1
        self._stop_child()

    def _send(self, msg) -> None:
        try:
            write_frame(self._proc.stdin, msg)
        except (BrokenPipeError, OSError):
            pass  # the child is gone: the next poll sees it exit and fails its episodes

    def _start_child(self) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        with signals.blocked_in_children():
            self._proc = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, bufsize=0, env=env)
        write_frame(self._proc.stdin, self._blob, raw=True)
        self._gen += 1
        threading.Thread(target=read_answers, args=(self._proc.stdout, self._answers, self._gen),
                         name="a3po-agent-reader", daemon=True).start()

    def _stop_child(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        proc.kill()
        proc.wait(timeout=10)

    def __del__(self):
        if getattr(self, "_proc", None) is not None:
            self._proc.kill()


# -- the child ---------------------------------------------------------------------------


def _serve() -> None:
    requests, out = child_pipes()
    if (first := read_frame(requests)) is None:
        return  # the parent closed the pipe before it sent the agent (stopped during start-up)
    agent = pickle.loads(first).resolve()
    lock = threading.Lock()
    loop = asyncio.new_event_loop()
    tasks: dict[Hashable, asyncio.Task] = {}

    def answer(msg) -> None:
        with lock:
            try:
                write_frame(out, msg)
            except Exception as e:  # an answer that cannot be pickled
                write_frame(out, (msg[0], 0.0, f"unpicklable result ({type(e).__name__}: {e})"[:300]))

    def dispatch(msg) -> None:
        if msg[0] == "run":
            _, eid, example, url, timeout_s = msg
            tasks[eid] = loop.create_task(_episode(agent, eid, example, url, timeout_s, answer))
            tasks[eid].add_done_callback(lambda _t, e=eid: tasks.pop(e, None))
            answer((STARTED, eid))
        elif msg[0] == "cancel":
            task = tasks.pop(msg[1], None)
            if task is not None:
                task.cancel()
            answer((CANCELLED, msg[1]))

    def read() -> None:
        while (frame := read_frame(requests)) is not None:
            loop.call_soon_threadsafe(dispatch, pickle.loads(frame))
        loop.call_soon_threadsafe(loop.stop)

    threading.Thread(target=read, name="a3po-agent-requests", daemon=True).start()
    loop.run_forever()


async def _episode(agent, eid, example, url: str, timeout_s: float, answer) -> None:
    import openai

    sync = not inspect.iscoroutinefunction(agent)
    client = (openai.OpenAI if sync else openai.AsyncOpenAI)(base_url=url, api_key=API_KEY, max_retries=0,
                                                             timeout=timeout_s)
    try:
        value = await (asyncio.to_thread(agent, example, client) if sync else agent(example, client))
        reward, failure = checked(value)
        if failure is not None:
            failure = f"the agent returned a {failure}"
    except asyncio.CancelledError:
        return  # its episode already ended
    except BaseException as e:  # user code may raise anything
        reward, failure = 0.0, f"{type(e).__name__}: {e}"[:300]
    finally:
        try:
            await client.close() if not sync else client.close()
        except Exception:
            pass
    answer((eid, reward, failure))

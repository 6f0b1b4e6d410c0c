"""What every child process of a run does first: leave Ctrl-C to the trainer, end with its parent, say its name.

The rollout workers (rollout/worker.py) and the reward processes (data/scoring.py) call
`take_signals()` and `exit_when_orphaned()` before anything else they do. Stdlib only: the
reward process imports this before the reward function.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import multiprocessing
import multiprocessing.connection
import os
import signal
import threading
import time

ORPHAN_POLL_S = 0.5  # how often a child checks its parent pid (a worker also watches the parent's pipe)


def take_signals() -> None:
    """Ignore SIGINT and let SIGTERM end us at once (its default: a child has nothing to save).

    A terminal's Ctrl-C reaches every process of its group; stopping the children is the
    trainer's job, and a child's own KeyboardInterrupt would only print a traceback. Children
    are started with both signals blocked (signals.blocked_in_children), so a Ctrl-C that
    arrived while this one was still importing is dropped here, when SIGINT is unblocked."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a process forked from launch/forked.py's server inherits SIG_IGN
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, (signal.SIGINT, signal.SIGTERM))


def name_process(name: str) -> None:
    """Show as `name` in ps, top and pgrep (Linux), not as one more `python`: an orphan is easy to find."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.prctl(15, name.encode()[:15], 0, 0, 0)  # 15 = PR_SET_NAME
    except (OSError, AttributeError):
        pass


def exit_when_orphaned(poll_s: float = ORPHAN_POLL_S) -> None:
    """End this process as soon as its parent is gone (killed with SIGKILL, crashed), whatever it is doing.

    A daemon thread checks the parent pid every poll_s seconds; in a multiprocessing child it
    also waits on the pipe multiprocessing keeps open from the parent, which reads end-of-file
    the moment the parent dies. It calls os._exit: a normal exit can wait for ever, on a
    queue's feeder thread writing into a full pipe nobody reads, or on a reward call that never
    returns.
    """
    parent, ppid = multiprocessing.parent_process(), os.getppid()
    sentinels = [parent.sentinel] if parent is not None else []

    def watch() -> None:
        while os.getppid() == ppid:
            if sentinels:
                if multiprocessing.connection.wait(sentinels, timeout=poll_s):
                    break
            else:
                time.sleep(poll_s)
        os._exit(0)

    threading.Thread(target=watch, name="a3po-orphan-watch", daemon=True).start()

"""SIGINT and SIGTERM: stop cleanly at any moment, with the shell's exit codes and no traceback.

Schedulers and `docker stop` send SIGTERM, a terminal's Ctrl-C sends SIGINT (to every
process of the foreground group, rollout workers included). Once `install()` ran, both
raise `Stopped` in the main thread wherever it is: model loading, the initial evaluation,
a training step. It unwinds through the same clean-up as any error (workers stopped, files
closed), and the top level prints one line and exits 128 + the signal number (130, 143),
what a shell reports for a process that signal ended.

Some things must not be cut in half: a checkpoint being written, child processes being
started (a half-started pool is one that nothing stops), the import of torch (its C++
start-up aborts on an exception, or drops it). Inside `deferred()` a signal is only noted
and raised when the block ends. A signal that arrives while the run is already stopping is
ignored: every wait in the clean-up has its own deadline (pipeline/pool.py), and a second
Ctrl-C cutting the clean-up short would be what leaves processes behind. Because of that,
a Stopped some library swallows is raised again by `check()`, and any error once a signal
arrived is reported as the stop (`stop_behind`).

This module imports nothing heavy: the command line installs it before torch loads.
"""

from __future__ import annotations

import contextlib
import signal

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Stopped(KeyboardInterrupt):
    """A stop signal arrived. A KeyboardInterrupt, so code that cleans up after Ctrl-C does so for SIGTERM too."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class _State:
    received: int | None = None  # the first stop signal, once one arrived
    deferring = 0  # depth of deferred() blocks
    pending = False  # a signal arrived inside deferred(): raise when it ends


_state = _State()


def install() -> None:
    """Turn SIGINT and SIGTERM into `Stopped`. A SIGINT its parent ignores (a job started with `&`
    or nohup) stays ignored, as Python itself does."""
    for sig in STOP_SIGNALS:
        if signal.getsignal(sig) is not signal.SIG_IGN:
            signal.signal(sig, _handler)


def received() -> Stopped | None:
    """The stop that is under way, if any."""
    return Stopped(_state.received) if _state.received is not None else None


def check() -> None:
    """Raise the stop again if a signal arrived and its `Stopped` did not end the run.

    Code that drops every exception swallows the Stopped raised inside it, and since a second
    signal is ignored while stopping, the run would go on training. Seen here: torch's C
    extension imports numpy while it loads and drops whatever that import raises, so a SIGINT
    landing in that import was lost. The trainer calls this after its start-up phases and in
    every wait, so such a stop takes effect at the next of them."""
    if _state.received is not None and not _state.deferring:
        _state.pending = False
        raise Stopped(_state.received)


def stop_behind(error: BaseException) -> Stopped | None:
    """The stop an exception stands for, if it does.

    Once a stop signal arrived, whatever error follows is part of the stop: a worker the same
    group-wide SIGTERM killed first, or an import the interrupt cut in half, after which
    libraries fail in their own ways (for example an error out of matplotlib's colormaps, a
    RecursionError from numpy's half-imported linalg)."""
    if isinstance(error, Stopped):
        return error
    if _state.received is not None:
        return Stopped(_state.received)
    return Stopped(signal.SIGINT) if isinstance(error, KeyboardInterrupt) else None  # handlers not installed


def _handler(signum: int, _frame) -> None:
    if _state.received is not None:
        return  # already stopping
    _state.received = signum
    if _state.deferring:
        _state.pending = True
        return
    raise Stopped(signum)


@contextlib.contextmanager
def deferred():
    """Hold a stop signal until the block is done; a block that completes then raises `Stopped`."""
    _state.deferring += 1
    try:
        yield
    finally:
        _state.deferring -= 1
    if not _state.deferring and _state.pending:
        _state.pending = False
        raise Stopped(_state.received)


@contextlib.contextmanager
def blocked_in_children():
    """Block SIGINT and SIGTERM in this thread while it starts child processes.

    A child inherits the signal mask across fork and exec, so a Ctrl-C that reaches it while
    it is still importing torch stays pending until it has decided what to do with it
    (a3po/child.py ignores SIGINT, then unblocks), instead of printing a KeyboardInterrupt
    traceback from inside an import. The parent still sees the signal: Python runs its
    handler on the main thread when the mask is restored, or at once if another thread took it.
    A child forked from launch/forked.py's server has nothing left to import and inherits the
    server's mask instead, with SIGINT and SIGTERM ignored until a3po/child.py sets them.
    """
    if not hasattr(signal, "pthread_sigmask"):  # not POSIX: nothing to inherit
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def reset() -> None:
    """Forget a signal handled earlier in this process (tests run several stops in one process)."""
    _state.received, _state.deferring, _state.pending = None, 0, False

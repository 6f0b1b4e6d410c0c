"""Stop signals and dead workers, in-process and fast (tests/test_signals.py runs real `a3po train` processes).

Proves: a signal becomes `Stopped` with the shell's exit code (130, 143); inside
`signals.deferred()` it waits until the block is done (a checkpoint is never cut in half);
a second signal while stopping is ignored, but a stop some code swallowed is raised again
by `signals.check()`; an error after a signal counts as the stop; a SIGINT the parent
ignores stays ignored; a
worker that dies while starting is reported within about a second, with how it ended; a
pool closed before it started closes quietly.
"""

import multiprocessing as mp
import os
import signal
import time

import pytest

from a3po import signals
from a3po.config import load_config
from a3po.launch.local import LocalLauncher
from a3po.pipeline.pool import READY_POLL_S, WorkerError, WorkerPool, describe_exit
from a3po.sync import SharedWeights


@pytest.fixture
def handlers():
    """Install a3po's handlers in this process for one test, then put pytest's back."""
    saved = {s: signal.getsignal(s) for s in signals.STOP_SIGNALS}
    signals.reset()
    yield signals.install
    for s, h in saved.items():
        signal.signal(s, h)
    signals.reset()


def deliver(sig: int) -> None:
    """Send sig to this process and give Python the bytecodes it needs to run the handler."""
    os.kill(os.getpid(), sig)
    for _ in range(100):
        time.sleep(0.001)


def test_a_signal_becomes_stopped_with_the_shell_exit_code(handlers):
    handlers()
    with pytest.raises(signals.Stopped) as stop:
        deliver(signal.SIGTERM)
    assert stop.value.exit_code == 143 and stop.value.name == "SIGTERM"
    assert isinstance(stop.value, KeyboardInterrupt)  # cleaned up after as Ctrl-C is


def test_a_deferred_block_finishes_before_the_stop(handlers):
    handlers()
    done = []
    with pytest.raises(signals.Stopped) as stop:
        with signals.deferred():
            deliver(signal.SIGINT)
            done.append("the checkpoint")  # reached: the signal waits for the block
    assert done == ["the checkpoint"] and stop.value.exit_code == 130


def test_a_second_signal_does_not_cut_the_clean_up_short(handlers):
    handlers()
    with pytest.raises(signals.Stopped):
        deliver(signal.SIGINT)
    deliver(signal.SIGTERM)  # the clean-up of the first stop runs on undisturbed
    assert signals.received().exit_code == 130


def test_a_swallowed_stop_is_raised_again_at_the_next_check(handlers):
    handlers()
    try:
        deliver(signal.SIGTERM)
    except signals.Stopped:
        pass  # as torch's C extension does with whatever its numpy import raises
    deliver(signal.SIGTERM)  # ignored: a stop is under way
    with pytest.raises(signals.Stopped) as stop:
        signals.check()
    assert stop.value.exit_code == 143


def test_an_error_after_a_signal_is_part_of_the_stop(handlers):
    assert signals.stop_behind(ValueError("a bug")) is None
    handlers()
    with pytest.raises(signals.Stopped):
        deliver(signal.SIGINT)
    stop = signals.stop_behind(ValueError("a half-imported module"))
    assert stop is not None and stop.exit_code == 130


def test_a_sigint_the_parent_ignores_stays_ignored(handlers):
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # as for `a3po train ... &` in a script
    handlers()
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL


def test_how_a_worker_ended_is_said_in_words():
    assert describe_exit(-9) == "killed by SIGKILL, e.g. out of memory"
    assert describe_exit(-15) == "killed by SIGTERM"
    assert describe_exit(3) == "exit code 3"


def make_pool() -> WorkerPool:
    cfg = load_config(None, ["actor.path=tiny"])
    return WorkerPool(cfg, None, SharedWeights({}), version=0, threads=1, launcher=LocalLauncher())


def test_a_worker_that_dies_while_starting_is_reported_at_once():
    pool = make_pool()
    # a worker whose process ends with exit code 3 before it says anything
    pool.slots[0].proc = mp.get_context("spawn").Process(target=os._exit, args=(3,), name="a3po-rollout-0", daemon=True)
    pool.start()
    t0 = time.monotonic()
    try:
        with pytest.raises(WorkerError, match=r"a3po-rollout-0 died \(exit code 3\)"):
            pool.wait_ready(timeout=120)
    finally:
        pool.close()
    assert time.monotonic() - t0 < 30 * READY_POLL_S  # the interpreter's start-up, then one poll


def test_a_pool_closed_before_it_started_closes_quietly():
    pool = make_pool()
    t0 = time.monotonic()
    pool.close()
    assert time.monotonic() - t0 < 1

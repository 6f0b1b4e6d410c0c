"""Signals and dead processes, on real `a3po train` runs of the tiny model.

Each run has a session of its own (tests/procs.py): its process group stands for a terminal's
Ctrl-C or a scheduler's group-wide SIGTERM.

Proves: SIGTERM or a group SIGINT mid-run exits 143 / 130 with one line, no traceback from
any process, and a resumable last checkpoint; SIGINT or SIGTERM during start-up (loading,
workers starting, initial evaluation) exits 130 or 143 with no traceback; the rollout
workers and reward processes of a trainer killed with SIGKILL exit on their own within
ORPHAN_EXIT_S, even one stuck in a reward call. (Killed or hung rollout workers: test_faults.py.)
"""

import os
import signal
import time
from pathlib import Path

import pytest
from procs import (
    LONG,
    ORPHAN_EXIT_S,
    a3po,
    assert_one_clean_line,
    gone_within,
    metrics_steps,
    rollout_workers,
    steps_logged,
)

from a3po.trainer.checkpoint import latest_checkpoint, load_run_state

pytestmark = pytest.mark.slow

MID_RUN = [  # `docker stop` signals the trainer alone; a batch scheduler or a terminal's Ctrl-C, every process
    (signal.SIGTERM, 143, "trainer"),
    (signal.SIGTERM, 143, "group"),
    (signal.SIGINT, 130, "group"),
]


@pytest.mark.parametrize("sig, code, target", MID_RUN, ids=lambda x: getattr(x, "name", str(x)))
def test_a_signal_mid_run_stops_cleanly_and_keeps_a_resumable_checkpoint(launch, tmp_path, sig, code, target):
    run = launch(*LONG, "saver.freq_steps=2", "evaluator.freq_steps=3")  # a reward process in the trainer too
    run_dir = tmp_path / "runs" / "tiny"
    run.wait_for(lambda: latest_checkpoint(run_dir) is not None, "a checkpoint")
    workers = rollout_workers(run)
    assert workers, "the trainer has no rollout worker"
    if target == "trainer":
        run.proc.send_signal(sig)
    else:
        os.killpg(run.sid, sig)
    assert run.finish() == code, run.err[-3000:]
    line = assert_one_clean_line(run.err, "a3po: interrupted")
    assert sig.name in line and "--resume" in line
    assert gone_within(run.others(), 2.0) is not None, "processes outlived the trainer"
    ckpt = latest_checkpoint(run_dir)
    assert (ckpt / "model.safetensors").exists() and not list(ckpt.parent.glob(".tmp-*"))
    step = load_run_state(ckpt)["step"]
    res = a3po("train", "--resume", str(run_dir), f"total_train_steps={step + 2}", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert metrics_steps(run_dir) == list(range(0, step + 3))


def catches(pid: int, sig: int) -> bool:
    """The process has a handler for sig (/proc SigCgt): a3po's command line is past its first instants."""
    try:
        status = (Path("/proc") / str(pid) / "status").read_text()
    except OSError:
        return False
    mask = next(int(line.split()[1], 16) for line in status.splitlines() if line.startswith("SigCgt:"))
    return bool(mask & (1 << (sig - 1)))


STARTUP = [  # (signal, exit code, when): what a terminal's Ctrl-C or a scheduler sends to the whole group
    (signal.SIGINT, 130, 0.5),  # seconds after the handlers are in: importing torch, loading config, data, model
    (signal.SIGTERM, 143, 0.5),
    (signal.SIGTERM, 143, "a3po: run directory"),  # the worker processes being started
    (signal.SIGINT, 130, "evaluating the initial policy"),  # workers importing torch, the initial evaluation
]


@pytest.mark.parametrize("sig, code, when", STARTUP, ids=lambda x: getattr(x, "name", str(x)))
def test_a_signal_during_start_up_exits_cleanly(launch, sig, code, when):
    run = launch(*LONG)
    if isinstance(when, str):
        run.wait_for_text(when)
    else:
        run.wait_for(lambda: catches(run.proc.pid, signal.SIGTERM), "signal handlers", timeout=30)
        time.sleep(when)
    os.killpg(run.sid, sig)
    assert run.finish() == code, run.err[-3000:]
    assert_one_clean_line(run.err, "a3po: interrupted")
    assert gone_within(run.others(), 2.0) is not None, "processes outlived the trainer"


@pytest.mark.parametrize("frozen_first", [False, True], ids=["running", "frozen"])
def test_workers_of_a_killed_trainer_exit_on_their_own(launch, tmp_path, frozen_first):
    """A deep pipeline (eta 8) with long completions. Frozen first (SIGSTOP: a hung or swapped-out trainer),
    the worker finishes everything admitted and its results fill the pipe nobody reads any more."""
    run = launch(*LONG, "rollout.max_head_offpolicyness=8", "gconfig.max_new_tokens=64", "saver.freq_steps=0")
    run.wait_for(lambda: steps_logged(tmp_path / "runs" / "tiny") >= 3, "three steps")
    left = run.others()
    assert rollout_workers(run), "the trainer has no rollout worker"
    if frozen_first:
        run.proc.send_signal(signal.SIGSTOP)
        time.sleep(3.0)
    run.proc.kill()
    run.proc.wait(timeout=10)
    took = gone_within(left, ORPHAN_EXIT_S)
    assert took is not None, f"orphans still alive {ORPHAN_EXIT_S}s after the trainer died: {left}"
    print(f"orphans gone {took:.2f}s after the trainer was killed")


HANGING_REWARD = """
import os, pathlib, time

def score(completion, example):
    # 0, except in a rollout worker's reward process, where the call never returns
    if pathlib.Path(f"/proc/{os.getppid()}/comm").read_text().startswith("a3po-rollout"):
        pathlib.Path("hanging").touch()
        time.sleep(3600)
    return 0.0
"""


def test_a_reward_process_stuck_in_a_call_ends_with_its_killed_trainer(launch, tmp_path):
    """Its worker is gone too, so no end of file or timeout kill will ever reach it: it must notice by itself."""
    (tmp_path / "hanging_reward.py").write_text(HANGING_REWARD)
    run = launch(*LONG, "train_dataset.reward=hanging_reward:score", "train_dataset.reward_timeout_s=3600")
    run.wait_for(lambda: (tmp_path / "hanging").exists(), "a reward call that hangs")
    left = run.others()
    run.proc.kill()
    run.proc.wait(timeout=10)
    took = gone_within(left, ORPHAN_EXIT_S)
    assert took is not None, f"processes still alive {ORPHAN_EXIT_S}s after the trainer died: {left}"
    print(f"worker and reward processes gone {took:.2f}s after the trainer was killed")

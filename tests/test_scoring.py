"""Reward calls in a real child process (data/scoring.py): failures become (0, reason), a call
that overruns its timeout is really ended (even one holding the GIL), a dead child is replaced,
and the caller never blocks. The reward functions live in a module written to tmp_path and
are named `module:function`, as a user's are."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from procs import TINY, a3po, children_of, gone_within

from a3po.config.schema import DatasetConfig
from a3po.data import Example, RewardProcess, TaskData, build_reward, load_task, scoring

REWARDS = '''
import math, os, re, time

def raises(completion, example):
    raise ValueError("bad input")

def nan(completion, example):
    return math.nan

def text(completion, example):
    return "1.0"

def nothing(completion, example):
    return None

def boolean(completion, example):
    return True

def quarter(completion, example):
    return 0.25

def echo_length(completion, example):
    print("a reward that prints to stdout")  # must not break the answers' framing
    return float(len(completion))

def regex_bomb(completion, example):
    # catastrophic backtracking inside the C regex engine: no thread timeout can interrupt it
    if completion == "bomb":
        re.match(r"(a+)+$", "a" * 64 + "b")
    return 1.0

def dies(completion, example):
    if completion == "die":
        os._exit(3)
    return 1.0

def exits(completion, example):
    raise SystemExit(0)
'''


@pytest.fixture
def reward_of(tmp_path, monkeypatch):
    (tmp_path / "fault_rewards.py").write_text(REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    made = []

    def make(name: str, timeout_s: float = 10.0) -> RewardProcess:
        fn = build_reward(DatasetConfig(reward=f"fault_rewards:{name}"), TaskData("chain_sum", [], []))
        made.append(RewardProcess(fn, timeout_s))
        return made[-1]

    yield make
    for r in made:
        r.close()


EX = Example("What is 1 + 1?", "2", 0)


def score_all(r: RewardProcess, items: list, deadline_s: float = 120) -> list[tuple[float, str | None]]:
    """Submit (completion, example) pairs as a rollout worker does and wait for every answer; in order."""
    for i, (completion, example) in enumerate(items):
        r.submit(i, completion, example)
    got, deadline = {}, time.monotonic() + deadline_s
    while len(got) < len(items):
        assert time.monotonic() < deadline, f"{len(items) - len(got)} reward call(s) unanswered after {deadline_s} s"
        got.update((key, (value, failure)) for key, value, failure in r.wait(0.5))
    return [got[i] for i in range(len(items))]


def test_failures_are_answers_with_a_reason(reward_of):
    """Through wait() and poll() alike (a rollout worker uses both), a failed reward's value is 0.0."""
    cases = {"raises": (0.0, "ValueError: bad input"), "nan": (0.0, "non-finite reward nan"),
             "boolean": (1.0, None), "quarter": (0.25, None), "exits": (0.0, "SystemExit: 0")}
    for name, expected in cases.items():
        assert score_all(reward_of(name), [("x", EX)]) == [expected], name
    assert score_all(reward_of("text"), [("x", EX)])[0][1].startswith("non-numeric reward '1.0'")
    assert score_all(reward_of("nothing"), [("x", EX)])[0][1].startswith("non-numeric reward None")


def test_answers_come_back_in_order_and_prints_do_not_break_them(reward_of):
    r = reward_of("echo_length")
    assert score_all(r, [("a" * n, EX) for n in range(20)]) == [(float(n), None) for n in range(20)]
    assert r.restarts == 0  # one child answered them all


def test_a_gil_holding_call_is_killed_at_its_timeout_and_the_next_call_answered(reward_of):
    r = reward_of("regex_bomb", timeout_s=0.5)
    assert score_all(r, [("ok", EX), ("bomb", EX), ("ok", EX)]) == [(1.0, None), (0.0, "timeout after 0.5s"),
                                                                   (1.0, None)]
    assert r.restarts == 1


def test_poll_never_blocks_on_a_running_call(reward_of):
    r = reward_of("regex_bomb", timeout_s=30)
    r.submit("k", "bomb", EX)
    assert r.poll() == [] and r.pending == 1  # still running: nothing to report, no wait
    r.close()
    assert r.pending == 0


def test_a_child_that_dies_is_replaced(reward_of):
    r = reward_of("dies")
    assert score_all(r, [("die", EX), ("fine", EX)]) == [(0.0, "reward process exited with status 3"), (1.0, None)]
    assert r.restarts == 1


SLOW_TO_IMPORT = '''
import os, time
if os.getpid() != {caller}:  # in the scoring child only (the caller imports it too, to check the reward)
    time.sleep({delay})  # a reward module that imports a heavy library
def one(completion, example):
    return 1.0
'''


def slow_reward(tmp_path, monkeypatch, name: str, delay: float, timeout_s: float) -> RewardProcess:
    (tmp_path / f"{name}.py").write_text(SLOW_TO_IMPORT.format(caller=os.getpid(), delay=delay))
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = build_reward(DatasetConfig(reward=f"{name}:one"), TaskData("chain_sum", [], []))
    return RewardProcess(fn, timeout_s)


def test_a_child_s_start_up_is_not_its_first_call_s_time(tmp_path, monkeypatch):
    """A reward module that takes longer to import than a call may run: every call is answered, none timed
    out (with the start-up charged to the first call, each new child's first call timed out, forever)."""
    r = slow_reward(tmp_path, monkeypatch, "slow_import", delay=1.5, timeout_s=0.5)
    try:
        assert score_all(r, [("x", EX)] * 3) == [(1.0, None)] * 3
        assert r.restarts == 0
    finally:
        r.close()


def test_a_child_that_never_gets_ready_fails_its_call_at_the_start_up_deadline(tmp_path, monkeypatch):
    monkeypatch.setattr(scoring, "START_GRACE_S", 1.0)
    r = slow_reward(tmp_path, monkeypatch, "hangs_on_import", delay=3600, timeout_s=0.5)
    try:
        assert score_all(r, [("x", EX)]) == [(0.0, "reward process not ready within 1s of its start")]
        assert r.restarts == 1
    finally:
        r.close()


def test_a_built_reward_scores_in_the_child():
    data = load_task(DatasetConfig(size=5), 2, 0)
    ex = data.eval[0]
    r = RewardProcess(build_reward(DatasetConfig(), data), 10)
    try:
        assert score_all(r, [(f"The answer is {ex.answer}", ex), ("no idea", ex)]) == [(1.0, None), (0.0, None)]
    finally:
        r.close()


@pytest.mark.parametrize("module", ["a3po.data.scoring", "a3po.agents.host"])
def test_a_child_whose_parent_stopped_before_sending_its_code_exits_quietly(module):
    """A run stopped during start-up closes the pipe before the reward function or agent is sent: the child
    ends without a traceback (the user saw one under the run's one-line message)."""
    child = __import__(module, fromlist=["CHILD"]).CHILD
    res = subprocess.run([sys.executable, "-c", child], stdin=subprocess.DEVNULL, capture_output=True, timeout=60)
    assert res.returncode == 0 and res.stderr == b"", res.stderr[-2000:]


@pytest.mark.slow
def test_the_child_exits_when_its_parent_is_killed(tmp_path):
    """The child reads end-of-file when its parent dies, whatever it was doing, and exits."""
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent('''
        import sys, time
        from a3po.config.schema import DatasetConfig
        from a3po.data import Example, RewardProcess, TaskData, build_reward
        r = RewardProcess(build_reward(DatasetConfig(), TaskData("chain_sum", [], [])), 60)
        r.submit("k", "1", Example("q", "1", 0))
        print(r.wait(60), flush=True)
        time.sleep(600)
    '''))
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout.readline().strip() == "[('k', 1.0, None)]"
        (child,) = children_of(parent.pid)  # the reward process, alive while its parent is
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
    assert gone_within([child], 10) is not None, "the reward child outlived its killed parent by 10 s"


@pytest.mark.slow
def test_a_run_goes_on_when_the_reward_hangs_on_some_completions(tmp_path):
    """A real `a3po train` whose reward holds the GIL forever on a third of the completions:
    each such call costs its timeout once, the run finishes every step, the failures are counted."""
    (tmp_path / "hang_rewards.py").write_text(textwrap.dedent('''
        import re, zlib
        def sometimes_hangs(completion, example):
            if zlib.crc32(completion.encode()) % 3 == 0:
                re.match(r"(a+)+$", "a" * 64 + "b")
            return 1.0
    '''))
    res = a3po("train", *TINY, "total_train_steps=3", "train_dataset.reward=hang_rewards:sometimes_hangs",
               "train_dataset.reward_timeout_s=0.3", "train_dataset.max_reward_failure_frac=1.0", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "runs" / "tiny" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "stale/max" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    failures = sum(r["rollout/reward_failures"] for r in steps)
    assert 0 < failures < 3 * 16  # some hung, not all (3 steps of 4 prompts x 4 samples)
    assert any(r["rollout/reward_mean"] > 0 for r in steps)  # the calls that did not hang scored 1

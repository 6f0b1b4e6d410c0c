"""Multi-turn training end to end: real `a3po train` runs of the tiny model in each built-in environment.

Proves: each built-in environment trains (episode metrics and held-out episodes logged, the
staleness bound held per token), and so does a game of the TextArena library; with two
workers, two trainer ranks and a worker killed mid-episode, the killed worker's groups are
redone in their slots and no step is lost or done twice; a run with an environment resumes
where it stopped; the environment written in docs/training.md trains with the command given there.
"""

import json
import os
import shlex
import signal
from pathlib import Path

import pytest
from procs import TINY, a3po, lines_with, rollout_workers, steps_logged

pytestmark = pytest.mark.slow


def metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("env", ["retry", "calculator", "guess"])
def test_each_builtin_environment_trains(env, tmp_path):
    res = a3po("train", *TINY, f"train_dataset.env={env}", "total_train_steps=4", "evaluator.freq_steps=2",
               "evaluator.size=8", "train_dataset.max_turns=3", cwd=tmp_path, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = metrics(tmp_path / "runs" / "tiny")
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    trained = rows[1:]
    assert all(1 <= r["episode/turns_mean"] <= 3 for r in trained)
    assert all(r["stale/max"] <= 2 for r in trained)
    assert all(abs(sum(v for k, v in r.items() if k.startswith("episode/finish/")) - 1) < 1e-6 for r in trained)
    assert all(0 < r["train/n_tokens"] for r in trained)
    evals = [r for r in rows if "eval/turns_mean" in r]
    assert [r["step"] for r in evals] == [0, 2, 4]
    if env == "retry":  # the feedback is a user message: a third or more of the tokens after the prompt
        assert all(r["episode/observation_token_frac"] > 0.2 for r in trained if r["episode/turns_mean"] > 1.5)


def test_a_textarena_game_trains_with_the_command_in_the_docs(tmp_path):
    """One step of docs/training.md's TextArena command (the textarena extra): the tiny model's moves are invalid,
    so each episode is the game's one allowed invalid move and the second, which ends the game with no credit."""
    pytest.importorskip("textarena", reason="the textarena extra is not installed (make installs it)")
    page = (Path(__file__).parents[1] / "docs" / "training.md").read_text()
    command = shlex.split(page.split("```bash\na3po train train_dataset.env=textarena ", 1)[1].split("\n", 1)[0])
    assert "train_dataset.env_id=GuessTheNumber-v0" in command and any("system_prompt=" in a for a in command)
    no_eval = ["evaluator.initial=false", "evaluator.freq_steps=0"]  # held-out episodes: the built-ins' test above
    res = a3po("train", *TINY, "train_dataset.env=textarena", *command, "total_train_steps=1", *no_eval,
               cwd=tmp_path, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = metrics(tmp_path / "runs" / "tiny")
    assert [r["step"] for r in rows] == [1]
    step = rows[0]
    assert step["episode/finish/done"] == 1.0 and step["episode/turns_mean"] == 2.0
    assert step["rollout/reward_failures"] == 0 and step["rollout/reward_mean"] == 0.0
    assert step["episode/observation_token_frac"] > 0.5  # the game's rules and its invalid-move message


def test_a_worker_killed_mid_episode_with_two_ranks_loses_and_repeats_nothing(launch, tmp_path):
    steps = 12
    run = launch(*TINY, "train_dataset.env=retry", "train_dataset.max_turns=4", f"total_train_steps={steps}",
                 "evaluator.freq_steps=0", "saver.freq_steps=0", "rollout.n_workers=2", "cluster.n_trainer_ranks=2")
    run_dir = tmp_path / "runs" / "tiny"
    run.wait_for(lambda: steps_logged(run_dir) >= 3, "three steps", timeout=300)
    os.kill(rollout_workers(run)[0], signal.SIGKILL)
    assert run.finish(timeout=300) == 0, run.err[-3000:]
    (line,) = lines_with(run.err, "replaced (restart 1 of")
    assert "died (killed by SIGKILL" in line, line
    rows = [r for r in metrics(run_dir) if r["step"] > 0]
    assert [r["step"] for r in rows] == list(range(1, steps + 1)), "a step lost or done twice"
    assert rows[-1]["rollout/worker_restarts"] == 1 and max(r["stale/max"] for r in rows) <= 2


def test_a_run_with_an_environment_resumes_where_it_stopped(tmp_path):
    args = [*TINY, "train_dataset.env=guess", "evaluator.freq_steps=0", "saver.freq_steps=2"]
    res = a3po("train", *args, "total_train_steps=4", cwd=tmp_path, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    run_dir = tmp_path / "runs" / "tiny"
    res = a3po("train", "--resume", str(run_dir), "total_train_steps=6", cwd=tmp_path, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4, 5, 6]
    assert all("episode/turns_mean" in r for r in rows[1:])


def test_the_worked_example_in_the_docs_trains(tmp_path):
    """docs/training.md's own environment, copied from the page as a user would, trained by its command."""
    page = (Path(__file__).parents[1] / "docs" / "training.md").read_text()
    code = page.split("In `hints.py`", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    (tmp_path / "hints.py").write_text(code)
    command = page.split("```bash\na3po train train_dataset.env=hints:Hints", 1)[1].split("\n", 1)[0].split()
    res = a3po("train", *TINY, "train_dataset.env=hints:Hints", *command, "total_train_steps=2", "evaluator.size=8",
               cwd=tmp_path, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = metrics(tmp_path / "runs" / "tiny")
    assert [r["step"] for r in rows] == [0, 1, 2] and rows[-1]["rollout/reward_failures"] == 0

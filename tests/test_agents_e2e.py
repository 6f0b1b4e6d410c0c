"""Agents in real `a3po train` runs of the tiny model: the worked example of docs/training.md trains with its
command from the repository's root and is evaluated by `a3po eval`; bad agent settings are one line."""

import json
from pathlib import Path

import pytest
from procs import TINY, a3po

pytestmark = pytest.mark.slow
ROOT = Path(__file__).parent.parent
DOC = (ROOT / "docs" / "training.md").read_text()


def test_the_worked_example_is_the_example_file_and_trains_with_its_command(tmp_path):
    snippet = DOC.split("## Agents", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    assert snippet in (ROOT / "examples" / "calculator_agent.py").read_text()
    command = DOC.split("```bash\na3po train train_dataset.agent=", 1)[1].split("\n", 1)[0].split()
    runs = tmp_path / "runs"
    res = a3po("train", *TINY, f"train_dataset.agent={command[0]}", *command[1:], "total_train_steps=3",
               "evaluator.freq_steps=3", "evaluator.size=4", "saver.freq_steps=0", f"fileroot={runs}", "seed=3",
               "rollout.n_workers=2", cwd=ROOT, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(line) for line in (runs / "tiny" / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if "episode/turns_mean" in r]
    assert len(trained) == 3 and all(1 <= r["episode/turns_mean"] <= 3 for r in trained)
    assert all(r["rollout/reward_failures"] == 0 and r["train/n_tokens"] > 0 for r in trained)
    assert [r["step"] for r in rows if "eval/turns_mean" in r] == [0, 3]
    ev = a3po("eval", str(runs / "tiny"), "--out", str(tmp_path / "eval.json"), cwd=ROOT, timeout=600)
    assert ev.returncode == 0, ev.stderr[-3000:]
    assert json.loads((tmp_path / "eval.json").read_text())["problems"] == 4


@pytest.mark.parametrize("overrides, says", [
    (["train_dataset.agent=no_such_module:run"], "cannot import 'no_such_module'"),
    (["train_dataset.agent=json:dumps"], "must accept (example, client)"),
    (["train_dataset.agent=json:JSONDecoder"], "not a function"),
    (["train_dataset.agent=json:loads", "train_dataset.env=retry"], "an environment or by an agent, not both"),
    (["train_dataset.agent=json:loads", "rollout.lockstep=true"], "timing decides"),
    (["train_dataset.agent_timeout_s=5"], "only read with train_dataset.agent"),
])
def test_bad_agent_settings_are_one_line_before_anything_starts(overrides, says, tmp_path):
    res = a3po("train", *TINY, *overrides, cwd=tmp_path, timeout=120)
    assert res.returncode == 2 and says in res.stderr, res.stderr[-2000:]
    assert res.stderr.strip().count("\n") == 0

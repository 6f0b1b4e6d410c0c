"""`a3po eval`, run as a user runs it on the tiny model.

Proves: a run folder's evaluation is the run's own last evaluation, problem by problem (same
held-out split, same greedy decoding, same scores); a checkpoint and a model folder evaluate too,
greedy or with K samples per problem (each problem's share solved is a multiple of 1/K); the
record holds the interval around the accuracy and, in an environment, what the first turn solved; records of
other problems or other decoding are refused by bench.paired; a folder that is none of a run, a checkpoint or a
model, a run without a checkpoint, --config with a run and --samples 0 are one line, exit 2.
"""

import json

import pytest
from procs import TINY, a3po

pytestmark = pytest.mark.slow

# about half the problems solve, by the parity of the completion's and the question's characters (the tiny model's
# greedy text alone is much the same for every question)
REWARD = ("def partial(completion, example):\n"
          "    return float((sum(map(ord, completion)) + sum(map(ord, example.question))) % 2)\n")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("eval")
    (cwd / "partial_reward.py").write_text(REWARD)
    res = a3po("train", *TINY, "total_train_steps=3", "evaluator.freq_steps=3",
               "train_dataset.reward=partial_reward:partial", cwd=cwd)
    assert res.returncode == 0, res.stderr[-2000:]
    return cwd, cwd / "runs" / "tiny"


def test_a_run_evaluates_to_its_own_last_evaluation(run):
    cwd, run_dir = run
    res = a3po("eval", str(run_dir), cwd=cwd)
    assert res.returncode == 0, res.stderr[-2000:]
    rec = json.loads((run_dir / "eval_step3.json").read_text())
    last = [json.loads(line) for line in (run_dir / "held_out.jsonl").read_text().splitlines()][-1]
    logged = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][-1]
    assert last["step"] == 3 and rec["step"] == 3 and rec["problems"] == 16
    assert rec["solved"] == last["solved"]
    assert rec["metrics"]["eval/reward"] == logged["eval/reward"]
    assert 0 < rec["accuracy"] == logged["eval/accuracy"] < 1
    lo, hi = rec["interval"]
    assert 0 <= lo <= rec["accuracy"] <= hi <= 1 and hi > lo
    assert "held-out accuracy" in res.stdout and "95 % interval" in res.stdout


def test_a_checkpoint_with_samples_and_a_model_folder(run):
    cwd, run_dir = run
    ckpt = run_dir / "checkpoints" / "step_000003"
    res = a3po("eval", str(ckpt), "--samples", "3", "--out", "k.json", "evaluator.size=8", cwd=cwd)
    assert res.returncode == 0, res.stderr[-2000:]
    rec = json.loads((cwd / "k.json").read_text())
    assert rec["samples"] == 3 and not rec["greedy"] and rec["problems"] == 8
    assert all(round(x * 3, 6) in (0, 1, 2, 3) for x in rec["solved"])
    res = a3po("eval", str(ckpt), "--preset", "tiny", "--out", "m.json", cwd=cwd)  # no run around it: the preset
    assert res.returncode == 2 and "drop --config/--preset" in res.stderr  # a checkpoint of a run: the run's config


# solved on the second turn whatever the model says: what the later turns add is the whole accuracy
SECOND_TURN_ENV = ("from a3po.envs import Step\n\n\nclass Env:\n    def __init__(self, example):\n"
                   "        self.turn = 0\n\n    def reset(self):\n        return 'Say anything.'\n\n"
                   "    def step(self, action):\n        self.turn += 1\n"
                   "        return Step(reward=1.0, done=True) if self.turn == 2 else Step('Once more.')\n")


def test_an_environment_records_what_the_first_turn_solved(tmp_path):
    (tmp_path / "second.py").write_text(SECOND_TURN_ENV)
    for env, first in (("second:Env", 0.0), ("retry", None)):
        res = a3po("eval", "tiny", "--preset", "tiny", f"train_dataset.env={env}", "train_dataset.max_turns=3",
                   "evaluator.size=8", "--out", "rec.json", cwd=tmp_path)
        assert res.returncode == 0, res.stderr[-2000:]
        m = json.loads((tmp_path / "rec.json").read_text())["metrics"]
        if first is not None:  # every episode: two turns, solved by the second
            assert m["eval/accuracy"] == 1.0 and m["eval/first_turn_accuracy"] == 0.0 and m["eval/turns_mean"] == 2.0
        else:  # the tiny model answers nothing right: no turn solves
            assert m["eval/accuracy"] == m["eval/first_turn_accuracy"] == 0.0 and m["eval/turns_mean"] == 3.0


@pytest.mark.parametrize("case", ["not_a_run", "no_checkpoint", "config_with_run", "samples0"])
def test_bad_targets_are_one_line(tmp_path, case):
    target = tmp_path / "x"
    target.mkdir()
    args = [str(target)]
    if case == "no_checkpoint":
        (target / "config.yaml").write_text("total_train_steps: 1\n")
    if case == "config_with_run":
        (target / "config.yaml").write_text("total_train_steps: 1\n")
        args += ["--preset", "tiny"]
    if case == "samples0":
        args = ["tiny", "--samples", "0"]
    res = a3po("eval", *args, cwd=tmp_path)
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("a3po:"), res.stderr


def test_two_sets_of_records_compare_paired_by_seed(run):
    """`python -m a3po.bench.paired` on real records: the initial model against the trained run, same problems."""
    import subprocess
    import sys

    cwd, run_dir = run
    res = a3po("eval", str(run_dir), "--out", "trained.json", cwd=cwd)
    assert res.returncode == 0, res.stderr[-2000:]
    res = a3po("eval", "tiny", "--preset", "tiny", "train_dataset.reward=partial_reward:partial", "--out", "base.json",
               cwd=cwd)
    assert res.returncode == 0, res.stderr[-2000:]
    base, trained = (json.loads((cwd / f).read_text()) for f in ("base.json", "trained.json"))

    def paired(*args):
        return subprocess.run([sys.executable, "-m", "a3po.bench.paired", *args], cwd=cwd, capture_output=True,
                              text=True, timeout=120)

    res = paired("--a", "base.json", "--b", "trained.json", "--names", "base,trained", "--out", "page.md")
    assert res.returncode == 0, res.stderr
    page = (cwd / "page.md").read_text()
    diff = sum(t - b for b, t in zip(base["solved"], trained["solved"])) / len(base["solved"])
    assert f"| 1 | {base['accuracy']:.3f} | {trained['accuracy']:.3f} | {diff:+.3f} |" in page
    assert "one seed: no interval yet" in page
    # records of different problems (8 instead of 16) are refused in one line, as is a file that is not a record
    res = a3po("eval", "tiny", "--preset", "tiny", "evaluator.size=8", "--out", "eight.json", cwd=cwd)
    assert res.returncode == 0, res.stderr[-2000:]
    res = paired("--a", "eight.json", "--b", "trained.json")
    assert res.returncode == 2 and "differ in problems" in res.stderr and len(res.stderr.splitlines()) == 1
    # a greedy record against a sampled one of the same problems: refused, the decoding would be measured too
    res = a3po("eval", str(run_dir), "--samples", "2", "--out", "sampled.json", cwd=cwd)
    assert res.returncode == 0, res.stderr[-2000:]
    res = paired("--a", "sampled.json", "--b", "trained.json")
    assert res.returncode == 2 and "decoded differently (samples 2 and 1" in res.stderr, res.stderr
    assert len(res.stderr.splitlines()) == 1
    (cwd / "junk.json").write_text("{")
    res = paired("--a", "junk.json", "--b", "trained.json")
    assert res.returncode == 2 and "not a readable JSON record" in res.stderr and len(res.stderr.splitlines()) == 1

"""`a3po eval`, run as a user runs it on the tiny model.

Proves: a run folder's evaluation is the run's own last evaluation, problem by problem (same
held-out split, same greedy decoding, same scores); a checkpoint and a model folder evaluate too,
greedy or with K samples per problem (each problem's share solved is a multiple of 1/K); the
record holds the interval around the accuracy; a folder that is none of a run, a checkpoint or a
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
    (cwd / "junk.json").write_text("{")
    res = paired("--a", "junk.json", "--b", "trained.json")
    assert res.returncode == 2 and "not a readable JSON record" in res.stderr and len(res.stderr.splitlines()) == 1

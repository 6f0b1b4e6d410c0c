"""rollout.lockstep: an asynchronous run that repeats from its seed.

Proves, with real `a3po train` runs on the tiny model: two lockstep runs with two workers
(a single-turn one, and one of multi-turn episodes whose environment answers at its own
pace) give the same metrics at every step, bit for bit; the batch of step k is sampled whole
by version max(0, k - 1 - eta) (its staleness is exactly min(k - 1, eta), no sequence spans
two versions); lockstep with dynamic filtering is refused in one line.
"""

import json
from pathlib import Path

import pytest
from procs import TINY, a3po

pytestmark = pytest.mark.slow

TRAINING = ("loss/", "rollout/reward", "rollout/solved", "stale/", "train/", "eval/", "episode/turns", "grad/")


def trained(run_dir: Path) -> list[dict]:
    """Per row of metrics.jsonl, what training computed (timings and throughput left out)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k == "step" or k.startswith(TRAINING)} for r in rows]


def run_twice(tmp_path: Path, *overrides: str) -> tuple[list[dict], list[dict]]:
    out = []
    for name in ("a", "b"):
        res = a3po("train", *TINY, "rollout.lockstep=true", f"experiment_name={name}", *overrides, cwd=tmp_path)
        assert res.returncode == 0, res.stderr[-2000:]
        out.append(trained(tmp_path / "runs" / name))
    return out[0], out[1]


def test_lockstep_runs_repeat_and_sample_each_batch_by_one_version(tmp_path):
    eta = 3
    a, b = run_twice(tmp_path, f"rollout.max_head_offpolicyness={eta}", "total_train_steps=8",
                     "rollout.n_workers=2", "gconfig.max_new_tokens=24", "evaluator.freq_steps=4")
    assert a == b
    steps = [r for r in a if "stale/max" in r]
    assert len(steps) == 8 and any(r["loss/approx_kl"] != 0 for r in steps)
    for r in steps:
        d = min(r["step"] - 1, eta)
        assert r["stale/max"] == d and r["stale/mean"] == pytest.approx(d), r["step"]


def test_lockstep_episodes_repeat(tmp_path):
    a, b = run_twice(tmp_path, "train_dataset.env=retry", "rollout.max_head_offpolicyness=2", "total_train_steps=5",
                     "evaluator.freq_steps=5")
    assert a == b
    steps = [r for r in a if "stale/max" in r]
    assert any(r["episode/turns_mean"] > 1 for r in steps)
    assert [r["stale/max"] for r in steps] == [0, 1, 2, 2, 2]


def test_lockstep_refuses_dynamic_filtering(tmp_path):
    res = a3po("train", *TINY, "rollout.lockstep=true", "train_dataset.dynamic_filtering=true", cwd=tmp_path)
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "dynamic_filtering" in lines[0] and "lockstep" in lines[0]

"""rollout.lockstep: an asynchronous run that repeats from its seed.

Proves, with real `a3po train` runs on the tiny model: two lockstep runs with two workers give
the same metrics at every step, bit for bit (single-turn; and multi-turn episodes whose environment
answers at its own pace, one run of them stopped and resumed); the batch of step k is sampled whole
by version max(0, k - 1 - eta) (its staleness is exactly min(k - 1, eta), no sequence spans
two versions); a run resumed from a checkpoint continues as if it had not stopped, bit for bit (the
checkpoint carries the batches already sampled), and from a checkpoint without them it warns and
samples them again with the checkpoint's weights; lockstep with dynamic filtering is refused in one line.
"""

import json
import re
import shutil
from pathlib import Path

import pytest
from procs import TINY, a3po, assert_one_clean_line

from a3po.pipeline.carry import ROLLOUT_FILE
from a3po.trainer.checkpoint import latest_checkpoint

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


def test_a_resumed_lockstep_run_continues_bit_for_bit_and_without_its_groups_samples_them_again(tmp_path):
    eta = 2
    common = (*TINY, "rollout.lockstep=true", "train_dataset.env=retry", f"rollout.max_head_offpolicyness={eta}",
              "rollout.n_workers=2", "evaluator.freq_steps=2")
    for name, steps in (("whole", 5), ("part", 2)):
        res = a3po("train", *common, f"experiment_name={name}", f"total_train_steps={steps}", cwd=tmp_path)
        assert res.returncode == 0, res.stderr[-2000:]
    runs = tmp_path / "runs"
    shutil.copytree(runs / "part", runs / "bare")
    (latest_checkpoint(runs / "bare") / ROLLOUT_FILE).unlink()  # as a checkpoint from before groups were kept
    for name in ("part", "bare"):
        res = a3po("train", "--resume", str(runs / name), "total_train_steps=5", cwd=tmp_path)
        assert res.returncode == 0, res.stderr[-2000:]
        if name == "part":  # batches 2 and 3 (eta of them) were finished when step 2's checkpoint was written, and
            # batch 4, which version 2 samples, may have been (in part)
            carried = int(re.search(r"(\d+) finished prompt groups carried over", res.stderr)[1])
            assert eta * 4 <= carried <= (eta + 1) * 4 and "warning" not in res.stderr
        else:
            assert_one_clean_line(res.stderr, "a3po: warning: step_000002 keeps no usable finished groups")
    whole, part, bare = (trained(runs / name) for name in ("whole", "part", "bare"))
    assert part == whole  # and so episodes repeat too: the two runs were made apart
    assert any(r["episode/turns_mean"] > 1 for r in whole if "stale/max" in r)
    assert (latest_checkpoint(runs / "part") / "model.safetensors").read_bytes() == \
        (latest_checkpoint(runs / "whole") / "model.safetensors").read_bytes()
    # without them, the checkpoint's version samples batches 2 and 3 again: step 3 trains on fresh tokens
    assert [r["stale/max"] for r in whole if "stale/max" in r] == [0, 1, 2, 2, 2]
    assert [r["stale/max"] for r in bare if "stale/max" in r] == [0, 1, 0, 1, 2]


def test_lockstep_refuses_dynamic_filtering(tmp_path):
    res = a3po("train", *TINY, "rollout.lockstep=true", "train_dataset.dynamic_filtering=true", cwd=tmp_path)
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "dynamic_filtering" in lines[0] and "lockstep" in lines[0]

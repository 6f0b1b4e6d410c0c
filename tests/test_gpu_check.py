"""tools/gpu_check.sh on its CPU path, and the timed pair's record (a3po/bench/timed_pair.py).

Proves: the script's timed pair runs as a GPU machine runs it (DEVICE=cpu and a small model in
place of cuda and tiny-2048x16): two real `a3po train` runs, then a record in which only the
recompute run paid a proximal forward pass, that names the device it ran on and the model's size;
the record's medians are those of the steps after the skipped ones, by hand; a pair that differs in
anything but the method is refused, naming the key.

    pytest tests/test_gpu_check.py
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from a3po.bench.timed_pair import arm_summary, pair_record
from a3po.config import ConfigError
from a3po.machine import machine
from a3po.models.tiny import tiny_params

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_scripts_timed_pair_runs_on_the_cpu_and_writes_its_record(tmp_path):
    env = {**os.environ, "DEVICE": "cpu", "ONLY": "pair-recompute pair-loglinear pair-record", "PAIR_MODEL": "tiny",
           "PAIR_STEPS": "3", "PAIR_DTYPE": "float32", "PYTHON": sys.executable, "LOG_DIR": str(tmp_path / "logs"),
           "PAIR_ARGS": "train_dataset.batch_size=2 gconfig.n_samples=2 gconfig.max_new_tokens=8",
           "RECORD": str(tmp_path / "results" / "timed-pair.json")}
    res = subprocess.run(["bash", str(ROOT / "tools" / "gpu_check.sh")], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:]
    assert [line.split()[:2] for line in res.stdout.splitlines() if line.startswith(("PASS", "FAIL"))] == [
        ["PASS", "pair-recompute"], ["PASS", "pair-loglinear"], ["PASS", "pair-record"]]
    rec = json.loads((tmp_path / "results" / "timed-pair.json").read_text())
    assert rec == json.loads((tmp_path / "logs" / "timed-pair.json").read_text())  # the copy that comes back
    assert rec["device"] == "cpu" and rec["device_name"] == machine()["cpu"]
    assert rec["model"] == "tiny" and rec["params"] == tiny_params(64, 2) and rec["actor_dtype"] == "float32"
    rc, ll = rec["arms"]["recompute"], rec["arms"]["loglinear"]
    assert rc["timed_steps"] == ll["timed_steps"] == 1  # 3 steps, the first 2 skipped
    assert rc["prox_logp_s"] > 0 and 0 < rc["prox_share"] < 1  # only recompute pays the forward pass
    assert ll["prox_logp_s"] == 0 and ll["prox_share"] == 0
    assert rec["recompute_over_loglinear"] == pytest.approx(rc["step_s"] / ll["step_s"])
    assert rc["tokens_per_s"] > 0 and ll["tokens_per_s"] > 0


def rows(prox: list[float], step: list[float]) -> list[dict]:
    """metrics.jsonl rows: an evaluation-only step 0, then training steps (they carry stale/max)."""
    return [{"step": 0, "eval/accuracy": 0.5}] + [
        {"step": i + 1, "stale/max": 1, "perf/prox_logp_s": p, "perf/step_s": s, "perf/train_s": s / 2,
         "perf/tokens_per_s": 100 / s} for i, (p, s) in enumerate(zip(prox, step))]


def test_arm_medians_leave_out_the_skipped_steps():
    a = arm_summary(rows([9.0, 1.0, 2.0, 3.0], [10.0, 4.0, 5.0, 6.0]), skip=1)
    # steps 2..4: prox 1, 2, 3 -> 2; step 4, 5, 6 -> 5; shares 1/4, 2/5, 3/6 -> 0.4
    assert a == {"timed_steps": 3, "step_s": 5.0, "prox_logp_s": 2.0, "train_s": 2.5, "tokens_per_s": 20.0,
                 "prox_share": pytest.approx(0.4)}
    with pytest.raises(ConfigError, match="no training step after the first 4"):
        arm_summary(rows([1.0] * 4, [2.0] * 4), skip=4)


def config(method: str, lr: float = 1e-5) -> dict:
    return {"experiment_name": f"pair-{method}", "fileroot": "runs", "seed": 1,
            "actor": {"path": "tiny-2048x16", "device": "cpu", "dtype": "bfloat16", "prox_logp_method": method,
                      "ppo_n_minibatches": 1, "optimizer": {"lr": lr}},
            "rollout": {"device": "cpu", "dtype": "bfloat16", "max_head_offpolicyness": 2},
            "train_dataset": {"batch_size": 8}, "gconfig": {"n_samples": 8, "max_new_tokens": 64}}


def test_a_pair_differing_in_more_than_the_method_is_refused_naming_the_key():
    metrics = [rows([1.0] * 3, [4.0] * 3), rows([0.0] * 3, [3.0] * 3)]
    rec = pair_record([config("recompute"), config("loglinear")], metrics, skip=2)
    assert rec["params"] == 604_577_792 and rec["recompute_over_loglinear"] == pytest.approx(4 / 3)
    with pytest.raises(ConfigError, match=r"differ in more than actor.prox_logp_method: actor.optimizer.lr$"):
        pair_record([config("recompute"), config("loglinear", lr=1e-4)], metrics, skip=2)
    with pytest.raises(ConfigError, match="give the recompute run, then the loglinear one"):
        pair_record([config("loglinear"), config("recompute")], metrics, skip=2)

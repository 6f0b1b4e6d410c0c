"""`a3po train` end to end on the tiny model, as a user runs it: real subprocesses, real workers.

Proves: asynchronous runs (eta >= 2) never train on a token staler than eta, and some
sequences really carry two versions after an in-flight weight update; eta = 0 trains
only on fresh tokens, and with top-k, top-p and min-p sampling the trainer's log-probs equal the
sampler's there; a resumed run continues the step count with no duplicated or
missing metrics; Ctrl-C stops every process and leaves the last checkpoint intact; bad
configuration, a missing dataset file and an unknown task exit with code 2 and one line.
"""

import json
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from procs import CLI, ORPHAN_EXIT_S, TINY, a3po, assert_one_clean_line, children_of, gone_within

from a3po.trainer.checkpoint import latest_checkpoint, load_run_state

pytestmark = pytest.mark.slow


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def train_steps(rows):
    return [r for r in rows if "stale/max" in r]


def test_async_run_bounds_staleness_and_updates_in_flight(tmp_path):
    eta = 2
    # 64 tokens: sequences long enough that a version usually arrives while some are generating (with 32 the tiny
    # model sometimes finished every sequence before each publication: no update in flight to check)
    res = a3po("train", *TINY, f"rollout.max_head_offpolicyness={eta}", "total_train_steps=8",
               "gconfig.max_new_tokens=64", "evaluator.freq_steps=4", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    run = tmp_path / "runs" / "tiny"
    rows = metrics(run)
    steps = train_steps(rows)
    assert [r["step"] for r in steps] == list(range(1, 9))
    assert all(r["stale/max"] <= eta for r in steps)  # per token: the stalest token of every step
    assert max(r["stale/max"] for r in steps) == eta  # the pipeline is deep enough to reach the bound
    for r in steps:
        assert sum(r[f"stale/frac_d{k}"] for k in range(eta + 1)) == pytest.approx(1.0)
        assert 0.0 <= r["rollout/idle_frac"] <= 1.0 and 0 <= r["rollout/groups_ahead"] <= eta * 4
    assert sum(r[f"stale/frac_d{eta}"] for r in steps[eta + 2:]) / len(steps[eta + 2:]) > 0.3
    # rollout works while the trainer updates: it finishes groups then, or (a rollout faster than the update,
    # which reaches the bound first) it has admitted groups for later versions by the update's end
    assert any(r["rollout/groups_done_while_training"] > 0 or r["rollout/groups_ahead"] > 0 for r in steps), \
        "rollout waited for the trainer"
    assert any(r["rollout/two_version_frac"] > 0 for r in steps), "no sequence spanned a weight update"
    # step 1 trains on tokens the initial weights sampled: fp32 trainer and fp32 sampler agree
    assert steps[0]["mismatch/tokens"] > 0 and steps[0]["mismatch/abs_max"] < 1e-3
    assert rows[0]["step"] == 0 and "eval/accuracy" in rows[0]
    assert "held-out accuracy" in res.stdout and (run / "config.yaml").exists()
    ckpt = latest_checkpoint(run)
    assert ckpt.name == "step_000008" and (ckpt / "model.safetensors").exists()


def test_synchronous_run_trains_only_on_fresh_tokens_and_filtered_sampling_matches_the_trainer(tmp_path):
    # top-k, top-p and min-p together: the trainer filters its log-probs as the sampler did, so on fresh tokens
    # the recomputed proximal policy equals the behaviour policy (w = 1, not the kept mass) and the mismatch is 0
    res = a3po("train", *TINY, "rollout.max_head_offpolicyness=0", "total_train_steps=4", "gconfig.max_new_tokens=24",
               "gconfig.top_k=50", "gconfig.top_p=0.9", "gconfig.min_p=0.05", "actor.prox_logp_method=recompute",
               cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    steps = train_steps(metrics(tmp_path / "runs" / "tiny"))
    assert len(steps) == 4
    assert all(r["stale/max"] == 0 and r["stale/mean"] == 0 for r in steps)
    assert all(r["rollout/two_version_frac"] == 0 for r in steps)
    assert all(r["mismatch/tokens"] > 0 and r["mismatch/abs_max"] < 1e-4 for r in steps)
    assert all(abs(r["loss/behav_weight_max"] - 1) < 1e-4 and abs(r["loss/behav_weight_mean"] - 1) < 1e-4
               for r in steps)


def test_resume_continues_the_step_count_without_gaps_or_duplicates(tmp_path):
    res = a3po("train", *TINY, "total_train_steps=4", "saver.freq_steps=2", "saver.keep_last=2", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    run = tmp_path / "runs" / "tiny"
    # make it look like a crash during step 4: metrics up to step 3, newest checkpoint step 2
    rows = metrics(run)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows if r["step"] <= 3))
    shutil.rmtree(run / "checkpoints" / "step_000004")
    (run / "checkpoints" / "latest").write_text("step_000002")
    res = a3po("train", "--resume", str(run), "total_train_steps=6", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "resuming" in res.stderr
    rows = metrics(run)
    assert [r["step"] for r in rows] == list(range(0, 7))
    assert load_run_state(latest_checkpoint(run))["step"] == 6
    # the summary is the run's, not the resumed part's: from its own step-0 evaluation to the last
    evals = [r for r in rows if "eval/accuracy" in r]
    assert evals[0]["step"] == 0 and evals[-1]["step"] == 6
    # the held-out records of evaluations past the checkpoint were made again, not kept twice
    held_out = [json.loads(line)["step"] for line in (run / "held_out.jsonl").read_text().splitlines()]
    assert held_out == [r["step"] for r in evals]
    assert (f"held-out accuracy        {evals[0]['eval/accuracy']:.3f} (step 0) -> "
            f"{evals[-1]['eval/accuracy']:.3f} (step 6)") in res.stdout, res.stdout
    assert "steps                    6" in res.stdout


def test_a_run_that_cuts_most_completions_warns_once_naming_the_key(tmp_path):
    # the tiny preset's 8 new tokens cut nearly every completion of a random model, step after step
    res = a3po("train", *TINY, "total_train_steps=3", "evaluator.freq_steps=0", "saver.freq_steps=0", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    cut = [r["rollout/truncated_frac"] for r in train_steps(metrics(tmp_path / "runs" / "tiny"))]
    assert sum(frac > 0.5 for frac in cut) >= 2, cut  # more than one step could have warned
    line = assert_one_clean_line(res.stderr, "a3po: warning:")
    assert "were cut at gconfig.max_new_tokens=8" in line and "raise gconfig.max_new_tokens" in line


def test_ctrl_c_stops_every_process_and_keeps_the_last_checkpoint(tmp_path):
    proc = subprocess.Popen([*CLI, "train", *TINY, "total_train_steps=400",
                             "saver.freq_steps=2", "evaluator.freq_steps=0"],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    run = tmp_path / "runs" / "tiny"
    deadline = time.monotonic() + 120
    while latest_checkpoint(run) is None and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.2)
    assert latest_checkpoint(run) is not None, proc.stderr.read() if proc.poll() is not None else "no checkpoint"
    kids = children_of(proc.pid)
    assert kids, "the trainer has no worker processes"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err[-2000:]
    assert "interrupted" in err and "Traceback" not in err
    assert gone_within(kids, ORPHAN_EXIT_S) is not None, "worker processes outlived the trainer"
    ckpt = latest_checkpoint(run)
    state = load_run_state(ckpt)
    assert (ckpt / "model.safetensors").exists() and state["step"] >= 2
    # and it resumes from there
    res = a3po("train", "--resume", str(run), f"total_train_steps={state['step'] + 2}", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    steps = [r["step"] for r in metrics(run)]
    assert steps == list(range(0, state["step"] + 3))


@pytest.mark.parametrize("args, needle", [
    (["rollout.max_head_offpolicyness=-1"], "rollout.max_head_offpolicyness=-1"),
    (["train_dataset.task=file", "train_dataset.path=missing.jsonl"], "missing.jsonl"),
    (["train_dataset.task=chain_summ"], "chain_sum"),
    (["actor.path=./no/such/model"], "no/such/model"),
])
def test_bad_input_exits_2_with_one_line(tmp_path, args, needle):
    res = a3po("train", *TINY, *args, cwd=tmp_path, timeout=120)
    assert res.returncode == 2, res.stderr[-2000:]
    lines = [line for line in res.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in res.stderr

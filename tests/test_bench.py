"""`a3po bench step` and `a3po bench e2e`: the fast CI variants on the tiny model, run as a
user runs them (real subprocesses, real training runs), plus the pure table arithmetic.

Proves: every arm trained for the requested steps and reports the columns the tables
need; the synchronous arm really was synchronous and coupled, the asynchronous ones
stayed within eta; only the recomputing arms paid a proximal forward pass; the output
files (markdown, JSON, PNG plots) exist and have the documented structure; a benchmark
continues where it stopped; a configuration one arm cannot accept is refused up front; every
benchmark's flags are generated from its options dataclass, defaults included.
"""

import contextlib
import io
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from procs import a3po

from a3po.bench.args import BENCHMARKS, StepBenchArgs, from_namespace
from a3po.bench.report import aggregate, approx_quality
from a3po.bench.runs import summarize_run
from a3po.cli import build_parser
from a3po.config import ConfigError
from a3po.models import ModelSourceError

PNG = b"\x89PNG\r\n\x1a\n"
TINY_E2E = ["--preset", "tiny", "total_train_steps=3", "gconfig.max_new_tokens=8", "logging.tensorboard=false",
            "train_dataset.size=200"]


# ----------------------------------------------------------------------------- options


@pytest.mark.parametrize("command", list(BENCHMARKS))
def test_each_benchmark_parser_is_its_options_dataclass(command):
    cls = BENCHMARKS[command]
    assert from_namespace(build_parser().parse_args(["bench", command])) == cls().checked()
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        build_parser().parse_args(["bench", command, "--help"])
    assert all(f" --{f.name.replace('_', '-')}" in out.getvalue() for f in cls.options())


def test_options_parse_as_their_fields_are_typed():
    ns = build_parser().parse_args(["bench", "step", "--minibatches", "2,1", "--methods", "reuse", "--threads", "3",
                                    "--prompt-len", "5"])
    a = from_namespace(ns)
    assert (a.minibatches, a.methods, a.threads, a.prompt_len) == ([2, 1], ["reuse"], 3, 5)
    ns = build_parser().parse_args(["bench", "staleness", "--etas", "4,0", "--all-arms-at-eta0", "x=1"])
    a = from_namespace(ns)
    assert (a.etas, a.all_arms_at_eta0, a.overrides, a.keep_checkpoints) == ([0, 4], True, ["x=1"], False)


# ----------------------------------------------------------------------------- bench step


@pytest.mark.slow
def test_bench_step_times_every_method_and_the_interpolation(tmp_path):
    res = a3po("bench", "step", "--model", "tiny", "--dtype", "float32", "--batch", "4", "--prompt-len", "8",
               "--output-len", "16", "--repeats", "2", "--out", "out", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    rec = json.loads((tmp_path / "out" / "step.json").read_text())
    arms = [(s["method"], s["minibatches"]) for s in rec["steps"]]
    assert arms == [("recompute", 1), ("loglinear", 1), ("linear", 1), ("reuse", 1),
                    ("recompute", 4), ("loglinear", 4), ("linear", 4)]  # reuse refused at 4 minibatches
    for s in rec["steps"]:
        assert s["step_n"] == 2 and 0 < s["step_min_s"] <= s["step_median_s"] <= s["step_max_s"]
        assert s["fwd_bwd_s"] > 0 and s["optimizer_s"] > 0
        assert s["fwd_bwd_gflops"] == pytest.approx(rec["fwd_bwd_tflop"] * 1e3 / s["fwd_bwd_s"])
        assert s["of_matmul"] == pytest.approx(s["fwd_bwd_gflops"] / rec["matmul_gflops"])
        assert s["shape_gflops"] > 0 and s["of_shapes"] > 0  # per round, so not the medians' quotient
        # the batch fits one micro-batch per minibatch: one training forward per minibatch, plus
        # the proximal pass for recompute only (counted by a forward hook, not inferred from time)
        extra = s["method"] == "recompute"
        assert s["forwards"] == s["minibatches"] + extra, s
        if extra:
            assert s["prox_logp_s"] > 0 and s["speedup_vs_recompute"] == 1.0
        else:
            assert s["prox_logp_s"] == 0 and s["speedup_vs_recompute"] > 0
    prox = {p["method"]: p for p in rec["prox"]}
    assert set(prox) == {"recompute (forward pass)", "loglinear", "linear"}
    assert prox["loglinear"]["time_n"] >= 50 and prox["loglinear"]["speedup_vs_forward"] > 1
    assert rec["dtype"] == "float32" and rec["batch"] == 4 and rec["seq"] == 24
    from a3po.bench.flops import linear_weights
    from a3po.models import load_policy

    body, head = linear_weights(load_policy("tiny")[0])
    assert rec["fwd_bwd_tflop"] * 1e12 == pytest.approx(6 * (body + head) * 4 * 24)  # 6 FLOPs per weight per token
    assert rec["matmul_gflops"] > 0 and rec["machine"]["cpu"]
    assert rec["device"] == "cpu" and rec["device_name"] == rec["machine"]["cpu"]  # --device's default, named
    md = (tmp_path / "out" / "step.md").read_text()
    assert "| recompute | 1 |" in md and "| loglinear | 4 |" in md and "forward / this" in md
    assert json.loads(res.stdout.strip().splitlines()[-1])["benchmark"] == "step"


@pytest.mark.slow
def test_bench_step_puts_a_lora_arm_beside_full_training(tmp_path):
    res = a3po("bench", "step", "--model", "tiny", "--dtype", "float32", "--batch", "4", "--prompt-len", "8",
               "--output-len", "16", "--repeats", "1", "--methods", "loglinear", "--minibatches", "1",
               "--lora-rank", "4", "--memory", "--out", "out", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    full, adapted = json.loads((tmp_path / "out" / "step.json").read_text())["steps"]
    assert (full["lora_rank"], adapted["lora_rank"]) == (0, 4)
    assert full["trainable_params"] == rec_params(tmp_path)
    assert 0 < adapted["trainable_params"] < full["trainable_params"]
    # full: weights and two AdamW moments of each; LoRA: the weights, and moments of the adapters only
    assert adapted["state_mb"] < 0.5 * full["state_mb"]
    assert "| loglinear | 1 | 4 |" in (tmp_path / "out" / "step.md").read_text()
    # peak memory of two steps in a fresh process each: torch itself is a few hundred MB
    assert full["peak_rss_mb"] > 100 and adapted["peak_rss_mb"] > 100


def rec_params(tmp_path) -> int:
    return json.loads((tmp_path / "out" / "step.json").read_text())["params"]


@pytest.mark.parametrize("bad, named", [(["--methods", "recompute,loglinaer"], "loglinaer"),
                                        (["--device", "gpu"], "use auto, cpu, cuda or cuda:N"),
                                        (["--device", "cuda", "--memory"], "leave it out with --device cuda")])
def test_bench_step_refuses_bad_arguments_in_one_line(tmp_path, bad, named):
    res = a3po("bench", "step", *bad, cwd=tmp_path)
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and named in res.stderr, res.stderr


NO_CUDA = [("--device", "cuda", ConfigError, "--device=cuda, but this torch")] if not torch.cuda.is_available() else []


@pytest.mark.parametrize("field, value, error, named", [("model", "tiny-100x2", ModelSourceError, "multiple of 64"),
                                                        *NO_CUDA])
def test_bench_step_refuses_a_model_or_device_that_is_not_there_before_its_folder(tmp_path, field, value, error,
                                                                                   named):
    # in this process (a subprocess would spend seconds importing torch); the CLI's part, the one line and exit
    # code 2 for each error type, is pinned in test_exits.py
    from a3po.bench import step

    args = StepBenchArgs(**{field.lstrip("-"): value}, out=str(tmp_path / "out")).checked()
    with pytest.raises(error, match=named):
        step.run(args)
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------- bench e2e


@pytest.fixture(scope="module")
def e2e_run(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("e2e")
    res = a3po("bench", "e2e", *TINY_E2E, cwd=cwd)
    assert res.returncode == 0, res.stderr[-3000:]
    out = cwd / "runs" / "bench-e2e"
    return res, out, json.loads((out / "results.json").read_text())


@pytest.mark.slow
def test_bench_e2e_every_arm_trains_with_the_same_seeds_and_steps(e2e_run):
    _, out, rec = e2e_run
    runs = {r["arm"]: r for r in rec["runs"]}
    assert list(runs) == ["sync", "recompute", "loglinear", "linear", "reuse", "metrics"]
    for arm, r in runs.items():
        assert r["ok"] and r["steps"] == 3 and r["seed"] == 1, arm
        assert len(r["curves"]["reward"]) == 3 and r["curves"]["step"] == [1, 2, 3]
        assert r["train_wall_s"] > 0 and r["train_s_per_step"] > 0
        assert 0 <= r["eval_initial"] <= 1 and 0 <= r["eval_final"] <= 1
        assert r["ratio_max"] > 0 and r["clipped_tokens_per_step"] >= 0 and 0 <= r["capped_frac"] <= 1
        assert not (Path(r["run_dir"]) / "checkpoints").exists()  # dropped unless --keep-checkpoints
    # synchronous and coupled vs asynchronous within eta = 2
    assert runs["sync"]["stale_max"] == 0 and runs["sync"]["capped_frac"] == 0
    assert all(runs[a]["stale_max"] <= 2 for a in runs)
    # only the recomputing arms pay a forward pass for the proximal log-probs
    assert runs["recompute"]["prox_s_per_step"] > 0 and runs["metrics"]["prox_s_per_step"] > 0
    assert all(runs[a]["prox_s_per_step"] == 0 for a in ("sync", "loglinear", "linear", "reuse"))
    # the arms' configurations differ only in the keys each arm names
    cfgs = rec["configs"]
    base = cfgs["loglinear-seed1"]
    assert cfgs["linear-seed1"]["actor"] == {**base["actor"], "prox_logp_method": "linear"}
    assert cfgs["sync-seed1"]["rollout"] == {**base["rollout"], "max_head_offpolicyness": 0}
    assert cfgs["sync-seed1"]["actor"]["use_decoupled_loss"] is False
    assert all(c["train_dataset"] == base["train_dataset"] and c["seed"] == 1 and c["total_train_steps"] == 3
               for c in cfgs.values())


@pytest.mark.slow
def test_bench_e2e_writes_tables_json_and_plots(e2e_run):
    res, out, rec = e2e_run
    table = {row["arm"]: row for row in rec["table"]}
    assert set(table) == {"sync", "recompute", "loglinear", "linear", "reuse", "metrics"}
    assert table["sync"]["speedup_vs_sync"] == pytest.approx(1.0)
    assert table["recompute"]["speedup_vs_recompute"] == pytest.approx(1.0)
    assert table["loglinear"]["train_wall_s"]["n"] == 1
    # the approximation-quality table comes from the metrics run, grouped by staleness
    approx = {row["staleness"]: row for row in rec["approx"]}
    assert "all" in approx and "d0" in approx
    assert approx["all"]["tokens"] == sum(row["tokens"] for d, row in approx.items() if d != "all") > 0
    assert approx["d0"]["loglinear/abs"] < 1e-3  # d = 0: behaviour = proximal policy up to rounding
    for name in ("reward_vs_step.png", "reward_vs_time.png", "clipped_tokens_per_step.png", "ratio_max_per_step.png"):
        data = (out / "plots" / name).read_bytes()
        assert data[:8] == PNG and len(data) > 5000, name
    md = (out / "results.md").read_text()
    assert md == res.stdout.split("written:")[0].rstrip("\n") + "\n"
    assert "| loglinear |" in md and "## Proximal approximation quality" in md and "](plots/reward_vs_time.png)" in md
    assert "Command: `a3po bench e2e --preset tiny" in md


@pytest.mark.slow
def test_bench_e2e_with_seeds_continues_where_it_stopped(e2e_run, tmp_path):
    """Continues a copy of the fixture's benchmark: one run lost, a second seed asked for."""
    _, out, first = e2e_run
    b = tmp_path / "b"
    shutil.copytree(out, b)
    cwd = out.parent.parent  # where the fixture ran: its runs' folders are recorded relative to it
    lost = [r for r in first["runs"] if r["arm"] != "sync"]
    (b / "results.json").write_text(json.dumps({**first, "runs": lost}))
    args = ["bench", "e2e", *TINY_E2E, "--arms", "sync,loglinear", "--out", str(b), "--seeds", "2"]
    res = a3po(*args, cwd=cwd)
    assert res.returncode == 0, res.stderr[-3000:]
    # the lost run is rerun, the new seed runs, and what the other arms measured is kept as it was
    assert "4 runs" in res.stderr and "1 already done; 4 more kept from earlier invocations" in res.stderr
    rec = json.loads((b / "results.json").read_text())
    assert sorted((r["arm"], r["seed"]) for r in rec["runs"]) == sorted(
        [(r["arm"], 1) for r in first["runs"]] + [("sync", 2), ("loglinear", 2)])
    assert [r for r in rec["runs"] if r["arm"] != "sync" and r["seed"] == 1] == lost
    row = {r["arm"]: r for r in rec["table"]}["loglinear"]
    assert row["seeds"] == [1, 2] and row["train_wall_s"]["n"] == 2
    assert row["train_wall_s"]["min"] <= row["train_wall_s"]["mean"] <= row["train_wall_s"]["max"]
    assert " (" in (b / "results.md").read_text()  # cells show mean (min..max)
    # fewer seeds: nothing to run, and the other seed's runs are kept (a study grows over invocations)
    res = a3po(*args[:-2], "--seeds", "1", cwd=cwd)
    assert res.returncode == 0 and "2 already done; 6 more kept from earlier invocations" in res.stderr, res.stderr
    assert {r["arm"]: r for r in json.loads((b / "results.json").read_text())["table"]}["sync"]["seeds"] == [1, 2]
    # a different configuration in the same folder is refused (overrides after options are fine)
    res = a3po(*args, "actor.optimizer.lr=0.1", cwd=cwd)
    assert res.returncode == 2 and "different configuration" in res.stderr, res.stderr
    # the other arms against the first, paired by seed; the page regenerates from results.json alone
    md = (b / "results.md").read_text()
    assert "## Against sync, paired by seed" in md and "| loglinear | 2 |" in md
    (b / "results.md").unlink()
    res = subprocess.run([sys.executable, "-m", "a3po.bench.e2e", str(b)], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0 and (b / "results.md").read_text() == md, res.stderr[-2000:]


def test_against_first_arm_pairs_each_seeds_problems():
    from a3po.bench.report import against_first_arm

    runs = [{"ok": True, "arm": arm, "seed": seed, "held_out_final": solved} for arm, seed, solved in (
        ("full", 1, [1, 0, 0, 0]), ("lora", 1, [1, 1, 0, 0]), ("full", 2, [0, 0, 0, 0]), ("lora", 2, [1, 1, 1, 0]),
        ("lora", 3, [1, 1, 1, 1]))]  # seed 3 has no pair
    lines = against_first_arm(runs, ["full", "lora"])
    assert lines[1] == "## Against full, paired by seed"
    assert lines[-1].startswith("| lora | 2 | +0.250, +0.750 | +0.500 | [")
    assert against_first_arm(runs[:2], ["full", "lora"]) == []  # one seed: no table


def test_bench_e2e_refuses_a_config_one_arm_cannot_take_before_running(tmp_path):
    # a behaviour-weight cap is meaningless for the coupled loss of the sync arm
    res = a3po("bench", "e2e", *TINY_E2E, "actor.behav_imp_weight_cap=3", cwd=tmp_path)
    assert res.returncode == 2, res.stderr[-2000:]
    assert res.stderr.count("\n") == 1 and "arm 'sync'" in res.stderr
    assert not (tmp_path / "runs").exists()


# ----------------------------------------------------------------------------- table arithmetic


def _run(arm, wall, seed=1, **extra):
    return {"arm": arm, "seed": seed, "ok": True, "train_wall_s": wall, "prox_s_per_step": 0.0, "train_s_per_step": 1.0,
            "rollout_wait_s_per_step": 0.0, "reward_final": 0.5, "eval_initial": 0.3, "eval_final": 0.6,
            "ratio_max": 1.1, "clipped_tokens_per_step": 2.0, "capped_frac": 0.0, **extra}


def test_aggregate_means_over_seeds_and_speedups_from_mean_wall_time():
    runs = [_run("sync", 100.0), _run("sync", 120.0, seed=2), _run("recompute", 80.0), _run("loglinear", 50.0),
            _run("loglinear", 60.0, seed=2), {"arm": "linear", "seed": 1, "ok": False}]
    rows = {r["arm"]: r for r in aggregate(runs)}
    assert set(rows) == {"sync", "recompute", "loglinear"}  # failed runs have no row
    assert rows["sync"]["train_wall_s"] == {"mean": 110.0, "min": 100.0, "max": 120.0,
                                           "std": pytest.approx(14.142, abs=1e-3), "n": 2}
    assert rows["loglinear"]["speedup_vs_sync"] == pytest.approx(2.0)
    assert rows["loglinear"]["speedup_vs_recompute"] == pytest.approx(80 / 55)


def test_approx_quality_pools_steps_by_token_count():
    step = lambda n0, n2, e0, e2: {"prox_err/tokens/d0": n0, "prox_err/tokens/d2": n2,
                                   "prox_err/loglinear/abs/d0": e0, "prox_err/loglinear/abs/d2": e2}
    runs = [{"prox_err_steps": [step(10, 30, 0.0, 0.2), step(30, 10, 0.0, 0.6)]}]
    rows = {r["staleness"]: r for r in approx_quality(runs)}
    assert [r["staleness"] for r in approx_quality(runs)] == ["d0", "d2", "all"]
    assert rows["d2"]["tokens"] == 40 and rows["d2"]["loglinear/abs"] == pytest.approx((30 * 0.2 + 10 * 0.6) / 40)
    assert rows["all"]["tokens"] == 80 and rows["all"]["loglinear/abs"] == pytest.approx(12 / 80)
    assert math.isnan(rows["all"]["linear/abs"])  # never logged: shown as missing, not as zero
    assert approx_quality([{"prox_err_steps": None}]) == []


def test_summarize_run_reads_steps_evaluations_and_clipped_token_counts():
    def step(k, reward):
        return {"step": k, "stale/max": 1.0, "stale/mean": 0.5, "perf/step_s": 2.0, "perf/prox_logp_s": 0.0,
                "perf/train_s": 1.5, "perf/rollout_wait_s": 0.1, "rollout/reward_mean": reward,
                "loss/ratio_max": 1.0 + k / 10, "loss/clipped_frac": 0.25, "train/n_tokens": 40.0,
                "loss/behav_capped_frac": 0.0}
    rows = ([{"step": 0, "eval/accuracy": 0.25}] + [step(k, k / 10) for k in range(1, 7)]
            + [{"step": 6, "eval/accuracy": 0.5}])
    rows[-2]["eval/accuracy"] = 0.5
    s = summarize_run(rows[:-1])
    assert s["steps"] == 6 and s["train_wall_s"] == 12.0 and s["curves"]["time_s"] == [2, 4, 6, 8, 10, 12]
    assert s["reward_final"] == pytest.approx((0.3 + 0.4 + 0.5 + 0.6) / 4)  # last 4 steps
    assert (s["eval_initial"], s["eval_final"]) == (0.25, 0.5)
    assert s["clipped_tokens_per_step"] == 10.0 and s["ratio_max"] == pytest.approx(1.6)
    assert "prox_err_steps" not in s
    # a run that stopped early has no final accuracy
    assert math.isnan(summarize_run(rows[:4])["eval_final"])


def test_trailing_mean_smooths_reward_curves():
    from a3po.bench.report import trailing_mean

    assert trailing_mean([0.0, 1.0, 0.0, 1.0, 1.0], 2) == [0.0, 0.5, 0.5, 0.5, 1.0]
    assert trailing_mean([3.0, 1.0], 1) == [3.0, 1.0]


def test_model_flops_count_every_linear_weight_once_per_token():
    from a3po.bench.flops import generation_flops, linear_weights
    from a3po.models import load_policy

    model, tok = load_policy("tiny-128x4")
    cfg = model.config
    d, kv = cfg.hidden_size, cfg.num_key_value_heads * cfg.head_dim
    per_layer = d * d * 2 + d * kv * 2 + 3 * d * cfg.intermediate_size  # q, o; k, v; gate, up, down
    assert linear_weights(model) == (cfg.num_hidden_layers * per_layer, len(tok) * d)
    # two prompts of 5 and 7 tokens, 3 new tokens each: 5 + 2 and 7 + 2 tokens through the body, 6 through the head
    assert generation_flops(model, [5, 7], 3) == 2 * (cfg.num_hidden_layers * per_layer * 16 + len(tok) * d * 6)


def test_the_machines_matmul_rate_takes_a_smaller_square_only_where_the_full_one_would_take_too_long(monkeypatch):
    from a3po.bench import flops

    cpu = torch.device("cpu")
    assert flops._affordable_size(torch.float32, 2048, cpu) in (1024, 2048)  # fp32 runs at full speed everywhere
    assert flops._affordable_size(torch.float32, 128, cpu) == 128  # a square at or under the probe's is kept
    monkeypatch.setattr(flops, "MAX_CALL_S", 1e-9)  # as if every square were too slow: the probe's own size
    assert flops._affordable_size(torch.float32, 2048, cpu) == flops.PROBE_SIZE
    assert flops.matmul_rate(torch.float32, repeats=1) > 0


def test_shape_rate_times_each_linear_shape_of_the_model_once():
    from a3po.bench.flops import linear_shapes, shape_rate
    from a3po.models import load_policy

    model, tok = load_policy("tiny-128x4")
    cfg = model.config
    d, kv, i, n = cfg.hidden_size, cfg.num_key_value_heads * cfg.head_dim, cfg.intermediate_size, cfg.num_hidden_layers
    body, head = linear_shapes(model)
    expected = {(d, d): 2 * n, (kv, d): 2 * n, (i, d): 2 * n, (d, i): n}  # q, o; k, v; gate, up; down
    if kv == d:
        expected = {(d, d): 4 * n, (i, d): 2 * n, (d, i): n}
    assert body == expected and head == (len(tok), d)
    for backward in (False, True):
        rate = shape_rate(model, rows=16, head_rows=8, dtype=torch.float32, backward=backward, repeats=1)
        assert 0 < rate < math.inf


@pytest.mark.slow
def test_bench_e2e_service_arm_trains_on_the_same_reward_through_a_slow_service_and_continues(e2e_run, tmp_path):
    """Adds the service arm to a copy of the fixture's benchmark: its loglinear run is the rule-reward twin."""
    _, out, _ = e2e_run
    b = tmp_path / "b"
    shutil.copytree(out, b)
    args = ["bench", "e2e", *TINY_E2E, "--arms", "loglinear,service", "--service-delay-s", "0.3", "--out", str(b)]
    res = a3po(*args, cwd=out.parent.parent)  # where the fixture ran, as in the test above
    assert res.returncode == 0, res.stderr[-3000:]
    assert "1 already done" in res.stderr
    rec = json.loads((b / "results.json").read_text())
    runs = {r["arm"]: r for r in rec["runs"]}
    service, rule = rec["configs"]["service-seed1"], rec["configs"]["loglinear-seed1"]
    assert service["reward_service"]["kind"] == "scorer" and service["reward_service"]["rule_weight"] == 0
    assert {**service, "reward_service": rule["reward_service"]} == rule  # nothing else differs
    assert runs["service"]["service_s_per_group"] >= 0.3 and runs["loglinear"]["service_s_per_group"] is None
    assert 0 <= runs["service"]["idle_frac"] <= 1 and "reward service (s/group)" in (b / "results.md").read_text()
    again = a3po(*args, cwd=out.parent.parent)  # the stub listens on a new port: still the same runs, none reruns
    assert again.returncode == 0 and "2 already done" in again.stderr, again.stderr[-2000:]


def test_paired_records_pair_by_seed_and_refuse_what_cannot_pair():
    """The committed evaluations of the base model (docs/results/yardstick-base) against themselves and each other."""
    from a3po.bench.paired import RecordError, compare, markdown, read_record

    base = Path(__file__).parent.parent / "docs" / "results" / "yardstick-base"
    recs = [read_record(base / f"seed{s}.json") for s in (1, 2, 3)]
    same = compare(recs, recs)
    assert same["n"] == 3 and same["values"] == [0.0, 0.0, 0.0] and not same["measurable"]
    part = compare(recs, recs[::2])
    assert [r["seed"] for r in part["rows"]] == [1, 3] and part["unpaired"] == [2]
    assert "Seeds without a pair, left out: 2." in markdown(part, ("a", "b"), recs, recs[::2])
    with pytest.raises(RecordError, match="two records of seed 1"):
        compare([recs[0], recs[0]], recs)
    with pytest.raises(RecordError, match="no seed in both sets"):
        compare(recs[:1], recs[1:])
    other_task = [{**r, "task_params": {**r["task_params"], "max_digits": 1}} for r in recs]
    with pytest.raises(RecordError, match="differ in task_params"):
        compare(recs, other_task)


def test_the_lockstep_arm_is_loglinear_with_only_lockstep_on():
    from a3po.bench.args import E2EArgs
    from a3po.bench.e2e import arm_configs
    from a3po.config import to_dict

    args = E2EArgs(preset="tiny", arms=["loglinear", "lockstep"], seeds=2).checked()
    planned = {p.key: to_dict(p.cfg) for p in arm_configs(args)}
    assert sorted(planned) == ["lockstep-seed1", "lockstep-seed2", "loglinear-seed1", "loglinear-seed2"]
    for seed in (1, 2):
        lock, free = planned[f"lockstep-seed{seed}"], planned[f"loglinear-seed{seed}"]
        assert lock["rollout"]["lockstep"] is True and free["rollout"]["lockstep"] is False
        assert {**lock, "rollout": free["rollout"]} == free

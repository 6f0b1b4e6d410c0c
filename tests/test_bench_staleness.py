"""`a3po bench staleness`: the fast CI variant on the tiny model, run as a user runs it (a real
subprocess making real training runs), and the table arithmetic on hand-made run summaries.

    PYTHONPATH=$PWD/src pytest tests/test_bench_staleness.py          # ~2 min on 2 cores
    PYTHONPATH=$PWD/src pytest tests/test_bench_staleness.py -m "not slow"   # arithmetic only, seconds

Proves: every planned cell trained the requested steps with the keys its arm, eta and
minibatch count name, and never consumed data staler than its eta; the outputs (markdown,
JSON, plots, per-run folders) have the documented structure and the JSON summary is the
last line of stdout; a finished benchmark is continued without rerunning anything, and a run
interrupted after a checkpoint resumes from it (lockstep: as if it had not stopped); a cell
the configuration refuses stops everything before any run. The arithmetic: the staleness
distribution pooled by tokens, steady state, the skip rules, one approximation-error row
for every d, means and spreads over seeds, the plotted lines.
"""

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from procs import a3po

from a3po.bench.args import StalenessArgs
from a3po.bench.staleness import (
    REASON_ETA0,
    Cell,
    aggregate,
    approx_tables,
    every_d_rows,
    grid,
    plan,
    reason_single_step,
    stale_distribution,
    steady_steps,
    summarize,
    token_weighted_mean,
)
from a3po.bench.staleness_report import lines_by_eta, markdown, plot
from a3po.config import ConfigError, load_config
from a3po.machine import code_commit

PNG = b"\x89PNG\r\n\x1a\n"
TINY = ["--preset", "tiny", "total_train_steps=4", "gconfig.max_new_tokens=8", "logging.tensorboard=false",
        "train_dataset.size=200"]
GRID = ["--etas", "0,2", "--minibatches", "1", "--out", "b"]
KEYS = ["coupled-eta0-mb1-seed1", "coupled-eta2-mb1-seed1", "recompute-eta2-mb1-seed1", "loglinear-eta2-mb1-seed1",
        "reuse-eta2-mb1-seed1"]


# ----------------------------------------------------------------------------- the fast CI variant


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("staleness")
    res = a3po("bench", "staleness", *TINY, *GRID, cwd=cwd)
    assert res.returncode == 0, res.stderr[-3000:]
    out = cwd / "b"
    return res, cwd, out, json.loads((out / "results.json").read_text())


def _metrics(run: dict, cwd: Path) -> list[dict]:
    path = cwd / run["run_dir"] / "metrics.jsonl"  # relative to where the benchmark ran, like --out
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.slow
def test_every_cell_trains_its_steps_within_its_eta(bench):
    _, cwd, _, rec = bench
    runs = {r["key"]: r for r in rec["runs"]}
    assert list(runs) == KEYS  # eta 0: the coupled baseline only; then the arms alternate
    for key, r in runs.items():
        assert r["ok"] and r["steps"] == 4, key
        steps = [m for m in _metrics(r, cwd) if "stale/max" in m]
        assert [m["step"] for m in steps] == [1, 2, 3, 4], key
        assert max(m["stale/max"] for m in steps) <= r["eta"] and r["stale_max"] <= r["eta"], key
        assert 0 <= r["eval_initial"] <= 1 and 0 <= r["eval_final"] <= 1 and r["train_wall_s"] > 0
        assert 0 <= r["clipped_frac"] <= 1 and r["step_s"] > 0
        assert not (cwd / r["run_dir"] / "checkpoints").exists()
        assert r["code_commit"] == code_commit(), key  # the code each run was made from, for a study's provenance
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True, text=True,
                          timeout=30)
    if head.returncode == 0:  # a checkout (CI's clean clone is one): the commit is its HEAD
        assert code_commit().removesuffix("+changes") == head.stdout.strip()
    assert runs["coupled-eta0-mb1-seed1"]["stale_max"] == 0
    cfgs = rec["configs"]
    assert cfgs["coupled-eta0-mb1-seed1"]["actor"]["use_decoupled_loss"] is False
    assert cfgs["coupled-eta0-mb1-seed1"]["rollout"]["max_head_offpolicyness"] == 0
    assert cfgs["recompute-eta2-mb1-seed1"]["actor"]["prox_logp_method"] == "metrics"
    assert cfgs["loglinear-eta2-mb1-seed1"]["actor"]["prox_logp_method"] == "loglinear"
    assert cfgs["reuse-eta2-mb1-seed1"]["actor"]["prox_logp_method"] == "reuse"
    assert all(c["rollout"]["max_head_offpolicyness"] == 2 for k, c in cfgs.items() if "-eta2-" in k)
    assert all(c["total_train_steps"] == 4 and c["evaluator"]["freq_steps"] == 4 and c["seed"] == 1
               for c in cfgs.values())


@pytest.mark.slow
def test_max_staleness_reaches_eta_with_the_deep_pipeline(bench):
    # only a pipeline that keeps eta batches in flight while the trainer trains reaches the bound
    _, _, _, rec = bench
    runs = [r for r in rec["runs"] if r["eta"] > 0]
    assert runs
    for r in runs:
        assert r["stale_max"] == r["eta"], r["key"]
        assert len(r["stale_dist"]) == r["eta"] + 1 and sum(r["stale_dist"]) == pytest.approx(1.0)


@pytest.mark.slow
def test_writes_tables_json_plots_and_a_json_last_line(bench):
    res, _, out, rec = bench
    for key in ("benchmark", "command", "args", "configs", "runs", "table", "approx", "skipped", "plots", "wall_s",
                "cpu_model", "avx512_bf16", "cpu_count", "torch"):
        assert key in rec, key
    assert rec["benchmark"] == "staleness" and rec["args"]["etas"] == [0, 2]
    table = {row["cell"]: row for row in rec["table"]}
    assert list(table) == [k.removesuffix("-seed1") for k in KEYS]
    assert table["loglinear-eta2-mb1"]["eval_final"]["n"] == 1 and table["loglinear-eta2-mb1"]["seeds"] == [1]
    assert {s["cell"] for s in rec["skipped"]} == {"recompute-eta0-mb1", "loglinear-eta0-mb1", "reuse-eta0-mb1"}
    # the approximation errors of the recompute (metrics) cell: a row for every d = 0..eta
    (approx,) = rec["approx"]
    assert approx["cell"] == "recompute-eta2-mb1"
    assert [row["staleness"] for row in approx["rows"]] == ["d0", "d1", "d2", "all"]
    assert approx["rows"][-1]["tokens"] == sum(row["tokens"] for row in approx["rows"][:-1]) > 0
    # every arm paired with recompute on the same seed and held-out problems
    assert [(r["arm"], r["n"]) for r in rec["paired"]] == [("coupled", 1), ("loglinear", 1), ("reuse", 1)]
    runs = {r["key"]: r for r in rec["runs"]}
    final = {arm: runs[f"{arm}-eta2-mb1-seed1"]["held_out_final"] for arm in ("loglinear", "recompute")}
    assert len(final["loglinear"]) == 16 and set(final["loglinear"]) <= {0.0, 1.0}
    assert rec["paired"][1]["mean"] == pytest.approx(sum(final["loglinear"]) / 16 - sum(final["recompute"]) / 16)
    for sub in ("configs", "logs"):
        assert sorted(p.name for p in (out / sub).iterdir()) == sorted(f"{k}.{'yaml' if sub == 'configs' else 'log'}"
                                                                       for k in KEYS)
    assert sorted(p.name for p in (out / "runs").iterdir()) == sorted(KEYS)
    assert rec["plots"][:2] == ["accuracy_vs_eta.png", "clipped_frac_vs_eta.png"]
    for name in rec["plots"]:
        data = (out / "plots" / name).read_bytes()
        assert data[:8] == PNG and len(data) > 5000, name
    md = (out / "results.md").read_text()
    for part in ("# a3po bench staleness", "Command: `a3po bench staleness --preset tiny", "## Training",
                 "## Consumed staleness", "## Proximal approximation error",
                 "## Against recompute (and variants against their arm), paired by seed",
                 "## Where the clip and the cap act, by staleness", "### eta = 2, 1 minibatch",
                 "| loglinear | 2 | 1 |", "prox_logp_method=metrics", "](plots/accuracy_vs_eta.png)", "torch "):
        assert part in md, part
    *printed, last = res.stdout.rstrip("\n").split("\n")
    assert "\n".join(printed).rstrip("\n") + "\n" == md
    summary = json.loads(last)
    assert summary["benchmark"] == "staleness" and summary["out"] == "b" and summary["failed"] == []
    assert list(summary["cells"]) == list(table)
    assert summary["cells"]["coupled-eta0-mb1"]["stale_max"] == 0 and summary["cells"]["reuse-eta2-mb1"]["eta"] == 2


@pytest.mark.slow
def test_a_finished_benchmark_is_continued_without_running_again(bench):
    _, cwd, out, rec = bench
    res = a3po("bench", "staleness", *TINY, *GRID, cwd=cwd)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "5 already done" in res.stderr and "[1/5]" not in res.stderr
    again = json.loads((out / "results.json").read_text())
    assert again["runs"] == rec["runs"] and again["wall_s"] >= rec["wall_s"]


@pytest.mark.slow
def test_a_continuation_asking_for_part_of_a_study_keeps_the_rest(bench, tmp_path):
    _, cwd, out, rec = bench
    part = tmp_path / "part"
    part.mkdir()
    earlier = dict(json.loads((out / "results.json").read_text()), cpu_model="An Earlier CPU")  # made elsewhere
    earlier.pop("machines", None)  # a record from before any continuation names one machine
    (part / "results.json").write_text(json.dumps(earlier))
    res = a3po("bench", "staleness", *TINY, "--etas", "2", "--minibatches", "1", "--arms", "loglinear",
               "--out", str(part), cwd=cwd)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "1 already done" in res.stderr
    again = json.loads((part / "results.json").read_text())
    assert again["runs"] == rec["runs"]  # nothing ran, nothing was dropped
    assert len(again["commands"]) == 2 and again["commands"][1].endswith(f"--out {part}")
    md = (part / "results.md").read_text()
    assert "Commands (each continued the same folder):" in md and "arms coupled, recompute, loglinear, reuse" in md
    # the folder names both machines, the earlier first, not only the one that continued it
    assert [m["cpu_model"] for m in again["machines"]] == ["An Earlier CPU", rec["cpu_model"]]
    assert "Machines (its invocations ran on 2, in this order): An Earlier CPU (" in md and rec["cpu_model"] in md


@pytest.mark.slow
def test_an_interrupted_run_continues_from_its_checkpoint_as_if_it_had_not_stopped(tmp_path):
    args = ["bench", "staleness", *TINY, "--etas", "2", "--minibatches", "1", "--arms", "loglinear", "--out", "b",
            "--eval-every", "2", "--keep-checkpoints", "rollout.lockstep=true", "saver.freq_steps=2",
            "saver.keep_last=2"]
    res = a3po(*args, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    out = tmp_path / "b"
    run = out / "runs" / "loglinear-eta2-mb1-seed1"
    whole = {name: (run / name).read_text() for name in ("held_out.jsonl", "metrics.jsonl")}
    first = json.loads((out / "results.json").read_text())["runs"][0]
    # as if the benchmark had been stopped during step 4, after its evaluation: not in results.json, metrics up to
    # step 3, held-out records up to step 4, the newest checkpoint step 2's
    (out / "results.json").write_text(json.dumps({**json.loads((out / "results.json").read_text()), "runs": []}))
    rows = whole["metrics.jsonl"].splitlines(keepends=True)
    (run / "metrics.jsonl").write_text("".join(r for r in rows if json.loads(r)["step"] <= 3))
    shutil.rmtree(run / "checkpoints" / "step_000004")
    (run / "checkpoints" / "latest").write_text("step_000002")
    res = a3po(*args, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "resuming" in (out / "logs" / "loglinear-eta2-mb1-seed1.log").read_text()
    again = json.loads((out / "results.json").read_text())["runs"][0]
    assert again["resumed_from_step"] == 2 and "resumed_from_step" not in first
    # lockstep: the same held-out results at every evaluation, each once, and the same training, bit for bit
    assert (run / "held_out.jsonl").read_text() == whole["held_out.jsonl"]
    trained = lambda text: [{k: v for k, v in json.loads(r).items() if k.startswith(("loss/", "rollout/reward"))}
                            for r in text.splitlines()]
    assert trained((run / "metrics.jsonl").read_text()) == trained(whole["metrics.jsonl"])
    assert {k: again[k] for k in ("eval_initial", "eval_final", "held_out_final")} == \
        {k: first[k] for k in ("eval_initial", "eval_final", "held_out_final")}
    # a configuration that differs from the interrupted attempt's starts afresh (refused once it is finished)
    shutil.rmtree(run / "checkpoints" / "step_000004")
    (run / "checkpoints" / "latest").write_text("step_000002")
    (out / "results.json").write_text(json.dumps({**json.loads((out / "results.json").read_text()), "runs": []}))
    res = a3po(*args, "actor.optimizer.lr=1e-4", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "resuming" not in (out / "logs" / "loglinear-eta2-mb1-seed1.log").read_text()
    assert "resumed_from_step" not in json.loads((out / "results.json").read_text())["runs"][0]


def test_a_cell_the_configuration_refuses_stops_everything_before_running(tmp_path):
    # a behaviour-weight cap means nothing to the coupled loss: the baseline cell refuses it
    res = a3po("bench", "staleness", *TINY, "actor.behav_imp_weight_cap=3", "--etas", "0,2", cwd=tmp_path)
    assert res.returncode == 2, res.stderr[-2000:]
    assert res.stderr.count("\n") == 1 and "cell 'coupled-eta0-mb1'" in res.stderr
    assert not (tmp_path / "runs").exists()
    res = a3po("bench", "staleness", *TINY, "--etas", "2", "--minibatches", "0", cwd=tmp_path)
    assert res.returncode == 2 and "--minibatches: 0 must be at least 1" in res.stderr


# ----------------------------------------------------------------------------- the skip rules


def test_grid_runs_the_coupled_baseline_at_eta0_and_reuse_at_one_minibatch_only():
    cells, skipped = grid(StalenessArgs(etas=[0, 4], minibatches=[1, 4]).checked())
    assert [c.key for c in cells] == [
        "coupled-eta0-mb1", "coupled-eta0-mb4",
        "coupled-eta4-mb1", "recompute-eta4-mb1", "loglinear-eta4-mb1", "reuse-eta4-mb1",
        "coupled-eta4-mb4", "recompute-eta4-mb4", "loglinear-eta4-mb4"]
    reasons = {s.cell.key: s.reason for s in skipped}
    assert reasons == {**{f"{a}-eta0-mb{m}": REASON_ETA0 for a in ("recompute", "loglinear", "reuse") for m in (1, 4)},
                       "reuse-eta4-mb4": reason_single_step("reuse")}
    # the baseline runs even when --arms leaves coupled out; --all-arms-at-eta0 runs every arm there
    cells, _ = grid(StalenessArgs(etas=[0, 2], minibatches=[1], arms=["loglinear"]).checked())
    assert [c.key for c in cells] == ["coupled-eta0-mb1", "loglinear-eta2-mb1"]
    cells, skipped = grid(StalenessArgs(etas=[0], minibatches=[4], arms=["loglinear", "reuse"],
                                        all_arms_at_eta0=True).checked())
    assert [c.key for c in cells] == ["coupled-eta0-mb4", "loglinear-eta0-mb4"]
    assert [(s.cell.key, s.reason) for s in skipped] == [("reuse-eta0-mb4", reason_single_step("reuse"))]


def test_plan_orders_seeds_outermost_and_names_a_refused_cell():
    args = StalenessArgs(preset="tiny", etas=[2, 0], minibatches=[1], arms=["loglinear", "coupled"], seeds=2).checked()
    runs, _ = plan(args)
    assert [p.key for p in runs] == ["coupled-eta0-mb1-seed1", "loglinear-eta2-mb1-seed1", "coupled-eta2-mb1-seed1",
                                     "coupled-eta0-mb1-seed2", "loglinear-eta2-mb1-seed2", "coupled-eta2-mb1-seed2"]
    p = runs[4]
    assert p.fields == {"arm": "loglinear", "eta": 2, "minibatches": 1, "seed": 2}
    assert (p.cfg.seed, p.cfg.rollout.max_head_offpolicyness, p.cfg.actor.prox_logp_method) == (2, 2, "loglinear")
    assert p.cfg.evaluator.freq_steps == p.cfg.total_train_steps  # the preset's 3 gives way: start and end only
    every = plan(StalenessArgs(preset="tiny", etas=[2], arms=["loglinear"], eval_every=2).checked())[0]
    assert {r.cfg.evaluator.freq_steps for r in every} == {2}
    with pytest.raises(ConfigError, match="cell 'coupled-eta0-mb1'"):
        plan(StalenessArgs(preset="tiny", overrides=["actor.m2_threshold=1.0"], etas=[0]).checked())
    with pytest.raises(ConfigError, match="nothing to run"):
        plan(StalenessArgs(preset="tiny", etas=[2], minibatches=[4], arms=["reuse"]).checked())


def test_args_are_sorted_deduplicated_and_refused_in_one_line():
    a = StalenessArgs(etas=[4, 0, 4], minibatches=[4, 1], arms=["reuse", "coupled", "reuse"]).checked()
    assert (a.etas, a.minibatches, a.arms) == ([0, 4], [1, 4], ["reuse", "coupled"])
    for bad, msg in (({"etas": [-1]}, "--etas: -1"), ({"arms": ["linear"]}, "unknown arm 'linear'"),
                     ({"seeds": 0}, "--seeds 0"), ({"minibatches": []}, "--minibatches needs")):
        with pytest.raises(ConfigError, match=msg):
            StalenessArgs(**bad).checked()


# ----------------------------------------------------------------------------- one run's numbers


def _step(k, n_tokens=100.0, **extra):
    return {"step": k, "stale/max": 1.0, "stale/mean": 0.5, "train/n_tokens": n_tokens, "perf/step_s": 2.0,
            "perf/prox_logp_s": 0.0, "perf/train_s": 1.0, "perf/rollout_wait_s": 0.1, "rollout/reward_mean": 0.5,
            "loss/ratio_max": 1.1, "loss/clipped_frac": 0.1, "loss/behav_capped_frac": 0.0, **extra}


def test_stale_distribution_pools_steps_by_tokens():
    steps = [_step(1, 100.0, **{"stale/frac_d0": 1.0, "stale/frac_d1": 0.0, "stale/frac_d2": 0.0}),
             _step(2, 300.0, **{"stale/frac_d0": 0.2, "stale/frac_d1": 0.5, "stale/frac_d2": 0.3})]
    assert stale_distribution(steps, 2) == pytest.approx([(100 + 60) / 400, 150 / 400, 90 / 400])
    # a step that logged only some d counts 0 for the others; eta beyond the logged d gives 0 shares
    assert stale_distribution([_step(1, 10.0, **{"stale/frac_d0": 1.0})], 2) == [1.0, 0.0, 0.0]
    # a share beyond eta (a broken bound) is kept so that it shows
    assert stale_distribution([_step(1, **{"stale/frac_d0": 0.5, "stale/frac_d3": 0.5})], 1) == [0.5, 0.0, 0.0, 0.5]
    assert stale_distribution([_step(1), _step(2)], 2) is None  # not logged: not available


def test_steady_state_is_after_the_first_eta_plus_two_steps_and_token_weighted():
    steps = [_step(k, n, **{"stale/mean": m}) for k, n, m in ((1, 100.0, 0.0), (2, 100.0, 1.0), (3, 100.0, 2.0),
                                                           (4, 100.0, 2.0), (5, 300.0, 2.0), (6, 100.0, 1.0))]
    assert [r["step"] for r in steady_steps(steps, 2)] == [5, 6]
    assert token_weighted_mean(steady_steps(steps, 2), "stale/mean") == pytest.approx((600 + 100) / 400)
    assert token_weighted_mean(steps, "stale/mean") == pytest.approx((0 + 100 + 200 + 200 + 600 + 100) / 800)
    assert steady_steps(steps, 4) == [] and math.isnan(token_weighted_mean([], "stale/mean"))


def test_summarize_adds_the_study_numbers_and_tolerates_missing_metrics():
    cfg = load_config(None, ["rollout.max_head_offpolicyness=0"], preset="tiny")
    rows = [{"step": 0, "eval/accuracy": 0.25},
            _step(1, **{"rollout/idle_frac": 0.2, "mismatch/k3": 1e-4, "mismatch/abs_mean": 0.01}),
            _step(2, **{"rollout/idle_frac": 0.4, "loss/clipped_frac": 0.3}),
            _step(3, **{"mismatch/k3": 3e-4, "mismatch/abs_mean": 0.03, "stale/mean": 0.8, "eval/accuracy": 0.5})]
    s = summarize(rows, cfg)
    assert s["steps"] == 3 and (s["eval_initial"], s["eval_final"]) == (0.25, 0.5)
    assert s["idle_frac"] == pytest.approx(0.3) and s["clipped_frac"] == pytest.approx(0.5 / 3)
    assert s["mismatch_k3"] == pytest.approx(2e-4) and s["mismatch_abs_mean"] == pytest.approx(0.02)
    assert s["step_s"] == 2.0 and s["train_wall_s"] == 6.0 and s["stale_dist"] is None
    assert s["stale_mean_steady"] == pytest.approx(0.8)  # eta = 0: the steps after the first 2
    assert s["stale_mean_all"] == pytest.approx(0.6)
    bare = summarize([_step(1)], cfg)
    assert math.isnan(bare["idle_frac"]) and math.isnan(bare["mismatch_k3"]) and math.isnan(bare["groups_ahead"])


# ----------------------------------------------------------------------------- the tables


def _run(arm, eta, mb, seed, **extra):
    base = {"arm": arm, "eta": eta, "minibatches": mb, "seed": seed, "ok": True,
            "key": f"{arm}-eta{eta}-mb{mb}-seed{seed}", "train_wall_s": 10.0, "step_s": 1.0,
            "eval_initial": 0.1, "eval_final": 0.5, "reward_final": 0.4,
            "clipped_frac": 0.1, "capped_frac": 0.0, "idle_frac": math.nan, "mismatch_k3": math.nan,
            "mismatch_abs_mean": math.nan, "stale_mean_all": 0.5, "stale_mean_steady": 1.0, "stale_max": float(eta),
            "groups_ahead": math.nan, "stale_dist": None}
    return {**base, **extra}


def test_aggregate_gives_each_cell_mean_and_spread_over_seeds():
    runs = [_run("coupled", 0, 1, 1, eval_final=0.4), _run("loglinear", 2, 1, 1, eval_final=0.5, stale_dist=[0.2, 0.8]),
            _run("coupled", 0, 1, 2, eval_final=0.6), _run("loglinear", 2, 1, 2, eval_final=0.7,
                                                           stale_dist=[0.4, 0.4, 0.2]),
            {"arm": "reuse", "eta": 2, "minibatches": 1, "seed": 1, "ok": False}]
    rows = {r["cell"]: r for r in aggregate(runs)}
    assert list(rows) == ["coupled-eta0-mb1", "loglinear-eta2-mb1"]  # a failed run has no row
    row = rows["loglinear-eta2-mb1"]
    assert row["seeds"] == [1, 2] and row["eval_final"]["mean"] == pytest.approx(0.6)
    assert (row["eval_final"]["min"], row["eval_final"]["max"], row["eval_final"]["n"]) == (0.5, 0.7, 2)
    assert row["idle_frac"]["n"] == 0  # never logged: '-' in the table, not 0
    assert [d["mean"] for d in row["stale_dist"]] == pytest.approx([0.3, 0.6, 0.1])
    assert (row["stale_dist"][2]["min"], row["stale_dist"][2]["max"]) == (0.0, 0.2)
    assert rows["coupled-eta0-mb1"]["stale_dist"] is None
    lines = table_under(markdown(record_of(runs[:-1], etas=[0, 2])), "## Consumed staleness")
    assert lines[0].endswith("| d=0 | d=1 | d=2 |")
    assert lines[2].endswith("| - |  |  |")  # eta 0, not logged: '-' at d = 0, blank beyond its eta
    assert lines[3].endswith("| 30% (20%..40%) | 60% (40%..80%) | 10% (0%..20%) |")


def test_approximation_table_has_a_row_for_every_d_up_to_eta():
    def step(n0, n2, e0, e2):
        return {"prox_err/tokens/d0": n0, "prox_err/tokens/d2": n2,
                "prox_err/loglinear/abs/d0": e0, "prox_err/loglinear/abs/d2": e2}
    runs = [_run("recompute", 3, 1, 1, prox_err_steps=[step(10, 30, 0.0, 0.2)]),
            _run("recompute", 3, 1, 2, prox_err_steps=[step(30, 10, 0.0, 0.6)]),
            _run("loglinear", 3, 1, 1, prox_err_steps=[step(1, 1, 9.0, 9.0)])]  # not a recompute cell: no table
    (t,) = approx_tables(runs)
    assert (t["cell"], t["eta"], t["minibatches"]) == ("recompute-eta3-mb1", 3, 1)
    assert [(r["staleness"], r["tokens"]) for r in t["rows"]] == [("d0", 40), ("d1", 0), ("d2", 40), ("d3", 0),
                                                                   ("all", 80)]
    assert t["rows"][2]["loglinear/abs"] == pytest.approx((30 * 0.2 + 10 * 0.6) / 40)
    md = markdown(record_of(runs, etas=[3], approx=[t]))
    assert "## Proximal approximation error (recompute cells)" in md
    lines = table_under(md, "### eta = 3, 1 minibatch(es)")
    assert lines[3] == "| 1 | 0 | - | - | - | - | - | - |"  # no token at d = 1: shown, not omitted
    assert lines[4].startswith("| 2 | 40 | 3.00e-01 | - |")  # rel was never logged: '-'
    assert [r["staleness"] for r in every_d_rows([], 1)] == ["d0", "d1"]


def test_each_line_starts_from_the_coupled_eta0_baseline_of_its_minibatch_count(tmp_path):
    runs = [_run("coupled", 0, 1, 1, eval_final=0.3), _run("coupled", 0, 4, 1, eval_final=0.35),
            _run("loglinear", 2, 1, 1, stale_dist=[0.5, 0.3, 0.2]), _run("loglinear", 2, 4, 1),
            _run("loglinear", 4, 1, 1), _run("coupled", 2, 1, 1)]
    table = aggregate(runs)
    lines = lines_by_eta(table)
    assert list(lines) == ["coupled mb1", "coupled mb4", "loglinear mb1", "loglinear mb4"]
    assert [(r["cell"]) for r in lines["loglinear mb1"]] == ["coupled-eta0-mb1", "loglinear-eta2-mb1",
                                                              "loglinear-eta4-mb1"]
    assert [r["cell"] for r in lines["loglinear mb4"]] == ["coupled-eta0-mb4", "loglinear-eta2-mb4"]
    assert [r["cell"] for r in lines["coupled mb1"]] == ["coupled-eta0-mb1", "coupled-eta2-mb1"]
    names = plot(table, tmp_path)
    assert names == ["accuracy_vs_eta.png", "clipped_frac_vs_eta.png", "staleness_distribution.png"]
    assert all((tmp_path / n).read_bytes()[:8] == PNG for n in names)
    single = lines_by_eta(aggregate([r for r in runs if r["minibatches"] == 1]))
    assert list(single) == ["coupled", "loglinear"]  # one minibatch count: no 'mb' in the labels


def record_of(runs: list[dict], etas: list[int], approx: list[dict] | None = None, skipped: list | None = None) -> dict:
    """The record `a3po bench staleness` writes results.md from, for these runs."""
    args = StalenessArgs(etas=etas, minibatches=[1, 4], arms=["coupled", "loglinear", "reuse"])
    return {"command": "a3po bench staleness", "args": vars(args), "cpu_model": "cpu", "avx512_bf16": False,
            "cpu_count": 2, "torch": "2", "wall_s": 60.0, "runs": runs, "table": aggregate(runs),
            "approx": approx or [], "configs": {"x": _cfg_dict()}, "skipped": skipped or [], "plots": []}


def table_under(md: str, heading: str) -> list[str]:
    """The lines of the first Markdown table after the heading."""
    after = md.split(f"\n{heading}\n", 1)[1].lstrip("\n").split("\n")
    return after[:next(i for i, line in enumerate(after) if not line.startswith("|"))]


def test_markdown_lists_skipped_cells_and_shows_unlogged_metrics_as_dashes():
    runs = [_run("coupled", 0, 1, 1), _run("loglinear", 2, 1, 1)]
    skipped = [{"cell": "reuse-eta2-mb4", "reason": reason_single_step("reuse")},
               {"cell": "reuse-eta0-mb1", "reason": REASON_ETA0}]
    md = markdown(record_of(runs, etas=[0, 2], skipped=skipped))
    assert "Skipped cells: `reuse-eta2-mb4`" in md and "`reuse-eta0-mb1`" not in md
    assert "At eta = 0 only the `coupled` arm runs by default" in md and "without AVX512-BF16" in md
    row = next(line for line in md.splitlines() if line.startswith("| loglinear | 2 | 1 | 10.0 |"))
    # idle frac and mismatch: not logged; speed against the baseline, but no rollout time for a ceiling
    assert row.endswith("| - | - | - | 1.00x | - | - |")
    assert "## Proximal approximation error" not in md


def test_runs_in_an_environment_show_what_the_first_turn_solved_and_single_turn_runs_do_not():
    cfg = load_config(None, [], preset="tiny")
    rows = [_step(1), _step(2, **{"eval/accuracy": 0.5, "eval/first_turn_accuracy": 0.375})]
    assert summarize(rows, cfg)["first_turn_final"] == 0.375
    assert math.isnan(summarize([_step(1), _step(2, **{"eval/accuracy": 0.5})], cfg)["first_turn_final"])
    title = "| of it by the first turn |"
    episodes = markdown(record_of([_run("coupled", 0, 1, 1), _run("loglinear", 2, 1, 1, first_turn_final=0.375)],
                                  etas=[0, 2]))
    assert title in episodes and "`eval/first_turn_accuracy`" in episodes
    row = next(line for line in episodes.splitlines() if line.startswith("| loglinear | 2 | 1 |"))
    assert "| 0.500 | 0.375 | 0.400 |" in row  # held-out accuracy, of it by the first turn, final reward
    single = markdown(record_of([_run("coupled", 0, 1, 1), _run("loglinear", 2, 1, 1)], etas=[0, 2]))
    assert title not in single and "first_turn" not in single


def _cfg_dict() -> dict:
    import yaml

    from a3po.config import dump_yaml

    return yaml.safe_load(dump_yaml(load_config(None, [], preset="tiny")))


def test_cell_keys_name_arm_eta_and_minibatches():
    assert Cell("loglinear", 4, 1).key == "loglinear-eta4-mb1"
    assert Cell("recompute", 2, 4).overrides() == ["actor.prox_logp_method=metrics", "rollout.max_head_offpolicyness=2",
                                                  "actor.ppo_n_minibatches=4"]


def test_overlap_ceiling_is_measured_against_the_synchronous_baseline():
    from a3po.bench.staleness import overlap

    stat = lambda x: {"mean": x, "min": x, "max": x, "std": 0.0, "n": 1}
    sync = {"eta": 0, "step_s": stat(10.0), "rollout_wait_s": stat(4.0)}  # R = 4, T = 6
    fast = {"eta": 2, "step_s": stat(6.25)}
    out = overlap(fast, sync)
    # ceiling (4 + 6) / max(4, 6) = 1.667; speedup 10 / 6.25 = 1.6; 1.6 / 1.667 = 96 %
    assert out["overlap_ceiling"] == pytest.approx(10 / 6)
    assert out["speedup_vs_sync"] == pytest.approx(1.6)
    assert out["of_ceiling"] == pytest.approx(0.96)
    assert overlap(sync, sync)["speedup_vs_sync"] is None  # the baseline is not compared with itself
    assert overlap(fast, None)["of_ceiling"] is None


def test_of_bottleneck_compares_each_step_with_its_slower_side():
    from a3po.bench.staleness import of_bottleneck

    steps = [
        # trainer-bound: busy 10 - 1 = 9 s of 10, workers (1 - 0.5) x 10 = 5 s -> 9
        {"perf/step_s": 10.0, "perf/rollout_wait_s": 1.0, "rollout/idle_frac": 0.5},
        # rollout-bound: trainer 5 - 3 = 2 s, workers 0.8 x 5 = 4 s -> 4
        {"perf/step_s": 5.0, "perf/rollout_wait_s": 3.0, "rollout/idle_frac": 0.2},
        {"perf/step_s": 7.0, "perf/rollout_wait_s": 0.0},  # no idle share logged: left out
    ]
    assert of_bottleneck(steps) == pytest.approx((9 + 4) / (10 + 5))
    assert math.isnan(of_bottleneck(steps[2:]))


def test_paired_differences_pair_each_seed_and_give_a_t_interval():
    from a3po.bench.report import paired_differences

    def run(arm, seed, solved):
        return {"ok": True, "arm": arm, "seed": seed, "held_out_final": solved}

    runs = [run("a", 1, [1, 1, 0, 0]), run("r", 1, [1, 0, 0, 0]),  # +0.25
            run("a", 2, [1, 1, 1, 1]), run("r", 2, [1, 1, 1, 0]),  # +0.25
            run("a", 3, [0, 0, 0, 0]), run("r", 3, [1, 0, 0, 0]),  # -0.25
            run("a", 4, [1, 0, 0, 0])]  # no reference on seed 4: left out
    d = paired_differences(runs, "a", "r")
    assert d["values"] == [0.25, 0.25, -0.25] and d["n"] == 3
    assert d["mean"] == pytest.approx(0.25 / 3)
    half = 4.303 * d["std"] / math.sqrt(3)  # t(0.975, 2 df)
    assert d["std"] == pytest.approx(math.sqrt(((1 / 6) ** 2 * 2 + (1 / 3) ** 2) / 2))
    assert d["interval"] == pytest.approx((0.25 / 3 - half, 0.25 / 3 + half)) and not d["measurable"]
    runs += [run("a", s, [1, 1, 1, 1]) for s in (5, 6, 7)] + [run("r", s, [0, 0, 0, 0]) for s in (5, 6, 7)]
    runs = [r for r in runs if r["seed"] != 3]
    assert paired_differences(runs, "a", "r")["measurable"]
    assert paired_differences(runs, "a", "missing") is None


@pytest.mark.slow
def test_a_copy_of_the_records_regenerates_from_its_own_run_folders(bench, tmp_path):
    """Copied elsewhere (docs/results), a study reads the run folders beside its record, not the folders its record
    names on the machine it ran on, even where those still exist."""
    _, cwd, out, record = bench
    run = next(r for r in record["runs"] if r["ok"])
    copy = tmp_path / "copy"
    (copy / "runs" / run["key"]).mkdir(parents=True)
    (copy / "results.json").write_text((out / "results.json").read_text())
    for name in ("config.yaml", "held_out.jsonl"):
        src = cwd / run["run_dir"] / name
        if src.exists():
            (copy / "runs" / run["key"] / name).write_text(src.read_text())
    rows = [json.loads(line) for line in (cwd / run["run_dir"] / "metrics.jsonl").read_text().splitlines() if line]
    for r in rows:
        if "perf/step_s" in r:
            r["perf/step_s"] += 100.0  # what only the copy says
    (copy / "runs" / run["key"] / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    res = subprocess.run([sys.executable, "-m", "a3po.bench.staleness", str(copy)], cwd=cwd, capture_output=True,
                         text=True, timeout=300)  # from where the recorded run_dir resolves
    assert res.returncode == 0, res.stderr[-2000:]
    again = next(r for r in json.loads((copy / "results.json").read_text())["runs"] if r["key"] == run["key"])
    assert again["step_s"] == pytest.approx(run["step_s"] + 100.0)


@pytest.mark.slow
def test_tables_and_plots_regenerate_from_results_json_alone(bench, tmp_path):
    _, _, out, _ = bench
    (tmp_path / "results.json").write_text((out / "results.json").read_text())
    res = subprocess.run([sys.executable, "-m", "a3po.bench.staleness", str(tmp_path)], capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert (tmp_path / "results.md").read_text() == (out / "results.md").read_text()
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == sorted(p.name for p in (out / "plots").iterdir())

    # one page over several folders: each folder's cells and paired rows, headed free-running or lockstep, the
    # environment named where episodes have turns
    record = json.loads((out / "results.json").read_text())
    for cfg in record["configs"].values():
        cfg["rollout"]["lockstep"] = True
        cfg["train_dataset"]["env"] = "retry"
    (tmp_path / "second").mkdir()
    (tmp_path / "second" / "results.json").write_text(json.dumps(record))
    page = tmp_path / "summary.md"
    res = subprocess.run([sys.executable, "-m", "a3po.bench.staleness", "--summary", str(page), str(tmp_path),
                          str(tmp_path / "second")], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    text = page.read_text()
    assert f"## {tmp_path.name} (free-running, " in text and "## second (lockstep, " in text
    assert "| loglinear (free-running) | recompute | 2 | 1 | 1 |" in text
    assert "| loglinear (lockstep, `retry` multi-turn) | recompute | 2 | 1 | 1 |" in text
    # one seed a cell: no interval, so nothing that chance could have made measurable
    assert "0 of these comparisons have an interval, and 0 of them read better or worse" in text
    for row in record["table"]:
        acc = row["eval_final"]["mean"]
        assert text.count(f"| {row['arm']} | {row['eta']} | {row['minibatches']} | {len(row['seeds'])} | "
                          f"{acc:.3f} (") == 2


def test_a_key_added_since_a_run_was_recorded_continues_it_only_at_its_default():
    import copy

    import yaml

    from a3po.bench.runs import same_configuration
    from a3po.config import Config, dump_yaml

    now = yaml.safe_load(dump_yaml(Config()))
    before = copy.deepcopy(now)
    del before["rollout"]["lockstep"]  # recorded before the key existed
    assert same_configuration(before, now)
    changed = copy.deepcopy(now)
    changed["rollout"]["lockstep"] = True
    assert not same_configuration(before, changed)
    old_default = copy.deepcopy(now)
    old_default["actor"]["c_clip"] = None  # a default that changed since: not the same run
    assert not same_configuration(old_default, now)
    gone = copy.deepcopy(now)
    gone["actor"]["removed_key"] = 1
    assert not same_configuration(gone, now) and not same_configuration(None, now)


def test_per_staleness_fractions_pool_steps_by_the_tokens_at_that_staleness():
    from a3po.bench.staleness import by_staleness

    steps = [
        {"train/n_tokens": 100, "stale/frac_d0": 1.0, "loss/clipped_frac_d0": 0.1},
        {"train/n_tokens": 100, "stale/frac_d0": 0.5, "stale/frac_d2": 0.5,
         "loss/clipped_frac_d0": 0.4, "loss/clipped_frac_d2": 0.2},
    ]
    # d = 0: (100 x 0.1 + 50 x 0.4) / 150; d = 1: no token; d = 2: 0.2
    assert by_staleness(steps, "loss/clipped_frac_d", 2) == pytest.approx([0.2, None, 0.2])


def test_variants_are_paired_with_the_arm_they_vary_as_well_as_with_recompute():
    from a3po.bench.staleness import paired_table

    def run(arm, seed, solved):
        return {"ok": True, "arm": arm, "eta": 8, "minibatches": 1, "seed": seed, "held_out_final": solved}

    runs = [run(arm, s, solved) for s in (1, 2) for arm, solved in
            (("recompute", [0, 0]), ("recompute-noclip", [1, 0]), ("loglinear-noclip", [1, 1]))]
    pairs = {(r["arm"], r["reference"]): r["mean"] for r in paired_table(runs)}
    assert pairs == {("recompute-noclip", "recompute"): 0.5, ("loglinear-noclip", "recompute"): 1.0,
                     ("loglinear-noclip", "recompute-noclip"): 0.5}


def test_an_arm_at_several_minibatches_is_paired_with_itself_at_one():
    from a3po.bench.staleness import paired_table

    def run(arm, mb, seed, solved):
        return {"ok": True, "arm": arm, "eta": 2, "minibatches": mb, "seed": seed, "held_out_final": solved}

    runs = [run("loglinear", 1, s, [1, 1]) for s in (1, 2)]
    runs += [run("loglinear", 4, 1, [0, 1]), run("loglinear", 4, 2, [0, 0])]
    runs += [run("recompute", 4, s, [0, 0]) for s in (1, 2)]
    rows = {(r["arm"], r["minibatches"], r["reference"]): r for r in paired_table(runs)}
    assert set(rows) == {("loglinear", 4, "recompute"), ("loglinear", 4, "loglinear, 1 minibatch")}
    against_one = rows[("loglinear", 4, "loglinear, 1 minibatch")]
    assert against_one["values"] == [-0.5, -1.0] and against_one["mean"] == -0.75
    assert rows[("loglinear", 4, "recompute")]["values"] == [0.5, 0.0]


def test_a_run_without_an_initial_evaluation_has_no_initial_accuracy():
    from a3po.bench.runs import summarize_run

    rows = [{"step": 1, "stale/max": 0, "perf/step_s": 1.0, "rollout/reward_mean": 0.5, "loss/clipped_frac": 0.0,
             "train/n_tokens": 10, "eval/accuracy": 0.25}]
    out = summarize_run(rows)
    assert math.isnan(out["eval_initial"]) and out["eval_final"] == 0.25


def test_the_paired_table_reads_one_seed_as_no_interval_yet():
    from a3po.bench.staleness_report import _paired_table

    row = dict(arm="loglinear", reference="recompute", eta=2, minibatches=1)
    one = {**row, "n": 1, "mean": 0.09, "values": [0.09], "interval": [math.nan, math.nan], "measurable": False}
    three = {**row, "n": 3, "mean": 0.05, "values": [0.09, -0.02, 0.08], "interval": [-0.1, 0.2],
             "measurable": False}
    lines = _paired_table([one, three])
    assert lines[2].endswith("| - | one seed: no interval yet |")
    assert lines[3].endswith("| [-0.100, +0.200] | no measurable difference |")


def _study_copy(record: dict, folder: Path, drop: set[str]) -> Path:
    """A copy of a study folder as it would stand had the runs in `drop` not been made there."""
    kept = {k: v for k, v in record.items() if k not in ("runs", "configs")}
    kept["runs"] = [r for r in record["runs"] if r["key"] not in drop]
    kept["configs"] = {k: v for k, v in record["configs"].items() if k not in drop}
    folder.mkdir()
    (folder / "results.json").write_text(json.dumps(kept))
    return folder


@pytest.mark.slow
def test_two_copies_of_a_study_continued_apart_join_into_the_whole_study(tmp_path):
    """A committed multi-turn study split as two side-by-side continuations would leave it: the shared
    runs in both, the coupled runs in one, the fifth seeds in the other. Joined, the page is the study's."""
    whole = json.loads((Path(__file__).parent.parent / "docs/results/evidence-retry-eta2-lockstep/results.json")
                       .read_text())
    coupled = {r["key"] for r in whole["runs"] if r["arm"] == "coupled"}
    fifth = {r["key"] for r in whole["runs"] if r["seed"] == 5}
    assert coupled and fifth
    into = _study_copy(whole, tmp_path / "into", coupled)
    other = _study_copy(whole, tmp_path / "other", fifth)
    res = subprocess.run([sys.executable, "-m", "a3po.bench.staleness", "--join", str(other), str(into)],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    joined = json.loads((into / "results.json").read_text())
    assert sorted(r["key"] for r in joined["runs"]) == sorted(r["key"] for r in whole["runs"])
    assert joined["configs"] == whole["configs"]
    assert joined["table"] == whole["table"] and joined["paired"] == whole["paired"]
    added = sum(r["process_wall_s"] for r in whole["runs"] if r["key"] in coupled)
    assert joined["wall_s"] == pytest.approx(whole["wall_s"] + added)
    page = (into / "results.md").read_text()
    assert "| coupled | 2 | 4 |" in page
    assert joined["commands"][-1] == f"python -m a3po.bench.staleness --join {other} {into}"
    assert f"- `python -m a3po.bench.staleness --join {other} {into}`" in page and "a --join added" in page

    # joining the same copy again adds nothing, not even its command a second time
    before = (into / "results.json").read_text()
    res = subprocess.run([sys.executable, "-m", "a3po.bench.staleness", "--join", str(other), str(into)],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert json.loads((into / "results.json").read_text()) == json.loads(before)

    # a run that failed in the folder and finished in the copy is kept finished
    failed = json.loads(before)
    first = failed["runs"][0]
    failed["runs"][0] = {**first, "ok": False, "returncode": 1, "eval_final": None}
    (into / "results.json").write_text(json.dumps(failed))
    res = subprocess.run([sys.executable, "-m", "a3po.bench.staleness", "--join", str(other), str(into)],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert json.loads((into / "results.json").read_text())["runs"][0] == first

    # a run both made, with other results: refused in one line, nothing written
    before = (into / "results.json").read_text()
    changed = json.loads(before)
    changed["runs"][0]["eval_final"] = 0.0
    (other / "results.json").write_text(json.dumps(changed))
    res = subprocess.run([sys.executable, "-m", "a3po.bench.staleness", "--join", str(other), str(into)],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 2
    assert f"both hold a run {whole['runs'][0]['key']} with different results" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1
    assert (into / "results.json").read_text() == before

    res = subprocess.run([sys.executable, "-m", "a3po.bench.staleness", "--join", str(other), str(into), str(other)],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 2 and "exactly one folder" in res.stderr
    res = subprocess.run([sys.executable, "-m", "a3po.bench.staleness", "--join", str(tmp_path / "nowhere"), str(into)],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 2 and "nowhere: no results.json there" in res.stderr


def test_correction_arms_differ_from_their_method_only_in_the_correction_and_the_surrogate():
    """Each arm of bench/args.py CORRECTION_ARMS, in bench staleness and bench e2e, is its proximal method's
    arm with only actor.correction and actor.policy_loss changed, and validates where A-3PO's approximation acts."""
    from a3po.bench import e2e
    from a3po.bench.args import CORRECTION_ARMS, E2EArgs
    from a3po.config import to_dict

    names = list(CORRECTION_ARMS)
    runs, skipped = plan(StalenessArgs(preset="tiny", etas=[8], minibatches=[4],
                                       arms=["recompute", "loglinear", *names]).checked())
    assert not skipped
    e2e_runs = e2e.arm_configs(E2EArgs(preset="tiny", arms=["recompute", "loglinear", *names]).checked())
    for planned, base_of in (({p.fields["arm"]: to_dict(p.cfg) for p in runs}, {"recompute": "recompute"}),
                             ({p.key.rsplit("-seed", 1)[0]: to_dict(p.cfg) for p in e2e_runs}, {})):
        for name, (_, method, _) in CORRECTION_ARMS.items():
            arm, base = planned[name], planned[base_of.get(method, method)]
            changed = {k for k in arm["actor"] if arm["actor"][k] != base["actor"][k]}
            assert changed and changed <= {"correction", "policy_loss"}, (name, changed)
            assert {**arm, "actor": base["actor"]} == base
    icepop = planned["loglinear-icepop"]["actor"]["correction"]
    assert (icepop["ratio"], icepop["mis"], icepop["mis_low"], icepop["mis_high"]) == ("current", "token", 0.5, 5)

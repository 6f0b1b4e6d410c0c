"""The pre-registered equivalence test (a3po.bench.equivalence) on study folders written in the records' own format,
its registration read from a real git repository, and the pilot mode on the committed pilot records."""

import json
import math
import shutil
import subprocess
from pathlib import Path

import pytest

from a3po.bench import equivalence as eq
from a3po.intervals import t_quantile

PILOT = Path(__file__).resolve().parents[1] / "docs/results/equivalence-pilot/lr1e-5"


@pytest.mark.parametrize(("p", "df", "value"), [(0.975, 1, 12.706), (0.975, 10, 2.228), (0.95, 29, 1.699),
                                                (0.95, 5, 2.015), (0.975, 100, 1.984), (0.05, 5, -2.015)])
def test_t_quantiles_match_the_tables(p, df, value):
    assert t_quantile(p, df) == pytest.approx(value, abs=5e-4)


def test_the_reading_against_the_margin():
    assert eq.verdict(-0.02, 0.029, 0.03) == "equivalent within 0.03"
    assert eq.verdict(-0.031, 0.01, 0.03) == "undecided"
    assert eq.verdict(0.01, 0.05, 0.03) == "undecided"  # measurably above 0 but not beyond the margin
    assert eq.verdict(0.031, 0.2, 0.03) == "different (by more than 0.03)"
    assert eq.verdict(-0.2, -0.04, 0.03) == "different (by more than 0.03)"


def test_the_seed_count_is_the_smallest_that_reaches_the_half_width():
    n = eq.seeds_for(0.078, 0.02, 0.90)
    half = lambda k: t_quantile(0.95, k - 1) * 0.078 / math.sqrt(k)
    assert half(n) <= 0.02 < half(n - 1)
    assert n == 44


def test_the_endpoints_of_one_run():
    rows = [{"step": 0, "solved": [0, 0, 1, 0]}, {"step": 8, "solved": [1, 0, 1, 0]},
            {"step": 16, "solved": [1, 1, 1, 0]}]
    assert eq.endpoint(rows, "final") == 0.75
    assert eq.endpoint(rows, "area") == pytest.approx((0.5 + 0.75) / 2)  # step 0 is the base model, not the run
    with pytest.raises(eq.DesignError, match="two or more evaluations after step 0"):
        eq.endpoint(rows[::2], "area")


def _study(folder: Path, finals: dict[tuple[str, int], float], lr=1e-5, failed=(), commit=None, machines=()):
    """A staleness study folder as the bench writes it: results.json (runs, configs, the machines its invocations
    ran on) and each run's held_out.jsonl, with 100 problems whose first round(100 * final) are solved; each run
    made from `commit`."""
    runs, configs = [], {}
    for (arm, seed), final in finals.items():
        key = f"{arm}-eta8-mb4-seed{seed}"
        runs.append({"arm": arm, "eta": 8, "minibatches": 4, "seed": seed, "key": key, "ok": key not in failed,
                     "returncode": 1 if key in failed else 0, "code_commit": commit})
        configs[key] = {"seed": seed, "actor": {"optimizer": {"lr": lr}}, "rollout": {"lockstep": True}}
        solved = lambda acc: [1.0] * round(100 * acc) + [0.0] * (100 - round(100 * acc))
        (folder / "runs" / key).mkdir(parents=True)
        (folder / "runs" / key / "held_out.jsonl").write_text(
            json.dumps({"step": 0, "solved": solved(0.2)}) + "\n" + json.dumps({"step": 24, "solved": solved(final)}))
    (folder / "results.json").write_text(json.dumps({"runs": runs, "configs": configs, "machines": list(machines)}))


DESIGN = """endpoint: final
margin: 0.03
confidence: 0.90
reference: recompute
arms: [loglinear]
seeds: 4
cells:
  - {name: single-turn, folder: cell, eta: 8, minibatches: 4}
fixed:
  actor.optimizer.lr: 1.0e-5
  rollout.lockstep: true
"""


def _git(cwd, *args):
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=cwd, check=True,
                   capture_output=True, timeout=30)


def test_a_registered_study_reads_equivalent_and_says_it_followed_its_design(tmp_path):
    (tmp_path / "DESIGN.yaml").write_text(DESIGN)
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", "DESIGN.yaml")
    _git(tmp_path, "commit", "-q", "-m", "design")
    ref = [0.40, 0.35, 0.45, 0.38]
    head = _head(tmp_path)
    diffs = [0.01, -0.01, 0.00, 0.01]
    finals = {("recompute", s + 1): r for s, r in enumerate(ref)}
    finals |= {("loglinear", s + 1): r + d for s, (r, d) in enumerate(zip(ref, diffs))}
    _study(tmp_path / "cell", finals, commit=head, machines=[ZEN4])
    page = tmp_path / "page.md"
    assert eq.main([str(tmp_path / "DESIGN.yaml"), "--out", str(page)]) == 0
    text = page.read_text()
    m, sd = sum(diffs) / 4, 0.00957427
    half = t_quantile(0.95, 3) * sd / 2
    assert f"{m:+.3f}, 90 % interval [{m - half:+.3f}, {m + half:+.3f}]" in text
    assert "equivalent within 0.03" in text
    assert "Registered: the design file was committed at" in text and "It has not changed since." in text
    assert f"Code: 8 run(s) from {head[:10]}." in text
    assert "Machines: AMD EPYC (with native bf16), 2 cores, torch 2.13.0+cpu." in text
    assert "one precision" not in text
    assert "The records followed the design." in text


ZEN4 = {"cpu_model": "AMD EPYC", "avx512_bf16": True, "cpu_count": 2, "torch": "2.13.0+cpu"}


def test_a_cell_continued_on_a_machine_without_native_bf16_says_its_runs_mixed_precisions(tmp_path):
    (tmp_path / "DESIGN.yaml").write_text(DESIGN)
    avx2 = {**ZEN4, "avx512_bf16": False}
    _study(tmp_path / "cell", {("recompute", 1): 0.4, ("loglinear", 1): 0.4}, machines=[ZEN4, avx2])
    design = eq.load_design(tmp_path / "DESIGN.yaml")
    text = eq.markdown(design, tmp_path / "DESIGN.yaml", eq.analyse(design, tmp_path))
    assert ("Machines: AMD EPYC (with native bf16), 2 cores, torch 2.13.0+cpu; AMD EPYC (without native bf16), "
            "2 cores, torch 2.13.0+cpu. Some have native bf16 and some not") in text
    assert "not all made in one precision" in text


def _head(cwd) -> str:
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True,
                          timeout=30).stdout.strip()


def test_a_cell_short_of_its_seeds_gives_no_reading(tmp_path):
    (tmp_path / "DESIGN.yaml").write_text(DESIGN)
    _study(tmp_path / "cell", {("recompute", 1): 0.4, ("loglinear", 1): 0.4, ("recompute", 2): 0.3,
                               ("loglinear", 2): 0.3})
    design = eq.load_design(tmp_path / "DESIGN.yaml")
    text = eq.markdown(design, tmp_path / "DESIGN.yaml", eq.analyse(design, tmp_path))
    assert "2 of 4 seeds have run; the test reads once all have." in text
    cell = text.split("## ")[1]
    assert "equivalent" not in cell and "interval" not in cell
    assert "not committed: this study is not pre-registered" in text


def test_records_that_left_the_design_are_named(tmp_path):
    (tmp_path / "DESIGN.yaml").write_text(DESIGN)
    finals = {(arm, s): 0.4 for arm in ("recompute", "loglinear") for s in range(1, 6)}
    _study(tmp_path / "cell", finals, lr=2e-5, failed=("loglinear-eta8-mb4-seed2",))
    design = eq.load_design(tmp_path / "DESIGN.yaml")
    text = eq.markdown(design, tmp_path / "DESIGN.yaml", eq.analyse(design, tmp_path))
    assert "did NOT follow the design" in text
    assert "seed 5 is beyond the design's 4" in text
    assert "loglinear-eta8-mb4-seed2: failed" in text
    assert "actor.optimizer.lr is 2e-05, the design fixed 1e-05" in text


@pytest.mark.parametrize(("edit", "message"), [
    (lambda d: d.replace("endpoint: final", "endpoint: best"), "endpoint 'best': choose one of final, area"),
    (lambda d: d.replace("seeds: 4", "seeds: 1"), "at least 2"),
    (lambda d: d.replace("margin: 0.03\n", ""), "lacks margin"),
    (lambda d: d.replace("eta: 8, ", ""), "each cell needs name, folder, eta and minibatches"),
    (lambda d: "[unclosed", "not a readable YAML design file"),
])
def test_a_bad_design_is_one_line_exit_2(tmp_path, capsys, edit, message):
    (tmp_path / "DESIGN.yaml").write_text(edit(DESIGN))
    assert eq.main([str(tmp_path / "DESIGN.yaml")]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_the_pilot_mode_reads_the_committed_pilot_records(capsys):
    assert eq.main(["--pilot", str(PILOT), "--arm", "coupled"]) == 0
    out = capsys.readouterr().out
    finals = {}
    for arm in ("recompute", "coupled"):
        for seed in (1, 2):
            rows = [json.loads(x) for x in (PILOT / f"runs/{arm}-eta8-mb4-seed{seed}/held_out.jsonl").read_text()
                    .splitlines()]
            last = max(rows, key=lambda r: r["step"])
            finals[arm, seed] = sum(last["solved"]) / len(last["solved"])
    diffs = [finals["coupled", s] - finals["recompute", s] for s in (1, 2)]
    assert f"final: differences {diffs[0]:+.3f}, {diffs[1]:+.3f}" in out
    assert "area: the area endpoint needs two or more evaluations after step 0" in out  # evaluated at 0 and 24 only


def test_runs_made_before_the_design_or_from_changed_code_did_not_follow_it(tmp_path):
    """Each run records the commit of the code it ran; the page reads them against the design's first commit."""
    _git(tmp_path, "init", "-q")
    (tmp_path / "README").write_text("before the design\n")
    _git(tmp_path, "add", "README")
    _git(tmp_path, "commit", "-q", "-m", "code")
    before = _head(tmp_path)
    (tmp_path / "DESIGN.yaml").write_text(DESIGN)
    _git(tmp_path, "add", "DESIGN.yaml")
    _git(tmp_path, "commit", "-q", "-m", "design")
    after = _head(tmp_path)
    finals = {(arm, s): 0.4 for arm in ("recompute", "loglinear") for s in range(1, 5)}
    design = eq.load_design(tmp_path / "DESIGN.yaml")

    def page(commit) -> str:
        shutil.rmtree(tmp_path / "cell", ignore_errors=True)
        _study(tmp_path / "cell", finals, commit=commit)
        return " ".join(eq.markdown(design, tmp_path / "DESIGN.yaml", eq.analyse(design, tmp_path)).split())

    assert "The records followed the design." in page(after)
    assert f"{before[:10]} does not hold the design file" in page(before)
    text = page(after + "+changes")
    assert "with uncommitted changes" in text and "had uncommitted changes to a3po's source" in text
    assert "8 run(s) do not record the code they were made from" in page(None)
    (tmp_path / "DESIGN.yaml").write_text(DESIGN.replace("seeds: 4", "seeds: 6"))
    _git(tmp_path, "commit", "-q", "-am", "more seeds")
    assert "It changed after:" in " ".join(eq.registration(tmp_path / "DESIGN.yaml"))

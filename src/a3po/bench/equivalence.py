"""A pre-registered equivalence test of training methods, read from `a3po bench staleness` records.

    python -m a3po.bench.equivalence DESIGN.yaml [--out PAGE.md]      # the test, as its design fixed it
    python -m a3po.bench.equivalence --pilot FOLDER [--arm loglinear]  # the seed count a design should fix

A comparison that asks "is there a difference?" can only say "no measurable difference" when the
interval holds 0, however wide it is. Equivalence needs a margin fixed in advance and two one-sided
tests: each arm's per-seed paired difference from the reference (same seed: same held-out problems,
same first weights), its mean and the (1 - 2 alpha) Student-t interval over seeds, read against +-margin:

  - the interval inside (-margin, +margin): "equivalent within margin" (both one-sided tests reject);
  - the interval wholly above +margin or below -margin: "different" (by more than the margin);
  - otherwise "undecided".

The design file fixes, before any run, the endpoint, the margin, the confidence, the reference and
the arms, the cells (each a study folder beside the design file) and the number of seeds, the same
for every arm and cell. A cell is read only once every seed of the design has run: stopping when a
cell reads well is what pre-registration rules out. The page says at which commit the design was
registered (git), whether it changed after, and whether the records followed it (no seed beyond
the design, every fixed configuration key as fixed, no failed run, every run made from a commit that
holds the design file, as each run's record names it).

Endpoints, from each run's held_out.jsonl: `final`, the held-out accuracy after the last step; `area`,
the mean of the accuracies at every evaluation after step 0 (the area under the held-out curve).
The pilot mode gives, for each endpoint, the between-seed SD s of the paired differences and the
smallest n with t(1 - alpha, n - 1) * s / sqrt(n) <= the half-width asked for.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

from a3po.bench.report import emit_page
from a3po.bench.runs import machines_of
from a3po.intervals import t_quantile
from a3po.machine import git

ENDPOINTS = ("final", "area")


class DesignError(ValueError):
    pass


@dataclass(frozen=True)
class Cell:
    name: str
    folder: str  # the study folder of `a3po bench staleness`, relative to the design file
    eta: int
    minibatches: int


@dataclass(frozen=True)
class Design:
    endpoint: str
    margin: float
    confidence: float  # of the two-sided interval; each one-sided test is at (1 - confidence) / 2
    reference: str
    arms: tuple[str, ...]
    seeds: int  # seeds 1..seeds in every cell, for the reference and every arm
    cells: tuple[Cell, ...]
    fixed: dict  # dotted configuration key -> the value every run must have


def load_design(path: Path) -> Design:
    try:
        raw = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise DesignError(f"{path}: not a readable YAML design file ({' '.join(str(e).split())})") from None
    if not isinstance(raw, dict):
        raise DesignError(f"{path}: a design file is a mapping of endpoint, margin, ... (see this module's doc)")
    need = ("endpoint", "margin", "confidence", "reference", "arms", "seeds", "cells")
    missing = [k for k in need if k not in raw]
    if missing:
        raise DesignError(f"{path}: lacks {', '.join(missing)}; a design fixes all of {', '.join(need)}")
    if raw["endpoint"] not in ENDPOINTS:
        raise DesignError(f"{path}: endpoint {raw['endpoint']!r}: choose one of {', '.join(ENDPOINTS)}")
    if not (isinstance(raw["seeds"], int) and raw["seeds"] >= 2):
        raise DesignError(f"{path}: seeds {raw['seeds']!r}: give the number of seeds per arm and cell, at least 2")
    if not 0 < float(raw["margin"]) < 1 or not 0 < float(raw["confidence"]) < 1:
        raise DesignError(f"{path}: margin and confidence lie between 0 and 1 (e.g. 0.03 and 0.90)")
    try:
        cells = tuple(Cell(str(c["name"]), str(c["folder"]), int(c["eta"]), int(c["minibatches"]))
                      for c in raw["cells"])
    except (KeyError, TypeError, ValueError):
        raise DesignError(f"{path}: each cell needs name, folder, eta and minibatches") from None
    arms = raw["arms"]
    if not (isinstance(arms, list) and arms and all(isinstance(a, str) for a in arms)):
        raise DesignError(f"{path}: arms {arms!r}: give a list of arm names, e.g. [loglinear]")
    return Design(raw["endpoint"], float(raw["margin"]), float(raw["confidence"]), str(raw["reference"]),
                  tuple(arms), raw["seeds"], cells, dict(raw.get("fixed") or {}))


def endpoint(held_out: list[dict], kind: str) -> float:
    """The endpoint of one run from its held_out.jsonl rows (each: step, solved per problem)."""
    acc = {row["step"]: statistics.fmean(row["solved"]) for row in held_out}
    if kind == "final":
        return acc[max(acc)]
    later = [a for step, a in sorted(acc.items()) if step > 0]
    if len(later) < 2:
        raise DesignError("the area endpoint needs two or more evaluations after step 0 (evaluator.freq_steps, "
                          "or --eval-every of the bench)")
    return statistics.fmean(later)


def interval(diffs: list[float], confidence: float) -> tuple[float, float, float, float]:
    """Mean, SD and the two-sided `confidence` Student-t interval of the mean of `diffs` (two or more)."""
    m, sd = statistics.fmean(diffs), statistics.stdev(diffs)
    half = t_quantile(1 - (1 - confidence) / 2, len(diffs) - 1) * sd / math.sqrt(len(diffs))
    return m, sd, m - half, m + half


def verdict(lo: float, hi: float, margin: float) -> str:
    if -margin < lo and hi < margin:
        return f"equivalent within {margin:g}"
    if lo > margin or hi < -margin:
        return f"different (by more than {margin:g})"
    return "undecided"


def seeds_for(sd: float, half_width: float, confidence: float) -> int:
    """The smallest n whose `confidence` interval of a mean of n paired differences of SD `sd` is +-half_width."""
    n = 2
    while t_quantile(1 - (1 - confidence) / 2, n - 1) * sd / math.sqrt(n) > half_width:
        n += 1
    return n


def _runs(folder: Path) -> tuple[list[dict], dict, list[dict]]:
    """The runs of a staleness study folder, their configurations and the machines its invocations ran on, from
    its results.json."""
    try:
        record = json.loads((folder / "results.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise DesignError(f"{folder}: no readable results.json ({e}); "
                          "give a folder `a3po bench staleness` wrote") from None
    return record["runs"], record.get("configs", {}), machines_of(record)


def _held_out(folder: Path, key: str) -> list[dict]:
    path = folder / "runs" / key / "held_out.jsonl"
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (OSError, json.JSONDecodeError) as e:
        raise DesignError(f"{path}: not readable ({e}); the study folder's run records must be kept") from None


def _dotted(config: dict, key: str):
    for part in key.split("."):
        if not isinstance(config, dict) or part not in config:
            return "(absent)"
        config = config[part]
    return config


def design_history(path: Path) -> list[str]:
    """The design file's commits as "hash date", newest first (git log --follow); empty where it is not committed."""
    log = git(["log", "--format=%H %cs", "--follow", "--", path.name], path.resolve().parent)
    return log.splitlines() if log else []


def registration(path: Path) -> list[str]:
    """What git says of the design file: the commit that added it, and later changes."""
    commits = design_history(path)
    if not commits:
        return ["The design file is not committed: this study is not pre-registered."]
    first, date = commits[-1].split()
    lines = [f"Registered: the design file was committed at {first[:10]} ({date})."]
    if len(commits) > 1:
        lines.append(f"It changed after: {', '.join(c.split()[0][:10] for c in commits[-2::-1])} (see git log).")
    else:
        lines.append("It has not changed since.")
    return lines


def provenance(path: Path, commits: dict[str | None, int]) -> tuple[str, list[str]]:
    """The code a cell's runs were made from, as each run recorded it (`a3po bench` keeps the commit of the a3po
    source it ran), read against the design file's first commit (a run from a commit that holds the design cannot
    have preceded it): a sentence, and the deviations among it."""
    where = path.resolve().parent
    history = design_history(path)
    first = history[-1].split()[0] if history else None
    said, deviations = [], []
    for commit, n in sorted(commits.items(), key=lambda kv: (kv[0] is None, kv[0] or "")):
        if commit is None:
            said.append(f"{n} run(s) without a recorded commit")
            deviations.append(f"{n} run(s) do not record the code they were made from")
            continue
        head, changed = commit.removesuffix("+changes"), commit.endswith("+changes")
        holds = first is not None and git(["merge-base", "--is-ancestor", first, head], where) is not None
        said.append(f"{n} run(s) from {head[:10]}" + (" with uncommitted changes" if changed else ""))
        if not holds:
            deviations.append(f"{head[:10]} does not hold the design file (runs made before it, or unknown here)")
        if changed:
            deviations.append(f"{head[:10]}'s runs had uncommitted changes to a3po's source")
    if not said:
        return "", []
    return "Code: " + "; ".join(said) + ".", deviations


def analyse(design: Design, root: Path) -> dict:
    """Per cell and arm: the per-seed endpoints and differences, whether the records followed the design, and,
    once every seed has run, the interval and its reading."""
    wanted = set(range(1, design.seeds + 1))
    cells = []
    for cell in design.cells:
        folder = root / cell.folder
        runs, configs, machines = _runs(folder) if (folder / "results.json").exists() else ([], {}, [])
        deviations, values, commits = [], {}, {}
        for run in runs:
            if (run["eta"], run["minibatches"]) != (cell.eta, cell.minibatches):
                continue
            arm, seed = run["arm"], run["seed"]
            if arm not in (design.reference, *design.arms):
                continue
            if seed not in wanted:
                deviations.append(f"{run['key']}: seed {seed} is beyond the design's {design.seeds}")
                continue
            if not run.get("ok"):
                deviations.append(f"{run['key']}: failed (exit {run.get('returncode')})")
                continue
            config = configs.get(run["key"], {})
            for key, value in design.fixed.items():
                if _dotted(config, key) != value:
                    deviations.append(f"{run['key']}: {key} is {_dotted(config, key)!r}, the design fixed {value!r}")
            values[(arm, seed)] = endpoint(_held_out(folder, run["key"]), design.endpoint)
            commits[run.get("code_commit")] = commits.get(run.get("code_commit"), 0) + 1
        rows = []
        for arm in design.arms:
            seeds = sorted(s for s in wanted if (arm, s) in values and (design.reference, s) in values)
            diffs = [values[(arm, s)] - values[(design.reference, s)] for s in seeds]
            row = {"arm": arm, "seeds": seeds, "differences": diffs,
                   "arm_values": [values[(arm, s)] for s in seeds],
                   "reference_values": [values[(design.reference, s)] for s in seeds]}
            if len(seeds) == design.seeds:
                m, sd, lo, hi = interval(diffs, design.confidence)
                row |= {"mean": m, "sd": sd, "interval": (lo, hi), "reading": verdict(lo, hi, design.margin)}
            rows.append(row)
        cells.append({"cell": cell, "rows": rows, "deviations": deviations, "commits": commits,
                      "machines": machines})
    return {"cells": cells}


def markdown(design: Design, path: Path, result: dict) -> str:
    pct = f"{design.confidence * 100:g} %"
    lines = [f"# Equivalence: {', '.join(design.arms)} against {design.reference}", "",
             f"Written by `python -m a3po.bench.equivalence {path.name}` from the study folders' run records. "
             f"Endpoint: {design.endpoint} held-out accuracy; margin +-{design.margin:g}; {design.seeds} seeds a "
             f"cell; the {pct} paired interval (two one-sided tests at {(1 - design.confidence) / 2:g}) inside the "
             "margin reads \"equivalent\", wholly outside it \"different\", else \"undecided\".", ""]
    lines += registration(path) + [""]
    for c in result["cells"]:
        cell = c["cell"]
        lines += [f"## {cell.name} (eta {cell.eta}, {cell.minibatches} minibatch(es); `{cell.folder}`)", ""]
        for row in c["rows"]:
            done = len(row["seeds"])
            if "reading" in row:
                lo, hi = row["interval"]
                lines.append(f"**{row['arm']} - {design.reference}: {row['mean']:+.3f}, {pct} interval "
                             f"[{lo:+.3f}, {hi:+.3f}] (SD {row['sd']:.3f}, {done} seeds): {row['reading']}.**")
            else:
                lines.append(f"{row['arm']} - {design.reference}: {done} of {design.seeds} seeds have run; the test "
                             "reads once all have.")
            lines += ["", f"| seed | {design.reference} | {row['arm']} | difference |", "|---:|---:|---:|---:|"]
            lines += [f"| {s} | {r:.3f} | {a:.3f} | {d:+.3f} |" for s, r, a, d in
                      zip(row["seeds"], row["reference_values"], row["arm_values"], row["differences"])]
            lines.append("")
        code, code_deviations = provenance(path, c["commits"])
        deviations = c["deviations"] + code_deviations
        followed = "The records followed the design." if not deviations else \
            "The records did NOT follow the design: " + "; ".join(deviations) + "."
        lines += [line for line in (code, machines_line(c["machines"]), followed) if line] + [""]
    return "\n".join(lines)


def machines_line(machines: list[dict]) -> str:
    """Where the cell's runs were made (every machine its invocations ran on). `dtype: auto` computes in bf16 only
    where the CPU does so natively, so a cell made on machines that differ there mixes two precisions: said."""
    if not machines:
        return ""
    named = [f"{m.get('cpu_model')} ({'with' if m.get('avx512_bf16') else 'without'} native bf16), "
             f"{m.get('cpu_count')} cores, torch {m.get('torch')}" for m in machines]
    line = "Machines: " + "; ".join(named) + "."
    if len({bool(m.get("avx512_bf16")) for m in machines}) > 1:
        line += (" Some have native bf16 and some not: under `dtype: auto` the cell's runs were not all made in "
                 "one precision.")
    return line


def pilot(folder: Path, reference: str, arm: str, half_width: float, confidence: float) -> str:
    runs, _, _ = _runs(folder)
    by = {(r["arm"], r["seed"]): r for r in runs if r.get("ok")}
    seeds = sorted(s for (a, s) in by if a == arm and (reference, s) in by)
    if len(seeds) < 2:
        raise DesignError(f"{folder}: {arm} and {reference} share {len(seeds)} finished seed(s); the SD needs two")
    lines = [f"{arm} - {reference}, {len(seeds)} paired seeds ({', '.join(map(str, seeds))}) in {folder}:"]
    for kind in ENDPOINTS:
        try:
            diffs = [endpoint(_held_out(folder, by[(arm, s)]["key"]), kind)
                     - endpoint(_held_out(folder, by[(reference, s)]["key"]), kind) for s in seeds]
        except DesignError as e:
            lines.append(f"  {kind}: {e}")
            continue
        sd = statistics.stdev(diffs)
        lines.append(f"  {kind}: differences {', '.join(f'{d:+.3f}' for d in diffs)}; SD {sd:.4f}; "
                     f"{seeds_for(sd, half_width, confidence)} seeds for a {confidence * 100:g} % half-width of "
                     f"{half_width:g}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    cli = argparse.ArgumentParser(prog="python -m a3po.bench.equivalence", description=__doc__.split("\n")[0])
    cli.add_argument("design", nargs="?", type=Path, help="the study's design file (YAML)")
    cli.add_argument("--out", type=Path, help="write the page here (default: print it)")
    cli.add_argument("--pilot", type=Path, metavar="FOLDER", help="a pilot study folder: SD and seeds per endpoint")
    cli.add_argument("--reference", default="recompute", help="--pilot: the reference arm")
    cli.add_argument("--arm", default="loglinear", help="--pilot: the arm compared with it")
    cli.add_argument("--half-width", type=float, default=0.02, help="--pilot: the interval half-width to reach")
    cli.add_argument("--confidence", type=float, default=0.90, help="--pilot: the interval's confidence")
    opts = cli.parse_args(argv)
    try:
        if opts.pilot is not None:
            print(pilot(opts.pilot, opts.reference, opts.arm, opts.half_width, opts.confidence), end="")
            return 0
        if opts.design is None:
            raise DesignError("give a design file, or --pilot FOLDER")
        design = load_design(opts.design)
        page = markdown(design, opts.design, analyse(design, opts.design.parent))
    except DesignError as e:
        print(f"a3po.bench.equivalence: {e}", file=sys.stderr)
        return 2
    emit_page(page, opts.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

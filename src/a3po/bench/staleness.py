"""`a3po bench staleness`: how each way of handling stale data trains as the staleness bound grows.

A grid of complete `a3po train` runs (bench/runs.py, shared with `a3po bench e2e`) over
the staleness bound eta (`rollout.max_head_offpolicyness`, --etas), the optimizer steps
per batch (`actor.ppo_n_minibatches`, --minibatches), the arms below and --seeds; every
other key is the same for all runs (--preset, --config and key=value apply to each).

    a3po bench staleness                                   # eta 0,2,4,8 x minibatches 1,4 x all arms
    a3po bench staleness --preset tiny total_train_steps=4 --etas 0,2 --minibatches 1   # a quick look
    python -m a3po.bench.staleness DIR    # results.md and plots again from DIR/results.json, nothing trains

Arms:
  coupled    actor.use_decoupled_loss=false: coupled asynchronous PPO/GRPO, the behaviour
             policy stands in for the proximal one.
  recompute  decoupled PPO with the proximal log-probs recomputed by a forward pass. It runs
             as prox_logp_method=metrics, whose training is identical to recompute (the
             recomputed log-probs are what trains) and which also logs every approximation's
             error against them: the approximation-error table comes without an extra run.
  loglinear  A-3PO: the proximal log-probs interpolated by staleness, no forward pass.
  reuse      p = sg(theta): exact only with one gradient step per sample, so it runs at one
             minibatch only; its cells at other minibatch counts are skipped and listed.
Asked for by name (--arms), the separating experiments:
  recompute-noclip, loglinear-noclip   the PPO clip, the dual clip and the behaviour-weight cap
             all off: at one minibatch both give the same gradient per batch, so a gap between
             them is the pipeline's, not the method's.
  loglinear-eps04   A-3PO with eps_clip = 0.4.
  loglinear-nodual  A-3PO without the dual clip (actor.c_clip = null).
  loglinear-icepop, loglinear-geomask, recompute-tis, loglinear-cispo, loglinear-sapo
             the off-policy corrections and the other surrogates (bench/args.py CORRECTION_ARMS).

Every arm is paired with `recompute` on the same seed and held-out problems: the paired table
gives the mean difference of final held-out accuracy and its 95 % t-interval over seeds.

At eta = 0 the pipeline is synchronous: every token is fresh, every decoupled arm's proximal
policy equals the behaviour one, and its loss reduces to the coupled loss (up to the rounding
between the rollout engine's and the trainer's log-probs). So eta = 0 runs only the coupled
arm (whatever --arms says; --all-arms-at-eta0 runs them all): synchronous GRPO, the common
point every arm's line starts from. Runs go seed by seed, then eta, then minibatch count,
with the arms alternating innermost, so that drifting machine load falls on all arms.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from a3po.bench.args import (
    BASELINE,
    CORRECTION_ARMS,
    NO_CLIP_BOUNDS,
    REASON_ETA0,
    REFERENCE,
    STALENESS_ARMS,
    STEADY_AFTER,
    StalenessArgs,
)
from a3po.bench.common import json_line
from a3po.bench.report import approx_quality, mean_spread, paired_differences
from a3po.bench.runs import (
    RESULTS,
    Arm,
    Benchmark,
    PlannedRun,
    held_out,
    mean,
    read_metrics,
    run_benchmark,
    summarize_run,
    training_steps,
)
from a3po.config import Config, ConfigError, load_config
from a3po.files import atomic_write_text, write_json

NO_CLIP = tuple(  # as overrides
    f"actor.{key}={'null' if x is None else format(x, 'g')}" for key, x in NO_CLIP_BOUNDS.items())
ARMS = {a.name: a for a in (
    Arm("coupled", "coupled PPO/GRPO (the behaviour policy as proximal)", ("actor.use_decoupled_loss=false",)),
    Arm.trains_with("recompute", "decoupled PPO, proximal log-probs recomputed (run as metrics)", "metrics"),
    Arm.trains_with("loglinear", "A-3PO, loglinear interpolation", "loglinear"),
    Arm.trains_with("reuse", "p = sg(theta), one minibatch only", "reuse"),
    Arm.trains_with("recompute-noclip", "recompute, no clip, dual clip or cap", "metrics", *NO_CLIP),
    Arm.trains_with("loglinear-noclip", "loglinear, no clip, dual clip or cap", "loglinear", *NO_CLIP),
    Arm.trains_with("loglinear-eps04", "loglinear, eps_clip 0.4", "loglinear", "actor.eps_clip=0.4"),
    Arm.trains_with("loglinear-nodual", "loglinear, no dual clip", "loglinear", "actor.c_clip=null"),
    *(Arm.trains_with(name, label, "metrics" if method == "recompute" else method, *extra)
      for name, (label, method, extra) in CORRECTION_ARMS.items()),
)}
assert tuple(ARMS) == STALENESS_ARMS


def reason_single_step(method: str) -> str:
    """Why a cell of a single-step-only method (variants.py) at more than one minibatch is skipped."""
    return f"{method} is exact only with one gradient step per sample (the configuration refuses it)"


@dataclass(frozen=True)
class Cell:
    """One point of the grid; its runs differ only in the seed."""

    arm: str
    eta: int
    minibatches: int

    @property
    def key(self) -> str:
        return f"{self.arm}-eta{self.eta}-mb{self.minibatches}"

    def overrides(self) -> list[str]:
        return [*ARMS[self.arm].overrides, f"rollout.max_head_offpolicyness={self.eta}",
                f"actor.ppo_n_minibatches={self.minibatches}"]


@dataclass(frozen=True)
class Skipped:
    cell: Cell
    reason: str


def grid(args: StalenessArgs) -> tuple[list[Cell], list[Skipped]]:
    """The cells to run, in run order within one seed, and those left out with the reason."""
    cells, skipped = [], []
    for eta in args.etas:
        for mb in args.minibatches:
            for arm in _arms_at(eta, args):
                cell = Cell(arm, eta, mb)
                if eta == 0 and arm != BASELINE and not args.all_arms_at_eta0:
                    skipped.append(Skipped(cell, REASON_ETA0))
                elif ARMS[arm].single_step_only and mb != 1:
                    skipped.append(Skipped(cell, reason_single_step(ARMS[arm].method)))
                else:
                    cells.append(cell)
    return cells, skipped


def _arms_at(eta: int, args: StalenessArgs) -> list[str]:
    """The requested arms; at eta = 0 the coupled baseline comes first, requested or not."""
    return [BASELINE, *(a for a in args.arms if a != BASELINE)] if eta == 0 else list(args.arms)


def plan(args: StalenessArgs) -> tuple[list[PlannedRun], list[Skipped]]:
    """Every run's configuration, validated before anything runs: a cell the configuration
    refuses is named in a one-line ConfigError."""
    cells, skipped = grid(args)
    if not cells:
        raise ConfigError(f"nothing to run: every requested cell is skipped; {skipped[0].reason}")
    base = load_config(args.config, args.overrides, preset=args.preset)
    runs, eval_every = [], args.eval_every or base.total_train_steps
    for seed in range(base.seed, base.seed + args.seeds):
        for cell in cells:
            extra = [*cell.overrides(), f"seed={seed}", f"evaluator.freq_steps={eval_every}"]
            try:
                cfg = load_config(args.config, [*args.overrides, *extra], preset=args.preset)
            except ConfigError as e:
                raise ConfigError(f"cell '{cell.key}' ({' '.join(cell.overrides())}): {e}") from None
            fields = {"arm": cell.arm, "eta": cell.eta, "minibatches": cell.minibatches, "seed": seed}
            runs.append(PlannedRun(f"{cell.key}-seed{seed}", cfg, fields))
    return runs, skipped


# ----------------------------------------------------------------------------- one run's numbers


def summarize(rows: list[dict], cfg: Config) -> dict:
    """e2e's summary plus what the staleness study adds (metrics a run did not log are NaN/None)."""
    steps = training_steps(rows)
    eta = cfg.rollout.max_head_offpolicyness
    col = lambda k: [r.get(k) for r in steps]
    return {
        **summarize_run(rows),
        "stale_dist": stale_distribution(steps, eta),
        "stale_mean_all": token_weighted_mean(steps, "stale/mean"),
        "stale_mean_steady": token_weighted_mean(steady_steps(steps, eta), "stale/mean"),
        "step_s": mean(col("perf/step_s")),
        "rollout_wait_s": mean(col("perf/rollout_wait_s")),
        "train_s": mean(col("perf/train_s")),
        "of_bottleneck": of_bottleneck(steps),
        "clipped_frac": mean(col("loss/clipped_frac")),
        "idle_frac": mean(col("rollout/idle_frac")),
        "groups_ahead": mean(col("rollout/groups_ahead")),
        "mismatch_k3": mean(col("mismatch/k3")),
        "mismatch_abs_mean": mean(col("mismatch/abs_mean")),
        "clipped_by_d": by_staleness(steps, "loss/clipped_frac_d", eta),
        "capped_by_d": by_staleness(steps, "loss/behav_capped_frac_d", eta),
        "grad_share_neg_low_d": mean(col("loss/grad_share_neg_low_d")),
    }


def by_staleness(steps: list[dict], prefix: str, eta: int) -> list[float | None]:
    """A per-staleness fraction (`<prefix><k>`) pooled over steps by the tokens at that staleness, for every
    d = 0..eta (None where no step had a token of that staleness)."""
    out = []
    for k in range(eta + 1):
        pairs = [(r.get("train/n_tokens", 1.0) * r.get(f"stale/frac_d{k}", 0.0), r[f"{prefix}{k}"])
                 for r in steps if f"{prefix}{k}" in r]
        total = sum(w for w, _ in pairs)
        out.append(sum(w * x for w, x in pairs) / total if total else None)
    return out


def of_bottleneck(steps: list[dict]) -> float:
    """How close the run's steps come to its slower side, measured in the run itself: per step,
    the trainer is busy T = step - rollout wait and the workers R = (1 - idle share) * step,
    so a perfect overlap takes max(T, R); returns sum of max(T, R) over sum of step times.
    Contention between the two processes (memory bandwidth on a small machine) inflates T and R
    alike and so does not count against the overlap here; it does in the speed against sync."""
    pairs = [(r["perf/step_s"], r["perf/rollout_wait_s"], r.get("rollout/idle_frac")) for r in steps
             if r.get("perf/step_s") and r.get("rollout/idle_frac") is not None]
    total = sum(step for step, _, _ in pairs)
    if not total:
        return math.nan
    return sum(max(step - wait, (1 - idle) * step) for step, wait, idle in pairs) / total


def steady_steps(steps: list[dict], eta: int) -> list[dict]:
    """The steps after the first eta + 2: before them the pipeline is still filling up and
    staleness cannot yet reach its steady level."""
    return [r for r in steps if r["step"] > eta + STEADY_AFTER]


def token_weighted_mean(steps: list[dict], key: str) -> float:
    """Mean of a per-step mean over the steps that logged it, weighted by the step's tokens
    (so that the mean staleness equals sum(d * share_d) of the pooled distribution)."""
    pairs = [(r.get("train/n_tokens", 1.0), r[key]) for r in steps if r.get(key) is not None]
    total = sum(w for w, _ in pairs)
    return sum(w * x for w, x in pairs) / total if total else math.nan


def stale_distribution(steps: list[dict], eta: int) -> list[float] | None:
    """Share of the run's tokens at each staleness d = 0..eta, pooled over steps by their
    token count; None when no step logged `stale/frac_d<k>`. A share above eta (a broken
    bound) is kept, so that it shows."""
    logged = [r for r in steps if any(k.startswith("stale/frac_d") for k in r)]
    if not logged:
        return None
    top = max(eta, *(int(k[len("stale/frac_d"):]) for r in logged for k in r if k.startswith("stale/frac_d")))
    weights = [r.get("train/n_tokens", 1.0) for r in logged]
    total = sum(weights)
    if not total:
        return None
    return [sum(w * r.get(f"stale/frac_d{d}", 0.0) for w, r in zip(weights, logged)) / total for d in range(top + 1)]


# ----------------------------------------------------------------------------- the tables


SCALARS = ("train_wall_s", "step_s", "rollout_wait_s", "train_s", "of_bottleneck", "eval_initial", "eval_final",
           "first_turn_final", "reward_final", "clipped_frac", "capped_frac", "idle_frac", "mismatch_k3",
           "mismatch_abs_mean", "stale_mean_all", "stale_mean_steady", "stale_max", "groups_ahead")


def cell_of(run: dict) -> Cell:
    return Cell(run["arm"], run["eta"], run["minibatches"])


def by_cell(runs: list[dict]) -> dict[Cell, list[dict]]:
    """The finished runs of each cell, cells in the order of their first run."""
    out: dict[Cell, list[dict]] = {}
    for r in runs:
        if r.get("ok"):
            out.setdefault(cell_of(r), []).append(r)
    return out


def aggregate(runs: list[dict]) -> list[dict]:
    """One row per cell: each number's mean and min..max over seeds."""
    rows = []
    for cell, rs in by_cell(runs).items():
        row = {"cell": cell.key, "arm": cell.arm, "eta": cell.eta, "minibatches": cell.minibatches,
               "seeds": sorted(r["seed"] for r in rs)}
        row.update({k: mean_spread([r.get(k) for r in rs]) for k in SCALARS})
        row["stale_dist"] = dist_spread([r.get("stale_dist") for r in rs])
        rows.append(row)
    for row in rows:
        row.update(overlap(row, next((b for b in rows if (b["arm"], b["eta"], b["minibatches"])
                                      == (BASELINE, 0, row["minibatches"])), None)))
    return rows


def overlap(row: dict, sync: dict | None) -> dict:
    """Speed against the synchronous baseline of the same minibatch count, and how much of what
    overlapping rollout with training can gain it achieves. In the synchronous run a step is
    rollout R (all of its wait for the batch) then training T, so an asynchronous run can at best
    take max(R, T) per step: ceiling = (R + T) / max(R, T), both measured in the baseline run."""
    if sync is None or row["eta"] == 0 or not sync["step_s"]["n"] or not row["step_s"]["n"]:
        return {"speedup_vs_sync": None, "overlap_ceiling": None, "of_ceiling": None}
    step = sync["step_s"]["mean"]
    speedup = step / row["step_s"]["mean"]
    if not sync["rollout_wait_s"]["n"]:
        return {"speedup_vs_sync": speedup, "overlap_ceiling": None, "of_ceiling": None}
    rollout = sync["rollout_wait_s"]["mean"]
    ceiling = step / max(rollout, step - rollout)
    return {"speedup_vs_sync": speedup, "overlap_ceiling": ceiling, "of_ceiling": speedup / ceiling}


# the arm a variant differs from in one setting, compared with it besides REFERENCE
VARIANT_OF = {"loglinear-noclip": "recompute-noclip", "loglinear-nodual": "loglinear", "loglinear-eps04": "loglinear"}


def paired_table(runs: list[dict]) -> list[dict]:
    """For each eta and minibatch count, every arm against REFERENCE, and a variant against the arm it varies
    (VARIANT_OF); and an arm at several minibatches against itself at one (the `ppo_n_minibatches` default): all on
    the same seeds and held-out problems."""
    out = []
    cells = by_cell(runs)
    for cell, rs in cells.items():
        pairs = [(Cell(reference, cell.eta, cell.minibatches), reference)
                 for reference in dict.fromkeys([REFERENCE, VARIANT_OF.get(cell.arm, REFERENCE)])
                 if reference != cell.arm]
        if cell.minibatches != 1:
            pairs.append((Cell(cell.arm, cell.eta, 1), f"{cell.arm}, 1 minibatch"))
        for ref, label in pairs:
            if ref not in cells:
                continue
            diff = paired_differences([*(dict(r, arm="this") for r in rs),
                                       *(dict(r, arm="reference") for r in cells[ref])], "this", "reference")
            if diff is not None:
                out.append({"cell": cell.key, "arm": cell.arm, "eta": cell.eta, "minibatches": cell.minibatches,
                            "reference": label, **diff})
    return out


def dist_spread(dists: list[list[float] | None]) -> list[dict] | None:
    """Mean and min..max over seeds of each staleness share (shorter distributions: 0 beyond)."""
    dists = [d for d in dists if d]
    if not dists:
        return None
    n = max(len(d) for d in dists)
    return [mean_spread([d[k] if k < len(d) else 0.0 for d in dists]) for k in range(n)]


def approx_tables(runs: list[dict]) -> list[dict]:
    """For each recompute cell: every approximation's error against the recomputed proximal
    log-probs, pooled over steps and seeds by tokens, one row for every d = 0..eta."""
    return [{"cell": cell.key, "eta": cell.eta, "minibatches": cell.minibatches,
             "rows": every_d_rows(approx_quality(rs), cell.eta)}
            for cell, rs in by_cell(runs).items() if cell.arm == "recompute"]


def every_d_rows(rows: list[dict], eta: int) -> list[dict]:
    """approx_quality's rows with one for every d = 0..eta (and any beyond), a d that had no
    token getting a row of 0 tokens; the pooled 'all' row last."""
    have = {r["staleness"]: r for r in rows}
    top = max([eta, *(int(g[1:]) for g in have if g != "all")])
    out = [have.get(f"d{d}", {"staleness": f"d{d}", "tokens": 0}) for d in range(top + 1)]
    return out + ([have["all"]] if "all" in have else [])


# ----------------------------------------------------------------------------- running it


def run(args: StalenessArgs, argv: list[str]) -> tuple[dict, int]:
    planned, skipped = plan(args)
    n_cells = len({(p.fields["arm"], p.fields["eta"], p.fields["minibatches"]) for p in planned})

    def write(bench_dir: Path, header: dict, runs: list[dict], wall_s: float) -> dict:
        return write_results(bench_dir, {**header, "skipped": [_skip_record(s) for s in skipped]}, runs, wall_s)

    bench = Benchmark(name="staleness", plan=planned, summarize=summarize, write=write,
                      description=f"{n_cells} cells x {args.seeds} seed(s)")
    return run_benchmark(bench, args, argv)


def _skip_record(s: Skipped) -> dict:
    return {"cell": s.cell.key, "arm": s.cell.arm, "eta": s.cell.eta, "minibatches": s.cell.minibatches,
            "reason": s.reason}


def write_results(bench_dir: Path, header: dict, runs: list[dict], wall_s: float) -> dict:
    from a3po.bench.staleness_report import markdown, plot

    ran = {r["arm"] for r in runs}  # and the labels a record written before kept (regenerate, --join)
    labels = {**header.get("arm_labels", {}),
              **{a.name: f"{a.label} (`{' '.join(a.overrides)}`)" for a in ARMS.values() if a.name in ran}}
    record = {**header, "arm_labels": labels, "wall_s": wall_s, "runs": runs, "table": aggregate(runs),
              "approx": approx_tables(runs), "paired": paired_table(runs)}
    record["plots"] = plot(record["table"], bench_dir / "plots")
    write_json(bench_dir / RESULTS, record)
    (bench_dir / "results.md").write_text(markdown(record))
    return record


# what write_results computes from the runs (arm_labels it extends: the labels of the arms run)
DERIVED = ("wall_s", "runs", "table", "approx", "paired", "plots", "out")


def regenerate(bench_dir: Path) -> dict:
    """results.md, the tables and the plots again from the run records in bench_dir/results.json alone (no run
    folder needed, nothing trains): how a committed study's numbers are reproduced."""
    record = json.loads((bench_dir / RESULTS).read_text())
    header = {k: v for k, v in record.items() if k not in DERIVED}
    return write_results(bench_dir, header, [resummarized(r, bench_dir) for r in record["runs"]], record["wall_s"])


def resummarized(run: dict, bench_dir: Path) -> dict:
    """A run's record summarised again from its metrics when its folder is beside the record (a summary added since
    it ran then appears), else as recorded. Only that folder: the run_dir a record names is a path on the machine it
    ran on, and a copy of the records elsewhere (docs/results) must read its own."""
    run_dir = bench_dir / "runs" / str(run.get("key"))
    if not run.get("ok") or not (run_dir / "metrics.jsonl").exists() or not (run_dir / "config.yaml").exists():
        return run
    cfg = load_config(run_dir / "config.yaml")
    return {**run, **summarize(read_metrics(run_dir / "metrics.jsonl"), cfg),
            **held_out(run_dir, cfg.total_train_steps)}


def summary_line(record: dict) -> str:
    """The last line of stdout: the key numbers of every cell (means over seeds) as JSON."""
    pick = ("eval_initial", "eval_final", "stale_mean_all", "stale_mean_steady", "stale_max", "train_wall_s",
            "step_s", "clipped_frac", "capped_frac", "idle_frac", "mismatch_k3")
    cells = {row["cell"]: {"arm": row["arm"], "eta": row["eta"], "minibatches": row["minibatches"],
                           "seeds": len(row["seeds"]), **{k: row[k]["mean"] for k in pick}}
             for row in record["table"]}
    failed = [r["key"] for r in record["runs"] if not r.get("ok")]
    return json_line({"benchmark": "staleness", "out": record["out"], "wall_s": record["wall_s"], "cells": cells,
                      "skipped": [s["cell"] for s in record["skipped"]], "failed": failed})


def main(args: StalenessArgs, argv: list[str]) -> int:
    record, status = run(args, argv)
    print((Path(record["out"]) / "results.md").read_text())
    print(summary_line(record))
    return status


def join(into: Path, other: Path) -> dict:
    """Add the finished runs of `other`, a copy of the study folder `into` continued apart, to `into`, and
    write its page again (runs.join_records says what must agree)."""
    from a3po.bench.runs import join_records

    for f in (into, other):
        if not (f / RESULTS).is_file():
            raise ConfigError(f"{f}: no {RESULTS} there; --join takes two folders written by a3po bench staleness")
    records = [json.loads((f / RESULTS).read_text()) for f in (into, other)]
    header, runs, wall_s = join_records(*records, where=f"joining {other} into {into}")
    header = {k: v for k, v in header.items() if k not in DERIVED}
    command = f"python -m a3po.bench.staleness --join {other} {into}"
    header["commands"] = [*(c for c in header["commands"] if c != command), command]
    return write_results(into, header, runs, wall_s)


def write_summary(out: Path, folders: list[Path]) -> None:
    """The cross-folder page (staleness_report.summary) of already regenerated folders."""
    from a3po.bench.staleness_report import summary

    records = {f.name: json.loads((f / "results.json").read_text()) for f in folders}
    atomic_write_text(out, summary(records))


if __name__ == "__main__":
    import argparse

    cli = argparse.ArgumentParser(prog="python -m a3po.bench.staleness",
                                  description="Regenerate each study folder's results.md and plots from its "
                                              "results.json (trains nothing); with --summary, also one page over all.")
    cli.add_argument("folders", nargs="*", type=Path, default=[Path(".")])
    cli.add_argument("--summary", type=Path, metavar="OUT", help="write the cross-folder page here")
    cli.add_argument("--join", type=Path, metavar="OTHER",
                     help="first add the finished runs of OTHER (a copy of the one folder given, continued apart: "
                          "side by side, or on another machine) to that folder")
    opts = cli.parse_args()
    if opts.join is not None:
        if len(opts.folders) != 1:
            cli.error("--join OTHER adds to exactly one folder: python -m a3po.bench.staleness --join OTHER FOLDER")
        try:
            join(opts.folders[0], opts.join)
        except ConfigError as e:
            cli.exit(2, f"error: {e}\n")
        print(f"joined the runs of {opts.join} into {opts.folders[0]}")
    for folder in opts.folders:
        regenerate(folder)
        print(f"wrote {folder / 'results.md'}")
    if opts.summary is not None:
        write_summary(opts.summary, opts.folders)
        print(f"wrote {opts.summary}")

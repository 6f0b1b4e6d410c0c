"""Tables and plots of `a3po bench e2e` from its per-run summaries (bench/e2e.py), and the
pieces `a3po bench staleness` (bench/staleness_report.py) formats its own tables with:
mean and spread over seeds, a table cell, the approximation-error pooling, a saved figure."""

from __future__ import annotations

import math
import statistics
from pathlib import Path

from a3po.bench.args import ARM_NAMES
from a3po.files import atomic_write_text
from a3po.intervals import t_interval

# (key in a run summary, column title, format)
COLUMNS = (
    ("train_wall_s", "wall time (s)", "{:.0f}"),
    ("prox_s_per_step", "prox logp (s/step)", "{:.2f}"),
    ("train_s_per_step", "train (s/step)", "{:.2f}"),
    ("rollout_wait_s_per_step", "rollout wait (s/step)", "{:.2f}"),
    ("weight_sync_s_per_step", "weight sync (s/step)", "{:.2f}"),
    ("ranks_sync_s_per_step", "rank sync (s/step)", "{:.2f}"),
    ("idle_frac", "rollout idle frac", "{:.2f}"),
    ("service_s_per_group", "reward service (s/group)", "{:.2f}"),
    ("reward_final", "final reward", "{:.3f}"),
    ("eval_initial", "held-out acc, start", "{:.3f}"),
    ("eval_final", "held-out acc, end", "{:.3f}"),
    ("tool_use_initial", "held-out tool use, start", "{:.3f}"),
    ("tool_use_final", "held-out tool use, end", "{:.3f}"),
    ("ratio_max", "max ratio", "{:.2f}"),
    ("clipped_tokens_per_step", "clipped tokens/step", "{:.1f}"),
    ("capped_frac", "capped frac", "{:.4f}"),
)
APPROXIMATIONS = ("loglinear", "linear", "behav")


def emit_page(page: str, out: Path | None) -> None:
    """A page a records-only command wrote: to `out`, or to standard output without one."""
    if out is None:
        print(page, end="")
    else:
        atomic_write_text(out, page)
        print(f"wrote {out}")


def measured(x) -> bool:
    """A value a run measured: not None (not logged, e.g. evaluator.initial=false) and not NaN."""
    return x is not None and not math.isnan(x)


def mean_spread(xs: list) -> dict:
    xs = [x for x in xs if measured(x)]
    if not xs:
        return {"mean": math.nan, "min": math.nan, "max": math.nan, "std": math.nan, "n": 0}
    return {"mean": statistics.fmean(xs), "min": min(xs), "max": max(xs),
            "std": statistics.stdev(xs) if len(xs) > 1 else 0.0, "n": len(xs)}


def reading(p: dict) -> str:
    """The words for a paired difference (`t_interval` of per-seed differences): a one-seed interval is NaN, or
    null once read back from a results.json."""
    lo = p["interval"][0]
    if lo is None or math.isnan(lo):
        return "one seed: no interval yet"
    if all(x == 0 for x in p["values"]):
        return "identical on every seed"
    return ("better" if lo > 0 else "worse") if p["measurable"] else "no measurable difference"


def paired_differences(runs: list[dict], arm: str, reference: str) -> dict | None:
    """`arm` against `reference` on the same seeds (each seed: the same held-out problems): per seed the mean over
    problems of the difference of their final results, then the t-interval over seeds. None without a pair."""
    per_seed = {}
    for r in runs:
        if r.get("ok") and r.get("held_out_final") is not None and r["arm"] in (arm, reference):
            per_seed.setdefault(r["seed"], {})[r["arm"]] = r["held_out_final"]
    diffs = [statistics.fmean(a - b for a, b in zip(pair[arm], pair[reference]))
             for _, pair in sorted(per_seed.items()) if len(pair) == 2 and len(pair[arm]) == len(pair[reference])]
    return t_interval(diffs) if diffs else None


def against_first_arm(runs: list[dict], arms: list[str]) -> list[str]:
    """The markdown table of every other arm against the first one, paired by seed over the same held-out
    problems (`paired_differences`); nothing when no arm has two seeds paired."""
    pairs = [(arm, paired_differences(runs, arm, arms[0])) for arm in arms[1:]]
    pairs = [(arm, p) for arm, p in pairs if p is not None and p["n"] > 1]
    if not pairs:
        return []
    lines = ["", f"## Against {arms[0]}, paired by seed", "",
             f"Per seed, the mean over the same held-out problems of the arm's final result minus {arms[0]}'s; "
             "mean and a 95 % Student-t interval over seeds. An interval that contains 0 is no measurable "
             "difference.", "", "| arm | seeds | per seed | mean | 95 % interval | reading |",
             "|---|---:|---|---:|---|---|"]
    for arm, p in pairs:
        lo, hi = p["interval"]
        lines.append(f"| {arm} | {p['n']} | {', '.join(f'{x:+.3f}' for x in p['values'])} | {p['mean']:+.3f} | "
                     f"[{lo:+.3f}, {hi:+.3f}] | {reading(p)} |")
    return lines


def held_out_gains(runs: list[dict]) -> dict[str, dict]:
    """Per arm: the paired held-out gains (end - start) of its seeds, their mean, std and 95 % t-interval."""
    out = {}
    for arm, rs in _by_arm(runs).items():
        xs = [r["eval_final"] - r["eval_initial"] for r in rs
              if measured(r.get("eval_final")) and measured(r.get("eval_initial"))]
        if xs:
            out[arm] = t_interval(xs)
    return out


def task_line(d: dict) -> str:
    """The task of a run's train_dataset config, and its environment if it has one."""
    env = f" in environment `{d['env']}` (up to {d['max_turns']} turns)" if d.get("env") else ""
    return f"`{d['task']}`{env}"


def _by_arm(runs: list[dict]) -> dict[str, list[dict]]:
    """Finished runs by arm, the arms in their declared order (ARM_NAMES): a study grown over several
    invocations reads the same, and compares against the same first arm, whatever order they ran in."""
    out: dict[str, list[dict]] = {}
    for r in sorted(runs, key=lambda r: ARM_NAMES.index(r["arm"]) if r["arm"] in ARM_NAMES else len(ARM_NAMES)):
        if r.get("ok"):
            out.setdefault(r["arm"], []).append(r)
    return out


def aggregate(runs: list[dict]) -> list[dict]:
    """One row per arm: each column's mean and spread over seeds, and the wall-time speedups."""
    rows = []
    for arm, rs in _by_arm(runs).items():
        row = {"arm": arm, "seeds": sorted(r["seed"] for r in rs)}
        for key, _, _ in COLUMNS:
            row[key] = mean_spread([r.get(key) for r in rs])  # results of an older a3po may lack a column
        rows.append(row)
    wall = {row["arm"]: row["train_wall_s"]["mean"] for row in rows}
    for row in rows:
        for ref in ("sync", "recompute"):
            row[f"speedup_vs_{ref}"] = wall[ref] / row["train_wall_s"]["mean"] if ref in wall else None
    return rows


def approx_quality(runs: list[dict]) -> list[dict]:
    """Error of each approximation against the recomputed proximal log-probs, pooled over
    steps and seeds by token count, per staleness d and overall (`metrics` runs only)."""
    sums: dict[str, dict[str, float]] = {}  # group -> key -> token-weighted sum
    for r in runs:
        for step in r.get("prox_err_steps") or []:
            counts = {k.rsplit("/", 1)[1]: n for k, n in step.items() if k.startswith("prox_err/tokens/")}
            for d, n in counts.items():
                for group in (d, "all"):
                    acc = sums.setdefault(group, {"tokens": 0.0})
                    acc["tokens"] += n
                    for name in APPROXIMATIONS:
                        for kind in ("abs", "rel", "iw"):
                            key = f"{name}/{kind}"
                            acc[key] = acc.get(key, 0.0) + n * step.get(f"prox_err/{key}/{d}", math.nan)
    out = []
    order = sorted((g for g in sums if g != "all"), key=lambda g: int(g[1:])) + (["all"] if sums else [])
    for group in order:
        acc = sums[group]
        row = {"staleness": group, "tokens": int(acc["tokens"])}
        row.update({k: v / acc["tokens"] for k, v in acc.items() if k != "tokens" and acc["tokens"]})
        out.append(row)
    return out


def format_cell(stat: dict, fmt: str) -> str:
    """mean, or mean (min..max) over several seeds; '-' where nothing was measured."""
    if stat["n"] == 0:
        return "-"
    text = fmt.format(stat["mean"])
    if stat["n"] > 1:
        text += f" ({fmt.format(stat['min'])}..{fmt.format(stat['max'])})"
    return text


def markdown(record: dict, bench_dir: Path) -> str:
    table, approx = record["table"], record["approx"]
    any_cfg = next(iter(record["configs"].values()))
    a, g, d = any_cfg["actor"], any_cfg["gconfig"], any_cfg["train_dataset"]
    eta = max(c["rollout"]["max_head_offpolicyness"] for c in record["configs"].values())
    seeds = record["args"]["seeds"]
    lines = [
        "# a3po bench e2e",
        "",
        f"Command: `{record['command']}`",
        "",
        f"Model `{a['path']}`, task {task_line(d)}, {any_cfg['total_train_steps']} steps of {d['batch_size']} "
        f"prompts x "
        f"{g['n_samples']} samples, eta = {eta} for the asynchronous arms; {seeds} seed(s)"
        + (" (cells: mean (min..max))" if seeds > 1 else "")
        + f"; {record['cpu_count']} CPUs, torch {record['torch']}; "
          f"benchmark wall time {record['wall_s'] / 60:.1f} min.",
        "Wall time is the training loop's (sum of `perf/step_s`), without start-up and evaluation. "
        "Final reward: mean task reward of the last 4 steps. "
        "Held-out accuracy: greedy, at step 0 and after the last step.",
        "",
        "## End to end",
        "",
        "| arm | " + " | ".join(title for _, title, _ in COLUMNS) + " | sync / this | recompute / this |",
        "|---|" + "---:|" * (len(COLUMNS) + 2),
    ]
    for row in table:
        cells = [format_cell(row[key], fmt) for key, _, fmt in COLUMNS]
        cells += [f"{row[k]:.2f}x" if row[k] else "-" for k in ("speedup_vs_sync", "speedup_vs_recompute")]
        lines.append(f"| {row['arm']} | " + " | ".join(cells) + " |")
    gains = held_out_gains(record["runs"])
    if any(g["n"] > 1 for g in gains.values()):
        lines += [
            "",
            "## Held-out gain over the initial policy",
            "",
            "Per seed, accuracy after the last step minus at step 0 (the same held-out set and starting model, so "
            "the difference is paired); mean, sample std and a 95 % Student-t interval over seeds. An interval that "
            "contains 0 is no measurable gain.",
            "",
            "| arm | seeds | gains | mean | std | 95 % interval |",
            "|---|---:|---|---:|---:|---|",
        ]
        for arm, g in gains.items():
            lo, hi = g["interval"]
            lines.append(f"| {arm} | {g['n']} | {', '.join(f'{x:+.3f}' for x in g['values'])} | {g['mean']:+.3f} | "
                         f"{g['std']:.3f} | [{lo:+.3f}, {hi:+.3f}] |")
    lines += against_first_arm(record["runs"], [row["arm"] for row in table])
    if approx:
        lines += [
            "",
            "## Proximal approximation quality (`metrics` run)",
            "",
            "Error against the recomputed proximal log-probs p, pooled over steps and seeds by tokens. "
            "abs = mean |p_hat - p|, rel = mean |exp(p_hat - p) - 1|; "
            "`behav` is p_hat = b (what the coupled loss uses).",
            "",
            "| staleness d | tokens | loglinear abs | loglinear rel "
            "| linear abs | linear rel | behav abs | behav rel |",
            "|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for row in approx:
            vals = [row.get(f"{n}/{k}", math.nan) for n in APPROXIMATIONS for k in ("abs", "rel")]
            lines.append(f"| {row['staleness'].lstrip('d')} | {row['tokens']} | "
                         + " | ".join(f"{v:.2e}" for v in vals) + " |")
    if record.get("plots"):
        lines += ["", "## Plots", ""]
        for name in record["plots"]:
            lines.append(f"![{name}](plots/{name})")
    failed = [r for r in record["runs"] if not r.get("ok")]
    if failed:
        lines += ["", "## Failed runs", ""]
        lines += [f"- {r['arm']} seed {r['seed']}: exit {r['returncode']}: {r['error']} (log: {r['log']})"
                  for r in failed]
    return "\n".join(lines) + "\n"


SMOOTH = 4  # reward curves: trailing mean over this many steps (a batch of 16 samples is noisy)
PLOTS = (  # file, x curve, y curve, x label, y label
    ("reward_vs_step.png", "step", "reward", "training step", f"task reward ({SMOOTH}-step trailing mean)"),
    ("reward_vs_time.png", "time_s", "reward", "training wall time (s)", f"task reward ({SMOOTH}-step trailing mean)"),
    ("clipped_tokens_per_step.png", "step", "clipped_tokens", "training step", "clipped tokens"),
    ("ratio_max_per_step.png", "step", "ratio_max", "training step", "max trust-region ratio"),
)


def trailing_mean(xs: list[float], k: int) -> list[float]:
    return [statistics.fmean(xs[max(0, i - k + 1) : i + 1]) for i in range(len(xs))]


def pyplot():
    """matplotlib's pyplot drawing to files only (no display on a server)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, ax, path: Path, xlabel: str, ylabel: str, legend_outside: bool = False) -> None:
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if legend_outside:  # right of the plot, where it hides no bar
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    else:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    pyplot().close(fig)


def plot(runs: list[dict], out: Path) -> list[str]:
    """One PNG per plot; each arm's curve is its mean over seeds, the band its min..max."""
    plt = pyplot()
    by_arm = _by_arm(runs)
    if not by_arm:
        return []
    out.mkdir(parents=True, exist_ok=True)
    names = []
    for fname, xk, yk, xlabel, ylabel in PLOTS:
        fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=100)
        for arm, rs in by_arm.items():
            n = min(len(r["curves"][yk]) for r in rs)
            if n == 0:
                continue
            x = [statistics.fmean(r["curves"][xk][i] for r in rs) for i in range(n)]
            curves = [trailing_mean(r["curves"][yk], SMOOTH if yk == "reward" else 1) for r in rs]
            ys = [[c[i] for c in curves] for i in range(n)]
            line, = ax.plot(x, [statistics.fmean(y) for y in ys], marker="o", markersize=3, label=arm)
            if len(rs) > 1:
                ax.fill_between(x, [min(y) for y in ys], [max(y) for y in ys], color=line.get_color(), alpha=0.2)
        save_figure(fig, ax, out / fname, xlabel, ylabel)
        names.append(fname)
    return names

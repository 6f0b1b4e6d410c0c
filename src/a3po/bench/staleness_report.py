"""results.md and the plots of `a3po bench staleness` (bench/staleness.py), from its cell table.

Written after every finished run by `a3po bench staleness`, and again from a folder's
results.json alone by `python -m a3po.bench.staleness DIR` (staleness.py). The cells'
arithmetic (pooling, means over seeds, pairing) lives in staleness.py, only layout lives here.
"""

from __future__ import annotations

import math
from pathlib import Path

from a3po.bench.args import BASELINE, REASON_ETA0, STALENESS_DEFAULT_ARMS, STEADY_AFTER
from a3po.bench.report import APPROXIMATIONS, format_cell, pyplot, reading, save_figure, task_line

# (key in a cell row, column title, format)
TRAINING = (
    ("train_wall_s", "wall time (s)", "{:.1f}"),
    ("step_s", "s/step", "{:.2f}"),
    ("rollout_wait_s", "rollout wait (s/step)", "{:.2f}"),
    ("train_s", "train (s/step)", "{:.2f}"),
    ("of_bottleneck", "of bottleneck", "{:.0%}"),
    ("eval_initial", "held-out acc, start", "{:.3f}"),
    ("eval_final", "held-out acc, end", "{:.3f}"),
    ("first_turn_final", "of it by the first turn", "{:.3f}"),  # shown where an environment logged it
    ("reward_final", "final reward", "{:.3f}"),
    ("clipped_frac", "clipped frac", "{:.4f}"),
    ("capped_frac", "capped frac", "{:.4f}"),
    ("idle_frac", "rollout idle frac", "{:.2f}"),
    ("mismatch_k3", "mismatch k3", "{:.1e}"),
    ("mismatch_abs_mean", "mismatch mean abs", "{:.1e}"),
)
STALENESS = (
    ("stale_mean_all", "mean d", "{:.2f}"),
    ("stale_mean_steady", "steady-state mean d", "{:.2f}"),
    ("stale_max", "max d", "{:.0f}"),
)
SHARE = "{:.0%}"


def markdown(record: dict) -> str:
    table = record["table"]
    multi_turn = any(row.get("first_turn_final", {}).get("n") for row in table)
    columns = tuple(c for c in TRAINING if multi_turn or c[0] != "first_turn_final")
    lines = _header(record) + ["", "## Training", "", *_table(table, columns, speed=True), "",
                               *_training_notes(multi_turn)]
    if record.get("paired"):
        lines += ["", "## Against recompute (and variants against their arm), paired by seed", "",
                  *_paired_table(record["paired"]), "", *_paired_notes()]
    if any(any(x is not None for x in r.get("clipped_by_d") or []) for r in record["runs"]):
        lines += ["", "## Where the clip and the cap act, by staleness", "", *_by_d_table(record), "",
                  *_by_d_notes()]
    lines += ["", "## Consumed staleness", "", *_staleness_table(table, record["args"]["etas"]), "",
              *_staleness_notes()]
    if record["approx"]:
        lines += ["", "## Proximal approximation error (recompute cells)", "", *_approx_notes()]
        for t in record["approx"]:
            lines += ["", f"### eta = {t['eta']}, {t['minibatches']} minibatch(es)", "", *_approx_table(t["rows"])]
    if record.get("plots"):
        lines += ["", "## Plots", ""] + [f"![{name}](plots/{name})" for name in record["plots"]]
    failed = [r for r in record["runs"] if not r.get("ok")]
    if failed:
        lines += ["", "## Failed runs", ""]
        lines += [f"- {r['key']}: exit {r['returncode']}: {r['error']} (log: {r['log']})" for r in failed]
    return "\n".join(lines) + "\n"


def _machines(record: dict) -> str:
    """'Machine: ...', or every machine in the order the folder's invocations ran on them."""
    def one(m: dict) -> str:
        bf16 = "with" if m["avx512_bf16"] else "without"
        return f"{m['cpu_model']} ({bf16} AVX512-BF16), {m['cpu_count']} CPUs, torch {m['torch']}"
    machines = record.get("machines") or [record]
    if len(machines) == 1:
        return f"Machine: {one(machines[0])}"
    return f"Machines (its invocations ran on {len(machines)}, in this order): " + "; ".join(map(one, machines))


def _header(record: dict) -> list[str]:
    args = record["args"]
    cfg = next(iter(record["configs"].values()))
    a, g, d = cfg["actor"], cfg["gconfig"], cfg["train_dataset"]
    commands = record.get("commands") or [record["command"]]
    runs = [r for r in record["runs"] if r.get("ok")] or [{"eta": e, "minibatches": m, "arm": x, "seed": 0}
                                                         for e in args["etas"] for m in args["minibatches"]
                                                         for x in args["arms"]]
    n_seeds = len({r["seed"] for r in runs}) if record["runs"] else args["seeds"]
    lines = [
        "# a3po bench staleness",
        "",
        *([f"Command: `{commands[0]}`"] if len(commands) == 1 else
          [("Commands (each continued the same folder; a --join added the runs a copy of it made elsewhere):"
            if any(" --join " in c for c in commands) else "Commands (each continued the same folder):"),
           "", *(f"- `{c}`" for c in commands)]),
        "",
        f"{_machines(record)}; benchmark wall time {record['wall_s'] / 60:.1f} min.",
        "",
        f"Model `{a['path']}`, task {task_line(d)}, {cfg['total_train_steps']} steps of {d['batch_size']} prompts x "
        f"{g['n_samples']} samples; eta (`rollout.max_head_offpolicyness`) {_csv(sorted({r['eta'] for r in runs}))}, "
        f"minibatches (`actor.ppo_n_minibatches`) {_csv(sorted({r['minibatches'] for r in runs}))}, arms "
        f"{', '.join(dict.fromkeys(r['arm'] for r in runs))}; "
        f"{n_seeds} seed(s)" + (" (cells: mean (min..max) over seeds)" if n_seeds > 1 else "") + ".",
        "",
        ("Arms: `coupled` = coupled PPO/GRPO (`actor.use_decoupled_loss=false`); `recompute` = decoupled PPO with the "
         "proximal log-probs recomputed, run as `prox_logp_method=metrics`: it trains exactly like recompute (the "
         "recomputed log-probs are what trains) and also logs every approximation's error against them, which gives "
         "the approximation-error table below (its time includes that logging); `loglinear` = A-3PO; `reuse` = "
         "p = sg(theta)." + _variant_arms(record, runs)),
        "",
        f"At eta = 0 only the `{BASELINE}` arm runs" + (" by default" if not args["all_arms_at_eta0"] else "")
        + ": the pipeline is synchronous, every decoupled arm's proximal policy equals the behaviour one and its loss "
        "reduces to the coupled loss, so this synchronous GRPO run is the shared baseline every arm's line starts "
        "from (in the plots too).",
    ]
    skipped = [s for s in record["skipped"] if s["reason"] != REASON_ETA0]
    if skipped:
        lines += ["", "Skipped cells: " + ", ".join(f"`{s['cell']}`" for s in skipped) + f" ({skipped[0]['reason']})."]
    return lines


def _variant_arms(record: dict, runs: list[dict]) -> str:
    labels = record.get("arm_labels", {})
    extra = [a for a in dict.fromkeys(r["arm"] for r in runs) if a not in STALENESS_DEFAULT_ARMS and a in labels]
    return "".join(f" `{a}` = {labels[a]}." for a in extra)


def _csv(xs: list) -> str:
    return ", ".join(map(str, xs))


def _cell_columns(row: dict) -> list[str]:
    return [row["arm"], str(row["eta"]), str(row["minibatches"])]


def _table(table: list[dict], columns: tuple, speed: bool = False) -> list[str]:
    extra = ["sync / this", "overlap ceiling", "of ceiling"] if speed else []
    out = ["| arm | eta | minibatches | " + " | ".join([title for _, title, _ in columns] + extra) + " |",
           "|---|---:|---:|" + "---:|" * (len(columns) + len(extra))]
    for row in table:
        cells = _cell_columns(row) + [format_cell(row[k], fmt) for k, _, fmt in columns]
        if speed:
            cells += [_opt(row.get("speedup_vs_sync"), "{:.2f}x"), _opt(row.get("overlap_ceiling"), "{:.2f}x"),
                      _opt(row.get("of_ceiling"), "{:.0%}")]
        out.append("| " + " | ".join(cells) + " |")
    return out


def _paired_table(rows: list[dict]) -> list[str]:
    out = ["| arm | against | eta | minibatches | seeds | mean difference | per seed | 95 % interval | reading |",
           "|---|---|---:|---:|---:|---:|---|---|---|"]
    for r in rows:
        lo, hi = r["interval"]
        interval = "-" if lo is None or math.isnan(lo) else f"[{lo:+.3f}, {hi:+.3f}]"
        out.append(f"| {r['arm']} | {r['reference']} | {r['eta']} | {r['minibatches']} | {r['n']} | {r['mean']:+.3f} | "
                   f"{', '.join(f'{x:+.3f}' for x in r['values'])} | {interval} | {reading(r)} |")
    return out


def summary(records: dict[str, dict]) -> str:
    """One page over several study folders (name -> results.json): every paired comparison of all of them in one
    table, marked lockstep (paired staleness, repeatable) or free-running (timing decides the staleness) and with
    the environment where episodes have turns, then each folder's cells (held-out accuracy at the end, mean and
    range over seeds). A folder holds one yardstick and one mode, so its first run's configuration speaks for it."""
    configs = {name: next(iter(r["configs"].values())) for name, r in records.items()}
    modes = {name: "lockstep" if cfg["rollout"].get("lockstep") else "free-running" for name, cfg in configs.items()}
    envs = {name: cfg["train_dataset"].get("env") for name, cfg in configs.items()}
    rows = [{**p, "arm": f"{p['arm']} ({modes[name]}" + (f", `{envs[name]}` multi-turn)" if envs[name] else ")")}
            for name, r in records.items() for p in r.get("paired", [])]
    lines = ["# The evidence study, every folder", "",
             "Written by `python -m a3po.bench.staleness --summary OUT DIR ...` from the folders' results.json.", "",
             "## Every paired comparison", "", *_paired_table(rows), "", *_paired_notes(), "", _by_chance(rows)]
    for name, record in records.items():
        cfg = configs[name]
        lines += ["", f"## {name} ({modes[name]}, {cfg['total_train_steps']} steps, task "
                      f"{task_line(cfg['train_dataset'])})", "",
                  "| arm | eta | minibatches | seeds | held-out acc, end: mean (min..max) |",
                  "|---|---:|---:|---:|---|"]
        for row in record["table"]:
            acc = row["eval_final"]
            spread = "-" if acc["mean"] is None else f"{acc['mean']:.3f} ({acc['min']:.3f}..{acc['max']:.3f})"
            lines.append(f"| {row['arm']} | {row['eta']} | {row['minibatches']} | {len(row['seeds'])} | {spread} |")
    return "\n".join(lines) + "\n"


def _by_d_table(record: dict) -> list[str]:
    """Per cell: clipped and capped fractions at each staleness d (means over seeds), and the gradient share."""
    cells: dict[str, list[dict]] = {}
    for r in record["runs"]:
        if r.get("ok") and r.get("clipped_by_d") is not None:
            cells.setdefault(f"{r['arm']}|{r['eta']}|{r['minibatches']}", []).append(r)
    top = max(len(r["clipped_by_d"]) for rs in cells.values() for r in rs)
    out = ["| arm | eta | minibatches | " + " | ".join(f"d = {d}" for d in range(top)) + " | A < 0, d <= 2 share |",
           "|---|---:|---:|" + "---|" * top + "---:|"]
    for key, rs in cells.items():
        parts = []
        for d in range(top):
            c, k = _seed_mean(rs, "clipped_by_d", d), _seed_mean(rs, "capped_by_d", d)
            parts.append("-" if c is None else f"{c:.2%} / {k:.2%}")
        shares = [r["grad_share_neg_low_d"] for r in rs if r.get("grad_share_neg_low_d") is not None]
        share = f"{sum(shares) / len(shares):.1%}" if shares else "-"
        out.append(f"| {' | '.join(key.split('|'))} | {' | '.join(parts)} | {share} |")
    return out


def _seed_mean(runs: list[dict], field: str, d: int) -> float | None:
    xs = [r[field][d] for r in runs if d < len(r[field]) and r[field][d] is not None]
    return sum(xs) / len(xs) if xs else None


def _by_d_notes() -> list[str]:
    return [("Per staleness d: the share of that staleness's tokens where the PPO clip won / where the behaviour "
             "weight exp(p - b) passed its cap (`loss/clipped_frac_d<k>`, `loss/behav_capped_frac_d<k>`), pooled "
             "over steps by tokens, mean over seeds; '-': no token of that staleness. Last column: the share of the "
             "update's per-token weight |dloss/dtheta_t| on tokens with A < 0 and d <= 2 "
             "(`loss/grad_share_neg_low_d`), mean over steps and seeds.")]


def _paired_notes() -> list[str]:
    return [("Final held-out accuracy of each arm minus the reference's, on the same seed (same held-out problems, "
             "and with rollout.lockstep the same staleness at every step): per seed the mean over problems, then the "
             "mean over seeds and its 95 % Student-t interval. An interval that holds 0 is no measurable "
             "difference.")]


def _by_chance(rows: list[dict]) -> str:
    """How many of the page's readings chance alone would make: a 95 % interval excludes 0 one time in 20 when
    the arms do not differ, so among many comparisons a few read "better" or "worse" anyway. The expected count
    holds however the comparisons depend on each other (they share references)."""
    tested = [r for r in rows if reading(r) in ("better", "worse", "no measurable difference")]
    measurable = sum(reading(r) != "no measurable difference" for r in tested)
    return (f"{len(tested)} of these comparisons have an interval, and {measurable} of them read better or worse. "
            f"If no arm differed from its reference, about {len(tested) / 20:.1f} would read so by chance alone "
            "(each interval is 95 %): a lone reading decides nothing until more seeds confirm it.")


def _opt(x: float | None, fmt: str) -> str:
    return "-" if x is None or math.isnan(x) else fmt.format(x)


def _training_notes(multi_turn: bool) -> list[str]:
    first = (" Of it by the first turn: the share solved by the episode's first answer (`eval/first_turn_accuracy`); "
             "the rest the later turns added." if multi_turn else "")
    return [
        ("Wall time: the training loop's (sum of `perf/step_s`), without start-up and evaluation; s/step its mean. "
         f"Held-out accuracy: greedy, at step 0 and after the last step.{first} Final reward: mean task reward of "
         "the last 4 steps. Clipped / capped frac: mean over steps of `loss/clipped_frac` (trust-region clip won) and "
         "`loss/behav_capped_frac` (behaviour weight above its cap). Rollout idle frac: mean of `rollout/idle_frac` "
         "(workers waiting for admission or weights). Mismatch: mean of `mismatch/k3` and `mismatch/abs_mean` over the "
         "steps that logged them, the trainer's log-probs against the rollout engine's on tokens of staleness 0 "
         "(same weights, so only numerics differ). '-': not logged by this training loop. sync / this: the synchronous "
         "baseline's s/step over this cell's (same minibatch count); overlap ceiling: what overlapping rollout and "
         "training can gain at most, (R + T) / max(R, T) with R the baseline's rollout wait and T the rest of its "
         "step; of ceiling: the first over the second. train: `perf/train_s` (the update alone). Of bottleneck: "
         "the overlap measured inside the run, sum over steps of max(trainer busy, workers busy) over the sum of step "
         "times (trainer busy = step - rollout wait, workers busy = (1 - idle share) x step)."),
    ]


def _staleness_table(table: list[dict], etas: list[int]) -> list[str]:
    top = max([max(etas), *(len(row["stale_dist"]) - 1 for row in table if row["stale_dist"])])
    lines = _table(table, STALENESS)
    lines[0] += "".join(f" d={d} |" for d in range(top + 1))
    lines[1] += "---:|" * (top + 1)
    for i, row in enumerate(table):
        dist = row["stale_dist"]
        shares = [format_cell(dist[d], SHARE) if dist and d < len(dist) else "-" if d <= row["eta"] else ""
                  for d in range(top + 1)]
        lines[i + 2] += "".join(f" {s} |" for s in shares)
    return lines


def _staleness_notes() -> list[str]:
    return [
        ("Consumed staleness d = trainer version - the version that generated the token, over the tokens each step "
         "trained on. Mean d: over all steps, weighted by the step's tokens (`train/n_tokens`); steady state: over the "
         f"steps after the first eta + {STEADY_AFTER}, once the pipeline has filled. d=k: share of tokens at "
         "staleness k (`stale/frac_d<k>`), pooled over steps by token count; '-' where the run did not log it."),
    ]


def _approx_notes() -> list[str]:
    return [
        ("Error of each approximation p_hat against the recomputed proximal log-probs p, pooled over steps and seeds "
         "by tokens, for every staleness d = 0..eta ('-': no token had that staleness). abs = mean |p_hat - p|, "
         "rel = mean |exp(p_hat - p) - 1|; `behav` is p_hat = b, what the coupled loss uses."),
    ]


def _approx_table(rows: list[dict]) -> list[str]:
    kinds = ("abs", "rel")
    out = ["| staleness d | tokens | " + " | ".join(f"{n} {k}" for n in APPROXIMATIONS for k in kinds) + " |",
           "|---|---:|" + "---:|" * (len(APPROXIMATIONS) * len(kinds))]
    for row in rows:
        vals = [_err(row, f"{n}/{k}") for n in APPROXIMATIONS for k in kinds]
        out.append(f"| {row['staleness'].lstrip('d')} | {row['tokens']} | " + " | ".join(vals) + " |")
    return out


def _err(row: dict, key: str) -> str:
    v = row.get(key)
    return "-" if not row["tokens"] or v is None or math.isnan(v) else f"{v:.2e}"


# ----------------------------------------------------------------------------- plots


PLOTS = (  # file, cell-row key, y label
    ("accuracy_vs_eta.png", "eval_final", "held-out accuracy after the last step"),
    ("clipped_frac_vs_eta.png", "clipped_frac", "clipped fraction (mean over steps)"),
)


def lines_by_eta(table: list[dict]) -> dict[str, list[dict]]:
    """Each plotted line: one per arm and minibatch count, its cells in eta order, starting
    from the coupled eta = 0 cell of its minibatch count when the arm has no eta = 0 cell of
    its own (the shared synchronous baseline)."""
    cells = {(r["arm"], r["eta"], r["minibatches"]): r for r in table}
    several_mb = len({r["minibatches"] for r in table}) > 1
    out: dict[str, list[dict]] = {}
    for arm, mb in dict.fromkeys((r["arm"], r["minibatches"]) for r in table):
        own = sorted((r for r in table if (r["arm"], r["minibatches"]) == (arm, mb)), key=lambda r: r["eta"])
        start = cells.get((BASELINE, 0, mb))
        if start is not None and own[0]["eta"] > 0:
            own = [start, *own]
        out[f"{arm} mb{mb}" if several_mb else arm] = own
    return out


def plot(table: list[dict], out: Path) -> list[str]:
    """The PNGs against eta (mean over seeds, band min..max), and the staleness distribution."""
    if not table:
        return []
    out.mkdir(parents=True, exist_ok=True)
    plt = pyplot()
    lines = lines_by_eta(table)
    etas = sorted({r["eta"] for r in table})
    names = []
    for fname, key, ylabel in PLOTS:
        fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=100)
        for label, rows in lines.items():
            rows = [r for r in rows if r[key]["n"]]
            if not rows:
                continue
            x = [r["eta"] for r in rows]
            line, = ax.plot(x, [r[key]["mean"] for r in rows], marker="o", markersize=4, label=label,
                            linestyle="--" if " mb" in label and not label.endswith(" mb1") else "-")
            if any(r[key]["n"] > 1 for r in rows):
                ax.fill_between(x, [r[key]["min"] for r in rows], [r[key]["max"] for r in rows],
                                color=line.get_color(), alpha=0.2)
        ax.set_xticks(etas)
        save_figure(fig, ax, out / fname, "staleness bound eta (rollout.max_head_offpolicyness)", ylabel)
        names.append(fname)
    if any(r["stale_dist"] for r in table):
        _plot_distribution(plt, table, out / "staleness_distribution.png")
        names.append("staleness_distribution.png")
    return names


def _plot_distribution(plt, table: list[dict], path: Path) -> None:
    """One stacked bar per cell (grouped by eta): the share of tokens at each staleness d."""
    rows = sorted((r for r in table if r["stale_dist"]), key=lambda r: r["eta"])
    top = max(len(r["stale_dist"]) for r in rows)
    several_mb = len({r["minibatches"] for r in table}) > 1
    fig, ax = plt.subplots(figsize=(max(6.4, 0.5 * len(rows) + 2), 4.4), dpi=100)
    colors = plt.get_cmap("viridis")([d / max(1, top - 1) for d in range(top)])
    bottom = [0.0] * len(rows)
    for d in range(top):
        share = [r["stale_dist"][d]["mean"] if d < len(r["stale_dist"]) else 0.0 for r in rows]
        ax.bar(range(len(rows)), share, bottom=bottom, color=colors[d], label=f"d={d}")
        bottom = [b + s for b, s in zip(bottom, share)]
    labels = [f"eta {r['eta']}\n{r['arm']}" + (f" mb{r['minibatches']}" if several_mb else "") for r in rows]
    ax.set_xticks(range(len(rows)), labels, fontsize=7, rotation=90)
    save_figure(fig, ax, path, "cell", "share of trained tokens", legend_outside=True)


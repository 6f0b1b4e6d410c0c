"""The tables of `a3po bench fidelity` (bench/fidelity.py) from its per-record rows: pooled over records, then
record by record. Torch-free, so that a results.json can be read and rewritten anywhere.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from a3po.bench.args import FIDELITY_ALL as ALL
from a3po.bench.args import FIDELITY_ARMS
from a3po.bench.report import mean_spread
from a3po.machine import machine_line

METRICS = ("cos", "rel_norm", "rel_err", "kl")


def cell_order(cell: str) -> tuple:
    """The whole update first, then d = 0, 1, ..., then A > 0, A < 0."""
    if cell == ALL:
        return (0, 0)
    if cell.startswith("d="):
        return (1, int(cell[2:]))
    return (2, cell != "A>0")


def summary(records: list[dict]) -> list[dict]:
    """Per arm and part, each metric's mean, min and max over the records that have that part (a part of one
    staleness pools the records' tokens of that d, whatever step they come from)."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for rec in records:
        for row in rec["rows"]:
            groups.setdefault((row["arm"], row["cell"]), []).append(row)
    order = sorted(groups, key=lambda k: (FIDELITY_ARMS.index(k[0]), cell_order(k[1])))
    return [{"arm": arm, "cell": cell, "records": len(groups[arm, cell]),
             "signal_tokens": sum(r["tokens"] for r in groups[arm, cell]),
             **{m: mean_spread([r[m] for r in groups[arm, cell]]) for m in METRICS}}
            for arm, cell in order]


def _num(x, fmt: str) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else fmt.format(x)


def _pooled(s: dict, fmt: str) -> str:
    if not s["n"]:
        return "-"
    if s["n"] == 1:
        return _num(s["mean"], fmt)
    return f"{_num(s['mean'], fmt)} [{_num(s['min'], fmt)}, {_num(s['max'], fmt)}]"


COS, NORM, ERR, KL, SHARE = "{:.4f}", "{:.3f}", "{:.3g}", "{:.2e}", "{:.3f}"
HEAD = "| arm | part | {extra}cos | \\|u\\| / \\|u_rec\\| | \\|u − u_rec\\| / \\|u_rec\\| | KL held-out |"
NO_UPDATE = "no update"  # the cosine of an arm that moved no parameter beyond the carried part (all masked)


def _cos(row: dict) -> str:
    return NO_UPDATE if row["rel_norm"] == 0 else _num(row["cos"], COS)


def _pooled_cos(s: dict) -> str:
    return NO_UPDATE if s["rel_norm"]["n"] and s["rel_norm"]["max"] == 0 else _pooled(s["cos"], COS)


def bounds(stats: dict, cell: str) -> tuple[float | None, float | None, float | None]:
    """Shares of tokens the clip, the dual clip and the behaviour-weight cap acted on in the arm's whole step
    (`stats`: its statistics), for a row of `cell`: all tokens for the whole update, those of staleness k for
    d=k (the engine logs no dual-clip share per d); none for a sign, whose shares the engine does not split."""
    if cell == ALL:
        return (stats.get("loss/clipped_frac"), stats.get("loss/dual_clipped_frac"),
                stats.get("loss/behav_capped_frac"))
    if cell.startswith("d="):
        k = cell[2:]
        return stats.get(f"loss/clipped_frac_d{k}"), None, stats.get(f"loss/behav_capped_frac_d{k}")
    return None, None, None


def markdown(record: dict) -> str:
    recs = record["records"]
    lines = [
        "# a3po bench fidelity", "",
        f"`{record['command']}`", "",
        f"{len(recs)} record(s) of {', '.join(record['runs'])}; {machine_line(record['machine'])}; "
        f"torch {record['torch']}; {record['wall_s']:.0f} s.", "",
        "Each arm's update u against recompute's u_rec on the same record, from the same weights and optimizer "
        "state, both net of the step's carried part (the same step with every advantage 0: AdamW's momentum). "
        "*all* is the whole step; *d=k*, *A>0*, *A<0* the step on those tokens alone, against recompute's step on "
        "the same tokens. KL held-out: KL(pi_rec || pi_arm) after the step, the mean per token of greedy "
        "continuations of held-out prompts. The recompute row is the reference replayed a second time. "
        "How to read it: docs/benchmarks.md.", "",
        "Arms: " + "; ".join(f"**{a}** {label}" for a, label in record["arms"].items()) + ".", "",
        "## Every record", "",
        "Mean over the records that have the part [min, max].", "",
        HEAD.format(extra="records | "), "|---|---|---:|---:|---:|---:|---:|",
    ]
    for s in record["summary"]:
        lines.append(f"| {s['arm']} | {s['cell']} | {s['records']} | {_pooled_cos(s)} "
                     f"| {_pooled(s['rel_norm'], NORM)} | {_pooled(s['rel_err'], ERR)} | {_pooled(s['kl'], KL)} |")
    lines += ["", "## Per record"]
    for rec in recs:
        ds = ", ".join(f"d={k}: {n}" for k, n in rec["d"].items())
        lines += ["", f"### {rec['run']}, step {rec['step']}", "",
                  f"Version {rec['version']}; {rec['sequences']} sequences in {rec['minibatches']} minibatch(es); "
                  f"{rec['tokens']} tokens ({ds}), {rec['signal_tokens']} of them with A != 0"]
        if not rec["rows"]:
            lines[-1] += ": every advantage is 0, no arm has an update to compare."
            continue
        lines[-1] += (f"; the carried part is {rec['carried_share']:.3f} of recompute's change; KL over "
                      f"{rec['heldout_tokens']} held-out tokens; {rec['wall_s']:.0f} s.")
        lines += ["",
                  HEAD.format(extra="") + " clipped | dual-clipped | capped |",
                  "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
        whole = {r["arm"]: r["stats"] for r in rec["rows"] if r["cell"] == ALL}
        for r in sorted(rec["rows"], key=lambda r: (FIDELITY_ARMS.index(r["arm"]), cell_order(r["cell"]))):
            clipped, dual, capped = bounds(whole.get(r["arm"], {}), r["cell"])
            lines.append(f"| {r['arm']} | {r['cell']} ({r['tokens']}) | {_cos(r)} "
                         f"| {_num(r['rel_norm'], NORM)} | {_num(r['rel_err'], ERR)} | {_num(r['kl'], KL)} "
                         f"| {_num(clipped, SHARE)} | {_num(dual, SHARE)} | {_num(capped, SHARE)} |")
    return "\n".join(lines) + "\n"


def regenerate(folder: Path) -> dict:
    """results.md again from folder/results.json alone (nothing is replayed): `python -m a3po.bench.fidelity_report
    DIR`, as the committed records under docs/results/ are checked."""
    record = json.loads((folder / "results.json").read_text())
    (folder / "results.md").write_text(markdown(record))
    return record


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        regenerate(Path(arg))
        print(f"wrote {Path(arg) / 'results.md'}")

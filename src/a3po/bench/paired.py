"""Two sets of `a3po eval` records against each other, paired by seed: is B better than A?

    python -m a3po.bench.paired --a before/seed1.json before/seed2.json --b after/seed1.json after/seed2.json \
        [--names before,after] [--out page.md]

Each record holds every held-out problem's result. A seed of A is paired with the seed of B that
evaluated the same problems (same task, parameters, environment, seed and count; anything else is
refused in one line, since a difference over different problems measures the problems; so are records
decoded differently, greedy against sampled). Per seed the difference is the mean over problems of B
minus A; over seeds, the mean and its 95 % Student-t interval. The page is written from the records
alone, so committing them makes it regenerable.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from a3po.bench.report import emit_page, reading
from a3po.intervals import t_interval

# what must be equal for two records to have evaluated the same problems, and the same way
SAME_PROBLEMS = ("task", "task_params", "env", "seed", "problems")
SAME_DECODING = ("samples", "temperature")


class RecordError(ValueError):
    pass


def read_record(path: Path) -> dict:
    try:
        record = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise RecordError(f"{path}: not a readable JSON record ({e}); give records written by `a3po eval`") from None
    missing = [k for k in (*SAME_PROBLEMS, *SAME_DECODING, "solved", "accuracy") if k not in record]
    if missing:
        raise RecordError(f"{path}: lacks {', '.join(missing)}; give records written by `a3po eval`")
    return {**record, "path": str(path)}


def by_seed(records: list[dict], name: str) -> dict[int, dict]:
    out: dict[int, dict] = {}
    for r in records:
        if r["seed"] in out:
            raise RecordError(f"{name}: two records of seed {r['seed']} ({out[r['seed']]['path']}, {r['path']}); "
                              "give one per seed")
        out[r["seed"]] = r
    return out


def compare(a: list[dict], b: list[dict]) -> dict:
    """Per paired seed: accuracies and the mean per-problem difference b - a; then the interval over seeds."""
    sa, sb = by_seed(a, "--a"), by_seed(b, "--b")
    seeds = sorted(set(sa) & set(sb))
    if not seeds:
        raise RecordError(f"no seed in both sets (--a has {sorted(sa)}, --b has {sorted(sb)})")
    rows = []
    for seed in seeds:
        x, y = sa[seed], sb[seed]
        differ = [k for k in SAME_PROBLEMS if x[k] != y[k]]
        if differ:
            raise RecordError(f"seed {seed}: {x['path']} and {y['path']} differ in {', '.join(differ)}, so they "
                              "evaluated different problems; evaluate both with the same task settings")
        differ = [f"{k} {x[k]} and {y[k]}" for k in SAME_DECODING if x[k] != y[k]]
        if differ:
            raise RecordError(f"seed {seed}: {x['path']} and {y['path']} decoded differently ({', '.join(differ)}), "
                              "which the difference would measure too; evaluate both with the same --samples")
        diff = sum(q - p for p, q in zip(x["solved"], y["solved"])) / len(x["solved"])
        rows.append({"seed": seed, "a": x["accuracy"], "b": y["accuracy"], "difference": diff})
    unpaired = sorted(set(sa) ^ set(sb))
    return {"rows": rows, "unpaired": unpaired, **t_interval([r["difference"] for r in rows])}


def markdown(result: dict, names: tuple[str, str], a: list[dict], b: list[dict]) -> str:
    na, nb = names
    lo, hi = result["interval"]
    words = reading(result)
    words = f"{nb} {words} than {na}" if words in ("better", "worse") else words
    first = a[0]
    lines = [f"# {nb} against {na}, paired by seed", "",
             f"Written by `python -m a3po.bench.paired` from `a3po eval` records: {first['problems']} held-out "
             f"problems of `{first['task']}` {json.dumps(first['task_params'])}"
             f"{' in `' + first['env'] + '`' if first['env'] else ''} per seed.", "",
             f"| seed | {na} | {nb} | {nb} - {na} |", "|---:|---:|---:|---:|"]
    lines += [f"| {r['seed']} | {r['a']:.3f} | {r['b']:.3f} | {r['difference']:+.3f} |" for r in result["rows"]]
    interval = "-" if result["n"] < 2 else f"[{lo:+.3f}, {hi:+.3f}]"
    lines += ["", f"Mean difference {result['mean']:+.3f} over {result['n']} seed(s), 95 % interval {interval}: "
                  f"{words}.", "", "Records:", ""]
    lines += [f"- {na}: `{r['path']}`" for r in a] + [f"- {nb}: `{r['path']}`" for r in b]
    if result["unpaired"]:
        lines += ["", f"Seeds without a pair, left out: {', '.join(map(str, result['unpaired']))}."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    cli = argparse.ArgumentParser(prog="python -m a3po.bench.paired", description=__doc__.split("\n")[0])
    cli.add_argument("--a", nargs="+", type=Path, required=True, metavar="RECORD", help="`a3po eval` records of A")
    cli.add_argument("--b", nargs="+", type=Path, required=True, metavar="RECORD", help="`a3po eval` records of B")
    cli.add_argument("--names", default="A,B", help="the two sets' names on the page, e.g. before,after")
    cli.add_argument("--out", type=Path, help="write the page here (default: print it)")
    opts = cli.parse_args(argv)
    names = tuple(opts.names.split(","))
    try:
        if len(names) != 2 or not all(names):
            raise RecordError(f"--names {opts.names!r}: give two names separated by a comma, e.g. before,after")
        a, b = [read_record(p) for p in opts.a], [read_record(p) for p in opts.b]
        page = markdown(compare(a, b), names, a, b)
    except RecordError as e:
        print(f"a3po.bench.paired: {e}", file=sys.stderr)
        return 2
    emit_page(page, opts.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

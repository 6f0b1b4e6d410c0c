"""What the benchmarks share: progress lines, median and spread, report files and JSON output.

Imported by every `a3po bench` command; kept free of torch so that it stays cheap. The machine
a record names is a3po/machine.py's, its JSON file a3po/files.py's `write_json`: `a3po eval`
writes its record with them too.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from a3po.files import json_safe, write_json


def progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def spread(samples: list[float], name: str, unit: str = "_s") -> dict[str, float]:
    """Median and min..max of samples, under `<name>_median<unit>` and so on (seconds unless told)."""
    return {f"{name}_median{unit}": statistics.median(samples), f"{name}_min{unit}": min(samples),
            f"{name}_max{unit}": max(samples), f"{name}_n": len(samples)}


def fmt_s(x: float) -> str:
    """Seconds for a table cell: milliseconds below 0.1 s, where two decimals of a second say nothing."""
    return f"{x:.2f} s" if x >= 0.1 else f"{x * 1e3:.3f} ms"


def on_device(record: dict) -> str:
    """The GPU a step or rollout record ran on, for its caption ("on cuda:0 (NVIDIA H100 80GB HBM3), "); nothing
    on the CPU, which the caption's machine line names."""
    return f"on {record['device']} ({record['device_name']}), " if record.get("device", "cpu") != "cpu" else ""


def save_report(out: Path, name: str, record: dict, markdown: str) -> None:
    """`<name>.json` and `<name>.md` in `out`, and the folder in the record for `print_report`."""
    write_json(out / f"{name}.json", record)
    (out / f"{name}.md").write_text(markdown)
    record["out"] = str(out)


def print_report(name: str, record: dict, markdown: str) -> None:
    """The tables for people, where they went, and one JSON line last, for scripts reading stdout."""
    print(markdown)
    print(f"written: {record['out']}/{name}.md, {record['out']}/{name}.json")
    print(json.dumps(json_safe({k: v for k, v in record.items() if k != "args"})))


def json_line(record: dict) -> str:
    """One line of JSON (NaN/inf as null), for the last line of a benchmark's stdout."""
    return json.dumps(json_safe(record))

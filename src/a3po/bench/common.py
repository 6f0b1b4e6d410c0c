"""What the benchmarks share: progress lines, median and spread, JSON output."""

from __future__ import annotations

import json
import math
import statistics
import sys
from pathlib import Path


def progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def spread(samples: list[float], name: str) -> dict[str, float]:
    """Median and min..max of timing samples, under `<name>_median_s` and so on."""
    return {f"{name}_median_s": statistics.median(samples), f"{name}_min_s": min(samples),
            f"{name}_max_s": max(samples), f"{name}_n": len(samples)}


def write_json(path: Path, record: dict) -> None:
    """Written whole or not at all (tmp + rename); NaN/inf become null so any JSON reader takes it."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(_clean(record), indent=1) + "\n")
    tmp.replace(path)


def json_line(record: dict) -> str:
    """One line of JSON (NaN/inf as null), for the last line of a benchmark's stdout."""
    return json.dumps(_clean(record))


def _clean(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x

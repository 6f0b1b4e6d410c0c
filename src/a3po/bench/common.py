"""What the benchmarks share: progress lines, median and spread, the machine, report files and JSON output.

Imported by every `a3po bench` command; kept free of torch so that it stays cheap.
"""

from __future__ import annotations

import json
import math
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path


def progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def spread(samples: list[float], name: str, unit: str = "_s") -> dict[str, float]:
    """Median and min..max of samples, under `<name>_median<unit>` and so on (seconds unless told)."""
    return {f"{name}_median{unit}": statistics.median(samples), f"{name}_min{unit}": min(samples),
            f"{name}_max{unit}": max(samples), f"{name}_n": len(samples)}


def fmt_s(x: float) -> str:
    """Seconds for a table cell: milliseconds below 0.1 s, where two decimals of a second say nothing."""
    return f"{x:.2f} s" if x >= 0.1 else f"{x * 1e3:.3f} ms"


def machine() -> dict:
    """CPU model name (as `lscpu` prints it) and its bf16 instructions: whether bf16 is fast here depends on them.

    A ratio measured on one CPU does not carry over to another (bf16 matmuls are faster than
    fp32 with AVX512-BF16/AMX and much slower without), so every record names its machine."""
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        text = ""
    name = re.search(r"^Model name:\s*(.+)$", text, re.MULTILINE)
    flags = re.search(r"^Flags:\s*(.+)$", text, re.MULTILINE)
    cpuinfo = _read("/proc/cpuinfo")
    if name is None:
        name = re.search(r"^model name\s*:\s*(.+)$", cpuinfo, re.MULTILINE)
    if flags is None:
        flags = re.search(r"^flags\s*:\s*(.+)$", cpuinfo, re.MULTILINE)
    flag_set = set(flags[1].split()) if flags else set()
    return {"cpu": name[1].strip() if name else "unknown", "cores": os.cpu_count(),
            "avx512_bf16": "avx512_bf16" in flag_set, "amx_bf16": "amx_bf16" in flag_set}


def machine_line(m: dict) -> str:
    """The machine in words, for a table's caption."""
    flags = ", ".join(f"{flag} {'yes' if m[flag] else 'no'}" for flag in ("avx512_bf16", "amx_bf16"))
    return f"{m['cpu']}, {m['cores']} cores, {flags}"


def write_json(path: Path, record: dict) -> None:
    """Written whole or not at all (tmp + rename); NaN/inf become null so any JSON reader takes it."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(_clean(record), indent=1) + "\n")
    tmp.replace(path)


def save_report(out: Path, name: str, record: dict, markdown: str) -> None:
    """`<name>.json` and `<name>.md` in `out`, and the folder in the record for `print_report`."""
    write_json(out / f"{name}.json", record)
    (out / f"{name}.md").write_text(markdown)
    record["out"] = str(out)


def print_report(name: str, record: dict, markdown: str) -> None:
    """The tables for people, where they went, and one JSON line last, for scripts reading stdout."""
    print(markdown)
    print(f"written: {record['out']}/{name}.md, {record['out']}/{name}.json")
    print(json.dumps(_clean({k: v for k, v in record.items() if k != "args"})))


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


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

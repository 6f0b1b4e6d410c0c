"""The machine a measurement ran on, named in every record of one (`a3po eval`, `a3po bench`).

A ratio measured on one CPU does not carry over to another (bf16 matmuls are faster than
fp32 with AVX512-BF16/AMX and much slower without), so every record names its machine.
Leaf module (no a3po imports, no torch): cheap to import wherever a record is written.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path


def machine() -> dict:
    """CPU model name (as `lscpu` prints it) and its bf16 instructions: whether bf16 is fast here depends on them."""
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


def git(args: list[str], cwd: Path) -> str | None:
    """git's output for `args` in `cwd` (a record's commit, a design file's history), or None where git fails or a
    copy has no .git."""
    try:
        res = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return res.stdout.strip() if res.returncode == 0 else None


def code_commit() -> str | None:
    """The commit of the a3po source that is running, with "+changes" where its tracked files differ from it; None
    where the source is not a git checkout (an installed package). A run record keeps it, so a study can show that
    its runs were made from the code it registered."""
    here = Path(__file__).resolve().parent
    head = git(["rev-parse", "HEAD"], here)
    if not head:
        return None
    changed = git(["status", "--porcelain", "--untracked-files=no", "--", "."], here)
    return head + ("+changes" if changed else "")


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""

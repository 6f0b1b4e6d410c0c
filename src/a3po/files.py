"""Files on disk written so that a crash or a full disk never leaves a torn one, and run folders never reused.

Leaf module (no a3po imports): the checkpoint writer, the metric sinks and the benchmarks share it.
"""

from __future__ import annotations

import os
from pathlib import Path


def fsync(path: Path) -> None:
    """Push a file's (or a folder's entries') bytes to the disk: a rename is durable only after its contents are."""
    if os.name == "nt" and path.is_dir():  # Windows cannot open a folder to fsync it
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(folder: Path) -> None:
    for p in sorted(folder.rglob("*"), reverse=True):  # files before the folders that list them
        fsync(p)
    fsync(folder)


def atomic_write_text(path: Path, text: str) -> None:
    """Replace `path` with `text` so that a crash leaves either the old or the new file, never a torn one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync(path.parent)


def unique_dir(base: Path) -> Path:
    """Create base, or base-2, base-3, ... if taken: a new run never writes into an old one."""
    path, k = base, 1
    while path.exists():
        k += 1
        path = base.with_name(f"{base.name}-{k}")
    path.mkdir(parents=True)
    return path

"""Files on disk written so that a crash or a full disk never leaves a torn one, and run folders never reused.

A write that fails for lack of space, however the writing library reports it, becomes one
DiskFullError naming the folder to free (`writing`). Leaf module (no a3po imports): the
checkpoint writer, the metric sinks, `a3po eval` and the benchmarks share it.
"""

from __future__ import annotations

import errno
import json
import math
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

NO_SPACE = (errno.ENOSPC, errno.EDQUOT)  # a full disk, and a full quota: the same remedy


class DiskFullError(OSError):
    """A write that failed for lack of space, in one line naming what was written and the folder to free."""

    def __init__(self, code: int, what: str, folder: Path):
        self.folder = Path(folder)
        self.message = f"{os.strerror(code).lower()} writing {what} in {folder}"
        super().__init__(code, self.message)

    def __str__(self) -> str:
        return self.message


def causes(error: BaseException) -> Iterator[BaseException]:
    """`error`, then what it was raised from or during, and so on down the chain."""
    seen: set[int] = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


def no_space(error: BaseException) -> int | None:
    """The errno (ENOSPC or EDQUOT) if `error` comes of a full disk or quota, else None.

    Writers say it each their own way: Python's files raise OSError(ENOSPC); torch.save into a
    Python file raises a RuntimeError of its own while that OSError is handled (its __context__);
    safetensors raises its own error type with the OS message in its text."""
    for e in causes(error):
        if isinstance(e, OSError) and e.errno in NO_SPACE:
            return e.errno
        text = str(e)
        for code in NO_SPACE:
            if os.strerror(code) in text:
                return code
    return None


@contextmanager
def writing(what: str, folder: Path) -> Iterator[None]:
    """Turn a write that fails for lack of space into DiskFullError naming `what` and `folder`."""
    try:
        yield
    except DiskFullError:
        raise
    except Exception as e:
        code = no_space(e)
        if code is None:
            raise
        raise DiskFullError(code, what, folder) from e


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


@contextmanager
def whole_folder(final: Path, what: str) -> Iterator[Path]:
    """Yield a temporary folder beside `final`, renamed onto it once the block is done: a folder that exists under
    its final name is complete. A failure removes what was written; no space is DiskFullError naming `what`."""
    root, tmp = final.parent, final.parent / f".tmp-{final.name}"
    try:
        with writing(what, root):
            root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            yield tmp
            fsync_tree(tmp)
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            fsync(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    """Replace `path` with `text` so that a crash leaves either the old or the new file, never a torn one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk gets its space back
        raise
    os.replace(tmp, path)
    fsync(path.parent)


def cache_dir() -> Path:
    """Where a3po keeps what it makes once and reuses (converted models, generated tasks): $A3PO_CACHE if set,
    else ~/.cache/a3po."""
    return Path(os.environ.get("A3PO_CACHE") or Path.home() / ".cache" / "a3po").expanduser()


def write_json(path: Path, record: dict) -> None:
    """A JSON record written whole or not at all; NaN/inf become null so any JSON reader takes it."""
    atomic_write_text(path, json.dumps(json_safe(record), indent=1) + "\n")


def json_safe(x):
    """`x` with every float that is not finite replaced by None (JSON has no NaN or inf)."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    return x


def umask() -> int:
    """This process's umask: read where the system tells it (Linux), else set and put back at once."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def plain_modes(folder: Path) -> None:
    """Give every file in `folder` the mode a file created with open() gets (0666 less the umask: 0644 as a
    rule). safetensors writes its files owner-only (0600), so a model folder saved for others to read,
    a checkpoint or an export, had its weights alone unreadable to them."""
    mode = 0o666 & ~umask()
    for p in Path(folder).iterdir():
        if p.is_file() and not p.is_symlink() and (p.stat().st_mode & 0o777) != mode:
            os.chmod(p, mode)


def unique_dir(base: Path) -> Path:
    """Create base, or base-2, base-3, ... if taken: a new run never writes into an old one."""
    path, k = base, 1
    while path.exists():
        k += 1
        path = base.with_name(f"{base.name}-{k}")
    path.mkdir(parents=True)
    return path

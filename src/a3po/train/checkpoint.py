"""Checkpoints a run can resume from, written so that a crash never leaves a broken one.

    RUN_DIR/checkpoints/step_000010/   Hugging Face model + tokenizer, trainer_state.pt, run_state.json
    RUN_DIR/checkpoints/latest         the name of the newest complete checkpoint

A checkpoint is written into a temporary folder, every file and the folder are fsynced, and
only then is it renamed into place; `latest` is written the same way after that, and older
checkpoints beyond `keep` are removed last. Without the fsyncs a power cut could leave a
renamed folder whose files are empty, which `latest` would then point at.

Resuming tries `latest`'s checkpoint first and then the others, newest first: one that cannot
be read (truncated, corrupt, half copied, made for another model) is skipped with a one-line
warning, and when none can be read `CheckpointError` says so in one line. `resume_config`
checks that a --resume folder is a run folder before torch is even imported.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from a3po.config import Config, load_config

RUN_STATE = "run_state.json"
LATEST = "latest"


class CheckpointError(ValueError):
    """A run directory that cannot be resumed, with a one-line message saying why and what to do."""


def _dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def _step_of(path: Path) -> int:
    try:
        return int(path.name.removeprefix("step_"))
    except ValueError:
        return -1


def _fsync(path: Path) -> None:
    """Push a file's (or a folder's entries') bytes to the disk: a rename is durable only after its contents are."""
    if os.name == "nt" and path.is_dir():  # Windows cannot open a folder to fsync it
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(folder: Path) -> None:
    for p in sorted(folder.rglob("*"), reverse=True):  # files before the folders that list them
        _fsync(p)
    _fsync(folder)


def atomic_write_text(path: Path, text: str) -> None:
    """Replace `path` with `text` so that a crash leaves either the old or the new file, never a torn one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync(path.parent)


def save_checkpoint(run_dir: Path, step: int, engine, tokenizer, run_state: dict, keep: int = 1) -> Path:
    root = _dir(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    name = f"step_{step:06d}"
    tmp = root / f".tmp-{name}"
    shutil.rmtree(tmp, ignore_errors=True)
    engine.save(tmp, tokenizer=tokenizer)
    (tmp / RUN_STATE).write_text(json.dumps(run_state))
    _fsync_tree(tmp)
    final = root / name
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    _fsync(root)
    atomic_write_text(root / LATEST, name)
    _prune(root, step, keep)
    return final


def _prune(root: Path, step: int, keep: int) -> None:
    """Keep the `keep` newest checkpoints up to `step`.

    Newer ones can exist only when a resume skipped them as unreadable; they are left for
    the run to overwrite when it gets there, not deleted behind the user's back."""
    older = sorted((p for p in root.glob("step_*") if p.is_dir() and 0 <= _step_of(p) < step), key=_step_of)
    for p in older[: max(0, len(older) - (keep - 1))]:
        shutil.rmtree(p, ignore_errors=True)


def checkpoints(run_dir: Path) -> list[Path]:
    """The checkpoints to try on resume: the one `latest` names, then every other, newest first."""
    root = _dir(run_dir)
    found = sorted((p for p in root.glob("step_*") if p.is_dir() and _step_of(p) >= 0), key=_step_of, reverse=True)
    try:
        named = root / (root / LATEST).read_text().strip()
    except (OSError, UnicodeDecodeError):
        return found
    return [named, *(p for p in found if p != named)] if named in found else found


def resume_config(run_dir: str, overrides: list[str]) -> Config:
    """The configuration saved in RUN_DIR, once it looks like a run that can be resumed.

    Light on purpose (no torch): a wrong --resume folder fails in a fraction of a second."""
    path = Path(run_dir)
    hint = "pass a run directory made by `a3po train` (<fileroot>/<experiment_name>)"
    if not path.exists():
        raise CheckpointError(f"--resume {run_dir}: no such directory; {hint}")
    if not path.is_dir():
        raise CheckpointError(f"--resume {run_dir} is a file, not a run directory; {hint}")
    if not (path / "config.yaml").is_file():
        raise CheckpointError(f"--resume {run_dir}: no config.yaml there, so it is not a run directory; {hint}")
    if not checkpoints(path):
        raise CheckpointError(f"--resume {run_dir}: the run saved no checkpoint before it stopped "
                              "(see saver.freq_steps); start a new run without --resume")
    return load_config(path / "config.yaml", overrides)


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = checkpoints(run_dir)
    return found[0] if found else None


def load_run_state(ckpt: Path) -> dict:
    try:
        state = json.loads((Path(ckpt) / RUN_STATE).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{RUN_STATE} is not valid JSON ({e})") from None
    if not isinstance(state, dict) or not all(isinstance(state.get(k), int) for k in ("step", "data_cursor")):
        raise ValueError(f"{RUN_STATE} lacks the integer step and data_cursor")
    return state


def resume(run_dir: Path, engine, warn: Callable[[str], None]) -> tuple[Path, dict]:
    """Load the newest readable checkpoint into `engine`; returns it and its run state.

    Any failure to read one means it is unusable whatever the cause (torch, safetensors and
    json each raise their own types), hence the broad except; the reasons are reported as
    warnings only when an older checkpoint does load, so a run that cannot resume at all
    prints one line, the error."""
    skipped = []
    for ckpt in checkpoints(run_dir):
        try:
            state = load_run_state(ckpt)
            engine.load(ckpt)
        except Exception as e:  # see the docstring
            skipped.append(f"{ckpt.name}: {_reason(e)}")
            continue
        for s in skipped:
            warn(f"a3po: warning: skipped checkpoint {s}; resuming from {ckpt.name} instead")
        return ckpt, state
    if not skipped:
        raise CheckpointError(f"--resume {run_dir}: it has no checkpoint yet; start a new run without --resume")
    raise CheckpointError(f"--resume {run_dir}: no checkpoint there can be loaded ({'; '.join(skipped)}); "
                          "restore the folder from a copy or start a new run without --resume")


def _reason(e: BaseException) -> str:
    """The first line of an exception, short enough to sit inside a one-line message.

    Our own ValueErrors and a missing file read well bare; a library's exception keeps its type name."""
    if isinstance(e, OSError) and e.filename:
        return f"{Path(e.filename).name}: {e.strerror or e}"
    text = " ".join(str(e).split("\n", 1)[0].split())[:200]
    if type(e) is ValueError and text:
        return text
    return f"{type(e).__name__}: {text}" if text else type(e).__name__

"""reasoning-gym draws kept on disk, so a run's start does not import reasoning-gym to make them again.

    name = generated.key(task, params, seed, size, eval_size)
    kept = generated.load(name)              # (train, held-out) entries, or None: not kept, or unreadable
    generated.keep(name, train, held_out)    # after drawing them

Importing reasoning-gym loads every one of its tasks (sympy, matplotlib and more): a large
part of every trainer's start, for draws that the same task, parameters, seed and sizes make
identically each time. The key holds all of those, reasoning-gym's version and the code that
draws and splits them (this file and tasks.py), so a kept file is what drawing again would
give. Tuples (reasoning-gym's difficulty ranges) are written tagged so that they read back as
tuples; draws that still would not read back equal are drawn each time, as are draws whose
file is missing, torn or foreign (two starts writing the same draws at once write the same text; at worst
one leaves a torn file, read as missing and written again). The cache never fails a run: a file that cannot be
written is simply not kept.
"""

from __future__ import annotations

import hashlib
import json
from importlib import metadata
from pathlib import Path

from a3po.files import atomic_write_text, cache_dir

FORMAT = 1  # raise when what a file holds changes
TUPLE = "<tuple>"  # {"<tuple>": [...]} in the file is a tuple in the entry


def key(task: str, params: dict, seed: int, size: int, eval_size: int) -> str | None:
    """The name of these draws' file, or None when reasoning-gym's version cannot be read (never kept)."""
    try:
        version = metadata.version("reasoning-gym")
    except metadata.PackageNotFoundError:
        return None
    code = hashlib.sha256(Path(__file__).read_bytes() + Path(__file__).with_name("tasks.py").read_bytes()).hexdigest()
    spec = json.dumps({"format": FORMAT, "code": code, "reasoning_gym": version, "task": task, "params": params,
                       "seed": seed, "size": size, "eval_size": eval_size}, sort_keys=True, default=repr)
    return f"{task}-{hashlib.sha256(spec.encode()).hexdigest()[:24]}"


def _path(name: str) -> Path:
    return cache_dir() / "tasks" / f"{name}.json"


def load(name: str | None) -> tuple[list[dict], list[dict]] | None:
    """(train entries, held-out entries) kept under `name`, or None."""
    if name is None:
        return None
    try:
        kept = json.loads(_path(name).read_text(), object_hook=_untag)
        train, held_out = kept["train"], kept["eval"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not (isinstance(train, list) and isinstance(held_out, list)
            and all(isinstance(e, dict) and "question" in e and "answer" in e for e in train + held_out)):
        return None
    return train, held_out


def keep(name: str | None, train: list[dict], held_out: list[dict]) -> None:
    """Write the draws under `name` if they read back unchanged; a failed write leaves nothing behind."""
    if name is None:
        return
    kept = {"train": train, "eval": held_out}
    try:
        text = json.dumps(_tag(kept))
        if json.loads(text, object_hook=_untag) != kept:  # sets, non-text keys ...: draw them each time
            return
    except (TypeError, ValueError):
        return
    path = _path(name)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, text)
    except OSError:
        pass  # not kept: the next start draws them again


def _tag(value):
    if isinstance(value, tuple):
        return {TUPLE: [_tag(v) for v in value]}
    if isinstance(value, list):
        return [_tag(v) for v in value]
    if isinstance(value, dict):
        return {k: _tag(v) for k, v in value.items()}
    return value


def _untag(obj: dict):
    return tuple(obj[TUPLE]) if obj.keys() == {TUPLE} else obj

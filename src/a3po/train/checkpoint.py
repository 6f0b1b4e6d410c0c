"""Checkpoints a run can resume from, written so that a crash never leaves a broken one.

    RUN_DIR/checkpoints/step_000010/   Hugging Face model + tokenizer, trainer_state.pt, run_state.json
    RUN_DIR/checkpoints/latest         the name of the newest complete checkpoint

A checkpoint is written into a temporary folder and renamed into place, and `latest` is
replaced atomically after that; older checkpoints beyond `keep` are removed only then.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

RUN_STATE = "run_state.json"


def _dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def save_checkpoint(run_dir: Path, step: int, engine, tokenizer, run_state: dict, keep: int = 1) -> Path:
    root = _dir(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    name = f"step_{step:06d}"
    tmp = root / f".tmp-{name}"
    shutil.rmtree(tmp, ignore_errors=True)
    engine.save(tmp, tokenizer=tokenizer)
    (tmp / RUN_STATE).write_text(json.dumps(run_state))
    final = root / name
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    pointer = root / ".latest.tmp"
    pointer.write_text(name)
    os.replace(pointer, root / "latest")
    old = sorted(p for p in root.glob("step_*") if p.is_dir() and p.name != name)
    for p in old[: max(0, len(old) - (keep - 1))]:
        shutil.rmtree(p, ignore_errors=True)
    return final


def latest_checkpoint(run_dir: Path) -> Path | None:
    pointer = _dir(run_dir) / "latest"
    if not pointer.exists():
        return None
    path = _dir(run_dir) / pointer.read_text().strip()
    return path if (path / RUN_STATE).exists() else None


def load_run_state(ckpt: Path) -> dict:
    return json.loads((Path(ckpt) / RUN_STATE).read_text())

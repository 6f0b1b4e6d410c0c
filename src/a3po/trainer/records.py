"""Recorded training steps: a step's batch and the trainer's state just before its update, kept for replay.

    a3po train saver.record_steps=[4,8] ...
    RUN_DIR/records/step_000004/   weights, optimizer, scheduler and RNG of version 3 (`save_engine`, as in a
                                   checkpoint), batch.pt (the TrainBatch step 4 trains on, advantages included)
                                   and record.json ({"step": 4, "version": 3})

`a3po bench fidelity` replays each record once per proximal method from that same state
(bench/fidelity.py). A record is written like a checkpoint, into a temporary folder renamed into
place, so one that exists is whole; with SmolLM2 it holds about 1.6 GB (weights and AdamW's moments).
"""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path

import torch

from a3po.files import whole_folder
from a3po.trainer.checkpoint import save_engine
from a3po.trajectories import TrainBatch

RECORDS = "records"
BATCH = "batch.pt"
INFO = "record.json"


def save_record(run_dir: Path, step: int, engine, batch: TrainBatch) -> Path:
    """RUN_DIR/records/step_NNNNNN: `batch` and the engine's state before the update of `step`."""
    final = Path(run_dir) / RECORDS / f"step_{step:06d}"
    with whole_folder(final, "a training record") as tmp:
        save_engine(engine, tmp)  # with several ranks every rank takes part (parallel.py); rank 0 writes
        torch.save({f.name: getattr(batch, f.name).cpu() for f in fields(batch)}, tmp / BATCH)
        (tmp / INFO).write_text(json.dumps({"step": step, "version": engine.version}))
    return final


def recorded(run_dir: Path) -> list[Path]:
    """The run's complete records, in step order."""
    root = Path(run_dir) / RECORDS
    return sorted(p for p in root.glob("step_*") if (p / INFO).is_file()) if root.is_dir() else []


def read_info(record: Path) -> dict:
    """{"step": N, "version": N - 1}."""
    return json.loads((Path(record) / INFO).read_text())


def read_batch(record: Path) -> TrainBatch:
    """The recorded batch (tensors only: read with weights_only, as a run folder may come from anyone)."""
    return TrainBatch(**torch.load(Path(record) / BATCH, weights_only=True))

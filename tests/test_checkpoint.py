"""Checkpoints: durable writes, loads that cannot run code, and resume past a broken newest checkpoint.

Proves: every file, the checkpoint folder and `latest` are fsynced before the rename that
makes them count; trainer_state.pt loads with weights_only=True and restores optimizer,
scheduler, version and RNG; a trainer_state.pt holding a pickle that would run code is
refused unread; a corrupt, truncated or half-copied newest checkpoint is skipped with one
warning line and the one before it is loaded; with none loadable resume fails in one line
and warns nothing. Real TrainEngines on the tiny model, real files in tmp_path; the fsync
test only records the real calls.
"""

import copy
import os
import shutil
from pathlib import Path

import pytest
import torch
from conftest import actor_cfg

from a3po.models import load_policy
from a3po.trainer import checkpoint
from a3po.trainer.checkpoint import (
    STATE_FILE,
    CheckpointError,
    checkpoints,
    latest_checkpoint,
    load_engine,
    load_run_state,
    save_checkpoint,
    save_engine,
)
from a3po.trainer.engine import TrainEngine


def new_engine(model) -> TrainEngine:
    return TrainEngine(copy.deepcopy(model), actor_cfg(), 8)


def train_one_step(engine: TrainEngine) -> None:
    """A real AdamW step (so the optimizer has state to save) without building a PPO batch."""
    loss = sum((p.float() ** 2).sum() for p in engine.model.parameters())
    loss.backward()
    engine.optimizer.step()
    engine.scheduler.step()
    engine.optimizer.zero_grad()
    engine.version += 1


def save(run: Path, engine: TrainEngine, tok, keep: int = 2) -> Path:
    return save_checkpoint(run, engine.version, engine, tok,
                           {"step": engine.version, "data_cursor": 4 * engine.version}, keep=keep)


@pytest.fixture
def run_with_two(tiny, tmp_path):
    """A run folder with checkpoints after step 1 and step 2, and step 1's weights."""
    model, tok = tiny
    engine = new_engine(model)
    train_one_step(engine)
    save(tmp_path, engine, tok)
    first = {k: v.clone() for k, v in engine.model.state_dict().items()}
    train_one_step(engine)
    save(tmp_path, engine, tok)
    return tmp_path, first, model


def resume_fresh(run: Path, model):
    warnings: list[str] = []
    engine = new_engine(model)
    ckpt, state = checkpoint.resume(run, engine, warn=warnings.append)
    return engine, ckpt, state, warnings


def test_trainer_state_loads_with_weights_only_and_restores_everything(tiny, tmp_path):
    model, tok = tiny
    a = new_engine(model)
    train_one_step(a)
    torch.manual_seed(123)
    rng = torch.get_rng_state()
    ckpt = save(tmp_path, a, tok)
    state = torch.load(ckpt / STATE_FILE, weights_only=True)  # raises if anything but tensors and plain types
    assert state["version"] == 1 and state["optimizer"]["state"]
    b = new_engine(model)
    torch.manual_seed(0)
    load_engine(b, ckpt)
    assert b.version == 1 and b.scheduler.state_dict() == a.scheduler.state_dict()
    for sa, sb in zip(a.optimizer.state.values(), b.optimizer.state.values(), strict=True):
        assert all(torch.equal(sa[k], sb[k]) for k in ("exp_avg", "exp_avg_sq", "step"))
    assert torch.equal(torch.get_rng_state(), rng)


class RunsCode:
    """Unpickled, it would create a file: the kind of payload a shared run folder could carry."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return open, (str(self.marker), "w")


def test_a_trainer_state_that_would_run_code_is_refused_unread(run_with_two, tmp_path):
    run, first, model = run_with_two
    marker = tmp_path / "code-ran"
    torch.save({"version": 2, "payload": RunsCode(marker)}, run / "checkpoints" / "step_000002" / STATE_FILE)
    engine, ckpt, _, warnings = resume_fresh(run, model)
    assert not marker.exists()
    assert ckpt.name == "step_000001" and engine.version == 1
    assert len(warnings) == 1 and "trainer_state.pt is corrupt or holds more than tensors" in warnings[0]


DAMAGE = {
    "garbage-state": lambda c: (c / STATE_FILE).write_bytes(b"garbage"),
    "truncated-state": lambda c: os.truncate(c / STATE_FILE, 64),
    "truncated-weights": lambda c: os.truncate(c / "model.safetensors", 100),
    "no-weights": lambda c: (c / "model.safetensors").unlink(),
    "broken-run-state": lambda c: (c / "run_state.json").write_text("{"),
    "no-run-state": lambda c: (c / "run_state.json").unlink(),
    "empty-folder": lambda c: [p.unlink() for p in c.iterdir()],
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_resume_skips_a_broken_newest_checkpoint_with_one_warning(run_with_two, damage):
    run, first, model = run_with_two
    DAMAGE[damage](run / "checkpoints" / "step_000002")
    engine, ckpt, state, warnings = resume_fresh(run, model)
    assert ckpt.name == "step_000001" and state == {"step": 1, "data_cursor": 4} and engine.version == 1
    assert all(torch.equal(v, first[k]) for k, v in engine.model.state_dict().items())
    assert len(warnings) == 1 and "\n" not in warnings[0]
    assert warnings[0].startswith("a3po: warning: skipped checkpoint step_000002: ")
    assert warnings[0].endswith("resuming from step_000001 instead")


def test_no_loadable_checkpoint_is_one_line_error_without_warnings(run_with_two):
    run, _, model = run_with_two
    DAMAGE["garbage-state"](run / "checkpoints" / "step_000002")
    DAMAGE["truncated-weights"](run / "checkpoints" / "step_000001")
    with pytest.raises(CheckpointError) as err:
        resume_fresh(run, model)
    msg = str(err.value)
    assert "\n" not in msg and "step_000002: trainer_state.pt is corrupt" in msg and "step_000001: " in msg
    assert "without --resume" in msg


def test_a_checkpoint_of_another_model_is_skipped(run_with_two):
    run, _, model = run_with_two
    wider, _ = load_policy("tiny-128x2")
    save_engine(new_engine(wider), run / "checkpoints" / "step_000002")
    _, ckpt, _, warnings = resume_fresh(run, model)
    assert ckpt.name == "step_000001" and "does not match the model" in warnings[0]


def test_latest_names_the_first_checkpoint_tried_else_the_highest_step(run_with_two):
    run, _, _ = run_with_two
    root = run / "checkpoints"
    assert [p.name for p in checkpoints(run)] == ["step_000002", "step_000001"]
    (root / "latest").write_text("step_000001")  # a crash between the folder's rename and the pointer's
    assert [p.name for p in checkpoints(run)] == ["step_000001", "step_000002"]
    for pointer in ("step_000009", "\xff garbage"):
        (root / "latest").write_text(pointer)
        assert latest_checkpoint(run).name == "step_000002"
    (root / "latest").unlink()
    assert latest_checkpoint(run).name == "step_000002"
    shutil.rmtree(root)
    assert checkpoints(run) == [] and latest_checkpoint(run) is None


def test_save_fsyncs_files_folder_and_pointer_before_each_rename(tiny, tmp_path, monkeypatch):
    model, tok = tiny
    engine = new_engine(model)
    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", str(src)))
        return real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    final = save(tmp_path, engine, tok)
    root = os.path.realpath(tmp_path / "checkpoints")
    tmp = f"{root}/.tmp-step_000000"
    moved = events.index(("replace", tmp))
    synced_before = {path for kind, path in events[:moved] if kind == "fsync"}
    assert {tmp + "/" + p.name for p in final.iterdir()} | {tmp} <= synced_before
    pointer = events.index(("replace", f"{root}/.latest.tmp"))
    assert ("fsync", f"{root}/.latest.tmp") in events[moved:pointer]
    assert ("fsync", root) in events[moved:pointer] and events[-1] == ("fsync", root)
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step_000000"
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step_000000"]


def test_pruning_keeps_the_newest_and_leaves_skipped_later_steps_to_be_overwritten(run_with_two):
    run, _, model = run_with_two
    root = run / "checkpoints"
    DAMAGE["garbage-state"](root / "step_000002")
    engine, _, _, _ = resume_fresh(run, model)  # back at step 1; step 2 is unreadable
    save_checkpoint(run, 1, engine, None, {"step": 1, "data_cursor": 4}, keep=1)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000001", "step_000002"]
    train_one_step(engine)
    save_checkpoint(run, 2, engine, None, {"step": 2, "data_cursor": 8}, keep=1)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000002"]
    assert load_run_state(root / "step_000002")["step"] == 2
    load_engine(new_engine(model), root / "step_000002")  # readable again

"""A full disk while a run writes: one line naming the folder, exit 1, the last checkpoint intact and resumable.

Proves: each writer's way of reporting a full disk (Python's OSError, torch.save's RuntimeError
raised while that OSError is handled, safetensors' error carrying the OS message) is recognised,
on a real full filesystem where one can be mounted; a checkpoint save that fails leaves no
half-written folder and the previous checkpoint as `latest`, loadable; a metrics line that does
not fit is the same one-line error; and a real `a3po train` whose second checkpoint does not fit
ends in one line and exit 1, and `--resume` continues from the first.

The full filesystem is a small tmpfs (mounting one needs root, as on the CI machine); where
none can be mounted those cases are skipped, and the `a3po train` run gets its full disk from
torch.save instead (a sitecustomize makes the second checkpoint's trainer_state.pt fail with
ENOSPC), so the run's handling is tested everywhere.
"""

import contextlib
import copy
import errno
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import actor_cfg
from procs import TINY, a3po, assert_one_clean_line, started_with

from a3po.files import DiskFullError, no_space
from a3po.pipeline.sinks import Sinks
from a3po.trainer import checkpoint
from a3po.trainer.checkpoint import save_checkpoint
from a3po.trainer.engine import TrainEngine

ENOSPC = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def mount_tmpfs(folder: Path, size: str) -> bool:
    """A tmpfs of `size` on `folder`; False where this process may not mount one."""
    folder.mkdir(parents=True, exist_ok=True)
    try:
        res = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                             capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return res.returncode == 0


@contextlib.contextmanager
def small_disk(folder: Path, size: str):
    if not mount_tmpfs(folder, size):
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], check=True, timeout=30)


def fill(folder: Path) -> None:
    """Write zeros into `folder` until its filesystem has no byte left."""
    with open(folder / "filler", "wb", buffering=0) as f, contextlib.suppress(OSError):
        while True:
            f.write(bytes(1 << 16))


def raised_by(write) -> BaseException:
    try:
        write()
    except Exception as e:
        return e
    raise AssertionError("the write into a full filesystem succeeded")


def test_no_space_reads_every_form_a_full_disk_takes():
    try:
        try:
            raise ENOSPC
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598") from None
    except RuntimeError as e:
        during = e
    assert no_space(ENOSPC) == errno.ENOSPC
    assert no_space(during) == errno.ENOSPC  # torch.save into a Python file
    assert no_space(RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)")) \
        == errno.ENOSPC  # safetensors
    assert no_space(OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))) == errno.EDQUOT
    assert no_space(OSError(errno.EACCES, "Permission denied")) is None
    assert no_space(RuntimeError("unexpected pos 704 vs 598")) is None


def test_on_a_real_full_filesystem_every_writer_is_read_as_no_space(tmp_path):
    from safetensors.torch import save_file

    with small_disk(tmp_path / "disk", "256k") as disk:
        fill(disk)
        big = {"w": torch.zeros(1 << 16)}

        def python_file():
            with open(disk / "a.txt", "w") as f:
                f.write("x" * (1 << 16))

        def torch_save():
            with open(disk / "b.pt", "wb") as f:  # as checkpoint.save_engine writes trainer_state.pt
                torch.save(big, f)

        for write in (python_file, torch_save, lambda: save_file(big, str(disk / "c.safetensors"))):
            assert no_space(raised_by(write)) == errno.ENOSPC, write


def checkpointed_engine(model, tok, run: Path) -> TrainEngine:
    """An engine after one real AdamW step, with that state saved as checkpoint step 1."""
    engine = TrainEngine(copy.deepcopy(model), actor_cfg(), 8)
    sum((p ** 2).sum() for p in engine.model.parameters()).backward()
    engine.optimizer.step()
    engine.optimizer.zero_grad()
    engine.version = 1
    save_checkpoint(run, 1, engine, tok, {"step": 1, "data_cursor": 4})
    return engine


def test_a_save_that_finds_the_disk_full_names_the_folder_and_leaves_the_last_checkpoint(tiny, tmp_path, monkeypatch):
    model, tok = tiny
    engine = checkpointed_engine(model, tok, tmp_path)
    root = tmp_path / "checkpoints"
    real_save = torch.save

    def save_on_a_full_disk(obj, f, *args, **kw):
        real_save(obj, f, *args, **kw)  # the bytes written, then the disk full (as at the last file's close)
        raise ENOSPC

    monkeypatch.setattr(torch, "save", save_on_a_full_disk)
    with pytest.raises(DiskFullError) as failed:
        save_checkpoint(tmp_path, 2, engine, tok, {"step": 2, "data_cursor": 8})
    monkeypatch.undo()
    assert str(failed.value) == f"no space left on device writing a checkpoint in {root}"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000001"], "half a checkpoint left behind"
    fresh = TrainEngine(model, actor_cfg(), 8)
    warnings: list[str] = []
    ckpt, state = checkpoint.resume(tmp_path, fresh, warn=warnings.append)
    assert ckpt == root / "step_000001" and state["step"] == 1 and fresh.version == 1 and warnings == []


def test_a_metrics_line_that_does_not_fit_names_the_run_folder(tmp_path):
    with small_disk(tmp_path / "run", "64k") as run:
        sinks = Sinks(run, tensorboard=False)
        fill(run)
        with pytest.raises(DiskFullError) as failed:
            for step in range(100):  # the first lines may still fit in the file's last page
                sinks.log(step, {"x": 1.0, "padding": "y" * 1000})
        with contextlib.suppress(OSError):
            sinks.close()  # the line that did not fit is still in the file's buffer
    assert str(failed.value) == f"no space left on device writing metrics.jsonl in {run}"


# torch.save's second call (the second checkpoint's trainer_state.pt) fails as on a full disk.
SECOND_SAVE_FAILS = """
import errno, os, torch
_save, _calls = torch.save, []
def _full_on_second(obj, f, *args, **kw):
    _calls.append(1)
    if len(_calls) > 1:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return _save(obj, f, *args, **kw)
torch.save = _full_on_second
"""
# Room for the first checkpoint (1.1 MB) beside the config and metrics, not for a second one.
DISK = "1600k"
RUN = [*TINY, "total_train_steps=8", "saver.freq_steps=2", "evaluator.freq_steps=0"]


@pytest.mark.slow
def test_a_run_whose_checkpoint_does_not_fit_ends_in_one_line_and_resumes_from_the_last(tmp_path):
    disk = tmp_path / "disk"
    with contextlib.ExitStack() as stack:
        env = None
        if mount_tmpfs(disk, DISK):
            stack.callback(subprocess.run, ["umount", str(disk)], check=True, timeout=30)
        else:
            env = started_with(tmp_path / "site", SECOND_SAVE_FAILS)
        res = a3po("train", *RUN, cwd=disk, env=env)
        assert res.returncode == 1, res.stderr[-3000:]
        line = assert_one_clean_line(res.stderr, "a3po: error: ")
        assert line == ("a3po: error: no space left on device writing a checkpoint in runs/tiny/checkpoints at step 4; "
                        "free space there, or set fileroot=<a folder with room> for a new run; last checkpoint "
                        "runs/tiny/checkpoints/step_000002 (continue with: a3po train --resume runs/tiny)"), line
        run = disk / "runs" / "tiny"
        assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest", "step_000002"]
        shutil.copytree(run, tmp_path / "moved")  # as a user would, to a disk with room
    resumed = a3po("train", "--resume", str(tmp_path / "moved"), cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming" in resumed.stderr and "from step_000002 (step 2)" in resumed.stderr, resumed.stderr[-3000:]
    assert (tmp_path / "moved" / "checkpoints" / "latest").read_text() == "step_000008"

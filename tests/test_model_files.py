"""The model folders a3po writes (checkpoints, `a3po export`) are as readable as every other file it writes, and
the commands that load or write a model print their own lines only, no library's progress bar.

safetensors writes its files owner-only (0600) where a file opened for writing gets 0666 less the umask (0644 as a
rule): a checkpoint's or an export's weights were the one file others could not read. transformers draws its own
progress bars ("Loading weights", "Writing model shards") into a3po export's and a3po serve's output. Real tiny
engines, real files, the real commands in subprocesses.
"""

import copy
import os
from pathlib import Path

import pytest
from conftest import actor_cfg
from procs import a3po, served

from a3po.config import dump_yaml, load_config
from a3po.trainer.checkpoint import save_checkpoint
from a3po.trainer.engine import TrainEngine

BARS = ("Loading weights", "Writing model shards", "it/s]", "%|")  # what transformers' tqdm bars print


def modes(folder: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mode & 0o777 for p in sorted(folder.iterdir()) if p.is_file()}


def checkpoint(model, tok, run: Path, *overrides: str) -> Path:
    engine = TrainEngine(copy.deepcopy(model), actor_cfg(*overrides), 8)
    return save_checkpoint(run, 1, engine, tok, {"step": 1, "data_cursor": 4})


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("mask", [0o022, 0o027], ids=["umask022", "umask027"])
def test_a_checkpoint_s_weights_get_the_mode_every_new_file_gets(tiny, tmp_path, mask, lora):
    model, tok = tiny
    before = os.umask(mask)
    try:
        ckpt = checkpoint(model, tok, tmp_path, *(["actor.lora.rank=4"] if lora else []))
    finally:
        os.umask(before)
    weights = "adapter_model.safetensors" if lora else "model.safetensors"
    got = modes(ckpt)
    assert got[weights] == 0o666 & ~mask, oct(got[weights])
    assert set(got.values()) == {0o666 & ~mask}, {k: oct(v) for k, v in got.items()}


@pytest.fixture(scope="module")
def run_folder(tmp_path_factory) -> Path:
    """A run folder as `a3po train --preset tiny` leaves it: its config.yaml and a checkpoint of step 1."""
    from a3po.models import load_policy

    run = tmp_path_factory.mktemp("run") / "runs" / "tiny"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(dump_yaml(load_config(preset="tiny")))
    model, tok = load_policy("tiny", seed=0)
    checkpoint(model, tok, run)
    return run


@pytest.fixture(scope="module")
def exported(run_folder, tmp_path_factory) -> tuple[Path, object]:
    out = tmp_path_factory.mktemp("export") / "model"
    return out, a3po("export", str(run_folder), "--out", str(out))


@pytest.mark.slow
def test_export_writes_the_weights_readable_like_the_rest(exported):
    out, res = exported
    assert res.returncode == 0, res.stderr[-2000:]
    umask = os.umask(0)
    os.umask(umask)  # the subprocess had this test process's umask
    got = modes(out)
    assert "model.safetensors" in got and set(got.values()) == {0o666 & ~umask}, {k: oct(v) for k, v in got.items()}


@pytest.mark.slow
def test_export_prints_its_own_line_and_no_progress_bar(exported):
    out, res = exported
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.startswith("a3po export: step 1 written to ") and len(res.stdout.splitlines()) == 1
    assert not any(bar in res.stdout + res.stderr for bar in BARS), res.stderr[-2000:]


@pytest.mark.slow
def test_serve_prints_its_own_line_and_no_progress_bar(exported):
    out, _ = exported
    with served("--model", str(out)) as (proc, url):
        assert proc.startup.startswith("a3po serve: serving") and len(proc.startup.splitlines()) == 1, proc.startup

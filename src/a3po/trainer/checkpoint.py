"""Checkpoints a run can resume from, written so that a crash never leaves a broken one.

    RUN_DIR/checkpoints/step_000010/   Hugging Face model + tokenizer, trainer_state.pt, run_state.json,
                                       and the run's files (rollout.jsonl: pipeline/carry.py)
    RUN_DIR/checkpoints/latest         the name of the newest complete checkpoint

A checkpoint is written into a temporary folder, every file and the folder are fsynced, and
only then is it renamed into place; `latest` is written the same way after that, and older
checkpoints beyond `keep` are removed last. Without the fsyncs a power cut could leave a
renamed folder whose files are empty, which `latest` would then point at. A save that fails
(a full disk is DiskFullError, naming the folder) removes its temporary folder and leaves
the older checkpoints and `latest` as they were.

Resuming tries `latest`'s checkpoint first and then the others, newest first: one that cannot
be read (truncated, corrupt, half copied, made for another model) is skipped with a one-line
warning, and when none can be read `CheckpointError` says so in one line. `resume_config`
checks that a --resume folder is a run folder before torch is even imported. The trainer's
state (`save_engine`, `load_engine`) is written and read here too, by every rank together.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from a3po.config import Config, load_config
from a3po.files import atomic_write_text, plain_modes, whole_folder, writing

if TYPE_CHECKING:  # torch is imported where a checkpoint is read or written, not for resume_config
    from a3po.trainer.engine import TrainEngine

RUN_STATE = "run_state.json"
STATE_FILE = "trainer_state.pt"
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


def save_checkpoint(run_dir: Path, step: int, engine, tokenizer, run_state: dict, keep: int = 1,
                    files: dict[str, str] | None = None) -> Path:
    """Write checkpoint `step` (with `files`, name -> text, beside the trainer's); a full disk is DiskFullError
    naming the checkpoints folder.

    A save that fails removes what it had written (the space is given back) and leaves the
    older checkpoints and `latest` as they were, so --resume continues from the last one."""
    root = _dir(run_dir)
    final = root / f"step_{step:06d}"
    with whole_folder(final, "a checkpoint") as tmp:
        save_engine(engine, tmp, tokenizer=tokenizer)
        (tmp / RUN_STATE).write_text(json.dumps(run_state))
        for name, text in (files or {}).items():
            (tmp / name).write_text(text)
    with writing("a checkpoint", root):
        atomic_write_text(root / LATEST, final.name)
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
    found = checkpoints(run_dir)
    if found:
        check_kind(engine, found[0])  # the run's settings against its checkpoints, before any is tried
    for ckpt in found:
        try:
            state = load_run_state(ckpt)
            load_engine(engine, ckpt)
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


# -- the trainer's own state: weights, optimizer, scheduler, version, RNG ---------------------------

def save_engine(engine: TrainEngine, directory: str | Path, tokenizer=None) -> None:
    """The weights (trainer/weights.py: a Hugging Face model folder, or with LoRA the adapter alone in
    PEFT's format) plus optimizer, scheduler, version and RNG state for resume.

    trainer_state.pt holds only tensors and plain types, so `load` can read it with weights_only=True.
    With several ranks the optimizer state is gathered whole, keyed by parameter name (every rank
    takes part; rank 0 writes)."""
    import torch

    engine.ranks.announce("save", directory, tokenizer)
    optimizer = engine.ranks.optimizer_state(engine.policy, engine.optimizer)
    if not engine.ranks.leader:
        return
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    engine.trained.save(engine.whole, d)
    if tokenizer is not None:
        tokenizer.save_pretrained(d)
    plain_modes(d)  # the weights as readable as the rest (safetensors writes them 0600)
    with open(d / STATE_FILE, "wb") as f:  # a Python file: a write error reaches us as OSError (files.no_space)
        torch.save({
            "version": engine.version,
            "optimizer": optimizer,
            "ranks": engine.ranks.world,
            "scheduler": engine.scheduler.state_dict(),
            "torch_rng": torch.get_rng_state(),
        }, f)

def load_engine(engine: TrainEngine, directory: str | Path) -> None:
    """Restore what `save` wrote into this engine (same architecture, same config).

    Everything is read and checked before anything is applied, so a checkpoint that turns
    out unreadable leaves the engine as it was and resume can try an older one. With several
    ranks, rank 0 tells the others to load the same folder once it has read it."""
    import torch

    d = Path(directory)
    check_kind(engine, d)
    weights = engine.trained.read(d)
    state = _read_state(d / STATE_FILE)
    ranks, saved = engine.ranks.world, state.get("ranks", 1)
    if (ranks > 1) != (saved > 1):
        raise ValueError(f"checkpoint {d} was written by {saved} trainer rank(s); resume it with "
                         f"cluster.n_trainer_ranks={'1' if saved == 1 else 'N > 1'}")
    engine.ranks.announce("load", directory)
    engine.ranks.load(engine.policy, engine.optimizer, engine.whole, weights, state["optimizer"])
    engine.scheduler.load_state_dict(state["scheduler"])
    engine.version = state["version"]
    torch.set_rng_state(state["torch_rng"])


def check_kind(engine: TrainEngine, d: Path) -> None:
    """A CheckpointError when checkpoint `d` does not fit the engine's training (full weights against
    LoRA, or another adapter rank): a setting to fix, not a damaged checkpoint."""
    from a3po.models import lora

    adapter, rank = lora.is_adapter_dir(d), engine.trained.adapter_rank
    if adapter != (rank is not None):
        raise CheckpointError(f"checkpoint {d} holds {'a LoRA adapter' if adapter else 'full weights'}, and this run "
                              f"{'trains LoRA adapters' if rank is not None else 'trains every weight'}: "
                              f"resume it with actor.lora.rank={'> 0' if adapter else '0'}, or start a new run")
    if adapter:
        saved = lora.saved_rank(d)
        if saved != rank:
            raise CheckpointError(f"checkpoint {d} holds a rank-{saved} adapter and this run has "
                                  f"actor.lora.rank={rank}: resume it with actor.lora.rank={saved}")


def _read_state(path: Path) -> dict:
    """weights_only: a run folder may come from someone else, and a full unpickle runs any code it holds.

    torch's own message for a refused file suggests weights_only=False, the one thing not to do here."""
    import pickle

    import torch

    try:
        return torch.load(path, weights_only=True)
    except pickle.UnpicklingError:
        raise ValueError(f"{path.name} is corrupt or holds more than tensors and plain values "
                         "(refused unread: loading it could run code)") from None

"""What `actor.path` names, and the checks of it that need no torch.

The command line runs `check_path` before torch and transformers are imported (pipeline/inputs.py), so a
mistyped folder or tiny-model name is one line at once instead of after several seconds of start-up;
source.py's `load_policy` dispatches on the same `kind` and runs the same checks again for callers that
load a model directly.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

SMOLLM2 = "smollm2-135m-instruct"
ACCEPTED = (f"accepted: 'tiny', 'tiny-<hidden>x<layers>', '{SMOLLM2}', a local Hugging Face model directory, "
            "or a hub id when the hub is reachable")
TINY_NAME = re.compile(r"tiny(?:-(\d+)x(\d+))?")  # "tiny" or "tiny-<hidden>x<layers>"
TINY_DEFAULT_SHAPE = (64, 2)  # plain "tiny"
TINY_HEAD_DIM = 32  # vLLM's CPU attention needs at least 32, so the tiny model runs under rollout.backend=vllm too


class ModelSourceError(ValueError):
    """A model source that cannot be loaded, with a one-line message saying how to fix it."""


def kind(path: str) -> str:
    """"tiny", "smollm2", "local" (a folder, existing or written as a filesystem path) or "hub"; a
    ModelSourceError for an empty path or one with surrounding spaces."""
    if not path or path != path.strip():
        raise ModelSourceError(f"actor.path={path!r} is empty or has surrounding spaces; {ACCEPTED}")
    if path.startswith("tiny") and "/" not in path and os.sep not in path:  # "tiny-x/y" may be a hub id
        return "tiny"
    if path == SMOLLM2:
        return "smollm2"
    if Path(path).expanduser().exists() or _looks_like_dir(path):
        return "local"
    return "hub"


def check_path(path: str) -> None:
    """Every fault of `path` that shows without loading anything: its form, a tiny model's shape, a local
    folder's files. A hub id is left to the loader (reaching the hub takes a request)."""
    k = kind(path)
    if k == "tiny":
        tiny_shape(path)
    elif k == "local":
        check_model_folder(Path(path).expanduser(), path)


def tiny_shape(path: str) -> tuple[int, int]:
    """(hidden, layers) of a tiny model's name, or a ModelSourceError saying how such names are made."""
    try:
        return parse_tiny_name(path)
    except ValueError as e:
        raise ModelSourceError(f"actor.path={path!r}: {e}") from None


def parse_tiny_name(name: str) -> tuple[int, int]:
    """(hidden, layers) of a tiny model's name; a ValueError saying how such names are made if `name` is not one."""
    m = TINY_NAME.fullmatch(name)
    if m is None:
        raise ValueError(f"tiny models are named 'tiny' or 'tiny-<hidden>x<layers>', e.g. 'tiny-128x4', not {name!r}")
    hidden, layers = (int(m[1]), int(m[2])) if m[1] else TINY_DEFAULT_SHAPE
    check_tiny_shape(hidden, layers)
    return hidden, layers


def check_tiny_shape(hidden: int, layers: int) -> None:
    if hidden <= 0 or hidden % (2 * TINY_HEAD_DIM) or layers <= 0:
        raise ValueError(f"tiny model needs hidden a positive multiple of {2 * TINY_HEAD_DIM} and layers > 0, "
                         f"got hidden={hidden}, layers={layers}")


def _looks_like_dir(path: str) -> bool:
    """A filesystem path rather than a hub id ("owner/name" also contains "/")."""
    return (path.startswith((".", "~")) or os.path.isabs(path) or path.count("/") > 1
            or (os.sep != "/" and os.sep in path))


def check_model_folder(folder: Path, path: str) -> None:
    """What transformers would report as a multi-line OSError, said in one line before it is asked."""
    if folder.is_file():
        where = f"; give its folder {str(folder.parent)!r}" if (folder.parent / "config.json").is_file() else ""
        raise ModelSourceError(f"actor.path={path!r} is a file, not a model folder{where}; "
                               "give the folder that holds config.json and the weights")
    if not folder.is_dir():
        raise ModelSourceError(f"actor.path={path!r}: no such directory {os.path.abspath(folder)!r}; "
                               "give an existing Hugging Face model folder (with config.json)")
    config = folder / "config.json"
    if not config.is_file() and (folder / "adapter_config.json").is_file():
        raise ModelSourceError(f"actor.path={path!r} is a LoRA adapter, not a model: merge it into its base with "
                               "`a3po export`, or train on the base with actor.lora.rank > 0")
    if not config.is_file():
        raise ModelSourceError(f"actor.path={path!r}: {str(folder)!r} has no config.json, so it is not "
                               "a Hugging Face model folder; save one with model.save_pretrained(dir)")
    try:
        json.loads(config.read_bytes())
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
        raise ModelSourceError(f"actor.path={path!r}: {str(config)!r} is not valid JSON ({e}); "
                               "fix it or save the model again with model.save_pretrained(dir)") from None
    if not any(folder.glob("*.safetensors")) and not any(folder.glob("*.bin")):
        raise ModelSourceError(f"actor.path={path!r}: {str(folder)!r} has config.json but no weights "
                               "(*.safetensors or *.bin); save them there with model.save_pretrained(dir)")

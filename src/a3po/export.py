"""`a3po export`: one self-contained model folder from a run, for users who want no adapter to carry.

    a3po export runs/a3po --out my-model                           # the run's newest checkpoint
    a3po export runs/a3po/checkpoints/step_000016 --out my-model   # one checkpoint of it

A LoRA run's checkpoint holds the adapter alone (PEFT's format); exported, it is folded into
the run's base model (W0 + s B A) and saved as a plain Hugging Face model with its tokenizer,
which `actor.path`, vLLM and transformers load as they load any model. A full run's
checkpoint is saved the same way, without its trainer state.
"""

from __future__ import annotations

from pathlib import Path

from a3po.config import ConfigError
from a3po.files import plain_modes
from a3po.heldout import resolve


def main(target: str, out: str) -> int:
    from a3po.models import load_policy, lora

    t = resolve(target, None, None, [])
    if t.step is None:
        raise ConfigError(f"{target}: not a run folder or one of its checkpoints; export takes what `a3po train` "
                          "saved")
    dest = Path(out)
    if dest.exists() and any(dest.iterdir()):
        raise ConfigError(f"--out {out}: the folder exists and is not empty; name a new folder")
    if lora.is_adapter_dir(t.model):
        model, tok = lora.load_merged(t.model, t.cfg.actor.path, seed=t.cfg.seed)
        what = f"adapter of step {t.step} folded into {t.cfg.actor.path}"
    else:
        model, tok = load_policy(t.model, seed=t.cfg.seed)
        what = f"step {t.step}"
    dest.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(dest, safe_serialization=True)
    tok.save_pretrained(dest)
    plain_modes(dest)  # the weights as readable as the rest (safetensors writes them 0600)
    print(f"a3po export: {what} written to {dest} (a plain model folder: actor.path={dest} loads it)")
    return 0

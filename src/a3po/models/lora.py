"""LoRA adapters on a Hugging Face causal LM: attach, switch off, publish, fold, save and read.

The adapter layers and their file format are PEFT's, so a saved adapter loads in PEFT
(`PeftModel.from_pretrained(base, folder)`) and in vLLM as it is. Everything outside the
trainer sees plain weights: a rollout worker folds each published adapter into its own
frozen copy of the base, W = W0 + s B A, always from W0 (folding into the previous version's
weights would accumulate rounding), and evaluation and export use a folded copy (`merged`).

Names. In the trainer a target module X holds `X.base_layer.weight` and
`X.lora_A.default.weight` / `X.lora_B.default.weight`. What is published and saved names
the adapter `X.lora_A.weight` / `X.lora_B.weight` (the file adds PEFT's `base_model.model.`
in front); the weight it folds into is `X.weight`.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import Tensor

from a3po.config import ConfigError

ADAPTER_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
FILE_PREFIX = "base_model.model."  # PEFT's prefix of every name in its adapter file
SCALE = "lora.scale"  # the published adapter's scale alpha / rank, beside its tensors
_PARTS = ("lora_A", "lora_B")


def is_adapter_dir(path: str | Path) -> bool:
    return (Path(path) / ADAPTER_CONFIG).is_file()


def _peft_config(rank: int, alpha: float, dropout: float, target_modules: list[str]):
    from peft import LoraConfig

    return LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout,
                      target_modules=list(target_modules) or "all-linear", bias="none")


def attach(model, rank: int, alpha: float, dropout: float, target_modules: list[str]) -> None:
    """Adapters on `model` in place (B = 0, so the model computes what it did), everything else frozen.
    A target that names no linear layer, or a head tied to the embeddings, is a ConfigError naming it."""
    from peft import inject_adapter_in_model

    linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
    head = model.get_output_embeddings()
    tied = getattr(model.config, "tie_word_embeddings", False)
    for t in target_modules:
        found = [m for n, m in model.named_modules() if n == t or n.endswith("." + t)]
        if not found:
            raise ConfigError(f"actor.lora.target_modules: {t!r} names no module of {type(model).__name__}; "
                             f"its linear layers are {linear}")
        if not all(isinstance(m, torch.nn.Linear) for m in found):
            raise ConfigError(f"actor.lora.target_modules: {t!r} is not a linear layer (adapters here are for linear "
                             f"layers: {linear})")
        if tied and any(m is head for m in found):
            raise ConfigError(f"actor.lora.target_modules: {t!r} is the LM head, which this model ties to its "
                             "embeddings: a folded adapter would change both; leave it out")
    inject_adapter_in_model(_peft_config(rank, alpha, dropout, target_modules), model)
    for name, p in model.named_parameters():
        p.requires_grad_(any(f".{part}." in name for part in _PARTS))


def has_adapters(model) -> bool:
    """Whether adapter layers are attached (by name: no PEFT import for the plain models everyone else holds)."""
    return any(name.endswith(".lora_A") for name, _ in model.named_modules())


@contextmanager
def adapters_off(model) -> Iterator[None]:
    """`model` computes its base weights alone (the reference policy) inside the block."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    for m in layers:
        m.enable_adapters(False)
    try:
        yield
    finally:
        for m in layers:
            m.enable_adapters(True)


def adapter_state(model) -> dict[str, Tensor]:
    """The adapter's tensors under their published names (live views: the sync copies them once)."""
    out = {}
    for name, t in model.state_dict().items():
        for part in _PARTS:
            if f".{part}.default." in name:
                out[name.replace(f".{part}.default.", f".{part}.")] = t
    return out


def to_model_names(adapter: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Published (or saved) names -> the trainer model's own state-dict names."""
    return {k.replace(".lora_A.", ".lora_A.default.").replace(".lora_B.", ".lora_B.default."): t
            for k, t in adapter.items() if k != SCALE}


def targets(adapter: Mapping[str, Tensor]) -> list[str]:
    """The modules an adapter folds into, from its tensor names."""
    return sorted({k.rsplit(".lora_A.", 1)[0] for k in adapter if ".lora_A." in k})


def delta(a: Tensor, b: Tensor, scale: float) -> Tensor:
    """s B A, in fp32 whatever the stored dtype."""
    return scale * (b.float() @ a.float())


class Folder:
    """A rollout worker's side: the base weights of the adapter's target modules, kept from the start, and
    each published adapter folded into them (W0 + s B A, from W0 every time)."""

    def __init__(self, model, adapter: Mapping[str, Tensor]):
        own = model.state_dict()
        names = [f"{m}.weight" for m in targets(adapter)]
        missing = [n for n in names if n not in own]
        if missing:
            raise KeyError(f"the adapter targets weights the rollout model lacks: {missing[:3]}")
        self.base = {n: own[n].detach().clone() for n in names}

    def __call__(self, adapter: Mapping[str, Tensor]) -> dict[str, Tensor]:
        scale = float(adapter[SCALE])
        out = {}
        for name, w0 in self.base.items():
            m = name.removesuffix(".weight")
            out[name] = (w0.float() + delta(adapter[f"{m}.lora_A.weight"], adapter[f"{m}.lora_B.weight"], scale)
                         ).to(w0.dtype)
        return out


def published(model, scale: float) -> dict[str, Tensor]:
    """What weight sync publishes for a model with adapters: their tensors and the scale."""
    return {**adapter_state(model), SCALE: torch.tensor(float(scale))}


def merged(model):
    """A plain copy of `model` (adapters attached) with every adapter folded into its base weight."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    hooks = {}  # the copy leaves the trainer's module hooks (core lending's) behind: their owners hold locks
    for m in model.modules():
        for key, d in vars(m).items():
            if key.endswith(("_hooks", "_hooks_with_kwargs", "_hooks_always_called")) and isinstance(d, dict):
                hooks[id(d)] = type(d)()
    out = copy.deepcopy(model, hooks)
    for name, m in list(out.named_modules()):
        if not isinstance(m, BaseTunerLayer):
            continue
        base = m.get_base_layer()
        with torch.no_grad():
            w = base.weight
            w.copy_((w.float() + delta(m.lora_A["default"].weight, m.lora_B["default"].weight,
                                       m.scaling["default"])).to(w.dtype))
        parent, _, leaf = name.rpartition(".")
        setattr(out.get_submodule(parent) if parent else out, leaf, base)
    out.requires_grad_(True)  # a plain model, as load_policy gives one
    return out


def save(model, directory: str | Path, rank: int, alpha: float, dropout: float, target_modules: list[str],
         base: str) -> None:
    """The adapter in PEFT's format (adapter_config.json naming `base`, adapter_model.safetensors)."""
    from safetensors.torch import save_file

    d = Path(directory)
    cfg = _peft_config(rank, alpha, dropout, target_modules)
    cfg.base_model_name_or_path = base
    cfg.target_modules = sorted({t.rsplit(".", 1)[-1] for t in targets(adapter_state(model))})
    cfg.save_pretrained(str(d))
    save_file({FILE_PREFIX + k: t.detach().contiguous() for k, t in adapter_state(model).items()},
              str(d / ADAPTER_FILE), metadata={"format": "pt"})


def saved_rank(directory: str | Path) -> int | None:
    """The rank a saved adapter's config states (None when unreadable: `read` says why)."""
    try:
        return int(json.loads((Path(directory) / ADAPTER_CONFIG).read_text())["r"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def read(directory: str | Path) -> tuple[dict[str, Tensor], float, str | None]:
    """(adapter tensors under published names, scale, the base model it names) of a saved adapter."""
    from safetensors.torch import load_file

    d = Path(directory)
    try:
        cfg = json.loads((d / ADAPTER_CONFIG).read_text())
        rank, alpha = int(cfg["r"]), float(cfg["lora_alpha"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{d / ADAPTER_CONFIG} is not a readable LoRA adapter config ({e})") from None
    if not (d / ADAPTER_FILE).is_file():
        raise ValueError(f"{d} has {ADAPTER_CONFIG} but no {ADAPTER_FILE}")
    tensors = {k.removeprefix(FILE_PREFIX): t for k, t in load_file(str(d / ADAPTER_FILE)).items()}
    return tensors, alpha / rank, cfg.get("base_model_name_or_path")


def fold_into(model, directory: str | Path) -> None:
    """Fold a saved adapter into a plain `model` in place: the model the adapter was trained on, merged."""
    adapter, scale, _ = read(directory)
    adapter[SCALE] = torch.tensor(scale)
    weights = Folder(model, adapter)(adapter)
    own = model.state_dict()
    with torch.no_grad():
        for name, w in weights.items():
            own[name].copy_(w)


def load_merged(directory: str | Path, base: str | None = None, seed: int = 0):
    """(model, tokenizer): a saved adapter folded into its base, `base` or else the one its config names."""
    from a3po.models import ModelSourceError, load_policy

    base = base or read(directory)[2]
    if not base:
        raise ModelSourceError(f"{directory}: the adapter names no base model; give its base (actor.path)")
    model, tok = load_policy(base, seed=seed)
    fold_into(model, directory)
    return model, tok

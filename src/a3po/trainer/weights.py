"""What the trainer trains: every weight (`FullWeights`) or low-rank adapters (`LoraWeights`), behind one interface.

    trained = trained_weights(model, cfg.actor, policy_of)   # attaches the adapters when actor.lora.rank > 0
    with trained.reference_policy(policy) as ref: ...         # the reference's pass in a training step
    trained.published(whole)                                  # what weight sync sends
    trained.sampling_model(whole)                             # a plain causal LM for evaluation
    trained.save(whole, folder); trained.read(folder)         # checkpoints

The two differ in exactly these places, so the engine's update has no branch for them:
  - which parameters the optimizer holds, and at what learning rate (LoRA: actor.lora.lr);
  - the reference policy of the KL: a frozen copy of the initial weights, or with LoRA the model
    itself with its adapters switched off, so no second copy is needed;
  - what is published and saved: every weight, or the adapter's tensors and scale alone
    (models/lora.py), which the rollout workers fold into their own base and PEFT reads as it is;
  - the sampling model: the weights themselves, or a copy with the adapters folded in.

`whole` is the whole model on rank 0 (trainer/parallel.py): the model itself in one process.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Protocol

import torch
from torch import Tensor

from a3po.config.schema import ActorConfig
from a3po.models import lora


class Weights(Protocol):
    """Training every weight or adapters only: the interface the engine and the checkpoints use."""

    adapter_rank: int | None  # the LoRA rank, None when every weight trains
    ref_model: torch.nn.Module | None  # a second, frozen model the reference's passes need (None: none is kept)

    def learning_rate(self, lr: float) -> float:
        """The optimizer's learning rate, given actor.optimizer.lr."""

    def reference_policy(self, policy) -> AbstractContextManager:
        """The policy whose passes inside a training step are the reference's (every rank runs it)."""

    def reference_model(self, whole) -> AbstractContextManager:
        """A plain model that computes the reference on rank 0 alone (KL charged to the rewards)."""

    def published(self, whole) -> dict[str, Tensor]:
        """What weight sync publishes: live views, which the sync copies once."""

    def sampling_model(self, whole):
        """The policy as a plain causal LM for a sampler."""

    def save(self, whole, directory: Path) -> None:
        """The weights into a checkpoint folder."""

    def read(self, directory: Path) -> dict[str, Tensor]:
        """A checkpoint's weights under the model's own names; a ValueError naming what does not match."""


def trained_weights(model, cfg: ActorConfig, policy_of: Callable) -> Weights:
    """`LoraWeights` (adapters attached to `model` now) when actor.lora.rank > 0, else `FullWeights`.
    `policy_of(model)` wraps a model as the engine's policy (trainer/logprobs.PolicyLogp)."""
    return LoraWeights(model, cfg) if cfg.lora.rank > 0 else FullWeights(model, cfg, policy_of)


class FullWeights:
    """Every weight trains. With actor.kl_ctl > 0 a frozen copy of the initial weights is the reference;
    every rank holds it whole, so its passes are no collective."""

    adapter_rank = None

    def __init__(self, model, cfg: ActorConfig, policy_of: Callable):
        self.model = model
        self.ref_model = copy.deepcopy(model).eval().requires_grad_(False) if cfg.kl_ctl > 0 else None
        self.ref_policy = policy_of(self.ref_model) if self.ref_model is not None else None

    def learning_rate(self, lr: float) -> float:
        return lr

    @contextmanager
    def reference_policy(self, policy) -> Iterator:
        yield self.ref_policy

    @contextmanager
    def reference_model(self, whole) -> Iterator:
        yield self.ref_model

    def published(self, whole) -> dict[str, Tensor]:
        """Every weight under its Hugging Face name, tied ones included."""
        return whole.state_dict()

    def sampling_model(self, whole):
        return whole

    def save(self, whole, directory: Path) -> None:
        whole.save_pretrained(directory, safe_serialization=True)

    def read(self, directory: Path) -> dict[str, Tensor]:
        weights = _read_safetensors(directory)
        _check_names(directory, *_mismatch(self.model, weights))
        return weights


class LoraWeights:
    """Low-rank adapters train on a frozen base (models/lora.py); the reference is the base itself,
    the model with its adapters off. Checkpoints hold the adapter alone, in PEFT's format, naming
    the run's actor.path as its base."""

    ref_model = None  # no second copy

    def __init__(self, model, cfg: ActorConfig):
        self.model, self.cfg, self.base = model, cfg.lora, cfg.path
        self.adapter_rank = cfg.lora.rank
        lora.attach(model, cfg.lora.rank, cfg.lora.alpha_value, cfg.lora.dropout, cfg.lora.target_modules)
        if cfg.gradient_checkpointing:  # frozen embeddings: the checkpointed layers' input needs a gradient
            model.enable_input_require_grads()

    def learning_rate(self, lr: float) -> float:
        return self.cfg.learning_rate(lr)

    @contextmanager
    def reference_policy(self, policy) -> Iterator:
        """This rank's own policy with its adapters off (under data parallelism every rank runs it, like the policy)."""
        with lora.adapters_off(self.model):
            yield policy

    @contextmanager
    def reference_model(self, whole) -> Iterator:
        """Rank 0's whole copy with its adapters off: no collective."""
        with lora.adapters_off(whole):
            yield whole

    def published(self, whole) -> dict[str, Tensor]:
        """The adapters' tensors and their scale only: the workers fold them into their base."""
        return lora.published(whole, self.cfg.scale)

    def sampling_model(self, whole):
        """A copy with the adapters folded in: a sampler reading the base weights would ignore them."""
        return lora.merged(whole)

    def save(self, whole, directory: Path) -> None:
        c = self.cfg
        lora.save(whole, directory, c.rank, c.alpha_value, c.dropout, c.target_modules, self.base)

    def read(self, directory: Path) -> dict[str, Tensor]:
        weights = lora.to_model_names(lora.read(directory)[0])
        own = {k: t for k, t in self.model.state_dict().items() if ".lora_" in k}
        missing = sorted(k for k in own if k not in weights)
        unexpected = sorted(k for k in weights if k not in own or weights[k].shape != own[k].shape)
        _check_names(directory, missing, unexpected)
        return weights


def _check_names(directory: Path, missing: list[str], unexpected: list[str]) -> None:
    if missing or unexpected:
        raise ValueError(f"checkpoint {directory} does not match the model: "
                         f"missing {missing[:3]}, unexpected {unexpected[:3]}")


def _read_safetensors(d: Path) -> dict[str, Tensor]:
    from safetensors.torch import load_file

    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise ValueError(f"checkpoint {d} has no *.safetensors weights")
    weights = {}
    for f in files:
        weights.update(load_file(f))
    return weights


def _mismatch(model, weights: dict[str, Tensor]) -> tuple[list[str], list[str]]:
    """Names the checkpoint lacks (a tied lm_head aside) and names the model lacks, or shapes that differ."""
    own = model.state_dict()
    tied = model.config.tie_word_embeddings
    missing = sorted(k for k in own if k not in weights and not (tied and k.endswith("lm_head.weight")))
    unexpected = sorted(k for k in weights if k not in own or weights[k].shape != own[k].shape)
    return missing, unexpected

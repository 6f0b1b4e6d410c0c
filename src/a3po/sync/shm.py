"""Weight sync on one machine through shared memory: no disk round trip, no pickling per update.

The trainer allocates one shared-memory tensor per weight once, hands them to the rollout
workers when it spawns them (torch shares the storage, it does not copy it), and on each
new version copies its weights in and tells the workers the version number. A worker
copies the shared tensors into its own model between two decode steps and acknowledges.
The trainer writes the next version only after every worker acknowledged the previous
one, so a worker never reads a half-written buffer; a training step takes far longer
than a load, so this wait is normally zero.

Every weight transport (this one, sync/object_store.py) offers the same three calls:
`publish(state)` on the trainer, `at_start()` for what a starting worker is given, and
`for_load()` for what a LoadWeights message carries (None here: the worker already holds
the buffer).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor


class SharedWeights:
    def __init__(self, state: Mapping[str, Tensor]):
        self.tensors = {k: v.detach().to("cpu", torch.float32, copy=True).contiguous().share_memory_()
                        for k, v in state.items()}

    @torch.no_grad()
    def publish(self, state: Mapping[str, Tensor]) -> None:
        for name, value in state.items():
            self.tensors[name].copy_(value)

    def at_start(self) -> dict[str, Tensor]:
        return self.tensors

    def for_load(self) -> None:
        return None

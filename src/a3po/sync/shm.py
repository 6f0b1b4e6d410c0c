"""Weight sync on one machine through shared memory: no disk round trip, no pickling per update.

The trainer allocates two shared-memory copies of the weights once and hands both to the
rollout workers when it starts them (torch shares the storage, it does not copy it). It
writes each new version into the copy the previous version is not in, then tells the
workers the version and which copy holds it; a worker copies that buffer into its own
model between two decode steps and acknowledges. So the trainer writes v + 1 while a slow
worker may still be reading v, and waits only for a worker still on v - 1 (whose buffer
v + 1 overwrites): with a training step far longer than a load, never.

Every weight transport (this one, sync/object_store.py) offers the same calls: on the
trainer `publish(state)` (returning the bytes it wrote), `at_start()` for what a starting worker is given and
`for_load()` for what a LoadWeights message carries; on the worker, `take()` of what it
was given at start, and `tensors(given)` of a message's payload.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class SharedBuffers:
    """Both buffers, and which one holds the version published last: what a worker is started with."""

    buffers: tuple[dict[str, Tensor], dict[str, Tensor]]
    current: int

    def take(self) -> dict[str, Tensor]:
        return self.buffers[self.current]


@dataclass
class InBuffer:
    """What a LoadWeights message carries: which buffer holds its version."""

    index: int

    def tensors(self, given: SharedBuffers) -> dict[str, Tensor]:
        return given.buffers[self.index]


class SharedWeights:
    def __init__(self, state: Mapping[str, Tensor]):
        copy = lambda: {k: v.detach().to("cpu", torch.float32, copy=True).contiguous().share_memory_()
                        for k, v in state.items()}
        self.buffers = (copy(), copy())
        self.current = 0

    @torch.no_grad()
    def publish(self, state: Mapping[str, Tensor]) -> int:
        """Into the other buffer; it becomes the current one once it is complete. Returns the bytes written."""
        spare = 1 - self.current
        for name, value in state.items():
            self.buffers[spare][name].copy_(value)
        self.current = spare
        return sum(t.nbytes for t in self.buffers[spare].values())

    def at_start(self) -> SharedBuffers:
        return SharedBuffers(self.buffers, self.current)

    def for_load(self) -> InBuffer:
        return InBuffer(self.current)

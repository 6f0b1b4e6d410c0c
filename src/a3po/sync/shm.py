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
    """Both buffers, and which one holds the version published last: what a worker is started with.

    Each buffer is one flat shared-memory tensor; the weights are views into it, made on the side that reads
    them. So handing a worker both buffers passes two file descriptors, not one per tensor (SmolLM2 publishes 273
    tensors; a fork server passes at most 252 descriptors to a child, launch/forked.py)."""

    flats: tuple[Tensor, Tensor]
    shapes: dict[str, torch.Size]
    current: int

    def tensors(self, index: int) -> dict[str, Tensor]:
        """Buffer `index`'s weights by name: views of its flat tensor."""
        out, at = {}, 0
        for name, shape in self.shapes.items():
            n = shape.numel()
            out[name] = self.flats[index][at:at + n].view(shape)
            at += n
        return out

    def take(self) -> dict[str, Tensor]:
        return self.tensors(self.current)


@dataclass
class InBuffer:
    """What a LoadWeights message carries: which buffer holds its version."""

    index: int

    def tensors(self, given: SharedBuffers) -> dict[str, Tensor]:
        return given.tensors(self.index)


class SharedWeights:
    def __init__(self, state: Mapping[str, Tensor]):
        shapes = {k: v.shape for k, v in state.items()}
        size = sum(shape.numel() for shape in shapes.values())
        self._given = SharedBuffers((torch.empty(size, dtype=torch.float32).share_memory_(),
                                     torch.empty(size, dtype=torch.float32).share_memory_()), shapes, 0)
        self.buffers = (self._given.tensors(0), self._given.tensors(1))
        with torch.no_grad():
            for buffer in self.buffers:
                for name, value in state.items():
                    buffer[name].copy_(value.detach())
        self.current = 0

    @torch.no_grad()
    def publish(self, state: Mapping[str, Tensor]) -> int:
        """Into the other buffer; it becomes the current one once it is complete. Returns the bytes written."""
        spare = 1 - self.current
        for name, value in state.items():
            self.buffers[spare][name].copy_(value)
        self.current = spare
        return self._given.flats[spare].nbytes  # the whole buffer: every weight was written

    def at_start(self) -> SharedBuffers:
        return SharedBuffers(self._given.flats, self._given.shapes, self.current)

    def for_load(self) -> InBuffer:
        return InBuffer(self.current)

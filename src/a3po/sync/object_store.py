"""Weight sync across machines through Ray's object store (cluster.launcher=ray).

The calls are those of sync/shm.py. Each published version is a new immutable object: the trainer puts its weights once
(`ray.put`, fp32 numpy arrays, which Ray stores without pickling them element by
element), and every LoadWeights message carries a reference to it. A worker on the
trainer's node maps the object without a copy; a worker on another node pulls it over
the network once, from the node that holds it. Because a version is never overwritten,
a slow worker can still read v while the trainer publishes v + 1; Ray frees a version
when the trainer and every worker holding its reference have dropped it.

Cost: a put writes a new object per version, dearer than the shared-memory copy, while a
worker on the same node maps the object and reads a version as fast as from shared memory;
across nodes a read also moves the model's fp32 bytes once per worker per version.
`a3po bench sync` measures both transports (docs/results.md).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping

import torch
from torch import Tensor


def as_tensors(arrays: Mapping) -> dict[str, Tensor]:
    """Tensors over the object store's read-only arrays, without a copy; the engines only read them."""
    with warnings.catch_warnings():  # torch warns that the array is not writable: it is not written
        warnings.simplefilter("ignore", UserWarning)
        return {k: torch.from_numpy(v) for k, v in arrays.items()}


class StoredVersion:
    """What a LoadWeights message carries: a reference to one published version."""

    def __init__(self, ref):
        self.ref = ref

    def tensors(self, given=None) -> dict[str, Tensor]:
        import ray

        return as_tensors(ray.get(self.ref))

    def take(self) -> dict[str, Tensor]:
        """The tensors, dropping this copy's reference: a worker's start-up version, passed in the arguments
        its actor keeps for its whole life, would otherwise pin that version in the store until it ends."""
        out, self.ref = self.tensors(), None
        return out


class ObjectStoreWeights:
    def __init__(self, state: Mapping[str, Tensor]):
        self.current: StoredVersion | None = None
        self.publish(state)

    @torch.no_grad()
    def publish(self, state: Mapping[str, Tensor]) -> int:
        import ray

        arrays = {k: v.detach().to("cpu", torch.float32).contiguous().numpy() for k, v in state.items()}
        self.current = StoredVersion(ray.put(arrays))
        return sum(a.nbytes for a in arrays.values())

    def at_start(self) -> StoredVersion:
        return self.current

    def for_load(self) -> StoredVersion:
        return self.current

"""The order in which training examples are handed out: a seeded shuffle per epoch, resumable by a cursor."""

from __future__ import annotations

import torch


class DataOrder:
    def __init__(self, n: int, seed: int, cursor: int = 0):
        if n <= 0:
            raise ValueError("the training split is empty")
        self.n, self.seed, self.cursor = n, seed, cursor
        self._epoch, self._perm = -1, None

    def index_at(self, position: int) -> int:
        epoch, offset = divmod(position, self.n)
        if epoch != self._epoch:
            g = torch.Generator().manual_seed(self.seed * 7919 + epoch)
            self._epoch, self._perm = epoch, torch.randperm(self.n, generator=g).tolist()
        return self._perm[offset]

    def next(self) -> int:
        """Index of the next example; advances the cursor."""
        i = self.index_at(self.cursor)
        self.cursor += 1
        return i

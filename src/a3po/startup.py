"""Start-up with the cycle collector held back: the imports and the model build of every a3po process.

Before it does any work, an a3po process imports torch and transformers and builds a model: a heap of
hundreds of thousands of objects, none of them garbage yet, which Python's cycle collector walks again at
every full collection while the heap grows. Held back while that happens, the collector then finds all of
it frozen (gc.freeze): the training loop's full collections walk only what the run allocates. No collection
precedes the freeze: it would walk the whole heap once more, costing most of what holding back saved, to free
the little that start-up leaves in cycles (a few closures, no tensors), which is frozen with the rest instead.
Held back, not switched off: a young collection still runs every HELD[0] allocations, so a process that
stays in start-up cannot grow without bound.

Stdlib only, like child.py: the command line imports this before torch.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

HELD = (100_000, 10, 10)  # gc thresholds while starting: allocations per young collection, then the older two


@contextlib.contextmanager
def collector_held() -> Iterator[None]:
    """Run the block with the collector's thresholds at HELD; afterwards freeze what exists and restore them."""
    before = gc.get_threshold()
    gc.set_threshold(*HELD)
    try:
        yield
    finally:
        gc.freeze()
        gc.set_threshold(*before)

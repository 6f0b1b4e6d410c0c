"""Keep freed memory in the process instead of handing it back to the kernel after every tensor.

glibc serves blocks above a threshold with mmap and returns them with munmap when freed; a
training step allocates and frees hundreds of such blocks (activations, (tokens x vocab)
logit chunks), so every one is faulted in again page by page. That makes element-wise ops
on fresh large tensors several times slower than on reused memory, a sizeable share of a
training step (docs/results.md). With mmap off and heap trimming
pushed out of reach, freed blocks stay in the heap and are reused. The price is that the
process keeps its peak heap; a3po's processes live for one run, so that is the right trade.

Set A3PO_KEEP_MALLOC=1 to leave the allocator alone. Elsewhere than glibc, nothing happens.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
_done = False


def keep_freed_memory() -> bool:
    """Tune glibc once per process; True if it took effect."""
    global _done
    if _done or os.environ.get("A3PO_KEEP_MALLOC") == "1":
        return _done
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (macOS, musl without mallopt, Windows)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _done = bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, 2**31 - 1))
    return _done

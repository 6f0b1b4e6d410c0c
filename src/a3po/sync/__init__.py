"""Weight sync: how the trainer's new weights reach the rollout engines."""

from a3po.sync.shm import SharedWeights

__all__ = ["SharedWeights"]

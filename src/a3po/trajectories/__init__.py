"""Trajectories: what rollout hands to training, and how they become padded batches."""

from a3po.trajectories.batch import TrainBatch, Trajectory, collate

__all__ = ["TrainBatch", "Trajectory", "collate"]

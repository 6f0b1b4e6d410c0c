"""Trajectories: what rollout hands to training, and how they become padded batches."""

from a3po.trajectories.batch import EpisodeInfo, TrainBatch, Trajectory, collate

__all__ = ["EpisodeInfo", "TrainBatch", "Trajectory", "collate"]

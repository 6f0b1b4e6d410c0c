"""Rollout: inference engines that sample completions with per-token log-probs and versions."""

from a3po.rollout.engine import Completion, GenerationRequest, RolloutEngine, generate

__all__ = ["Completion", "GenerationRequest", "RolloutEngine", "generate"]

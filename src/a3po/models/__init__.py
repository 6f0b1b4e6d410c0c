"""Models and tokenizers for the actor: `load_policy(actor.path)` (see source.py)."""

from a3po.models.source import ModelSourceError, cache_dir, end_ids, load_policy

__all__ = ["ModelSourceError", "cache_dir", "end_ids", "load_policy"]

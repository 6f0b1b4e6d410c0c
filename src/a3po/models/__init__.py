"""Models and tokenizers for the actor: `load_policy(actor.path)` (see source.py).

The loaders import torch and transformers; `a3po.models.paths` (what `actor.path` names, checked without
loading) must not, since the command line reads it before torch's start-up. So the loaders are looked up
on first use instead of here.
"""

from a3po.models.paths import ModelSourceError

__all__ = ["ModelSourceError", "cache_dir", "end_ids", "load_policy"]


def __getattr__(name: str):
    if name in ("cache_dir", "end_ids", "load_policy"):
        from a3po.models import source

        return getattr(source, name)
    raise AttributeError(f"module 'a3po.models' has no attribute {name!r}")

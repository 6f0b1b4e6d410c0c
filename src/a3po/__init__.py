"""a3po: asynchronous RL post-training of language models with A-3PO."""

__version__ = "0.1.0"

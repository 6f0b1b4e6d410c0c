"""The local engine's forward through the model's own Hugging Face code: any causal LM.

Used where rollout/kv_decoder.py does not apply (another architecture) or when asked for
(`rollout.forward=hf`). The rows share one left-padded DynamicCache: new sequences are
prefilled together and merged in, finished rows are dropped by indexing, and columns that
are padding in every row are trimmed. It has the same calls as KVDecoder.
"""

from __future__ import annotations

import inspect

import torch
from torch import Tensor
from transformers import DynamicCache


class HFForward:
    def __init__(self, model):
        self.model = model
        self.device = next(model.parameters()).device
        self.pad_id = model.config.pad_token_id or 0  # never attended to
        self._cache = None  # DynamicCache over the rows, left-padded
        self._attn: Tensor | None = None  # (B, L) long, 1 on real tokens
        self._next_pos: Tensor | None = None  # (B,) position of the next token
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"

    def weights_changed(self) -> None:
        """The model's forward reads its weights at every call."""

    @torch.no_grad()
    def prefill(self, start: int, seqs: list[list[int]]) -> Tensor:
        """Run whole sequences into rows start.. (start is 0 or the number of rows): next-token logits (n, V)."""
        L = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), L), self.pad_id, dtype=torch.long)
        attn = torch.zeros(len(seqs), L, dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, L - len(s):] = torch.tensor(s, dtype=torch.long)
            attn[i, L - len(s):] = 1
        ids, attn = ids.to(self.device), attn.to(self.device)
        pos = (attn.cumsum(-1) - 1).clamp(min=0)  # (B, L)
        cache = DynamicCache()
        logits = self._forward(ids, attn, pos, cache)
        if start == 0:
            self._cache, self._attn, self._next_pos = cache, attn, attn.sum(-1)
        else:
            self._merge(cache, attn, attn.sum(-1))
        return logits

    @torch.no_grad()
    def decode(self, tokens: Tensor) -> Tensor:
        """One decode forward pass for every row with its newest token: next-token logits (B, V)."""
        self._attn = torch.cat([self._attn, self._attn.new_ones(len(tokens), 1)], 1)
        logits = self._forward(tokens[:, None].to(self.device), self._attn, self._next_pos[:, None], self._cache)
        self._next_pos = self._next_pos + 1
        return logits

    def keep(self, rows: list[int]) -> list[int]:
        """Keep only `rows`, in their order: the old row each new row holds (`rows` itself)."""
        if not rows:
            self._cache = self._attn = self._next_pos = None
            return rows
        idx = torch.tensor(rows, dtype=torch.long, device=self.device)
        attn = self._attn[idx]
        start = int((attn.sum(0) > 0).to(torch.int8).argmax())  # drop columns that are padding in every row
        for layer in self._cache.layers:
            layer.keys = layer.keys[idx, :, start:]
            layer.values = layer.values[idx, :, start:]
        self._attn, self._next_pos = attn[:, start:], self._next_pos[idx]
        return rows

    def _forward(self, ids: Tensor, attn: Tensor, pos: Tensor, cache) -> Tensor:
        out = self.model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=True, logits_to_keep=1,
                         **{self._cache_kw: cache})
        return out.logits[:, -1]  # (B, V)

    def _merge(self, cache, attn: Tensor, pos: Tensor) -> None:
        """Append prefilled rows to the running ones, left-padding the shorter side."""
        L = max(self._attn.shape[1], attn.shape[1])
        for own, other in zip(self._cache.layers, cache.layers):
            own.keys = torch.cat([_left_pad(own.keys, L), _left_pad(other.keys, L)], 0)
            own.values = torch.cat([_left_pad(own.values, L), _left_pad(other.values, L)], 0)
        self._attn = torch.cat([_left_pad(self._attn, L, dim=1), _left_pad(attn, L, dim=1)], 0)
        self._next_pos = torch.cat([self._next_pos, pos])


def _left_pad(t: Tensor, length: int, dim: int = 2) -> Tensor:
    """Zero-pad `t` on the left along `dim` to `length`."""
    missing = length - t.shape[dim]
    if missing == 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t.new_zeros(shape), t], dim)

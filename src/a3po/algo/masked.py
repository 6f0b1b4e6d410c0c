"""Masked reductions and loss aggregation over (B, T) per-token tensors.

Every per-token quantity in a3po lives on a padded (B, T) grid next to a boolean
`mask` that is True only on tokens that count (generated, not prompt, not padding).
Reductions here use `torch.where` rather than multiplying by the mask, so a NaN or
Inf sitting on a masked-out position (padding logits, say) can never leak into a sum.

Aggregation modes (`actor.loss_agg_mode`):

    token-mean            sum_{i,t} x_it m_it / sum_{i,t} m_it
    seq-mean-token-mean   1/B' sum_i ( sum_t x_it m_it / sum_t m_it )   B' = sequences with a token
    seq-mean-token-sum    1/B' sum_i ( sum_t x_it m_it ) / norm         Dr.GRPO with norm = a constant
                                                                        such as max_new_tokens

When one minibatch is split into micro-batches, pass the minibatch's `n_tokens` and
`n_seqs`: each micro-batch then contributes its share and the summed gradients equal
the gradient of the whole minibatch.
"""

from __future__ import annotations

import torch
from torch import Tensor

from a3po.algo import variants
from a3po.algo.variants import implements, lookup


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    picked = torch.where(mask, x, zero)
    return picked.sum() if dim is None else picked.sum(dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean over masked entries; 0 where nothing is masked in (never NaN)."""
    count = mask.sum() if dim is None else mask.sum(dim)
    return masked_sum(x, mask, dim) / count.clamp(min=1).to(x.dtype)


def masked_min(x: Tensor, mask: Tensor) -> Tensor:
    if not mask.any():
        return torch.zeros((), dtype=x.dtype, device=x.device)
    return x[mask].min()


def masked_max(x: Tensor, mask: Tensor) -> Tensor:
    if not mask.any():
        return torch.zeros((), dtype=x.dtype, device=x.device)
    return x[mask].max()


def _token_mean(x: Tensor, mask: Tensor, norm: float, n_tokens: int | None, n_seqs: int | None) -> Tensor:
    denom = mask.sum().item() if n_tokens is None else n_tokens
    return masked_sum(x, mask) / max(denom, 1)


def _mean_over_sequences(per_seq: Tensor, mask: Tensor, n_seqs: int | None) -> Tensor:
    """Mean of per_seq (B,) over the sequences with a token (or the minibatch's n_seqs)."""
    has_tokens = mask.any(-1)
    denom = has_tokens.sum().item() if n_seqs is None else n_seqs
    return torch.where(has_tokens, per_seq, torch.zeros_like(per_seq)).sum() / max(denom, 1)


def _seq_mean_token_mean(x: Tensor, mask: Tensor, norm: float, n_tokens: int | None, n_seqs: int | None) -> Tensor:
    return _mean_over_sequences(masked_mean(x, mask, dim=-1), mask, n_seqs)


def _seq_mean_token_sum(x: Tensor, mask: Tensor, norm: float, n_tokens: int | None, n_seqs: int | None) -> Tensor:
    return _mean_over_sequences(masked_sum(x, mask, dim=-1) / norm, mask, n_seqs)


# actor.loss_agg_mode
AGGREGATORS = implements({
    "token-mean": _token_mean,
    "seq-mean-token-mean": _seq_mean_token_mean,
    "seq-mean-token-sum": _seq_mean_token_sum,
}, variants.AGG_MODES)


def aggregate(
    x: Tensor,  # (B, T)
    mask: Tensor,  # (B, T) bool
    mode: str = "token-mean",
    norm: float = 1.0,
    n_tokens: int | None = None,
    n_seqs: int | None = None,
) -> Tensor:
    """Reduce a per-token loss to a scalar as `mode` prescribes (see module docstring)."""
    return lookup(AGGREGATORS, mode, "loss aggregation mode")(x, mask, norm, n_tokens, n_seqs)

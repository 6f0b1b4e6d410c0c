"""Next-token sampling with per-row settings and per-row random streams.

`sampling_logp` applies temperature, top-k and top-p and returns the log-probs of the
distribution that is then sampled, so the behaviour log-prob of a token is exactly the
probability with which it was drawn. `draw` samples by inverse CDF with one uniform per
row from that row's own generator: a request's samples depend on its seed only, not on
which other requests share the batch (continuous batching gives the same samples as
running requests one at a time).
"""

from __future__ import annotations

import torch
from torch import Tensor


def sampling_logp(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """logits (B, V) -> log-probs (B, V) of the processed distribution; excluded tokens get -inf."""
    z = logits.float() / temperature[:, None]
    V = z.shape[-1]
    use_k = (top_k > 0) & (top_k < V)
    use_p = top_p < 1.0
    if use_k.any() or use_p.any():
        sorted_z, order = z.sort(dim=-1, descending=True)  # (B, V)
        rank = torch.arange(V, device=z.device)[None]
        keep = torch.ones_like(sorted_z, dtype=torch.bool)
        keep &= ~use_k[:, None] | (rank < top_k[:, None])
        probs = torch.softmax(sorted_z.masked_fill(~keep, float("-inf")), -1)
        mass_before = probs.cumsum(-1) - probs  # probability of strictly better tokens
        keep &= ~use_p[:, None] | (mass_before < top_p[:, None])
        keep[:, 0] = True
        z = torch.full_like(z, float("-inf")).scatter(-1, order, sorted_z.masked_fill(~keep, float("-inf")))
    return torch.log_softmax(z, dim=-1)


def draw(logp: Tensor, generators: list[torch.Generator]) -> Tensor:
    """One token per row, by inverse CDF with one uniform from each row's generator: (B,)."""
    u = torch.stack([torch.rand((), generator=g, dtype=torch.float64) for g in generators]).to(logp.device)
    cdf = logp.double().exp().cumsum(-1)  # (B, V)
    u = u * cdf[:, -1]  # the total is 1 up to rounding
    return torch.searchsorted(cdf, u[:, None], right=True).squeeze(-1).clamp(max=logp.shape[-1] - 1)

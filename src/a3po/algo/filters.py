"""Sampling filters (min-p, top-k, top-p) as one function that the sampler and the trainer both apply.

A filter changes the distribution tokens are drawn from: the engine samples from the kept tokens,
renormalised, and records that distribution's log-prob as b. The trainer applies the same filter to
its own logits, so that every policy in the loss (theta, the recomputed proximal policy, the
reference) is the distribution a sampler with those weights would draw from. At d = 0 the trainer's
log-prob of a token then equals b up to numerics, and an importance ratio measures a change of
policy, not the filtered-out mass (docs/design.md, "Sampling filters").

Order, as vLLM applies them: temperature (by the caller), then min-p (keep p >= min_p * p_max), then
top-k (the k most likely, ties broken by the sort), then top-p (keep a token while the mass of the
tokens ranked above it is below top_p, so the most likely token always stays). `keep` names a token
per row that stays whatever the filter says: the trainer passes the sampled token, so that a token
the engine kept but the trainer's logits put just outside the boundary (rounding, or weights that
moved since) keeps a finite log-prob.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class SamplingFilter:
    """One run's filter (gconfig.min_p, top_k, top_p); the default keeps every token."""

    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1.0: off
    min_p: float = 0.0  # 0.0: off

    @property
    def active(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0

    def rows(self, n: int, device: torch.device | str = "cpu") -> tuple[Tensor, Tensor, Tensor]:
        """The per-row tensors `filter_logits` takes, the same for `n` rows."""
        return (torch.full((n,), self.top_k, device=device), torch.full((n,), self.top_p, device=device),
                torch.full((n,), self.min_p, device=device))


def filter_logits(z: Tensor, top_k: Tensor, top_p: Tensor, min_p: Tensor, keep: Tensor | None = None) -> Tensor:
    """z (B, V) temperature-scaled logits; per row top_k (0: off), top_p (1: off), min_p (0: off); keep (B,) token
    ids or None. The logits of the filtered distribution, -inf where a token is filtered out: fp32 (fp64 for fp64
    input), or `z` itself when no row filters anything."""
    V = z.shape[-1]
    use_k = (top_k > 0) & (top_k < V)
    use_p = top_p < 1.0
    use_m = min_p > 0.0
    if not (use_k.any() or use_p.any() or use_m.any()):
        return z
    z = z if z.dtype == torch.float64 else z.float()
    raw = z
    if use_m.any():  # p >= min_p * p_max  <=>  z >= z_max + log(min_p)
        floor = z.max(-1, keepdim=True).values + torch.log(min_p.clamp(min=math.ulp(0.0)))[:, None].to(z.dtype)
        z = z.masked_fill(use_m[:, None] & (z < floor), float("-inf"))
    sorted_z, order = z.sort(dim=-1, descending=True)  # (B, V)
    rank = torch.arange(V, device=z.device)[None]
    kept = ~use_k[:, None] | (rank < top_k[:, None])
    if use_p.any():
        probs = torch.softmax(sorted_z.masked_fill(~kept, float("-inf")), -1)
        mass_before = probs.cumsum(-1) - probs  # probability of the better-ranked tokens
        kept &= ~use_p[:, None] | (mass_before < top_p[:, None])
    kept[:, 0] = True
    out = torch.full_like(z, float("-inf")).scatter(-1, order, sorted_z.masked_fill(~kept, float("-inf")))
    if keep is not None:
        out.scatter_(-1, keep[:, None], raw.gather(-1, keep[:, None]))
    return out


NO_FILTER = SamplingFilter()

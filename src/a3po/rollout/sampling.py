"""Next-token sampling with per-row settings and per-row random streams.

`sample` returns each row's token and its log-prob under the distribution it was drawn
from (temperature, top-k, top-p applied), so the behaviour log-prob is exactly the
probability of the draw. Each row draws with one uniform from its own generator, by
inverse CDF: a request's samples depend on its seed only, not on which other requests
share the batch (continuous batching gives the same samples as one request at a time).

Why two levels: the vocabulary (49k for SmolLM2) is read once in fp32 for the maximum and
once for exp(z - max), summed in blocks of BLOCK tokens; the inverse CDF then walks the
few hundred block sums and the BLOCK tokens of one block in float64. A float64 cumulative
sum over the whole vocabulary per row per step cost more than the rest of sampling together.
"""

from __future__ import annotations

import torch
from torch import Tensor

BLOCK = 256  # tokens per block of the two-level inverse CDF


def sample(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, greedy: Tensor,
           generators: list[torch.Generator]) -> tuple[Tensor, Tensor]:
    """One token per row and its log-prob: (B,) long, (B,) float. Greedy rows take the argmax of
    the raw logits and report the raw model's log-prob (their temperature, top-k, top-p unused)."""
    on, temperature, top_k, top_p = (t.to(logits.device) for t in (greedy, temperature, top_k, top_p))
    z = _processed(logits.float(), temperature.masked_fill(on, 1.0), top_k.masked_fill(on, 0),
                   top_p.masked_fill(on, 1.0))
    top, best = z.max(-1)  # (B,) each
    e = torch.exp(z - top[:, None])  # (B, V), at most 1
    B, V = e.shape
    pad = -V % BLOCK
    blocks = torch.nn.functional.pad(e, (0, pad)).view(B, -1, BLOCK) if pad else e.view(B, -1, BLOCK)
    sums = blocks.sum(-1, dtype=torch.float64)  # (B, V / BLOCK)
    cum = sums.cumsum(-1)
    u = torch.stack([torch.rand((), generator=g, dtype=torch.float64) for g in generators]).to(e.device)
    target = u * cum[:, -1]  # (B,) in [0, total)
    block = torch.searchsorted(cum, target[:, None], right=True).clamp(max=cum.shape[1] - 1)  # (B, 1)
    rest = target[:, None] - (cum.gather(1, block) - sums.gather(1, block))  # mass still to walk inside the block
    inner = blocks[torch.arange(B, device=e.device), block[:, 0]].double().cumsum(-1)  # (B, BLOCK)
    within = torch.searchsorted(inner, rest, right=True).clamp(max=BLOCK - 1)
    tokens = (block * BLOCK + within)[:, 0]
    tokens = torch.where(on | (tokens >= V), best, tokens)
    chosen = z.gather(1, tokens[:, None])[:, 0]
    bad = ~torch.isfinite(chosen)  # rounding past the last token with any mass
    if bad.any():
        tokens = torch.where(bad, best, tokens)
        chosen = z.gather(1, tokens[:, None])[:, 0]
    logp = chosen - top - torch.log(cum[:, -1]).to(z.dtype)  # z - logsumexp(z)
    return tokens, logp


def _processed(z: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """Temperature, then top-k and top-p as -inf: the logits of the distribution that is sampled."""
    if (temperature != 1).any():
        z = z / temperature[:, None]
    V = z.shape[-1]
    use_k = (top_k > 0) & (top_k < V)
    use_p = top_p < 1.0
    if not (use_k.any() or use_p.any()):
        return z
    sorted_z, order = z.sort(dim=-1, descending=True)  # (B, V)
    rank = torch.arange(V, device=z.device)[None]
    keep = ~use_k[:, None] | (rank < top_k[:, None])
    probs = torch.softmax(sorted_z.masked_fill(~keep, float("-inf")), -1)
    mass_before = probs.cumsum(-1) - probs  # probability of strictly better tokens
    keep &= ~use_p[:, None] | (mass_before < top_p[:, None])
    keep[:, 0] = True
    return torch.full_like(z, float("-inf")).scatter(-1, order, sorted_z.masked_fill(~keep, float("-inf")))

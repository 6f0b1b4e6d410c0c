"""Next-token sampling with per-row settings and per-row random streams.

`draw` returns each row's token and its log-prob under the distribution it was drawn
from (temperature, then min-p, top-k and top-p as algo/filters.py applies them), so the
behaviour log-prob is exactly the probability of the draw. Each row draws with one uniform from its own generator, by
inverse CDF: a request's samples depend on its seed only, not on which other requests
share the batch (continuous batching gives the same samples as one request at a time).

Why two levels: the vocabulary (49k for SmolLM2) is read by one fused fp32 softmax and once
more to sum it in blocks of BLOCK tokens; the inverse CDF then walks the few hundred block
sums and the BLOCK tokens of one block in float64. A float64 cumulative sum over the whole
vocabulary per row per step cost more than the rest of sampling together. The log-prob is
log p of the drawn token, whose fp32 relative rounding (1e-7) is far below anything that
matters to an importance weight.

A token is `draw` over `distribution`'s p; an engine that was asked for a request's most likely
alternatives (`top_logprobs`) reads them from the same p with `alternatives`, for that
request's rows only and only on steps where one asked, so sampling without them costs nothing more.
"""

from __future__ import annotations

import torch
from torch import Tensor

from a3po.algo.filters import filter_logits

BLOCK = 256  # tokens per block of the two-level inverse CDF


def distribution(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, greedy: Tensor,
                 min_p: Tensor | None = None) -> Tensor:
    """(B, V) fp32 probabilities each row's token is drawn from: temperature, then the filters; a greedy row's is
    the raw model's (its argmax is the token)."""
    min_p = torch.zeros(len(greedy)) if min_p is None else min_p
    on, temperature, top_k, top_p, min_p = (t.to(logits.device) for t in (greedy, temperature, top_k, top_p, min_p))
    t = temperature.masked_fill(on, 1.0)
    z = logits.float() / t[:, None] if (t != 1).any() else logits
    z = filter_logits(z, top_k.masked_fill(on, 0), top_p.masked_fill(on, 1.0), min_p.masked_fill(on, 0.0))
    return torch.softmax(z, dim=-1, dtype=torch.float32)  # one fused pass


def draw(p: Tensor, greedy: Tensor, generators: list[torch.Generator]) -> tuple[Tensor, Tensor]:
    """One token per row of `distribution`'s p, by inverse CDF with one uniform from the row's generator (the
    argmax on greedy rows), and log p of it."""
    on = greedy.to(p.device)
    B, V = p.shape
    pad = -V % BLOCK
    blocks = (torch.nn.functional.pad(p, (0, pad)) if pad else p).view(B, -1, BLOCK)
    sums = blocks.sum(-1).double()  # (B, V / BLOCK)
    cum = sums.cumsum(-1)
    u = torch.stack([torch.rand((), generator=g, dtype=torch.float64) for g in generators]).to(p.device)
    target = u * cum[:, -1]  # (B,) in [0, total), the total being 1 up to rounding
    block = torch.searchsorted(cum, target[:, None], right=True).clamp(max=cum.shape[1] - 1)  # (B, 1)
    inner = blocks[torch.arange(B, device=p.device), block[:, 0]].double().cumsum(-1)  # (B, BLOCK)
    rest = target[:, None] - (cum.gather(1, block) - sums.gather(1, block))  # mass still to walk inside the block
    rest = torch.minimum(rest.clamp(min=0), inner[:, -1:] * (1 - 2**-40))  # the sums and this cumsum round apart
    tokens = (block * BLOCK + torch.searchsorted(inner, rest, right=True))[:, 0]  # a token with mass in p
    if on.any():
        tokens = torch.where(on, p.argmax(-1), tokens)
    chosen = p.gather(1, tokens[:, None])[:, 0]
    return tokens, torch.log(chosen)


def alternatives(p: Tensor, ks: list[int]) -> list[tuple[tuple[int, float], ...]]:
    """Row i's ks[i] most likely tokens under `distribution`'s p, most likely first, with their log-probs (the
    log of the same p a drawn token's log-prob is read from, so a chosen token among them has the same value).
    Tokens the filters left no mass are not alternatives: a row may get fewer than it asked for."""
    k = max(ks)
    if k == 0:
        return [() for _ in ks]
    values, ids = torch.topk(p, min(k, p.shape[-1]), dim=-1)
    logs = torch.log(values).tolist()
    return [tuple((t, lp) for t, lp, v in zip(ids[i, :n].tolist(), logs[i][:n], values[i, :n].tolist()) if v > 0)
            for i, n in enumerate(ks)]

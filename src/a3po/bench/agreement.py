"""The arithmetic of `a3po bench fidelity` (bench/fidelity.py): pure functions over tensors, no model.

An update is one flat vector u of every trained parameter's change. Against the exact method's
update u_rec on the same record:

    cos      = <u, u_rec> / (|u| |u_rec|)        direction
    rel_norm = |u| / |u_rec|                      size
    rel_err  = |u - u_rec| / |u_rec|              both at once: 0 only for the same update

Inner products accumulate in float64, a chunk at a time (a 135M-parameter vector in float64 would
be another 1 GB), so three digits of a cosine near 1 are not rounding. Identical vectors give
cos = 1.0 and rel_err = 0.0 exactly (sqrt(x * x) is x in IEEE arithmetic).

The policies after two steps are compared by the KL between their next-token distributions over
the whole vocabulary, KL(pi_rec || pi) = sum_v pi_rec(v) (log pi_rec(v) - log pi(v)), per position.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import Tensor

from a3po.bench.args import FIDELITY_ALL as ALL

CHUNK = 1 << 22  # elements per float64 chunk of an inner product (32 MB)


def flat(tensors: Iterable[Tensor]) -> Tensor:
    """The tensors' values as one new fp32 vector (P,), in the order given."""
    return torch.cat([t.detach().reshape(-1).float() for t in tensors])


def dot(a: Tensor, b: Tensor) -> float:
    """<a, b> of two (P,) vectors, accumulated in float64 chunk by chunk."""
    return math.fsum(float(torch.dot(a[i : i + CHUNK].double(), b[i : i + CHUNK].double()))
                     for i in range(0, a.numel(), CHUNK))


@dataclass(frozen=True)
class Agreement:
    """One update against the reference's (module docstring); NaN where the reference update is 0."""

    cos: float
    rel_norm: float
    rel_err: float


def agreement(u: Tensor, ref: Tensor) -> Agreement:
    uu, rr, ur = dot(u, u), dot(ref, ref), dot(u, ref)
    if rr == 0:
        return Agreement(math.nan, math.nan, math.nan)
    cos = ur / math.sqrt(uu * rr) if uu > 0 else math.nan  # sqrt(x * x) == x: an update against itself reads 1.0
    # |u - ref|^2 expanded would cancel catastrophically near agreement: take the difference itself
    diff = math.sqrt(sum(float(torch.linalg.vector_norm((u[i : i + CHUNK] - ref[i : i + CHUNK]).double())) ** 2
                         for i in range(0, u.numel(), CHUNK)))
    return Agreement(cos=cos, rel_norm=math.sqrt(uu) / math.sqrt(rr), rel_err=diff / math.sqrt(rr))


def sum_norm(a: Tensor, b: Tensor) -> float:
    """|a + b| without forming a + b."""
    return math.sqrt(max(0.0, dot(a, a) + 2 * dot(a, b) + dot(b, b)))


def cells(d: Tensor, adv: Tensor, mask: Tensor, by: Iterable[str]) -> dict[str, Tensor]:
    """The token sets the update is split by, each a (B, T) bool mask of trained tokens with A != 0 (the others
    add nothing to a gradient): `ALL`; with "d" in `by`, one "d=k" per staleness k present; with "sign",
    "A>0" and "A<0" where present. A part equal to ALL (a batch of one staleness) is ALL's step again."""
    live = mask.bool() & (adv != 0)
    out = {ALL: live}
    by = set(by)
    if "d" in by:
        out.update({f"d={k}": live & (d == k) for k in sorted(set(d[live].tolist()))})
    if "sign" in by:
        out.update({name: m for name, m in (("A>0", live & (adv > 0)), ("A<0", live & (adv < 0))) if m.any()})
    return out


def d_values(d: Tensor, mask: Tensor) -> dict[int, int]:
    """{staleness: tokens} over the tokens of `mask`."""
    ks, n = torch.unique(d[mask.bool()], return_counts=True)
    return {int(k): int(c) for k, c in zip(ks, n)}


def only(adv: Tensor, cell: Tensor) -> Tensor:
    """The advantages of the cell's tokens, 0 elsewhere: a step on them is the cell's share of the update, every
    other token still counted in the loss's denominator as in the full step."""
    return torch.where(cell, adv, torch.zeros((), dtype=adv.dtype))


def kl_rows(logp_ref: Tensor, logp: Tensor) -> Tensor:
    """KL(pi_ref || pi) per row of two (N, V) log-softmax tables: (N,). 0 * log 0 counts 0. Give float64 tables
    for policies that differ by little: in float32 the rounding of near-equal log-probs can read as a KL < 0."""
    p = logp_ref.exp()
    return torch.where(p > 0, p * (logp_ref - logp), torch.zeros((), dtype=p.dtype)).sum(-1)

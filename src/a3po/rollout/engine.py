"""The interface every rollout engine implements, and the records it exchanges.

An engine samples completions and, for every generated token, reports the token, its
log-prob under the distribution it was actually sampled from (temperature, top-k,
top-p applied: the pi_behav that decoupled PPO needs) and the version of the weights
that sampled it. Weights can change between two decode steps (`update_weights`); the
tokens sampled after the change carry the new version, so one completion may hold two.

A request may name a `session` (a multi-turn episode): the engine then keeps what it computed
for the sequence after it finishes, so that the episode's next turn, whose prompt extends
this sequence, computes only its new tokens (unless new weights arrived and
rollout.weight_update says to recompute); `release` drops it when the episode ends.

A new backend (vLLM, an HTTP server) is one new file implementing `RolloutEngine`.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from torch import Tensor


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    max_new_tokens: int
    rid: Hashable = 0  # caller's id, returned with the completion
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k
    min_p: float = 0.0  # 0 = no min-p
    greedy: bool = False  # argmax decoding (evaluation); log-probs are then the raw model's
    stop_token_ids: tuple[int, ...] = ()  # in addition to the engine's end-of-sequence ids
    stop: tuple[str, ...] = ()  # stop strings, matched on the decoded output
    seed: int | None = None  # fixes this request's samples whatever else runs beside it
    session: Hashable | None = None  # an episode's id: its KV cache is kept after it finishes, for its next turn
    top_logprobs: int = 0  # per token, this many most likely alternatives from the distribution it was drawn from


@dataclass
class Completion:
    rid: Hashable
    prompt_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_versions: list[int] = field(default_factory=list)
    # per token when the request asked for top_logprobs: (token id, log-prob) most likely first, from the same
    # distribution as output_logprobs (tokens the filters gave no mass are left out); empty otherwise
    output_top_logprobs: list[tuple[tuple[int, float], ...]] = field(default_factory=list)
    finish_reason: str = "length"  # "stop" or "length"
    prefilled: int = 0  # prompt tokens computed when it started (the rest came from a kept KV cache)


class RolloutEngine(Protocol):
    version: int

    def submit(self, request: GenerationRequest) -> None:
        """Queue a request; it joins the running batch at the next step."""

    def step(self) -> list[Completion]:
        """Advance generation; return the completions that finished."""

    def update_weights(self, weights: Mapping[str, Tensor], version: int) -> None:
        """Load new weights; sequences in flight continue on them, tagged with `version`."""

    def release(self, session: Hashable) -> None:
        """Drop the KV cache kept for `session` (its episode is over)."""

    @property
    def num_pending(self) -> int:
        """Requests queued or in flight."""

    def close(self) -> None:
        """Release what outlives the process (files in /dev/shm, servers); the worker calls it on its way out."""


def generate(engine: RolloutEngine, requests: list[GenerationRequest]) -> list[Completion]:
    """Run `requests` to completion and return their completions in request order."""
    for r in requests:
        engine.submit(r)
    done: dict = {}
    while len(done) < len(requests):
        for c in engine.step():
            done[c.rid] = c
    return [done[r.rid] for r in requests]

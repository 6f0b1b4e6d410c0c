"""Trajectory records and the padded (B, T) batch the trainer consumes.

Every per-token field is indexed by the token it describes: position i holds token i,
its behaviour log-prob log pi_behav(token_i | tokens_<i), the version of the weights
that sampled it (-1 for prompt tokens), and whether the loss counts it. An episode of
several turns is one trajectory: its output interleaves the model's turns with the
environment's observations, which, like the prompt, carry log-prob 0, version -1 and mask 0. The trainer's
own log-probs are placed on the same positions, so nothing is ever shifted relative to
anything else (docs/design.md §2: versions stay aligned with log-probs).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch
from torch import Tensor


@dataclass
class EpisodeInfo:
    """What a multi-turn episode did, for its metrics."""

    turns: int = 0
    tool_calls: int = 0  # environment: turns whose step was a tool call; agent: calls read from its replies
    tool_errors: int = 0
    success: bool = False  # its undiscounted reward reached 1
    env_s: float = 0.0  # time its environment calls took, waiting included ...
    wall_s: float = 0.0  # ... of its whole life in the worker
    malformed_tool_calls: int = 0  # an agent's replies whose tool-call text could not be read
    rerendered_tokens: int = 0  # context tokens rendered again for its later turns' rows (turn_context rerender)


@dataclass
class Trajectory:
    """One completion of one prompt (or one episode of several turns), as the rollout worker produced it."""

    prompt_ids: list[int]
    output_ids: list[int]
    output_logprobs: list[float]  # behaviour log-probs of output_ids (0 on observation tokens)
    output_versions: list[int]  # version of the weights that sampled each output token (-1 on observation tokens)
    reward: float = 0.0
    finish_reason: str = "stop"  # "stop" (end-of-sequence or stop string), "length"; episodes: see rollout/episodes.py
    output_mask: list[bool] | None = None  # which output tokens the model generated; None: all of them
    episode: EpisodeInfo | None = None  # set on multi-turn episodes (on an agent's episode, on its first row)
    part: int = 0  # an episode in several rows (an agent's, or one re-rendered per turn): this row's index; rows
    # after the first follow it in the group and share its reward and advantage

    def __post_init__(self) -> None:
        n = len(self.output_ids)
        mask = self.output_mask
        if len(self.output_logprobs) != n or len(self.output_versions) != n or (mask is not None and len(mask) != n):
            raise ValueError(
                f"trajectory fields out of step: {n} output tokens, {len(self.output_logprobs)} log-probs, "
                f"{len(self.output_versions)} versions" + (f", {len(mask)} mask entries" if mask is not None else "")
            )

    @property
    def generated_versions(self) -> list[int]:
        """The versions of the tokens the model generated."""
        if self.output_mask is None:
            return self.output_versions
        return [v for v, m in zip(self.output_versions, self.output_mask) if m]

    @property
    def n_generated(self) -> int:
        return len(self.output_ids) if self.output_mask is None else sum(self.output_mask)


@dataclass
class TrainBatch:
    """B trajectories right-padded to T tokens."""

    input_ids: Tensor  # (B, T) long, prompt then output then pad
    attention_mask: Tensor  # (B, T) bool, real tokens
    loss_mask: Tensor  # (B, T) bool, output tokens
    logp_behav: Tensor  # (B, T) float, 0 outside loss_mask
    versions: Tensor  # (B, T) long, -1 outside loss_mask
    advantages: Tensor  # (B, T) float, 0 outside loss_mask
    rewards: Tensor  # (B,) float

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def n_tokens(self) -> int:
        return int(self.loss_mask.sum())

    def with_advantages(self, advantages: Tensor) -> TrainBatch:
        """This batch with sequence advantages (B,) spread over each sequence's output tokens."""
        adv = advantages.float()[:, None]
        return replace(self, advantages=torch.where(self.loss_mask, adv, torch.zeros((), dtype=adv.dtype)))

    def to(self, device: torch.device) -> TrainBatch:
        """This batch on `device` (itself when it is there already)."""
        if self.input_ids.device == device:
            return self
        return replace(self, **{f.name: getattr(self, f.name).to(device) for f in fields(self)})

    def select(self, rows: Tensor | list[int]) -> TrainBatch:
        """The given rows, trimmed to their longest sequence (tight padding)."""
        rows = torch.as_tensor(rows, dtype=torch.long)
        length = int(self.attention_mask[rows].sum(-1).max()) if len(rows) else 0
        picked = {}
        for f in fields(self):
            value = getattr(self, f.name)[rows]
            picked[f.name] = value[:, :length] if value.dim() == 2 else value
        return TrainBatch(**picked)


def collate(trajs: list[Trajectory], advantages: Tensor | None = None, pad_id: int = 0) -> TrainBatch:
    """Pad trajectories into a TrainBatch; `advantages` (B,) are spread over each output."""
    B = len(trajs)
    T = max(len(t.prompt_ids) + len(t.output_ids) for t in trajs)
    input_ids = torch.full((B, T), pad_id, dtype=torch.long)
    attention_mask = torch.zeros(B, T, dtype=torch.bool)
    loss_mask = torch.zeros(B, T, dtype=torch.bool)
    logp = torch.zeros(B, T, dtype=torch.float32)
    versions = torch.full((B, T), -1, dtype=torch.long)
    for i, t in enumerate(trajs):
        p, n = len(t.prompt_ids), len(t.output_ids)
        input_ids[i, : p + n] = torch.tensor(t.prompt_ids + t.output_ids, dtype=torch.long)
        attention_mask[i, : p + n] = True
        loss_mask[i, p : p + n] = True if t.output_mask is None else torch.tensor(t.output_mask, dtype=torch.bool)
        logp[i, p : p + n] = torch.tensor(t.output_logprobs, dtype=torch.float32)
        versions[i, p : p + n] = torch.tensor(t.output_versions, dtype=torch.long)
    versions.masked_fill_(~loss_mask, -1)  # observation tokens: never generated, whatever the record says
    logp.masked_fill_(~loss_mask, 0.0)
    batch = TrainBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        loss_mask=loss_mask,
        logp_behav=logp,
        versions=versions,
        advantages=torch.zeros(B, T),
        rewards=torch.tensor([t.reward for t in trajs], dtype=torch.float32),
    )
    return batch if advantages is None else batch.with_advantages(advantages)

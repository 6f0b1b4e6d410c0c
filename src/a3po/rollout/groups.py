"""The one interface a rollout worker and the evaluator hold, whatever a group's samples are.

    runner = runners.build(engine, tokenizer)                 # rollout/runners.py picks the kind
    runner.start_group(key, example, group_seeds(cfg.seed, slot, n))
    while runner.busy:                                        # the caller steps the engine
        for c in engine.step():
            runner.finished_turn(c)
        for group in runner.poll_groups():
            ...                                               # group.trajectories, group.failures

A group is n samples of one example, started together and returned together once every
sample is scored. Three kinds implement `GroupRunner`: completions scored by the reward
function and a reward service (rollout/completions.py), episodes in an environment
(rollout/episodes.py) and runs of the user's agent (rollout/agents.py). A new kind of group
is one class implementing it and one branch in rollout/runners.py (which makes the child
processes it needs; a runner owns none); the worker and the evaluator never ask which kind
they hold.

Sample i of group `key` has the id (key, i): the engine's request id of a completion, the
episode's id otherwise.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, Protocol

from a3po.data import Example
from a3po.rollout.engine import Completion
from a3po.trajectories import Trajectory


@dataclass
class Group:
    """A group whose samples are all scored: what the worker sends the trainer, and what the evaluator counts."""

    key: Hashable
    samples: list[list[Trajectory]]  # in sample order; each sample's rows (one, or an agent's episode's several)
    failures: list[str]  # why samples scored 0 (a reward or an environment that failed), counted by the trainer
    dropped: bool = False  # reward_service.on_failure=drop: the service failed on it; its slot is refilled
    service_s: float = 0.0  # the reward service's time on this group (submit to last answer)

    @property
    def trajectories(self) -> list[Trajectory]:
        return [row for rows in self.samples for row in rows]


class GroupRunner(Protocol):
    """Samples of groups beside an engine that the caller steps.

    `busy`: a group was started that `poll_groups` has not returned yet. `sampling`: a sample
    may still send the engine a request (rollout.lockstep starts a batch's groups only when no
    sample is sampling and the engine is idle, so that they are one engine batch)."""

    poll_s: float  # how long a caller with an idle engine waits before polling again, while busy

    def start_group(self, key: Hashable, example: Example, seeds: list[int], greedy: bool = False) -> None:
        """Start len(seeds) samples of `example`, sample i with the random stream seeds[i]."""

    def finished_turn(self, c: Completion) -> None:
        """A completion the engine finished, of a request this runner submitted."""

    def poll_groups(self, block_s: float = 0.0) -> list[Group]:
        """The groups scored since the last poll (waiting up to block_s for an answer to arrive)."""

    @property
    def busy(self) -> bool: ...

    @property
    def sampling(self) -> bool: ...


class Gathering:
    """The finished samples of each group started, until the group is whole."""

    def __init__(self) -> None:
        self._groups: dict[Hashable, tuple[int, dict[int, Any]]] = {}

    def open(self, key: Hashable, n: int) -> list[tuple[Hashable, int]]:
        """The ids of the group's n samples."""
        self._groups[key] = (n, {})
        return [(key, i) for i in range(n)]

    def add(self, sample: tuple[Hashable, int], item: Any) -> list | None:
        """Add sample (key, i): the group's items in sample order once it is whole, else None."""
        key, i = sample
        n, got = self._groups[key]
        got[i] = item
        if len(got) < n:
            return None
        del self._groups[key]
        return [got[j] for j in range(n)]

    def ended(self, episodes: list, rows: Callable[[Any], list[Trajectory]]) -> list[Group]:
        """The groups that `episodes` (each with its sample id `eid` and its `failure`) complete; a sample's
        trajectories are rows(episode)."""
        out = []
        for ep in episodes:
            done = self.add(ep.eid, ep)
            if done is not None:
                out.append(Group(ep.eid[0], [rows(e) for e in done], [e.failure for e in done if e.failure]))
        return out

    def __bool__(self) -> bool:
        return bool(self._groups)


def group_seeds(seed: int, slot: int, n: int) -> list[int]:
    """Each sample's random stream depends on the run seed and its slot only, not on the worker."""
    return [(seed * 1_000_003 + slot) * 1024 + sample for sample in range(n)]

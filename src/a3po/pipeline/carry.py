"""What a checkpoint keeps of rollout, so that a resumed run samples nothing twice.

At a checkpoint after step s the trainer holds version s and will next train the groups of
slots [sB, (s + 1)B) (admission.py). The groups of slots sB, sB + 1, ... that are already
finished, up to the first that is not, are written beside the weights with the data position
of that first unfinished slot. A resume puts them back in the controller's buffer and admits
from that slot on, at that data position: the finished work is trained on as it was sampled,
by the versions that sampled it, and what was in flight is sampled again by version s.

Under rollout.lockstep that makes a resumed run continue bit for bit: version s + 1 is
published only once batch s + eta is finished (controller.py), so at the checkpoint batches
s .. s + eta - 1 are all carried, and batch s + eta, the first sampled again, was being
sampled by version s, which is the checkpoint's (its slots' sampling seeds are (seed, slot)). Only whole
batches are carried then: a worker generates its share of a batch once all of it has come (controller.py).

A file that is missing (a checkpoint written before this existed), unreadable, or made under
other settings is not fatal: the resume warns and samples those groups again, as from slot sB.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from a3po.config import Config
from a3po.rollout.worker import GroupDone
from a3po.trajectories import EpisodeInfo, Trajectory

ROLLOUT_FILE = "rollout.jsonl"  # in the checkpoint folder: a header line, then one line per carried group


@dataclass(frozen=True)
class Carried:
    """Finished groups not yet trained on, from slot version x B on without a gap, and where admission resumes."""

    groups: list[GroupDone]  # in slot order
    cursors: list[int]  # the data position each of them was admitted at
    next_slot: int  # the first slot not finished: admission starts here
    cursor: int  # the data position that slot was (or would be) admitted at

    @property
    def first_cursor(self) -> int:
        """The data position of the first group not trained on: where a resume without the groups starts."""
        return self.cursors[0] if self.cursors else self.cursor


def settings(cfg: Config) -> dict:
    """What the carried groups' meaning depends on: a resume under other values samples them again."""
    r = cfg.rollout
    return {"batch_size": cfg.train_dataset.batch_size, "n_samples": cfg.gconfig.n_samples,
            "eta": r.max_head_offpolicyness, "lockstep": r.lockstep}


def dumps(carried: Carried, cfg: Config) -> str:
    head = {"next_slot": carried.next_slot, "cursor": carried.cursor, **settings(cfg)}
    lines = [json.dumps(head)]
    for g, cursor in zip(carried.groups, carried.cursors):
        lines.append(json.dumps({"slot": g.slot, "cursor": cursor, "trajectories": [asdict(t) for t in g.trajectories],
                                 "reward_failures": g.reward_failures, "service_s": g.service_s}))
    return "\n".join(lines) + "\n"


def load(ckpt: Path, version: int, cfg: Config) -> Carried:
    """The groups a checkpoint at `version` carried; ValueError saying in a few words why they cannot be used."""
    try:
        lines = (Path(ckpt) / ROLLOUT_FILE).read_text().splitlines()
    except FileNotFoundError:
        raise ValueError(f"no {ROLLOUT_FILE} in it") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{ROLLOUT_FILE} cannot be read ({type(e).__name__})") from None
    if not lines:
        raise ValueError(f"{ROLLOUT_FILE} is empty")
    try:
        head = json.loads(lines[0])
        rows = [json.loads(line) for line in lines[1:]]
        groups = [GroupDone(-1, int(r["slot"]), [_trajectory(t) for t in r["trajectories"]],
                            [str(f) for f in r["reward_failures"]], service_s=float(r["service_s"]))
                  for r in rows]
        cursors = [int(r["cursor"]) for r in rows]
        next_slot, cursor = int(head["next_slot"]), int(head["cursor"])
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{ROLLOUT_FILE} is not a list of finished groups ({type(e).__name__}: {e})") from None
    changed = [f"{k} {head.get(k)} -> {v}" for k, v in settings(cfg).items() if head.get(k) != v]
    if changed:
        raise ValueError(f"made under other settings: {', '.join(changed)}")
    first = version * cfg.train_dataset.batch_size
    if [g.slot for g in groups] != list(range(first, first + len(groups))) or next_slot != first + len(groups):
        raise ValueError(f"{ROLLOUT_FILE} does not hold the slots from {first} on without a gap")
    return Carried(groups, cursors, next_slot, cursor)


def _trajectory(d: dict) -> Trajectory:
    episode = d.pop("episode")
    return Trajectory(**d, episode=None if episode is None else EpisodeInfo(**episode))

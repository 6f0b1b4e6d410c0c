"""The asynchronous training loop: one `step` turns version v into v + 1.

    1. admit and collect: keep workers busy within the staleness bound, wait for this
       version's prompt groups (admission.py says which), refill filtered groups;
    2. advantages: shaped rewards -> group-relative advantages (algorithm core);
    3. PPO update on the batch (train/engine.py): version v -> v + 1;
    4. weight sync: publish the new weights in shared memory, tell the workers;
    5. statistics for this step.

Rollout never stops: while the trainer runs stages 2-5, the workers keep generating the
groups admitted for the next versions (up to eta ahead); with eta = 0 they idle instead,
and the same code is synchronous on-policy training.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from a3po.algo import normalize_advantages, shape_rewards
from a3po.config import Config
from a3po.data import TaskData
from a3po.data.order import DataOrder
from a3po.rollout.pool import WorkerPool
from a3po.rollout.worker import GroupDone, WeightsLoaded, Work
from a3po.sync import SharedWeights
from a3po.train.admission import Admission
from a3po.train.engine import TrainEngine
from a3po.trajectories import Trajectory, collate

MAX_REFILLS_PER_SLOT = 4  # dynamic filtering gives up on a slot after this many all-equal groups


class RewardFailureError(RuntimeError):
    """Too many reward calls failed in one step."""


class StalenessError(RuntimeError):
    """A consumed token was staler than eta: a bug in admission or weight sync, never expected."""


@dataclass
class Collected:
    groups: list[GroupDone]
    wait_s: float
    filtered: int = 0


class Trainer:
    def __init__(self, cfg: Config, engine: TrainEngine, pool: WorkerPool, weights: SharedWeights,
                 data: TaskData, order: DataOrder, pad_id: int):
        self.cfg, self.engine, self.pool, self.weights = cfg, engine, pool, weights
        self.data, self.order, self.pad_id = data, order, pad_id
        B = cfg.train_dataset.batch_size
        max_running = cfg.rollout.max_concurrent_rollouts or B
        self.admission = Admission(B, cfg.rollout.max_head_offpolicyness, max_running, engine.version)
        self.done: dict[int, GroupDone] = {}
        self.slot_cursor: dict[int, int] = {}  # data cursor when each in-flight slot was admitted
        self.refill_count: dict[int, int] = {}
        self.acked = [engine.version] * cfg.rollout.n_workers  # newest version each worker loaded
        self._load_s: list[float] = []

    # -- stage 1 ---------------------------------------------------------------------------

    def _admit(self) -> None:
        v = self.engine.version
        while (slot := self.admission.take(v)) is not None:
            if slot not in self.slot_cursor:
                self.slot_cursor[slot] = self.order.cursor
            example = self.data.train[self.order.next()]
            self.pool.submit(Work(slot, example))

    def _handle(self, msg) -> int:
        """Record one worker message; returns 1 if a group was filtered out."""
        if isinstance(msg, WeightsLoaded):
            self.acked[msg.worker_id] = max(self.acked[msg.worker_id], msg.version)
            self._load_s.append(msg.seconds)
            return 0
        if not isinstance(msg, GroupDone):
            return 0
        self.pool.group_finished(msg.worker_id)
        rewards = [t.reward for t in msg.trajectories]
        uninformative = max(rewards) == min(rewards)
        if self.cfg.train_dataset.dynamic_filtering and uninformative and self.refill_count.get(msg.slot, 0) < MAX_REFILLS_PER_SLOT:
            self.refill_count[msg.slot] = self.refill_count.get(msg.slot, 0) + 1
            self.admission.done(msg.slot, refill=True)
            return 1
        self.admission.done(msg.slot)
        self.done[msg.slot] = msg
        return 0

    def collect(self) -> Collected:
        v = self.engine.version
        slots = self.admission.batch_slots(v)
        t0 = time.perf_counter()
        filtered = 0
        self._admit()
        while not all(s in self.done for s in slots):
            msg = self.pool.receive(timeout=1.0)
            if msg is not None:
                filtered += self._handle(msg)
                self._admit()
        groups = [self.done.pop(s) for s in slots]
        for s in slots:
            self.slot_cursor.pop(s, None)
            self.refill_count.pop(s, None)
        return Collected(groups, time.perf_counter() - t0, filtered)

    # -- the step ---------------------------------------------------------------------------

    def step(self) -> dict[str, float]:
        cfg, a = self.cfg, self.cfg.actor
        v = self.engine.version
        t_step = time.perf_counter()

        # 1. Admit and collect this version's groups.
        got = self.collect()
        trajs: list[Trajectory] = [t for g in got.groups for t in g.trajectories]
        failures = [f for g in got.groups for f in g.reward_failures]
        if len(failures) > cfg.train_dataset.max_reward_failure_frac * len(trajs):
            raise RewardFailureError(
                f"the reward function failed on {len(failures)} of {len(trajs)} samples at step {v + 1} "
                f"(first: {failures[0]}); fix it, or raise train_dataset.max_reward_failure_frac"
            )
        batch_versions = [min(t.output_versions) for t in trajs if t.output_versions]
        oldest = min(batch_versions) if batch_versions else v
        if v - oldest > cfg.rollout.max_head_offpolicyness:
            raise StalenessError(f"a token of version {oldest} reached training at version {v} (eta={cfg.rollout.max_head_offpolicyness})")

        # 2. Advantages from shaped rewards, group-relative (algorithm core).
        raw = torch.tensor([t.reward for t in trajs], dtype=torch.float32)
        shaped = shape_rewards(raw, a.reward_scaling, a.reward_bias, a.reward_clip)
        adv = normalize_advantages(shaped, cfg.gconfig.n_samples, a.adv_norm.mean_level, a.adv_norm.std_level,
                                   a.adv_norm.mean_leave1out, a.adv_norm.eps)
        batch = collate(trajs, adv, self.pad_id)

        # 3. PPO update: version v -> v + 1.
        stats = self.engine.ppo_update(batch)

        # 4. Weight sync: every worker must have loaded v before v + 1 overwrites the buffer.
        t0 = time.perf_counter()
        while min(self.acked) < v:
            msg = self.pool.receive(timeout=1.0)
            if msg is not None:
                got.filtered += self._handle(msg)
        self.weights.publish(self.engine.weights())
        self.pool.load_weights(self.engine.version)
        stats["perf/weight_sync_s"] = time.perf_counter() - t0

        # 5. Statistics.
        gen_tokens = sum(len(t.output_ids) for t in trajs)
        step_s = time.perf_counter() - t_step
        stats.update({
            "rollout/reward_mean": float(raw.mean()),
            "rollout/reward_std": float(raw.std()) if len(raw) > 1 else 0.0,
            "rollout/solved_frac": float((raw >= 1.0 - 1e-6).float().mean()),
            "rollout/response_len_mean": gen_tokens / max(1, len(trajs)),
            "rollout/truncated_frac": sum(t.finish_reason == "length" for t in trajs) / max(1, len(trajs)),
            "rollout/reward_failures": float(len(failures)),
            "rollout/filtered_groups": float(got.filtered),
            "rollout/two_version_frac": sum(len(set(t.output_versions)) > 1 for t in trajs) / max(1, len(trajs)),
            "perf/rollout_wait_s": got.wait_s,
            "perf/weight_load_s": max(self._load_s) if self._load_s else 0.0,
            "perf/step_s": step_s,
            "perf/tokens_per_s": gen_tokens / step_s,
        })
        self._load_s.clear()
        return stats

    def resume_cursor(self) -> int:
        """Data position to restart from: the first example of any group not yet trained on."""
        return min(self.slot_cursor.values(), default=self.order.cursor)

"""The asynchronous training loop: one `step` turns version v into v + 1.

    1. take this version's prompt groups from the rollout controller (controller.py), in
       slot order, waiting only if they are not finished yet;
    2. advantages: shaped rewards (less the KL to the reference with actor.kl_in_reward)
       -> group-relative advantages (algorithm core);
    3. PPO update on the batch (trainer/engine.py): version v -> v + 1; at a step listed in
       saver.record_steps, the batch and the trainer's state are saved first (trainer/records.py);
    4. weight sync: once every worker is past v - 1, publish v + 1 (shared memory, or Ray's object store);
       with rollout.lockstep, only once batch v + eta is sampled (controller.py);
    5. statistics for this step.

Rollout does not wait for this loop: the controller thread keeps admitting groups and
collecting finished ones during stages 2-5 and during evaluation and checkpoints, up to
eta versions ahead of the trainer (admission.py holds the bound). With eta = 0 only the
current batch may be generated, so the workers idle while the trainer trains and the same
code is synchronous on-policy training.
"""

from __future__ import annotations

import itertools
import time
from pathlib import Path

import torch

from a3po.algo import kl_in_reward, masked_mean, normalize_advantages, shape_rewards, staleness_stats
from a3po.config import Config
from a3po.config.choices import ServiceKind
from a3po.data import TaskData
from a3po.data.order import DataOrder
from a3po.episode_end import EpisodeEnd
from a3po.pipeline.carry import Carried
from a3po.pipeline.controller import Controller, Snapshot
from a3po.pipeline.pool import WorkerPool
from a3po.trainer.engine import TrainEngine
from a3po.trainer.records import save_record
from a3po.trajectories import TrainBatch, Trajectory, collate


def batch_with_advantages(cfg: Config, engine: TrainEngine, trajs: list[Trajectory],
                          pad_id: int) -> tuple[TrainBatch, dict[str, float]]:
    """Stage 2: the padded batch with its advantages, and the statistics of the KL in the reward.

    With actor.kl_in_reward each shaped reward loses kl_ctl x its sequence's summed per-token KL
    to the reference (algo/kl.py) before the group normalisation, so the advantages see it.
    """
    a = cfg.actor
    batch = collate(trajs, pad_id=pad_id)
    rewards = shaped = shape_rewards(batch.rewards, a.reward_scaling, a.reward_bias, a.reward_clip)
    stats: dict[str, float] = {}
    if a.kl_in_reward and a.kl_ctl > 0:
        t0 = time.perf_counter()
        kl = engine.reference_kl(batch)
        rewards = kl_in_reward(rewards, kl, batch.loss_mask, a.kl_ctl)
        stats = {"loss/kl_ref": float(masked_mean(kl, batch.loss_mask)), "perf/ref_kl_s": time.perf_counter() - t0}
    # An agent's episode may be several rows (rollout/agents.py), sharing its reward: the group statistics run
    # over episodes, each counted once with the KL penalties of all its rows, and every row gets its episode's
    # advantage.
    episode = torch.tensor(list(itertools.accumulate(int(t.part == 0) for t in trajs))) - 1
    first = torch.tensor([t.part == 0 for t in trajs])
    more = torch.zeros(int(episode[-1]) + 1).index_add_(0, episode, torch.where(first, 0.0, shaped - rewards))
    adv = normalize_advantages(rewards[first] - more, cfg.gconfig.n_samples, a.adv_norm.mean_level,
                               a.adv_norm.std_level, a.adv_norm.mean_leave1out, a.adv_norm.eps)
    return batch.with_advantages(adv[episode]), stats


def episode_stats(trajs: list[Trajectory]) -> dict[str, float]:
    """Per-episode means of what multi-turn episodes did; nothing for single-turn completions."""
    eps = [(t, t.episode) for t in trajs if t.episode is not None]
    if not eps:
        return {}
    n = len(eps)
    tokens = sum(len(t.output_ids) for t, _ in eps)
    stats = {
        "episode/turns_mean": sum(e.turns for _, e in eps) / n,
        "episode/tool_calls_mean": sum(e.tool_calls for _, e in eps) / n,
        "episode/tool_errors_mean": sum(e.tool_errors for _, e in eps) / n,
        "episode/tool_calls_malformed_mean": sum(e.malformed_tool_calls for _, e in eps) / n,
        "episode/rerendered_tokens_mean": sum(e.rerendered_tokens for _, e in eps) / n,
        "episode/success_frac": sum(e.success for _, e in eps) / n,
        "episode/observation_token_frac": sum(len(t.output_ids) - t.n_generated for t, _ in eps) / max(1, tokens),
        "episode/env_time_frac": sum(e.env_s / e.wall_s if e.wall_s > 0 else 0.0 for _, e in eps) / n,
        "episode/versions_spanned_mean": sum(len(set(t.generated_versions)) for t, _ in eps) / n,
    }
    for reason in EpisodeEnd.CHOICES:
        stats[f"episode/finish/{reason}"] = sum(t.finish_reason == reason for t, _ in eps) / n
    return stats


class RewardFailureError(RuntimeError):
    """Too many reward calls failed in one step."""


class StalenessError(RuntimeError):
    """A consumed token was staler than eta: a bug in admission or weight sync, never expected."""


class Trainer:
    def __init__(self, cfg: Config, engine: TrainEngine, pool: WorkerPool, weights,
                 data: TaskData, order: DataOrder, pad_id: int, log=print, run_dir: Path | None = None,
                 carried: Carried | None = None):
        self.cfg, self.engine, self.weights, self.pad_id = cfg, engine, weights, pad_id
        self.run_dir = run_dir  # where saver.record_steps' records go
        self.controller = Controller(cfg, pool, data, order, engine.version, log=log, carried=carried)
        self._started = False
        self._last = None  # controller counters at the end of the previous step

    def close(self) -> None:
        self.controller.close()

    def carried(self) -> Carried:
        """What a checkpoint now keeps of rollout (pipeline/carry.py)."""
        return self.controller.carried(self.engine.version)

    # -- the step ---------------------------------------------------------------------------

    def step(self) -> dict[str, float]:
        cfg, ctl = self.cfg, self.controller
        v = self.engine.version
        eta = cfg.rollout.max_head_offpolicyness
        t_step = time.perf_counter()
        if not self._started:  # rollout starts with the first step, after the initial evaluation
            ctl.start()
            self._started = True
            self._last = ctl.snapshot()

        # 1. This version's groups, in slot order.
        got = ctl.take_batch(v)
        trajs: list[Trajectory] = [t for g in got.groups for t in g.trajectories]
        failures = [f for g in got.groups for f in g.reward_failures]
        if len(failures) > cfg.train_dataset.max_reward_failure_frac * len(trajs):
            raise RewardFailureError(
                f"the {'environment' if cfg.train_dataset.env else 'reward'} failed on {len(failures)} of "
                f"{len(trajs)} samples at step {v + 1} (first: {failures[0]}); fix it, or raise "
                f"train_dataset.max_reward_failure_frac"
            )
        batch_versions = [min(vs) for t in trajs if (vs := t.generated_versions)]
        oldest = min(batch_versions) if batch_versions else v
        if v - oldest > eta:
            raise StalenessError(f"a token of version {oldest} reached training at version {v} (eta={eta})")

        # 2. Advantages from shaped rewards (less the KL to the reference with kl_in_reward), group-relative.
        before_train = ctl.snapshot()
        batch, adv_stats = batch_with_advantages(cfg, self.engine, trajs, self.pad_id)
        raw = batch.rewards

        # 3. PPO update: version v -> v + 1, recorded first at a step of saver.record_steps.
        if v + 1 in cfg.saver.record_steps and self.run_dir is not None:
            t0 = time.perf_counter()
            save_record(self.run_dir, v + 1, self.engine, batch)
            adv_stats["perf/record_s"] = time.perf_counter() - t0
        stats = self.engine.ppo_update(batch) | adv_stats
        after_train = ctl.snapshot()

        # 4. Weight sync: v + 1 goes where v - 1 was (sync/shm.py keeps two versions), so every worker must be
        #    past v - 1; a worker still loading v is not waited for.
        t0 = time.perf_counter()
        if cfg.rollout.lockstep:  # v + 1 samples batch v + 1 + eta: batch v + eta must be done with v
            ctl.wait_sampled(v + eta)
        ctl.wait_loaded(v - 1)
        stats["sync/published_bytes"] = self.weights.publish(self.engine.weights())
        ctl.publish(self.engine.version)
        stats["perf/weight_sync_s"] = time.perf_counter() - t0

        # 5. Statistics.
        now = ctl.snapshot()
        gen_tokens = sum(t.n_generated for t in trajs)
        step_s = time.perf_counter() - t_step
        stats.update(staleness_stats(batch.versions, v, batch.loss_mask, eta))
        stats.update(self._idle_fractions(self._last, now))
        stats.update({
            "rollout/reward_mean": float(raw.mean()),
            "rollout/reward_std": float(raw.std()) if len(raw) > 1 else 0.0,
            "rollout/solved_frac": float((raw >= 1.0 - 1e-6).float().mean()),
            "rollout/response_len_mean": gen_tokens / max(1, len(trajs)),
            "rollout/truncated_frac": sum(t.finish_reason == "length" for t in trajs) / max(1, len(trajs)),
            "rollout/reward_failures": float(len(failures)),
            "rollout/filtered_groups": float(got.filtered),
            "rollout/dropped_groups": float(got.dropped),
            "rollout/worker_restarts": float(now.worker_restarts),  # over the run so far
            "rollout/two_version_frac": sum(len(set(t.generated_versions)) > 1 for t in trajs) / max(1, len(trajs)),
            # groups admitted for later versions when the update ended: how far rollout ran ahead
            "rollout/groups_ahead": float(max(0, after_train.next_slot - (v + 1) * cfg.train_dataset.batch_size)),
            "rollout/groups_done_while_training": float(after_train.groups_done - before_train.groups_done),
            "perf/rollout_wait_s": got.wait_s,
            "perf/weight_load_s": ctl.weight_load_s(),
            "perf/step_s": step_s,
            "perf/tokens_per_s": gen_tokens / step_s,
        })
        stats.update(episode_stats(trajs))
        if cfg.reward_service.kind != ServiceKind.NONE:
            stats["rollout/reward_service_s"] = sum(g.service_s for g in got.groups) / max(1, len(got.groups))
        self._last = now
        return stats

    @staticmethod
    def _idle_fractions(before: Snapshot, after: Snapshot) -> dict[str, float]:
        """Each worker's share of the time between two snapshots with nothing to generate."""
        out = {}
        for w, (was, now) in enumerate(zip(before.clocks, after.clocks)):
            alive = now.alive_s - was.alive_s
            out[f"rollout/idle_frac/w{w}"] = (now.idle_s - was.idle_s) / alive if alive > 0 else 0.0
        fracs = list(out.values())
        out["rollout/idle_frac"] = sum(fracs) / len(fracs) if fracs else 0.0
        return out

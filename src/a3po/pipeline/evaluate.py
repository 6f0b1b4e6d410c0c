"""Held-out evaluation: greedy decoding of examples never seen in training, scored by the run's reward,
or, with an environment or an agent, greedy episodes of them; or k sampled completions (episodes) per example.

The run evaluates with it every evaluator.freq_steps, and `a3po eval` evaluates a finished model with it,
so a number from either is the same measurement. Its samples are a rollout worker's, from the same runner
(rollout/runners.py), scored by the reward function alone (never reward_service)."""

from __future__ import annotations

from dataclasses import dataclass

from a3po.config import Config
from a3po.data import Example
from a3po.models import end_ids
from a3po.rollout.groups import Group, GroupRunner, group_seeds
from a3po.rollout.local import LocalEngine
from a3po.rollout.runners import Runners, Scoring

SOLVED = 1.0 - 1e-6  # a score at least this solves the example


@dataclass
class Evaluation:
    """One evaluation: the logged means, and each example's share of solved samples (0 or 1 when greedy)."""

    metrics: dict[str, float]
    solved: list[float]  # per example, in the order given


class Evaluator:
    """eval/accuracy: share of examples whose completion (episode) scores >= 1 (before any turn discount), averaged
    over the samples; eval/reward: mean score. The child processes that score (reward, environment, agents) start
    with the first call and serve every call until `close`; each call's engine is over the model it is given.
    """

    def __init__(self, cfg: Config, scoring: Scoring):
        self.cfg, self.scoring = cfg, scoring
        self.runners: Runners | None = None

    def close(self) -> None:
        """End the child processes."""
        if self.runners is not None:
            self.runners.close()
            self.runners = None

    def __call__(self, model, tokenizer, examples: list[Example], samples: int = 1,
                 greedy: bool = True) -> Evaluation:
        """`samples` completions per example: greedy ones (the same each time, so one is enough) or sampled at
        gconfig.temperature with seeds fixed by the example's place and the run's seed."""
        cfg = self.cfg
        samples = 1 if greedy else samples
        engine = LocalEngine(model, eos_token_ids=end_ids(model, tokenizer), decode=tokenizer.decode, max_batch=64,
                             forward=cfg.rollout.forward)
        if self.runners is None:
            self.runners = Runners(cfg, self.scoring)
        runner = self.runners.build(engine, tokenizer)
        try:
            for i, example in enumerate(examples):  # slots below 0: never a training group's seeds
                runner.start_group(i, example, group_seeds(cfg.seed, -1 - i, samples), greedy)
            groups = sorted(_run(runner, engine), key=lambda g: g.key)
        except BaseException:
            self.close()  # calls still out in the children must not be answered into the next evaluation
            raise
        solved = [0.0] * len(examples)
        rewards, infos = [], []
        for group in groups:
            for first, *_ in group.samples:  # an agent's episode: its first row holds the episode's facts
                info = first.episode
                solved[group.key] += (info.success if info is not None else first.reward >= SOLVED) / samples
                rewards.append(first.reward)
                infos.append(info)
        n = max(1, len(rewards))
        metrics = {"eval/accuracy": sum(solved) / max(1, len(examples)), "eval/reward": sum(rewards) / n}
        if infos and all(info is not None for info in infos):  # episodes
            first_turn = sum(info.success and info.turns <= 1 for info in infos) / n
            metrics["eval/first_turn_accuracy"] = first_turn  # accuracy minus this is what the later turns added
            metrics["eval/turns_mean"] = sum(i.turns for i in infos) / n
            metrics["eval/tool_use_frac"] = sum(i.tool_calls > 0 for i in infos) / n
        return Evaluation(metrics, solved)


def _run(runner: GroupRunner, engine: LocalEngine) -> list[Group]:
    """Step the engine until every group started is scored."""
    groups = []
    while runner.busy:
        for c in engine.step():
            runner.finished_turn(c)
        groups += runner.poll_groups(block_s=runner.poll_s if engine.num_pending == 0 else 0.0)
    return groups

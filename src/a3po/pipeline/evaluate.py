"""Held-out evaluation: greedy decoding of examples never seen in training, scored by the run's reward,
or, with an environment or an agent, greedy episodes of them; or k sampled completions (episodes) per example.

The run evaluates with it every evaluator.freq_steps, and `a3po eval` evaluates a finished model with it,
so a number from either is the same measurement."""

from __future__ import annotations

from dataclasses import dataclass

from a3po.config import Config
from a3po.data import CallProcess, Example, RewardProcess
from a3po.envs.host import EnvHost
from a3po.rollout import GenerationRequest, generate
from a3po.rollout.episodes import EpisodeRunner, Turns
from a3po.rollout.local import LocalEngine
from a3po.rollout.prompts import encode_prompt
from a3po.rollout.worker import Scoring, request_seed, start_agents
from a3po.trajectories import EpisodeInfo

SOLVED = 1.0 - 1e-6  # a score at least this solves the example


@dataclass
class Evaluation:
    """One evaluation: the logged means, and each example's share of solved samples (0 or 1 when greedy)."""

    metrics: dict[str, float]
    solved: list[float]  # per example, in the order given


class Evaluator:
    """eval/accuracy: share of examples whose completion (episode) scores >= 1 (before any turn discount), averaged
    over the samples; eval/reward: mean score. Owns the child processes that score, until `close`."""

    def __init__(self, cfg: Config, scoring: Scoring):
        self.cfg, self.scoring = cfg, scoring
        self.reward = RewardProcess(scoring.reward_fn, cfg.train_dataset.reward_timeout_s)
        self.env = None
        if scoring.env is not None:
            self.env = CallProcess(EnvHost(scoring.env.factory), cfg.train_dataset.env_timeout_s, what="environment")

    def close(self) -> None:
        self.reward.close()
        if self.env is not None:
            self.env.close()

    def __call__(self, model, tokenizer, examples: list[Example], samples: int = 1,
                 greedy: bool = True) -> Evaluation:
        """`samples` completions per example: greedy ones (the same each time, so one is enough) or sampled at
        gconfig.temperature with seeds fixed by the example's place and the run's seed."""
        cfg = self.cfg
        samples = 1 if greedy else samples
        engine = LocalEngine(model, eos_token_ids=[tokenizer.eos_token_id], decode=tokenizer.decode, max_batch=64,
                             forward=cfg.rollout.forward)
        cases = [(i, s) for i in range(len(examples)) for s in range(samples)]
        seed = lambda i, s: request_seed(cfg.seed, -1 - i, s)  # slots below 0: never a training group's
        if self.scoring.agent is not None:
            scores, infos = self._agent_episodes(engine, tokenizer, examples, cases, seed, greedy)
        elif self.env is not None:
            scores, infos = self._episodes(engine, tokenizer, examples, cases, seed, greedy)
        else:
            g = cfg.gconfig
            requests = [GenerationRequest(encode_prompt(tokenizer, examples[i], cfg.train_dataset.system_prompt),
                                          g.max_new_tokens, rid=(i, s), greedy=greedy, temperature=g.temperature,
                                          stop=tuple(g.stop), seed=seed(i, s)) for i, s in cases]
            outs = generate(engine, requests)
            texts = [tokenizer.decode(o.output_ids, skip_special_tokens=True) for o in outs]
            scores = self._scored([(t, examples[i]) for t, (i, _) in zip(texts, cases)])
            infos = None
        solved = [0.0] * len(examples)
        for (i, _), (_, success) in zip(cases, scores):
            solved[i] += success / samples
        n = max(1, len(cases))
        metrics = {"eval/accuracy": sum(solved) / max(1, len(examples)), "eval/reward": sum(s for s, _ in scores) / n}
        if infos is not None:
            first = sum(info.success and info.turns <= 1 for info in infos) / n
            metrics["eval/first_turn_accuracy"] = first  # accuracy minus this is what the later turns added
            metrics["eval/turns_mean"] = sum(i.turns for i in infos) / n
            metrics["eval/tool_use_frac"] = sum(i.tool_calls > 0 for i in infos) / n
        return Evaluation(metrics, solved)

    def _scored(self, texts_and_examples) -> list[tuple[float, bool]]:
        return [(r, r >= SOLVED) for r, _ in self.reward.score_all(texts_and_examples)]

    def _episodes(self, engine: LocalEngine, tokenizer, examples: list[Example], cases, seed, greedy: bool):
        spec = self.scoring.env
        runner = EpisodeRunner(engine, tokenizer, spec, Turns.from_config(self.cfg, spec), self.env,
                               rounds=self.cfg.rollout.lockstep)
        for i, s in cases:
            runner.start(("eval", i, s), examples[i], seed=seed(i, s), greedy=greedy)
        ended = {}
        while runner.busy:
            for c in engine.step():
                runner.finished_turn(c)
            for ep in runner.poll(block_s=0.05 if engine.num_pending == 0 else 0.0):
                ended[ep.eid[1:]] = ep
        eps = [ended[c] for c in cases]
        return [(ep.reward, ep.info.success) for ep in eps], [ep.info for ep in eps]

    def _agent_episodes(self, engine: LocalEngine, tokenizer, examples: list[Example], cases, seed, greedy: bool):
        runner = start_agents(engine, tokenizer, self.cfg, self.scoring.agent)
        ended = {}
        try:
            for i, s in cases:
                runner.start(("eval", i, s), examples[i], seed=seed(i, s), greedy=greedy)
            while runner.busy:
                runner.pump(block_s=0.002 if engine.num_pending == 0 else 0.0)
                for c in engine.step():
                    runner.finished_turn(c)
                for ep in runner.poll():
                    ended[ep.eid[1:]] = ep
        finally:
            runner.close()
        eps = [ended[c] for c in cases]
        infos = [EpisodeInfo(turns=ep.calls, success=ep.reward >= SOLVED) for ep in eps]
        return [(ep.reward, ep.reward >= SOLVED) for ep in eps], infos

"""Held-out evaluation: greedy decoding of examples never seen in training, scored by the run's reward,
or, with an environment, greedy episodes of them."""

from __future__ import annotations

from a3po.config import Config
from a3po.data import CallProcess, Example, RewardProcess
from a3po.envs.host import EnvHost
from a3po.rollout import GenerationRequest, generate
from a3po.rollout.episodes import EpisodeRunner, Turns
from a3po.rollout.local import LocalEngine
from a3po.rollout.prompts import encode_prompt
from a3po.rollout.worker import Scoring


class Evaluator:
    """eval/accuracy: share of examples whose greedy completion (episode) scores >= 1 (before any turn
    discount); eval/reward: mean score. Owns the child processes that score, until `close`."""

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

    def __call__(self, model, tokenizer, examples: list[Example]) -> dict[str, float]:
        cfg = self.cfg
        engine = LocalEngine(model, eos_token_ids=[tokenizer.eos_token_id], decode=tokenizer.decode, max_batch=64,
                             forward=cfg.rollout.forward)
        n = max(1, len(examples))
        if self.env is not None:
            return self._episodes(engine, tokenizer, examples, n)
        requests = [
            GenerationRequest(encode_prompt(tokenizer, ex, cfg.train_dataset.system_prompt),
                              cfg.gconfig.max_new_tokens, rid=i, greedy=True, stop=tuple(cfg.gconfig.stop))
            for i, ex in enumerate(examples)
        ]
        outs = generate(engine, requests)
        texts = [tokenizer.decode(o.output_ids, skip_special_tokens=True) for o in outs]
        scores = [r for r, _ in self.reward.score_all(list(zip(texts, examples)))]
        return {"eval/accuracy": sum(s >= 1.0 - 1e-6 for s in scores) / n, "eval/reward": sum(scores) / n}

    def _episodes(self, engine: LocalEngine, tokenizer, examples: list[Example], n: int) -> dict[str, float]:
        spec = self.scoring.env
        runner = EpisodeRunner(engine, tokenizer, spec, Turns.from_config(self.cfg, spec), self.env)
        for i, ex in enumerate(examples):
            runner.start(("eval", i), ex, seed=i, greedy=True)
        ended = []
        while runner.busy:
            for c in engine.step():
                runner.finished_turn(c)
            ended += runner.poll(block_s=0.05 if engine.num_pending == 0 else 0.0)
        infos = [ep.info for ep in ended]
        return {
            "eval/accuracy": sum(i.success for i in infos) / n,
            "eval/reward": sum(ep.reward for ep in ended) / n,
            "eval/turns_mean": sum(i.turns for i in infos) / n,
            "eval/tool_use_frac": sum(i.tool_calls > 0 for i in infos) / n,
        }

"""Held-out evaluation: greedy decoding of examples never seen in training, scored by the run's reward."""

from __future__ import annotations

from a3po.config import Config
from a3po.data import Example, RewardProcess
from a3po.rollout import GenerationRequest, generate
from a3po.rollout.local import LocalEngine
from a3po.rollout.prompts import encode_prompt


def evaluate(model, tokenizer, examples: list[Example], reward: RewardProcess, cfg: Config) -> dict[str, float]:
    """eval/accuracy: share of examples whose greedy completion scores >= 1; eval/reward: mean score."""
    engine = LocalEngine(model, eos_token_ids=[tokenizer.eos_token_id], decode=tokenizer.decode, max_batch=64,
                         forward=cfg.rollout.forward)
    requests = [
        GenerationRequest(encode_prompt(tokenizer, ex, cfg.train_dataset.system_prompt), cfg.gconfig.max_new_tokens,
                          rid=i, greedy=True, stop=tuple(cfg.gconfig.stop))
        for i, ex in enumerate(examples)
    ]
    outs = generate(engine, requests)
    texts = [tokenizer.decode(o.output_ids, skip_special_tokens=True) for o in outs]
    scores = [r for r, _ in reward.score_all(list(zip(texts, examples)))]
    n = max(1, len(scores))
    return {"eval/accuracy": sum(s >= 1.0 - 1e-6 for s in scores) / n, "eval/reward": sum(scores) / n}

"""Groups of single completions of one prompt, scored by the reward function and, with a reward service, by it too.

    runner = Completions(engine, tokenizer, cfg.gconfig, system_prompt, RewardProcess(fn, timeout_s),
                         build_service(cfg.reward_service), cfg.reward_service)

Once a group's last completion is out of the engine, its texts go to the reward process
(data/scoring.py) and to the service (a3po/services/) at the same time: the service's
requests run on its client's threads, so the decode loop never waits on them, and the group
is returned once both have answered (reward = rule_weight x rule + weight x service). A
completion the service could not score follows reward_service.on_failure: its service score
is 0, its group is dropped (refilled from the dataset), or `poll_groups` raises and the
worker fails with the reason.
"""

from __future__ import annotations

from collections.abc import Hashable

from a3po.config.choices import OnFailure
from a3po.config.schema import GenerationConfig, RewardServiceConfig
from a3po.data import Example, RewardProcess
from a3po.rollout.engine import Completion, GenerationRequest, RolloutEngine
from a3po.rollout.groups import Gathering, Group
from a3po.rollout.prompts import encode_prompt
from a3po.services import JudgeItem, Scored, ServiceClient
from a3po.trajectories import Trajectory

Rule = dict[int, tuple[float, str | None]]  # sample -> (the reward function's score, its failure)


class Completions:
    poll_s = 0.02  # rewards are scored in a child process and a service's threads: no hurry

    def __init__(self, engine: RolloutEngine, tokenizer, g: GenerationConfig, system_prompt: str | None,
                 reward: RewardProcess, service: ServiceClient | None, rs: RewardServiceConfig):
        self.engine, self.tok, self.g, self.system_prompt = engine, tokenizer, g, system_prompt
        self.reward, self.service, self.rs = reward, service, rs
        self.examples: dict[Hashable, Example] = {}
        self.generating = Gathering()
        self.scoring: dict[Hashable, tuple[list[Completion], Rule]] = {}
        self.service_scores: dict[Hashable, Scored] = {}

    @property
    def busy(self) -> bool:
        return bool(self.generating or self.scoring)

    @property
    def sampling(self) -> bool:
        return bool(self.generating)

    def start_group(self, key: Hashable, example: Example, seeds: list[int], greedy: bool = False) -> None:
        g = self.g
        ids = encode_prompt(self.tok, example, self.system_prompt)
        self.examples[key] = example
        for rid, seed in zip(self.generating.open(key, len(seeds)), seeds):
            self.engine.submit(GenerationRequest(
                ids, g.max_new_tokens, rid=rid, temperature=g.temperature, top_p=g.top_p, top_k=g.top_k,
                min_p=g.min_p, greedy=greedy, stop=tuple(g.stop), seed=seed,
            ))

    def finished_turn(self, c: Completion) -> None:
        done = self.generating.add(c.rid, c)
        if done is None:
            return
        key = c.rid[0]
        example = self.examples.pop(key)
        self.scoring[key] = (done, {})
        texts = [self.tok.decode(comp.output_ids, skip_special_tokens=True) for comp in done]
        for comp, text in zip(done, texts):  # scored in the reward process while generation goes on
            self.reward.submit(comp.rid, text, example)
        if self.service is not None:  # and by the service, on its client's threads
            self.service.submit(key, [JudgeItem(example.question, example.answer, t) for t in texts])

    def poll_groups(self, block_s: float = 0.0) -> list[Group]:
        ready = set()
        for (key, i), reward, failure in self.reward.wait(block_s) if block_s else self.reward.poll():
            self.scoring[key][1][i] = (reward, failure)  # a failed reward is 0.0 (RewardProcess.FAILED)
            ready.add(key)
        if self.service is not None:
            for got in self.service.poll():
                self.service_scores[got.key] = got
                ready.add(got.key)
        out = []
        for key in sorted(ready):
            done, rule = self.scoring[key]
            if len(rule) < len(done) or (self.service is not None and key not in self.service_scores):
                continue
            del self.scoring[key]
            out.append(self._scored(key, done, rule))
        return out

    def _scored(self, key: Hashable, done: list[Completion], rule: Rule) -> Group:
        """The group with its rewards: the rule's, or with a service the weighted sum of both."""
        rewards = [rule[c.rid[1]][0] for c in done]
        failures = [f for _, f in (rule[c.rid[1]] for c in done) if f]
        dropped, service_s = False, 0.0
        if self.service is not None:
            rs = self.rs
            got = self.service_scores.pop(key)
            scores, service_s = got.scores, got.seconds
            bad = [f for f in got.failures if f]
            if bad and rs.on_failure == OnFailure.STOP:
                raise RuntimeError(f"{bad[0]} (reward_service.on_failure=stop)")
            dropped = bool(bad) and rs.on_failure == OnFailure.DROP
            failures += bad
            rewards = [rs.rule_weight * r + rs.weight * (s or 0.0) for r, s in zip(rewards, scores)]
        samples = [[Trajectory(c.prompt_ids, c.output_ids, c.output_logprobs, c.output_versions, reward=r,
                               finish_reason=c.finish_reason)] for c, r in zip(done, rewards)]
        return Group(key, samples, failures, dropped=dropped, service_s=service_s)

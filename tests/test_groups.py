"""One runner for every kind of rollout group (rollout/groups.py), on the tiny model with real child processes.

Proves: completions come back as whole groups in sample order, each the engine's completion of the request
`generate` answers for the same prompt and seed, its reward the reward function's as called directly; a group is
busy until scored and sampling only while its requests are in the engine; episodes come back grouped the same
way, each sample its episode's trajectory; the factory gives the kind the run's inputs name, and each kind has
every member of GroupRunner; the evaluator scores every evaluation in the one reward process it starts, whatever
model each is of, and that process is gone once the evaluator is closed.
"""

import copy
import os
import time

from procs import proc_stat
from scripted_envs import Echo, scorer_pid

from a3po.config import load_config
from a3po.data import Example, build_reward, load_task
from a3po.data.rewards import Imported
from a3po.envs import EnvSpec
from a3po.pipeline.evaluate import Evaluator
from a3po.rollout import GenerationRequest, generate
from a3po.rollout.agents import AgentRunner
from a3po.rollout.completions import Completions
from a3po.rollout.episodes import EpisodeRunner
from a3po.rollout.groups import GroupRunner, group_seeds
from a3po.rollout.local import LocalEngine
from a3po.rollout.prompts import encode_prompt
from a3po.rollout.runners import Runners, Scoring

PROTOCOL = {"poll_s", "start_group", "finished_turn", "poll_groups", "busy", "sampling"}


def engine_for(model, tok):
    return LocalEngine(model, eos_token_ids=[tok.eos_token_id], decode=tok.decode)


def drive(runner, engine, on_step=None) -> list:
    groups = []
    while runner.busy:
        for c in engine.step():
            runner.finished_turn(c)
        if on_step is not None:
            on_step()
        groups += runner.poll_groups(block_s=runner.poll_s if engine.num_pending == 0 else 0.0)
    return groups


def test_completions_are_the_engines_completions_scored_by_the_reward_function(tiny):
    model, tok = tiny
    cfg = load_config(None, ["gconfig.n_samples=3", "gconfig.max_new_tokens=8"])
    data = load_task(cfg.train_dataset, 2, 0)
    reward_fn = build_reward(cfg.train_dataset, data)
    engine = engine_for(model, tok)
    runners = Runners(cfg, Scoring(reward_fn))
    runner = runners.build(engine, tok)
    assert isinstance(runner, Completions)
    seen = []  # (busy, sampling, requests in the engine) after each step
    try:
        for slot, ex in enumerate(data.eval):
            runner.start_group(slot, ex, group_seeds(cfg.seed, slot, 3))
        groups = drive(runner, engine, lambda: seen.append((runner.busy, runner.sampling, engine.num_pending)))
    finally:
        runners.close()
    assert sorted(g.key for g in groups) == [0, 1]
    assert all(busy for busy, _, _ in seen) and not runner.busy
    assert all(sampling == (pending > 0) for _, sampling, pending in seen)
    g = cfg.gconfig
    prompts = [encode_prompt(tok, ex, cfg.train_dataset.system_prompt) for ex in data.eval]
    alone = generate(engine_for(copy.deepcopy(model), tok), [  # the same requests, in one batch as the runner's
        GenerationRequest(prompts[slot], g.max_new_tokens, rid=(slot, i), temperature=g.temperature, seed=seed)
        for slot in range(2) for i, seed in enumerate(group_seeds(cfg.seed, slot, 3))])
    for group in groups:
        ex = data.eval[group.key]
        assert [len(rows) for rows in group.samples] == [1, 1, 1] and group.failures == []
        for i, (t,) in enumerate(group.samples):
            c = alone[3 * group.key + i]
            assert t.prompt_ids == prompts[group.key] and t.output_ids == c.output_ids
            assert t.output_versions == c.output_versions
            assert t.reward == reward_fn(tok.decode(c.output_ids, skip_special_tokens=True), ex)


def test_episodes_come_back_as_whole_groups_in_sample_order(tiny):
    model, tok = tiny
    cfg = load_config(None, ["gconfig.max_new_tokens=6", "train_dataset.env=retry", "train_dataset.max_turns=5",
                             "rollout.lockstep=true"])  # the env named here is not used: Echo is
    echo = Scoring(None, EnvSpec("echo", Echo))
    examples = {"a": Example("Count to 2.", "2", 0), "b": Example("Count to 3.", "3", 1)}
    runners = Runners(cfg, echo)
    runner = runners.build(engine := engine_for(model, tok), tok)
    assert isinstance(runner, EpisodeRunner)
    try:
        for key, ex in examples.items():
            runner.start_group(key, ex, [1, 2])
        groups = {g.key: g for g in drive(runner, engine)}
    finally:
        runners.close()
    runners = Runners(cfg, echo)
    one_by_one = runners.build(engine := engine_for(copy.deepcopy(model), tok), tok)
    try:  # the same episodes started one by one, with the runner's sample ids and seeds (in rounds: the same batches)
        for key, ex in examples.items():
            for i, seed in enumerate([1, 2]):
                one_by_one.start((key, i), ex, seed)
        episodes = {}
        while one_by_one.busy:
            for c in engine.step():
                one_by_one.finished_turn(c)
            episodes.update({ep.eid: ep for ep in one_by_one.poll(block_s=0.05 if engine.num_pending == 0 else 0)})
    finally:
        runners.close()
    assert sorted(groups) == ["a", "b"]
    for key, turns in (("a", 2), ("b", 3)):
        samples = groups[key].samples
        assert [len(rows) for rows in samples] == [1, 1] and groups[key].failures == []
        assert [rows[0].episode.turns for rows in samples] == [turns, turns]
        assert all(rows[0].reward == 1.0 and rows[0].finish_reason == "done" for rows in samples)
        for i, (t,) in enumerate(samples):
            assert t.output_ids == episodes[key, i].trajectories()[0].output_ids


def test_the_factory_gives_the_kind_the_inputs_name_each_with_the_whole_protocol(tiny):
    model, tok = tiny
    cfg = load_config(None, [])
    engine = engine_for(model, tok)
    kinds = {Completions: Scoring(None), EpisodeRunner: Scoring(None, EnvSpec("echo", Echo)),
             AgentRunner: Scoring(None, agent=Imported("scripted_agents:by_example"))}
    for kind, scoring in kinds.items():
        runners = Runners(cfg, scoring)
        try:
            runner = runners.build(engine, tok)
            assert type(runner) is kind
            assert all(hasattr(runner, name) for name in PROTOCOL), kind
        finally:
            runners.close()
    assert PROTOCOL == {n for n in vars(GroupRunner) if not n.startswith("_")} | set(GroupRunner.__annotations__)


def test_the_evaluators_reward_process_serves_every_evaluation_until_close(tiny):
    model, tok = tiny
    cfg = load_config(None, ["gconfig.max_new_tokens=4"])
    examples = [Example("What is 1 + 1?", "2", 0), Example("What is 2 + 2?", "4", 1)]
    evaluator = Evaluator(cfg, Scoring(scorer_pid))  # each reward is the pid of the process that scored it
    try:
        first = evaluator(model, tok, examples).metrics["eval/reward"]
        second = evaluator(copy.deepcopy(model), tok, examples).metrics["eval/reward"]  # another model, engine
    finally:
        t0 = time.monotonic()
        evaluator.close()
        closing_s = time.monotonic() - t0
    pid = int(first)
    assert first == second == pid and pid != os.getpid()  # one reward process, not one per evaluation
    assert proc_stat(pid) is None, f"the reward process {pid} outlived Evaluator.close"  # gone, and waited for
    assert closing_s < 10  # within its own deadline (end of file, then a kill)

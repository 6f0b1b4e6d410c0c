"""The metric registry (a3po/metrics.py) against what real runs log.

Two tiny `a3po train` runs whose options together reach every family: the `metrics` proximal
method (prox_err/), two rollout workers (rollout/idle_frac/w<i>), a recorded step (perf/record_s),
the KL in the loss and, in the second run, in the reward (perf/ref_kl_s), coupled PPO trained with SAPO
and off-policy corrections on the current weights' ratio to the sampler (verl's bypass mode), multi-turn
episodes with a tool (episode/, eval/tool_use_frac), evaluation steps. Every key either writes
to metrics.jsonl or to TensorBoard must be declared by exactly one entry, and every entry must be
logged: on every training step when it declares no condition, in one of the runs otherwise.
"""

import importlib.util
import json
import math
from pathlib import Path

import pytest
from procs import a3po

from a3po.algo.prox import APPROXIMATIONS
from a3po.metrics import NAMESPACES, PLACEHOLDER, REGISTRY, declaring, is_family, namespace, placeholders

# Conditional entries no run here reaches, with where they are exercised instead.
NOT_EXERCISED = {"perf/ranks_sync_s": "needs two trainer ranks; tests/test_parallel.py trains with them",
                 "rollout/reward_service_s": "needs a reward service; tests/test_services_e2e.py checks it"}

RUNS = {
    "metrics-2w-kl": ["actor.prox_logp_method=metrics", "rollout.n_workers=2", "actor.kl_ctl=0.1",
                      "total_train_steps=3", "evaluator.freq_steps=2", "saver.record_steps=[2]"],
    "coupled-klreward": ["actor.use_decoupled_loss=false", "actor.kl_ctl=0.1", "actor.kl_in_reward=true",
                         "actor.policy_loss=sapo", "actor.correction.ratio=current", "actor.correction.tis=sequence",
                         "actor.correction.mis=token", "actor.correction.mis_low=0.5", "actor.correction.mis_high=2",
                         "actor.correction.opsm_delta=0.05",
                         "train_dataset.env=calculator", "train_dataset.max_turns=2",
                         "total_train_steps=2", "evaluator.freq_steps=0", "logging.tensorboard=false"],
}


def _example(name: str) -> str:
    """One key of an entry's family (the entry's name itself when it has no placeholder)."""
    values = {"<k>": "3", "<i>": "1"}
    for hole, (regex, _) in placeholders().items():
        values.setdefault(hole, regex.split("|")[0].replace("\\", ""))
    return PLACEHOLDER.sub(lambda m: values[m.group(0)], name)


def test_entries_are_unique_and_well_formed():
    names = [m.name for m in REGISTRY]
    assert len(names) == len(set(names))
    for m in REGISTRY:
        assert m.unit and m.meaning and m.producer, m.name
        assert namespace(m) in NAMESPACES, f"{m.name}: a namespace NAMESPACES does not describe"
        assert set(PLACEHOLDER.findall(m.name)) <= set(placeholders()), m.name
        assert [e.name for e in declaring(_example(m.name))] == [m.name], "two entries declare the same key"


def test_each_producer_writes_its_keys():
    """The modules an entry names mention the key (a family: the part of its name before the placeholders)."""
    for m in REGISTRY:
        literal = m.name.split("<")[0].rsplit("/", 1)[0] if is_family(m) else m.name
        for module in m.producer:
            spec = importlib.util.find_spec(module)
            assert spec is not None and spec.origin, f"{m.name}: no module {module}"
            assert literal in Path(spec.origin).read_text(), f"{m.name}: {module} does not write it"


@pytest.fixture(scope="module")
def logged(tmp_path_factory) -> tuple[dict[str, list[dict]], set[str]]:
    """Each run's metrics.jsonl lines, and the TensorBoard tags of the first run."""
    out = {}
    root = tmp_path_factory.mktemp("metric-runs")
    for name, overrides in RUNS.items():
        res = a3po("train", "--preset", "tiny", f"experiment_name={name}", "saver.freq_steps=0", *overrides, cwd=root)
        assert res.returncode == 0, res.stderr[-3000:]
        out[name] = [json.loads(line) for line in (root / "runs" / name / "metrics.jsonl").read_text().splitlines()]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(root / "runs" / next(iter(RUNS)) / "tb"))
    events.Reload()
    return out, set(events.Tags()["scalars"])


@pytest.mark.slow
def test_every_logged_key_is_declared_once(logged):
    runs, tb_tags = logged
    assert len(tb_tags) > 40  # TensorBoard got the run's scalars
    keys = {k for rows in runs.values() for row in rows for k in row} | tb_tags
    undeclared = sorted(k for k in keys if not declaring(k))
    assert undeclared == [], "declare them in src/a3po/metrics.py, then run: python -m a3po.config.docs docs"
    assert sorted(k for k in keys if len(declaring(k)) > 1) == []


@pytest.mark.slow
def test_every_declared_key_is_logged(logged):
    runs, _ = logged
    steps = [row for rows in runs.values() for row in rows if row["step"] > 0]
    assert [row["step"] for row in steps] == [1, 2, 3, 1, 2]
    keys = {k for rows in runs.values() for row in rows for k in row}
    for m in REGISTRY:
        if m.when is None:  # on every training step
            missing = [row["step"] for row in steps if not any(declaring(k) == [m] for k in row)]
            assert missing == [], f"{m.name} declares no condition but is missing on steps {missing}"
        elif m.name in NOT_EXERCISED:
            assert not any(declaring(k) == [m] for k in keys)
        else:
            assert any(declaring(k) == [m] for k in keys), f"{m.name} ({m.when}) was logged by no run here"
    assert all(next(m for m in REGISTRY if m.name == name).when for name in NOT_EXERCISED)


@pytest.mark.slow
def test_families_have_the_members_the_runs_imply(logged):
    first = logged[0]["metrics-2w-kl"]
    eta = 2  # the tiny preset's rollout.max_head_offpolicyness (the default)
    for row in first[1:]:
        assert {k for k in row if k.startswith("rollout/idle_frac/")} == {f"rollout/idle_frac/w{i}" for i in (0, 1)}
        assert {k for k in row if k.startswith("stale/frac_d")} == {f"stale/frac_d{k}" for k in range(eta + 1)}
        approx = {k.split("/")[1] for k in row if k.startswith("prox_err/") and not k.startswith("prox_err/tokens")}
        assert approx == set(APPROXIMATIONS)
    assert [r["step"] for r in first if "eval/accuracy" in r] == [0, 2, 3]


@pytest.mark.slow
def test_a_run_with_a_new_loss_and_corrections_trains(logged):
    """The second run (SAPO, TIS, IcePop and OPSM under coupled PPO, set on the command line) trains to its end
    with a finite loss on every step and reports every correction's shares, within [0, 1]. Its tiny model's
    rewards rarely differ, so tests/test_train_engine.py is where the corrections are seen acting."""
    rows = [r for r in logged[0]["coupled-klreward"] if r["step"] > 0]
    assert rows and all(math.isfinite(r["loss/total"]) for r in rows)
    for r in rows:
        for key in ("loss/tis_truncated_frac", "loss/tis_truncated_seq_frac", "loss/corr_masked_frac",
                    "loss/corr_masked_seq_frac", "loss/opsm_masked_seq_frac"):
            assert 0.0 <= r[key] <= 1.0, (key, r[key])

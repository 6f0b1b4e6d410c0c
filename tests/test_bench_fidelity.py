"""`a3po bench fidelity`: the arithmetic on hand-made tensors, replays of recorded steps on the real tiny model in
this process, and the command run as a user runs it (a real subprocess training a real recording run).

    PYTHONPATH=$PWD/src pytest tests/test_bench_fidelity.py                  # ~30 s on 2 cores
    PYTHONPATH=$PWD/src pytest tests/test_bench_fidelity.py -m "not slow"    # seconds

Proves: cosine, relative norm and relative error as computed by hand, an update against itself exactly 1 and 0
across float64 chunks; the parts an update is split into; the KL per row; records are written whole and read
back; a replay is deterministic (recompute against itself reads cos 1.0 and error 0.0 exactly, and a second
replay gives the same numbers); coupled PPO's update parts from recompute's on a stale batch of several
minibatches, and on fresh data at one minibatch every arm's update is recompute's; saver.record_steps is checked;
the command records a run, replays it and writes its tables, and the replay of the run's own method reproduces the
statistics the run logged for that step.
"""

import copy
import json
import math
from pathlib import Path

import pytest
import torch
from procs import a3po

from a3po.bench import agreement as ag
from a3po.bench.args import FIDELITY_ARMS
from a3po.bench.fidelity import Replayer, records_of, replay, spread_steps
from a3po.bench.fidelity_report import markdown, summary
from a3po.cli import build_parser
from a3po.config import ConfigError, dump_yaml, load_config
from a3po.trainer.engine import TrainEngine
from a3po.trainer.records import read_batch, read_info, recorded, save_record
from a3po.trajectories import Trajectory, collate

# ----------------------------------------------------------------------------- the arithmetic


def test_agreement_as_computed_by_hand():
    a = ag.agreement(torch.tensor([1.0, 0.0, 0.0]), torch.tensor([1.0, 1.0, 0.0]))
    # <u, ref> = 1, |u| = 1, |ref| = sqrt 2, u - ref = (0, -1, 0)
    assert (a.cos, a.rel_norm, a.rel_err) == pytest.approx((1 / math.sqrt(2),) * 3, abs=1e-15)
    a = ag.agreement(torch.tensor([2.0, 4.0]), torch.tensor([1.0, 2.0]))  # twice the reference
    assert (a.cos, a.rel_norm, a.rel_err) == pytest.approx((1.0, 2.0, 1.0), abs=1e-15)
    a = ag.agreement(torch.tensor([-1.0, 0.0]), torch.tensor([1.0, 0.0]))
    assert (a.cos, a.rel_norm, a.rel_err) == (-1.0, 1.0, 2.0)
    a = ag.agreement(torch.ones(2), torch.zeros(2))  # no reference update: nothing to compare with
    assert all(math.isnan(x) for x in (a.cos, a.rel_norm, a.rel_err))


def test_an_update_against_itself_is_exactly_one_across_chunks(monkeypatch):
    monkeypatch.setattr(ag, "CHUNK", 1000)  # three chunks, the last of 5
    u = torch.randn(2005, generator=torch.Generator().manual_seed(0))
    a = ag.agreement(u, u.clone())
    assert (a.cos, a.rel_norm, a.rel_err) == (1.0, 1.0, 0.0)
    v = u + 1e-4 * torch.randn(u.shape, generator=torch.Generator().manual_seed(1))
    assert ag.dot(u, v) == pytest.approx(float(torch.dot(u.double(), v.double())), rel=1e-12)
    a = ag.agreement(v, u)  # v - u is ~1e-4 per element: its norm ~1e-4 of u's
    assert a.rel_err == pytest.approx(1e-4, rel=0.1) and 0 < 1 - a.cos < 1e-7
    assert ag.sum_norm(u, v) == pytest.approx(float((u.double() + v.double()).norm()), rel=1e-12)


def test_flat_joins_tensors_in_order():
    assert ag.flat([torch.tensor([[1, 2], [3, 4]]), torch.tensor([5.0])]).tolist() == [1, 2, 3, 4, 5]


def test_the_parts_an_update_is_split_into():
    d = torch.tensor([[0, 2, 2, 3, 3, 9]])
    adv = torch.tensor([[1.0, 1.0, -1.0, -2.0, 0.0, 1.0]])
    mask = torch.tensor([[False, True, True, True, True, False]])  # d = 9 and the first are not trained tokens
    parts = {k: m.tolist()[0] for k, m in ag.cells(d, adv, mask, ["d", "sign"]).items()}
    assert parts == {"all": [False, True, True, True, False, False],  # A = 0 adds nothing to a gradient
                     "d=2": [False, True, True, False, False, False], "d=3": [False, False, False, True, False, False],
                     "A>0": [False, True, False, False, False, False], "A<0": [False, False, True, True, False, False]}
    assert list(ag.cells(d, adv, mask, [])) == ["all"]
    one = ag.cells(d, adv.abs(), mask & (d == 2), ["d", "sign"])  # one staleness, one sign: each part is the whole
    assert list(one) == ["all", "d=2", "A>0"] and all(torch.equal(m, one["all"]) for m in one.values())
    assert ag.d_values(d, mask) == {2: 2, 3: 2}
    assert ag.only(adv, torch.tensor([[True, False, True, False, True, True]])).tolist() == [[1, 0, -1, 0, 0, 1]]


def test_kl_per_row_by_hand():
    p = torch.tensor([[0.5, 0.5], [1.0, 0.0], [0.2, 0.8]], dtype=torch.float64)
    q = torch.tensor([[0.25, 0.75], [0.5, 0.5], [0.2, 0.8]], dtype=torch.float64)
    kl = ag.kl_rows(p.log(), q.log())
    # 0.5 ln(0.5/0.25) + 0.5 ln(0.5/0.75) = 0.5 ln(4/3); 1 ln 2 (0 log 0 counts 0); identical rows: 0
    assert kl.tolist() == pytest.approx([0.5 * math.log(4 / 3), math.log(2), 0.0], abs=1e-15)


def test_spread_steps():
    assert spread_steps(6) == [2, 3, 4, 6] and spread_steps(2) == [1, 2] and spread_steps(24) == [6, 12, 18, 24]


def _row(arm, cell, cos, err, kl=None):
    return {"arm": arm, "cell": cell, "tokens": 4, "cos": cos, "rel_norm": 1.0, "rel_err": err, "kl": kl,
            "kl_max": kl, "stats": {"loss/clipped_frac": 0.25, "loss/clipped_frac_d8": 0.5}}


def test_summary_pools_each_part_over_the_records_that_have_it():
    recs = [{"rows": [_row("coupled", "A<0", 0.5, 0.9), _row("coupled", "all", 0.9, 0.4, 1e-3),
                      _row("loglinear", "all", 0.99, 0.1, 1e-4), _row("loglinear", "d=8", 0.99, 0.1, 1e-4)]},
            {"rows": [_row("loglinear", "all", 0.97, 0.3, 3e-4), _row("loglinear", "d=3", 0.999, 0.05)]},
            {"rows": []}]  # a record with no signal adds nothing
    s = {(r["arm"], r["cell"]): r for r in summary(recs)}
    assert list(s) == [("loglinear", "all"), ("loglinear", "d=3"), ("loglinear", "d=8"), ("coupled", "all"),
                       ("coupled", "A<0")]  # arms in their order, then all, d ascending, the signs
    whole = s["loglinear", "all"]
    assert whole["records"] == 2 and whole["signal_tokens"] == 8
    assert (whole["cos"]["mean"], whole["cos"]["min"], whole["cos"]["max"]) == pytest.approx((0.98, 0.97, 0.99))
    assert whole["rel_err"]["mean"] == pytest.approx(0.2) and whole["kl"]["mean"] == pytest.approx(2e-4)
    assert s["loglinear", "d=3"]["kl"]["n"] == 0  # a part has no KL of its own


def test_an_arm_that_moves_nothing_reads_no_update_not_a_blank_cosine():
    masked = {**_row("loglinear-geomask", "all", math.nan, 1.0), "rel_norm": 0.0}
    rec = {"run": "r", "step": 8, "version": 7, "sequences": 2, "minibatches": 1, "tokens": 4, "d": {"8": 4},
           "signal_tokens": 4, "carried_share": 0.5, "heldout_tokens": 0, "wall_s": 1.0,
           "rows": [_row("loglinear", "all", 0.99, 0.1), masked]}
    text = markdown({"command": "c", "runs": ["r"], "wall_s": 1.0, "torch": "x", "records": [rec],
                     "machine": {"cpu": "c", "cores": 2, "avx512_bf16": False, "amx_bf16": False},
                     "arms": {"loglinear": "l", "loglinear-geomask": "g"}, "summary": summary([rec])})
    rows = [line for line in text.splitlines() if line.startswith("| loglinear-geomask | all")]
    assert len(rows) == 2 and all(line.split(" | ")[2 if "(4)" in line else 3] == "no update" for line in rows), rows
    assert "| loglinear | all | 1 | 0.9900 |" in text


# ----------------------------------------------------------------------------- records and replays


@pytest.fixture(autouse=True)
def _one_thread():
    """One torch thread, as the command gives its replays on two cores: a second one beside other busy processes
    (a parallel test run) makes the tiny model's many small steps ten times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _run_folder(tmp_path: Path, *overrides: str) -> tuple[Path, object]:
    cfg = load_config(None, ["logging.tensorboard=false", "actor.dtype=float32", *overrides], preset="tiny")
    (tmp_path / "config.yaml").write_text(dump_yaml(cfg))
    return tmp_path, cfg


def _record(run_dir: Path, cfg, stale: bool, v: int = 8, rows: int = 8, out_len: int = 12) -> Path:
    """A record of step v + 1 made by hand: the tiny model at version v, a batch of random tokens whose behaviour
    log-probs are an older, perturbed model's and whose staleness is 1..8 by row (stale), or the model's own at
    staleness 0 (fresh); random advantages of both signs."""
    from a3po.models import load_policy

    model, tok = load_policy("tiny", seed=cfg.seed)
    engine = TrainEngine(model, cfg.actor, 16, temperature=cfg.gconfig.temperature)
    engine.version = v
    g = torch.Generator().manual_seed(3)
    trajs = [Trajectory(prompt_ids=torch.randint(3, len(tok), (6,), generator=g).tolist(),
                        output_ids=torch.randint(3, len(tok), (out_len,), generator=g).tolist(),
                        output_logprobs=[0.0] * out_len, output_versions=[v - (1 + i % 8 if stale else 0)] * out_len)
             for i in range(rows)]
    batch = collate(trajs, advantages=torch.tensor([1.0, -1.0] * (rows // 2)) * (1 + torch.rand(rows, generator=g)))
    behaviour = copy.deepcopy(model)
    if stale:
        with torch.no_grad():
            for p in behaviour.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=g))
    batch.logp_behav = engine.compute_logp(batch, behaviour if stale else None)
    return save_record(run_dir, v + 1, engine, batch)


def test_a_record_holds_the_batch_and_the_state_before_the_step(tmp_path):
    run_dir, cfg = _run_folder(tmp_path)
    path = _record(run_dir, cfg, stale=True)
    assert recorded(run_dir) == [path] and path.name == "step_000009" and read_info(path) == {"step": 9, "version": 8}
    batch = read_batch(path)
    assert batch.input_ids.shape == (8, 18) and batch.loss_mask.sum() == 8 * 12
    assert sorted(set(batch.versions[batch.loss_mask].tolist())) == list(range(0, 8))  # d = 1..8 at version 8
    assert not list(run_dir.glob("records/.tmp-*"))
    assert records_of(run_dir, [9]) == [path]
    with pytest.raises(ConfigError, match="no record of step 4; it has 9"):
        records_of(run_dir, [4])
    empty = tmp_path / "empty"
    empty.mkdir()
    _run_folder(empty)
    with pytest.raises(ConfigError, match="holds no records; train it with saver.record_steps"):
        records_of(empty, None)
    with pytest.raises(ConfigError, match="not a run folder"):
        records_of(run_dir / "records", None)


@pytest.fixture
def stale(tmp_path):
    run_dir, cfg = _run_folder(tmp_path, "actor.ppo_n_minibatches=4", "rollout.max_head_offpolicyness=8")
    return Replayer(run_dir, heldout=2), _record(run_dir, cfg, stale=True)


def _by(rec: dict) -> dict:
    return {(r["arm"], r["cell"]): r for r in rec["rows"]}


@pytest.mark.slow
def test_a_stale_batch_over_four_minibatches_parts_coupled_from_recompute(stale):
    rp, path = stale
    rec = replay(rp, path, list(FIDELITY_ARMS), ["d", "sign"], log=lambda line: None)
    rows = _by(rec)
    assert rec["minibatches"] == 4 and rec["d"] == {k: 12 for k in range(1, 9)}
    same = rows["recompute", "all"]  # the reference replayed a second time: the determinism check
    assert (same["cos"], same["rel_norm"], same["rel_err"], same["kl"]) == (1.0, 1.0, 0.0, 0.0)
    coupled = rows["coupled", "all"]
    assert coupled["rel_err"] > 0.01 and coupled["cos"] < 0.9999 and coupled["kl"] > 0
    # every part of both splits, for every arm but the determinism check, and each part has its own step
    parts = ["all", *(f"d={k}" for k in range(1, 9)), "A>0", "A<0"]
    assert sorted(rows) == sorted([("recompute", "all")] + [(a, p) for a in FIDELITY_ARMS[1:] for p in parts])
    assert rows["coupled", "d=8"]["tokens"] == 12 and rows["coupled", "A<0"]["tokens"] == 48
    assert rows["coupled", "d=8"]["rel_err"] != coupled["rel_err"] and rows["coupled", "d=8"]["kl"] is None
    assert 0 < rec["heldout_tokens"] and rec["carried_share"] == 0.0  # a fresh AdamW: nothing carried
    # a correction acts on the tokens its ratio leaves its band: IcePop drops some, and its step then parts from
    # loglinear's; where it drops nothing it is loglinear's step exactly
    icepop = rows["loglinear-icepop", "all"]
    assert 0 < icepop["stats"]["loss/corr_masked_frac"] < 1 and icepop["rel_err"] != rows["loglinear", "all"]["rel_err"]
    for d in range(1, 9):
        if rows["loglinear-icepop", f"d={d}"]["stats"]["loss/corr_masked_frac"] == 0:
            assert rows["loglinear-icepop", f"d={d}"]["rel_err"] == rows["loglinear", f"d={d}"]["rel_err"], d
    # the same record replayed again gives the same numbers, every one of them
    again = replay(rp, path, ["coupled", "reuse"], ["sign"], log=lambda line: None)
    for key, r in _by(again).items():
        assert {k: r[k] for k in ("cos", "rel_norm", "rel_err", "kl", "stats")} == \
               {k: rows[key][k] for k in ("cos", "rel_norm", "rel_err", "kl", "stats")}, key
    text = markdown({"command": "a3po bench fidelity", "runs": [str(rp.run_dir)], "wall_s": 1.0, "torch": "x",
                     "machine": {"cpu": "c", "cores": 2, "avx512_bf16": False, "amx_bf16": False},
                     "arms": {"coupled": "p = b"}, "summary": summary([rec]), "records": [rec]})
    assert "| coupled | d=8 (12) |" in text and "| recompute | all (96) | 1.0000 | 1.000 | 0 | 0.00e+00 |" in text


def test_on_fresh_data_at_one_minibatch_every_arm_makes_recompute_s_update(tmp_path):
    run_dir, cfg = _run_folder(tmp_path, "actor.ppo_n_minibatches=1", "rollout.max_head_offpolicyness=0")
    path = _record(run_dir, cfg, stale=False)  # b is the model's own: p = b = theta for every method, w = r = 1
    rec = replay(Replayer(run_dir, heldout=2), path, list(FIDELITY_ARMS), [], log=lambda line: None)
    assert {r["arm"] for r in rec["rows"]} == set(FIDELITY_ARMS)
    for r in rec["rows"]:
        assert r["rel_err"] < 1e-5 and r["cos"] > 1 - 1e-9 and r["kl"] < 1e-10, r["arm"]


def test_record_steps_are_steps_of_the_run():
    assert load_config(None, ["saver.record_steps=[1, 16]"]).saver.record_steps == [1, 16]
    for bad in ("[0]", "[17]", "[2.5]", "[true]"):
        with pytest.raises(ConfigError, match="saver.record_steps.*from 1 to total_train_steps=16"):
            load_config(None, [f"saver.record_steps={bad}"])


def test_run_replays_its_own_configuration_only():
    from a3po.bench.args import from_namespace

    for extra in (["--preset", "tiny"], ["actor.optimizer.lr=1"], ["--seeds", "2"]):
        with pytest.raises(ConfigError, match="--run replays the records of R with that run's own configuration"):
            from_namespace(build_parser().parse_args(["bench", "fidelity", "--run", "R", *extra]))


# ----------------------------------------------------------------------------- the command


# The tiny random model rarely solves a sum: rewarded by the parity of its completion's length instead, every group
# holds rewards that differ, and every recorded step has advantages to train on.
PARITY = "def score(completion, example):\n    return float(len(completion) % 2)\n"


@pytest.mark.slow
def test_the_command_records_a_run_and_replays_it(tmp_path):
    (tmp_path / "parity.py").write_text(PARITY)
    res = a3po("bench", "fidelity", "--preset", "tiny", "logging.tensorboard=false", "total_train_steps=3",
               "actor.optimizer.lr=1e-2", "train_dataset.reward=parity:score", "--steps", "2,3",
               "--arms", "recompute,loglinear", "--split", "", "--heldout", "2", "--out", "out", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    out = tmp_path / "out"
    rec = json.loads((out / "results.json").read_text())
    assert json.loads(res.stdout.splitlines()[-1])["summary"] == rec["summary"]  # one JSON line last
    assert (out / "results.md").read_text() in res.stdout
    run_dir = tmp_path / rec["runs"][0]
    cfg = load_config(run_dir / "config.yaml")
    assert (cfg.saver.record_steps, cfg.rollout.max_head_offpolicyness, cfg.actor.ppo_n_minibatches) == ([2, 3], 8, 4)
    assert [p.name for p in recorded(run_dir)] == ["step_000002", "step_000003"]
    assert not (run_dir / "checkpoints").exists()
    assert [(r["step"], r["version"]) for r in rec["records"]] == [(2, 1), (3, 2)]
    logged = {m["step"]: m for m in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}
    for r in rec["records"]:
        assert max(map(int, r["d"])) <= 8 and logged[r["step"]]["perf/record_s"] > 0 and r["signal_tokens"] > 0
        rows = _by(r)
        assert set(rows) == {("recompute", "all"), ("loglinear", "all")} and rows["loglinear", "all"]["kl"] >= 0
        assert (rows["recompute", "all"]["cos"], rows["recompute", "all"]["rel_err"]) == (1.0, 0.0)
        # the run trained with loglinear: replaying that arm is the step the run took, statistics and all
        own = rows["loglinear", "all"]["stats"]
        for key in ("loss/ratio_mean", "loss/clipped_frac", "train/grad_norm", "train/n_tokens"):
            assert own[key] == pytest.approx(logged[r["step"]][key], rel=1e-5), key

"""`a3po train cluster.launcher=ray` on a real Ray cluster on 127.0.0.1, started here and stopped after.

Proves: the tiny preset trains end to end with 2 rollout workers as Ray actors and 2 trainer
ranks (one of them an actor), every token within the staleness bound (the trainer checks it
per token and stops otherwise) and the bound reached, and resumes; a worker actor killed
with SIGKILL is replaced like a killed worker process, no step lost; a trainer killed with
SIGKILL takes its actors with it; SIGTERM stops a run in one line; nothing of a run outlives
it; a cluster that does not answer, or is too small, is one line; without
cluster.launcher=ray nothing imports Ray; and the Slurm recipe runs.

The cluster is docs/scaling.md's recipe: `ray start --head --port P --num-cpus 4` (Ray counts
logical CPUs; the run reserves 3: one trainer rank and two workers of one thread each).
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from procs import (
    TINY,
    Run,
    a3po,
    assert_one_clean_line,
    gone_within,
    lines_with,
    proc_stat,
    session_members,
    steps_logged,
    without,
)

from a3po.models import load_policy
from a3po.trainer.parallel import free_port

pytest.importorskip("ray")
pytestmark = pytest.mark.slow

RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled"}  # loopback only, no token file
ACTORS = ("ray::RolloutWorker", "ray::TrainerRank")
ACTOR_EXIT_S = 30.0  # Ray notices a dead driver or a killed actor's owner within seconds


def ray_start(*args: str) -> subprocess.Popen:
    """`ray start --block ...` in a session of its own, returned once the node is up."""
    node = subprocess.Popen([str(Path(sys.executable).parent / "ray"), "start", "--block", "--node-ip-address",
                             "127.0.0.1", "--disable-usage-stats", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    seen = []
    deadline = time.monotonic() + 120
    for line in node.stdout:  # --block: it prints this once the node is up, then stays in the foreground
        seen.append(line)
        if "Ray runtime started" in line:
            return node
        if time.monotonic() > deadline:
            break
    stop_nodes([node])
    pytest.fail("ray start did not come up:\n" + "".join(seen))


def stop_nodes(nodes: list[subprocess.Popen]) -> None:
    for node in nodes:
        for pid in session_members(node.pid):  # Ray's workers leave the node's process group, not its session
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        node.wait(timeout=30)


@pytest.fixture(scope="module")
def ray_head():
    """A one-node Ray cluster on 127.0.0.1; its address. Every process of it is killed afterwards."""
    saved = {k: os.environ.get(k) for k in RAY_ENV}
    os.environ.update(RAY_ENV)
    port = free_port()
    head = None
    try:
        head = ray_start("--head", "--port", str(port), "--num-cpus", "4", "--include-dashboard=false")
        yield f"127.0.0.1:{port}"
    finally:
        stop_nodes([head] if head else [])
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def actor_pids(kind: str = "") -> list[int]:
    """Live a3po actor processes (their title is ray::<class>.<method>)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                cmd = (d / "cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if any(cmd.startswith(a) for a in ACTORS if kind in a) and (s := proc_stat(int(d.name))) and s[0] != "Z":
                out.append(int(d.name))
    return out


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def on_ray(address: str, *args: str) -> list[str]:
    return [*TINY, "cluster.launcher=ray", f"cluster.ray_address={address}", "rollout.n_workers=2",
            "cluster.n_trainer_ranks=2", *args]


SRUN = """#!/bin/sh
# srun on a one-node "allocation": drop the step options, run the command here
while [ $# -gt 0 ]; do case "$1" in -w) shift 2;; -*) shift;; *) break;; esac; done
exec "$@"
"""


def test_the_slurm_recipe_starts_ray_and_trains(tmp_path):
    """recipes/slurm-ray.sbatch as sbatch would run it, on a one-node allocation of this machine (srun and
    scontrol stand-ins that run the step here): Ray's head comes up, the run trains on it, and the script
    returns a3po's exit code. Runs before the module's cluster starts."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(SRUN)
    (bin_dir / "scontrol").write_text("#!/bin/sh\necho localhost\n")
    for stub in ("srun", "scontrol"):
        (bin_dir / stub).chmod(0o755)
    env = {**os.environ, **RAY_ENV, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "A3PO_VENV": sys.prefix,
           "SLURM_JOB_NODELIST": "localhost", "SLURM_CPUS_PER_TASK": "4", "RAY_HEAD_IP": "127.0.0.1",
           "RAY_PORT": str(free_port())}
    script = Path(__file__).parents[1] / "recipes" / "slurm-ray.sbatch"
    with open(tmp_path / "stderr.txt", "w") as err:  # a file: Ray's head, left running, holds it open
        job = subprocess.Popen(["bash", str(script), *TINY, "total_train_steps=3", "rollout.n_workers=2",
                                "cluster.n_trainer_ranks=2"], cwd=tmp_path, env=env, stdout=subprocess.DEVNULL,
                               stderr=err, start_new_session=True)
    try:
        job.wait(timeout=600)
    finally:  # what Slurm does when the job ends: every step's processes go
        for pid in session_members(job.pid):
            os.kill(pid, signal.SIGKILL)
    err = (tmp_path / "stderr.txt").read_text()
    assert job.returncode == 0, err[-3000:]
    assert "Ray actors on the Ray cluster at 127.0.0.1:" in err
    assert [r["step"] for r in metrics(tmp_path / "runs" / "tiny")] == [0, 1, 2, 3]


def test_tiny_trains_on_ray_actors_with_two_ranks_and_resumes(ray_head, tmp_path):
    """In multi-turn episodes (train_dataset.env): the environment travels to the actors with the worker's
    arguments and runs in a child process of each. With LoRA: the object store carries the adapters alone, which
    every actor folds into its base (the full weights cross it in the three-node test below)."""
    first = Run(on_ray(ray_head, "total_train_steps=4", "saver.freq_steps=2", "train_dataset.env=guess",
                       "actor.lora.rank=4"), tmp_path)
    assert first.finish(timeout=600) == 0, first.err[-3000:]
    assert "Traceback" not in first.err, first.err[-3000:]
    assert "2 ranks, fsdp2" in first.err and f"Ray actors on the Ray cluster at {ray_head}" in first.err
    assert gone_within(actor_pids(), ACTOR_EXIT_S) is not None, "an actor outlived the run"
    run_dir = tmp_path / "runs" / "tiny"
    again = Run(["--resume", str(run_dir), "total_train_steps=8"], tmp_path)  # the saved config says ray
    assert again.finish(timeout=600) == 0, again.err[-3000:]
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(9))
    assert max(r["stale/max"] for r in rows if r["step"] > 0) == 2  # eta reached, never passed
    assert all(r["train/n_tokens"] > 0 and r["episode/turns_mean"] >= 1 for r in rows if r["step"] > 0)
    full = 4 * sum(p.numel() for p in load_policy("tiny", seed=1)[0].state_dict().values())
    assert all(0 < r["sync/published_bytes"] < full / 4 for r in rows if r["step"] > 0)
    fresh = [r for r in rows if r.get("mismatch/tokens")]  # tokens sampled by the version trained on them
    assert fresh and all(r["mismatch/abs_max"] < 1e-3 for r in fresh)
    # actors may sit on other nodes: their cores are not the trainer's to borrow (pipeline/cores.py:lends_cores)
    assert all(r["perf/borrowed_frac"] == 0 for r in rows if r["step"] > 0)
    assert gone_within(actor_pids(), ACTOR_EXIT_S) is not None, "an actor outlived the resumed run"


def test_actors_spread_over_three_nodes_get_the_weights_from_another_nodes_store(ray_head, tmp_path, monkeypatch):
    """Three Ray nodes (a raylet and an object store each; here all on 127.0.0.1) of one CPU each, and
    cluster.ray_placement=STRICT_SPREAD: the trainer rank and both workers on nodes of their own, so every
    worker pulls each version from the store of the node it was put on, as on separate machines. Multi-node
    clusters on one host need RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1 (0 makes the head refuse other nodes)."""
    monkeypatch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "1")
    port = free_port()
    nodes = []
    try:
        nodes.append(ray_start("--head", "--port", str(port), "--num-cpus", "1", "--include-dashboard=false"))
        for _ in range(2):
            nodes.append(ray_start("--address", f"127.0.0.1:{port}", "--num-cpus", "1"))
        run = Run([*on_ray(f"127.0.0.1:{port}", "total_train_steps=4"), "cluster.ray_placement=STRICT_SPREAD"],
                  tmp_path)
        assert run.finish(timeout=600) == 0, run.err[-3000:]
        rows = metrics(tmp_path / "runs" / "tiny")
        assert [r["step"] for r in rows] == list(range(5))
        assert max(r["stale/max"] for r in rows if r["step"] > 0) == 2
        # three CPUs in all, but no node holds a worker of two threads: refused in one line after cluster.timeout_s
        run = Run(on_ray(f"127.0.0.1:{port}", "rollout.n_workers=1", "rollout.torch_threads=2",
                         "cluster.timeout_s=3"), tmp_path)
        assert run.finish(timeout=300) == 2, run.err[-3000:]
        line = assert_one_clean_line(run.err, "a3po: error: cluster.launcher=ray: the Ray cluster at")
        assert "could not place 2 actors" in line and "within 3s (cluster.timeout_s)" in line
    finally:
        stop_nodes(nodes)


def test_agents_run_beside_worker_actors_which_end_with_a_killed_trainer(ray_head, tmp_path):
    """Each worker actor serves its agents on its own node's loopback and runs them in its own agent process; a
    trainer killed with SIGKILL takes its actors (the second trainer rank and both workers) with it."""
    run = Run(on_ray(ray_head, "total_train_steps=10000", "evaluator.freq_steps=0",
                     "train_dataset.agent=scripted_agents:two_turns"),
              tmp_path, env={"PYTHONPATH": str(Path(__file__).parent)})
    try:
        run_dir = tmp_path / "runs" / "tiny"
        run.wait_for(lambda: steps_logged(run_dir) >= 3, "three logged steps", timeout=300)
        rows = [r for r in metrics(run_dir) if r["step"] > 0]
        assert rows and all(r["episode/turns_mean"] == 2 and r["rollout/reward_failures"] == 0 for r in rows)
        assert len(actor_pids()) == 3
        os.kill(run.proc.pid, signal.SIGKILL)
        assert gone_within(actor_pids(), ACTOR_EXIT_S) is not None, "an actor outlived its trainer"
    finally:
        run.kill_all()


def test_a_killed_worker_actor_is_replaced_and_sigterm_stops_the_run_in_one_line(ray_head, tmp_path):
    """A worker actor killed with SIGKILL is replaced like a killed worker process, no step lost or done twice;
    then SIGTERM stops the run in one line with its actors (ray.init replaces the SIGTERM handler with one that
    exits on the spot; a3po's must be back)."""
    run = Run(on_ray(ray_head, "total_train_steps=10000", "evaluator.freq_steps=0", "saver.freq_steps=2"), tmp_path)
    try:
        run_dir = tmp_path / "runs" / "tiny"
        run.wait_for(lambda: steps_logged(run_dir) >= 3, "three steps", timeout=300)
        workers = actor_pids("RolloutWorker")
        assert len(workers) == 2
        os.kill(workers[0], signal.SIGKILL)
        run.wait_for_text("replaced (restart 1 of", timeout=300)
        replaced_at = steps_logged(run_dir)
        run.wait_for(lambda: steps_logged(run_dir) >= replaced_at + 3, "three steps after the replacement", 300)
        os.kill(run.proc.pid, signal.SIGTERM)
        assert run.finish() == 143, run.err[-3000:]
        (line,) = lines_with(run.err, "replaced (restart 1 of")
        assert line.startswith("a3po: rollout worker a3po-rollout-") and "died (killed by SIGKILL" in line, line
        line = assert_one_clean_line(run.err, "a3po: interrupted by SIGTERM at step")
        assert "rollout workers stopped" in line and "continue with: a3po train --resume runs/tiny" in line
        rows = [r for r in metrics(run_dir) if r["step"] > 0]
        assert [r["step"] for r in rows] == list(range(1, len(rows) + 1)), "a step lost or done twice"
        assert rows[-1]["rollout/worker_restarts"] == 1
        assert max(r["stale/max"] for r in rows) <= 2
        assert gone_within(actor_pids(), ACTOR_EXIT_S) is not None, "an actor outlived the stopped run"
    finally:
        run.kill_all()


def test_a_cluster_that_does_not_answer_is_one_line(tmp_path):
    t0 = time.monotonic()
    run = Run([*TINY, "cluster.launcher=ray", f"cluster.ray_address=127.0.0.1:{free_port()}"], tmp_path)
    assert run.finish(timeout=120) == 2
    line = assert_one_clean_line(run.err, "a3po: error: cluster.launcher=ray: nothing answers at 127.0.0.1:")
    assert "ray start --head" in line
    assert time.monotonic() - t0 < 60  # not Ray's own minutes of retries


def test_a_cluster_too_small_is_one_line(ray_head, tmp_path):
    run = Run(on_ray(ray_head, "rollout.n_workers=4"), tmp_path)  # 1 + 4 CPUs on a 4-CPU cluster
    assert run.finish(timeout=300) == 2
    line = assert_one_clean_line(run.err, "a3po: error: cluster.launcher=ray: the Ray cluster at")
    assert "too small: the actors need 5 CPU (it has 4)" in line


def test_without_ray_installed_the_ray_launcher_is_one_line_and_local_runs_never_import_ray(tmp_path):
    env = without("ray", tmp_path / "no_ray")  # every process of the run (the spawned ones too) starts without Ray
    res = a3po("train", *TINY, "cluster.launcher=ray", cwd=tmp_path, env=env)
    assert res.returncode == 2, res.stderr[-3000:]
    line = assert_one_clean_line(res.stderr, "a3po: error: cluster.launcher=ray needs Ray")
    assert "pip install 'a3po[ray]'" in line
    res = a3po("train", *TINY, "total_train_steps=2", "rollout.n_workers=2", "cluster.n_trainer_ranks=2", cwd=tmp_path,
               env=env)
    assert res.returncode == 0, res.stderr[-3000:]


EXACT = """
import sys, ray, torch
from a3po.sync.object_store import ObjectStoreWeights
ray.init(address=sys.argv[1], logging_level="WARNING")
state = {"w": torch.randn(64, 32), "b": torch.randn(32)}
store = ObjectStoreWeights(state)
v0 = store.for_load()
store.publish({k: v * 2 for k, v in state.items()})
v1 = store.for_load()
read = ray.get(ray.remote(lambda a, b: (a.tensors(), b.tensors())).remote(v0, v1), timeout=120)
assert all(torch.equal(read[0][k], v) and torch.equal(read[1][k], v * 2) for k, v in state.items()), "changed"
print("equal")
"""


def test_the_object_store_hands_a_worker_exactly_the_published_weights(ray_head, tmp_path):
    """Each version is its own object: a reader holding v still reads v after v + 1 is published.
    In a process of its own: Ray reads its environment (RAY_ENV) when it is imported."""
    res = subprocess.run([sys.executable, "-c", EXACT, ray_head], cwd=tmp_path, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0 and res.stdout.strip() == "equal", res.stderr[-3000:]


def test_bench_sync_times_both_transports(tmp_path):
    res = a3po("bench", "sync", "--model", "tiny", "--repeats", "2", "--out", "out", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    rec = json.loads((tmp_path / "out" / "sync.json").read_text())
    assert [r["transport"] for r in rec["rows"]] == ["shm", "object store"]
    assert all(r["publish_n"] == r["read_n"] == 2 and r["publish_median_s"] > 0 < r["read_median_s"]
               for r in rec["rows"])
    assert rec["bytes"] > 0 and json.loads(res.stdout.strip().splitlines()[-1])["benchmark"] == "sync"
    assert "| object store |" in (tmp_path / "out" / "sync.md").read_text()

"""A run's rollout workers are forked from a server that `a3po train` forks after its imports (launch/forked.py).

Proves: on this machine (Linux, CPU torch) a worker's parent is that server and the server's parent is the
trainer, a worker starts with torch already imported, SIGTERM back at its default and generators of its own,
and nothing of it outlives the run; where a fork is not safe (a second thread running) the server is not made
and processes are spawned as before.
"""

import subprocess
import sys
from pathlib import Path

import pytest
from procs import EXIT_S, TINY, a3po, gone_within, metrics_steps, rollout_workers, steps_logged

from a3po.launch import forked

pytestmark = [pytest.mark.skipif(sys.platform != "linux", reason="the server is made on Linux only"), pytest.mark.slow]


def comm(pid: int) -> str:
    return (Path("/proc") / str(pid) / "comm").read_text().strip()


def ppid(pid: int) -> int:
    return int((Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[1])


def test_a_runs_workers_are_forked_from_a_server_the_trainer_made_and_end_with_the_run(launch, tmp_path):
    run = launch(*TINY, "total_train_steps=400", "evaluator.freq_steps=0", "saver.freq_steps=0")
    run.wait_for(lambda: steps_logged(tmp_path / "runs" / "tiny") >= 2, "two steps")
    (worker,) = rollout_workers(run)
    server = ppid(worker)
    assert comm(server) == forked.NAME and ppid(server) == run.proc.pid
    run.proc.terminate()  # SIGTERM to the trainer alone: it stops its workers, and the server ends with it
    assert run.finish() == 143, run.err[-2000:]
    assert gone_within([worker, server], EXIT_S) is not None, "the worker or the server outlived the run"


def test_a_trainer_killed_outright_leaves_no_socket_folder(launch, tmp_path, monkeypatch):
    """The server's socket is in a temporary folder the trainer removes as it exits; killed with SIGKILL it cannot,
    and the server removes it once the run's last process is gone."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))  # the run's temporary folders, apart from other tests' runs
    run = launch(*TINY, "total_train_steps=400", "evaluator.freq_steps=0", "saver.freq_steps=0")
    run.wait_for(lambda: steps_logged(tmp_path / "runs" / "tiny") >= 2, "two steps")
    (worker,) = rollout_workers(run)
    server = ppid(worker)
    assert [p.name for p in tmp.glob("pymp-*/listener-*")], "no server socket while the run goes on"
    run.proc.kill()
    run.proc.wait(timeout=10)
    assert gone_within([worker, server], EXIT_S) is not None, "the worker or the server outlived the trainer"
    assert not list(tmp.glob("pymp-*")), "the killed run left its socket folder"


PROBE = """
import signal, sys, threading
from a3po import child  # stdlib only: a spawned child imports no torch through this file

def probe(answers):
    imported = "torch" in sys.modules
    child.take_signals()
    import numpy, torch
    draws = (int(numpy.random.randint(2**31)), float(torch.rand(1)))
    answers.put((imported, signal.getsignal(signal.SIGTERM) == signal.SIG_DFL, draws))

if __name__ == "__main__":
    import torch  # noqa: F401  (what a fork from the server saves its children importing)
    from a3po.launch import forked

    if sys.argv[1] == "thread":
        stop = threading.Event()
        threading.Thread(target=stop.wait, daemon=True).start()
    made = forked.start()
    ctx = forked.context()
    answers = ctx.Queue()
    procs = [ctx.Process(target=probe, args=(answers,)) for _ in range(2)]
    for p in procs:
        p.start()
    (imported, default, draws), (_, _, other) = answers.get(timeout=120), answers.get(timeout=120)
    # two children's unseeded numpy and torch draws differ, as two spawned processes' do
    print(made, ctx.get_start_method(), imported, default, draws[0] != other[0] and draws[1] != other[1])
    for p in procs:
        p.join(60)
    sys.exit(max(p.exitcode for p in procs))
"""


@pytest.mark.parametrize("thread, expected", [("none", "True forkserver True True True"),
                                              ("thread", "False spawn False True True")])
def test_the_server_is_made_only_where_a_fork_is_safe(tmp_path, thread, expected):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    res = subprocess.run([sys.executable, str(script), thread], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.split("\n")[0] == expected


def test_a_model_of_more_tensors_than_a_server_passes_descriptors_trains(tmp_path):
    """The weights reach a forked worker as two shared buffers, not one descriptor per tensor: 40 layers of 9
    tensors each are more than the 252 descriptors multiprocessing's fork server passes to a child."""
    res = a3po("train", *TINY, "actor.path=tiny-64x40", "total_train_steps=2", "evaluator.freq_steps=0",
               "saver.freq_steps=0", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    assert metrics_steps(tmp_path / "runs" / "tiny")[-1] == 2

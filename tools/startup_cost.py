"""What a3po's start-up measures save a short run, side by side: the cycle collector held back (a3po/startup.py)
and the rollout workers forked from a server made after the trainer's imports (a3po/launch/forked.py).

    PYTHONPATH=src python tools/startup_cost.py [--arms plain,held,forked] [--repeats 4] [--steps 2] [--out FILE]

Each repeat runs the same tiny `a3po train` once per arm in fresh folders, the arms' order alternated.
`forked` is a3po as it starts; `held` has launch/forked.start replaced by a no-op in every process of the
command (its workers are spawned and import everything again), `plain` has startup.collector_held replaced
by an empty block too (through a sitecustomize.py first on PYTHONPATH). A run is a trainer and its rollout
worker, almost all of whose CPU time on a small model is start-up, so this is the cost of every test that
starts a run. CPU seconds are the whole command's: this tool is its processes' subreaper, so the forked
workers and their server, which outlive the trainer by a moment, are waited for and counted too. Each arm's
ratio to the first arm, per repeat, is reported with the medians. Each process also counts its collections
and the CPU seconds spent in them (gc.callbacks), reported for the trainer and the rollout worker.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from a3po.machine import code_commit, machine

NOT_HELD = "import contextlib\nimport a3po.startup\na3po.startup.collector_held = contextlib.nullcontext\n"
SPAWNED = "import a3po.launch.forked\na3po.launch.forked.start = lambda: False\n"
ARMS = {"plain": NOT_HELD + SPAWNED, "held": SPAWNED, "forked": ""}  # what each arm's processes replace
PR_SET_CHILD_SUBREAPER = 36
REAP_S = 30.0  # the forked workers' server ends within moments of the trainer
# Every process of both arms: its collections and their CPU time, one JSON line at its exit (the workers leave
# through os._exit, which skips atexit)
COUNT = """
import atexit, gc, json, multiprocessing, os, sys, time
_gc = {"s": 0.0, "n": 0, "t0": 0.0}
def _count(phase, info):
    if phase == "start":
        _gc["t0"] = time.thread_time()
    else:
        _gc["s"] += time.thread_time() - _gc["t0"]
        _gc["n"] += 1
gc.callbacks.append(_count)
def _write():
    name = multiprocessing.current_process().name
    server = open("/proc/self/comm").read().startswith("a3po-forkserver")  # forked from the trainer: its argv
    kind = "worker" if name.startswith("a3po-rollout") else "trainer" if "train" in sys.argv and not server else "other"
    with open(os.environ["STARTUP_COST_GC_FILE"], "a") as f:
        f.write(json.dumps({"pid": os.getpid(), "kind": kind, "gc_s": _gc["s"], "collections": _gc["n"]}) + "\\n")
atexit.register(_write)
_exit = os._exit
def _write_and_exit(code):
    _write()
    _exit(code)
os._exit = _write_and_exit
"""


def one_run(arm: str, steps: int, work: Path) -> dict[str, float]:
    """One tiny run of `arm` in a fresh folder under `work`: its wall and CPU seconds."""
    cwd = Path(tempfile.mkdtemp(dir=work))
    env = {**os.environ, "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
    (cwd / "site").mkdir()
    (cwd / "site" / "sitecustomize.py").write_text(COUNT + ARMS[arm])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(cwd / "site"), env.get("PYTHONPATH")) if p)
    env["STARTUP_COST_GC_FILE"] = str(cwd / "gc.jsonl")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    res = subprocess.run([sys.executable, "-m", "a3po.cli", "train", "--preset", "tiny", "logging.tensorboard=false",
                          f"total_train_steps={steps}"], cwd=cwd, env=env, capture_output=True, text=True,
                         timeout=600)
    wall = time.perf_counter() - t0
    if res.returncode != 0:
        sys.exit(f"startup_cost: the {arm} run failed (exit {res.returncode}):\n{res.stderr[-2000:]}")
    reap_orphans()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    counts = {}  # by pid, the last line (the trainer writes at atexit and again at its os._exit)
    for line in (cwd / "gc.jsonl").read_text().splitlines():
        c = json.loads(line)
        counts[c["pid"]] = c
    gc_of = {kind: [c for c in counts.values() if c["kind"] == kind] for kind in ("trainer", "worker")}
    assert all(len(v) == 1 for v in gc_of.values()), f"one trainer and one worker expected: {list(counts.values())}"
    return {"wall_s": round(wall, 2), "cpu_s": round(cpu, 2),
            **{f"{kind}_gc_s": round(v[0]["gc_s"], 3) for kind, v in gc_of.items()},
            **{f"{kind}_collections": v[0]["collections"] for kind, v in gc_of.items()}}


def reap_orphans() -> None:
    """Wait for the command's processes that outlived it (made ours by PR_SET_CHILD_SUBREAPER), so that their CPU
    time is in RUSAGE_CHILDREN."""
    deadline = time.monotonic() + REAP_S
    while time.monotonic() < deadline:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            time.sleep(0.05)
    sys.exit(f"startup_cost: a process of the run was still alive {REAP_S:.0f} s after it ended")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arms", default="plain,held,forked", help=f"comma-separated, the first the reference: {ARMS}")
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--out", type=Path, help="write the record here as JSON")
    args = ap.parse_args()
    arms = args.arms.split(",")
    if len(arms) < 2 or not set(arms) <= set(ARMS) or len(set(arms)) != len(arms):
        sys.exit(f"startup_cost: --arms {args.arms}: two or more of {', '.join(ARMS)}, each once")
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        sys.exit("startup_cost: cannot become a subreaper (Linux only): the forked workers' CPU would go uncounted")
    rows = []
    with tempfile.TemporaryDirectory(prefix="a3po-startup-") as work:
        for i in range(args.repeats):
            order = arms if i % 2 == 0 else arms[::-1]
            pair = {arm: one_run(arm, args.steps, Path(work)) for arm in order}
            rows.append(pair)
            print(f"repeat {i + 1}: " + ", ".join(f"{arm} {pair[arm]['cpu_s']:.2f} CPU-s ({pair[arm]['wall_s']:.1f} s "
                                                  f"wall)" for arm in arms), file=sys.stderr)
    keys = ("cpu_s", "wall_s", "trainer_gc_s", "worker_gc_s", "trainer_collections", "worker_collections")
    med = {arm: {k: round(statistics.median(r[arm][k] for r in rows), 3) for k in keys} for arm in arms}
    ratios = {}
    for arm in arms[1:]:
        per_repeat = [r[arm]["cpu_s"] / r[arms[0]]["cpu_s"] for r in rows]
        ratios[arm] = {"median": round(statistics.median(per_repeat), 3), "min": round(min(per_repeat), 3),
                       "max": round(max(per_repeat), 3)}
    record = {
        "command": f"PYTHONPATH=src python tools/startup_cost.py --arms {args.arms} --repeats {args.repeats} "
                   f"--steps {args.steps}",
        "machine": machine(),
        "commit": code_commit(),
        "arms": arms,
        "repeats": rows,
        "median": med,
        f"cpu_ratio_to_{arms[0]}": ratios,
    }
    print(f"a tiny {args.steps}-step run, median of {args.repeats}: " + ", ".join(
        f"{arm} {med[arm]['cpu_s']:.2f} CPU-s ({med[arm]['wall_s']:.1f} s wall)" for arm in arms) + "; " + ", ".join(
        f"{arm}/{arms[0]} {r['median']:.3f} (per-repeat {r['min']:.3f}..{r['max']:.3f})" for arm, r in ratios.items())
        + "; in the collector, trainer/worker: " + ", ".join(
        f"{arm} {med[arm]['trainer_gc_s']:.2f}/{med[arm]['worker_gc_s']:.2f} s" for arm in arms))
    if args.out:
        args.out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()

"""What holding the cycle collector back at start-up (a3po/startup.py) saves a short run, side by side.

    PYTHONPATH=src python tools/startup_cost.py [--repeats 4] [--steps 2] [--out FILE]

Each repeat runs the same tiny `a3po train` twice in fresh folders, arms alternated: as a3po starts
(`held`), and with startup.collector_held replaced by a block that does nothing in every process of the
command (`plain`, through a sitecustomize.py first on PYTHONPATH). A run is a trainer and its rollout
worker, almost all of whose CPU time on a small model is start-up, so this is the cost of every test that
starts a run. CPU seconds are the whole command's (trainer, worker, reward process: every process it
waited for); the ratio held/plain of each repeat's pair is reported with the medians. Where the difference
comes from: each process of both arms also counts its collections and the CPU seconds spent in them
(gc.callbacks), reported for the trainer and the rollout worker.
"""

from __future__ import annotations

import argparse
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

PLAIN = "import contextlib\nimport a3po.startup\na3po.startup.collector_held = contextlib.nullcontext\n"
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
    kind = "worker" if name.startswith("a3po-rollout") else "trainer" if "train" in sys.argv else "other"
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
    (cwd / "site" / "sitecustomize.py").write_text(COUNT + (PLAIN if arm == "plain" else ""))
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--out", type=Path, help="write the record here as JSON")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="a3po-startup-") as work:
        for i in range(args.repeats):
            order = ("plain", "held") if i % 2 == 0 else ("held", "plain")
            pair = {arm: one_run(arm, args.steps, Path(work)) for arm in order}
            rows.append(pair)
            print(f"repeat {i + 1}: plain {pair['plain']['cpu_s']:.2f} CPU-s ({pair['plain']['wall_s']:.1f} s wall), "
                  f"held {pair['held']['cpu_s']:.2f} CPU-s ({pair['held']['wall_s']:.1f} s wall)", file=sys.stderr)
    keys = ("cpu_s", "wall_s", "trainer_gc_s", "worker_gc_s", "trainer_collections", "worker_collections")
    med = {arm: {k: round(statistics.median(r[arm][k] for r in rows), 3) for k in keys} for arm in ("plain", "held")}
    ratios = [r["held"]["cpu_s"] / r["plain"]["cpu_s"] for r in rows]
    record = {
        "command": f"PYTHONPATH=src python tools/startup_cost.py --repeats {args.repeats} --steps {args.steps}",
        "machine": machine(),
        "commit": code_commit(),
        "repeats": rows,
        "median": med,
        "cpu_ratio_held_to_plain": {"median": round(statistics.median(ratios), 3), "min": round(min(ratios), 3),
                                    "max": round(max(ratios), 3)},
    }
    ratio = record["cpu_ratio_held_to_plain"]
    print(f"a tiny {args.steps}-step run, median of {args.repeats}: plain {med['plain']['cpu_s']:.2f} CPU-s, "
          f"held {med['held']['cpu_s']:.2f} CPU-s; held/plain {ratio['median']:.3f} "
          f"(per-repeat {ratio['min']:.3f}..{ratio['max']:.3f}); in the collector: the trainer "
          f"{med['plain']['trainer_gc_s']:.2f} s -> {med['held']['trainer_gc_s']:.2f} s, the worker "
          f"{med['plain']['worker_gc_s']:.2f} s -> {med['held']['worker_gc_s']:.2f} s")
    if args.out:
        args.out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()

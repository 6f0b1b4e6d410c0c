"""What holding the cycle collector back at start-up (a3po/startup.py) saves a short run, side by side.

    PYTHONPATH=src python tools/startup_cost.py [--repeats 4] [--steps 2] [--out FILE]

Each repeat runs the same tiny `a3po train` twice in fresh folders, arms alternated: as a3po starts
(`held`), and with startup.collector_held replaced by a block that does nothing in every process of the
command (`plain`, through a sitecustomize.py first on PYTHONPATH). A run is a trainer and its rollout
worker, almost all of whose CPU time on a small model is start-up, so this is the cost of every test that
starts a run. CPU seconds are the whole command's (trainer, worker, reward process: every process it
waited for); the ratio held/plain of each repeat's pair is reported with the medians.
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


def one_run(arm: str, steps: int, work: Path) -> dict[str, float]:
    """One tiny run of `arm` in a fresh folder under `work`: its wall and CPU seconds."""
    cwd = Path(tempfile.mkdtemp(dir=work))
    env = {**os.environ, "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
    if arm == "plain":
        (cwd / "site").mkdir()
        (cwd / "site" / "sitecustomize.py").write_text(PLAIN)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(cwd / "site"), env.get("PYTHONPATH")) if p)
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
    return {"wall_s": round(wall, 2), "cpu_s": round(cpu, 2)}


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
    med = {arm: {k: round(statistics.median(r[arm][k] for r in rows), 2) for k in ("cpu_s", "wall_s")}
           for arm in ("plain", "held")}
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
          f"(per-repeat {ratio['min']:.3f}..{ratio['max']:.3f})")
    if args.out:
        args.out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()

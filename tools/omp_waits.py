"""Why the suite sets OMP_WAIT_POLICY=PASSIVE: small torch ops in processes that share the cores, timed
with OpenMP's default waits and with passive ones, side by side in one run.

    PYTHONPATH=src python tools/omp_waits.py [--procs 2] [--threads 2] [--iters 3000] [--repeats 2] [--out FILE]

Each round starts --procs processes at once under one policy, each with --threads torch threads, each
running the sampler's kind of work (a softmax over 700 logits and a 64 x 256 matmul) --iters times; the
round's time is the slowest process's loop. The policies alternate over --repeats rounds. With more
threads in all than cores, an OpenMP thread that spins at a barrier waiting for a descheduled peer keeps
its core from that peer: the default policy's time grows with the oversubscription, the passive one's
does not. --out writes the rounds, the machine and the commit as JSON (docs/results/omp-waits/).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

WORK = """
import sys, time, torch
torch.set_num_threads({threads})
x, a, b = torch.randn(700), torch.randn(64, 256), torch.randn(256, 256)
torch.softmax(x, -1); a @ b  # the first call of each op sets up its kernels
start = time.perf_counter()
for _ in range({iters}):
    torch.softmax(x, -1)
    a @ b
print(time.perf_counter() - start)
"""
POLICIES = {"default": None, "passive": "PASSIVE"}


def round_s(policy: str | None, procs: int, threads: int, iters: int) -> float:
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if policy:
        env["OMP_WAIT_POLICY"] = policy
    code = WORK.format(threads=threads, iters=iters)
    ps = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
          for _ in range(procs)]
    outs = [p.communicate(timeout=1800)[0] for p in ps]
    if any(p.returncode for p in ps):
        raise SystemExit(f"a timed process failed under OMP_WAIT_POLICY={policy or 'unset'}")
    return max(float(o.split()[-1]) for o in outs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--procs", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--iters", type=int, default=3000)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    from a3po.machine import code_commit, machine

    rounds = []
    load_before = os.getloadavg()[0]
    for r in range(args.repeats):
        order = list(POLICIES) if r % 2 == 0 else list(reversed(POLICIES))
        for name in order:
            s = round_s(POLICIES[name], args.procs, args.threads, args.iters)
            rounds.append({"repeat": r + 1, "policy": name, "s": round(s, 3)})
            print(f"round {r + 1}: {name:8s} {s:8.2f} s", flush=True)
    med = {name: statistics.median(x["s"] for x in rounds if x["policy"] == name) for name in POLICIES}
    ratio = med["default"] / med["passive"]
    print(f"median: default {med['default']:.2f} s, passive {med['passive']:.2f} s; default / passive {ratio:.1f}x "
          f"({args.procs} processes x {args.threads} threads on {os.cpu_count()} cores, {args.iters} iterations)")
    if args.out:
        record = {"command": "PYTHONPATH=src python tools/omp_waits.py " + " ".join(sys.argv[1:]),
                  "machine": machine(), "code_commit": code_commit(), "date": time.strftime("%Y-%m-%d"),
                  "procs": args.procs, "threads": args.threads, "iters": args.iters,
                  "load_before": round(load_before, 2), "load_after": round(os.getloadavg()[0], 2),
                  "rounds": rounds, "median_s": {k: round(v, 3) for k, v in med.items()}}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()

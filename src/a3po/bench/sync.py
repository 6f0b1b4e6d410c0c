"""`a3po bench sync`: what publishing one version of the weights costs, per transport, side by side.

The trainer publishes after every step and waits for it (`perf/weight_sync_s`); a worker
then reads the version into its own model between two decode steps. Both halves are
timed here for the model's full fp32 state, on this machine, with the transports
alternated inside each repeat:

  shm           the local launcher's: copy into the spare one of two shared-memory buffers
                (sync/shm.py); the reader is a spawned process handed both when it started
  object store  the Ray launcher's: `ray.put` of a new object per version
                (sync/object_store.py); the reader is a Ray actor on this node that gets
                the reference, maps the object and copies it

Reading means copying into the reader's own fp32 copy of the weights, which is what a
rollout engine's load does after it has the tensors. Across nodes an object-store read also
moves the model's bytes over the network once per worker per version (the record gives the
byte count; divide by the link's bandwidth).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import time
from dataclasses import asdict
from pathlib import Path

import torch

from a3po.bench.args import SyncBenchArgs
from a3po.bench.common import print_report, progress, save_report, spread
from a3po.machine import machine, machine_line


def _copy_into(own: dict, tensors: dict) -> None:
    with torch.no_grad():
        for k, v in tensors.items():
            own[k].copy_(v)


def _shm_reader(given, conn) -> None:
    """A spawned process holding the shared buffers, as a local rollout worker does: time each read."""
    torch.set_num_threads(1)
    own = {k: v.clone() for k, v in given.take().items()}
    while (version := conn.recv()) is not None:
        t0 = time.perf_counter()
        _copy_into(own, version.tensors(given))
        conn.send(time.perf_counter() - t0)


class _StoreReader:
    """A Ray actor standing for a rollout worker of the Ray launcher: time each read of a published version."""

    def __init__(self, shapes: dict):
        torch.set_num_threads(1)
        self.own = {k: torch.empty(s) for k, s in shapes.items()}

    def read(self, version) -> float:
        t0 = time.perf_counter()
        _copy_into(self.own, version.tensors())
        return time.perf_counter() - t0


def run(args: SyncBenchArgs) -> dict:
    import ray

    from a3po.files import unique_dir
    from a3po.models import load_policy
    from a3po.sync import SharedWeights
    from a3po.sync.object_store import ObjectStoreWeights

    torch.set_num_threads(1)
    out = unique_dir(Path(args.out))
    model, _ = load_policy(args.model, dtype=torch.float32, seed=0)
    state = {k: v.detach() for k, v in model.state_dict().items()}
    nbytes = sum(v.numel() * 4 for v in state.values())
    progress(f"bench sync: {args.model}, {len(state)} tensors, {nbytes / 1e6:.0f} MB fp32, {args.repeats} repeats; "
             f"writing to {out}")

    shm = SharedWeights(state)
    parent, child = mp.get_context("spawn").Pipe()
    reader = mp.get_context("spawn").Process(target=_shm_reader, args=(shm.at_start(), child), daemon=True)
    reader.start()
    t0 = time.perf_counter()
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="WARNING")
    ray_start_s = time.perf_counter() - t0
    samples = {t: {"publish": [], "read": []} for t in ("shm", "object store")}
    try:
        store = ObjectStoreWeights(state)
        actor = ray.remote(_StoreReader).options(num_cpus=1).remote({k: tuple(v.shape) for k, v in state.items()})
        ray.get(actor.read.remote(store.for_load()), timeout=300)  # warm-up: the actor's start, the first map
        for rep in range(args.repeats):
            for name in samples:
                bumped = {k: v + (rep + 1) * 1e-3 if v.is_floating_point() else v for k, v in state.items()}
                t0 = time.perf_counter()
                if name == "shm":
                    shm.publish(bumped)
                    publish = time.perf_counter() - t0
                    parent.send(shm.for_load())
                    if not parent.poll(300):
                        raise RuntimeError("the shared-memory reader did not answer within 300 s")
                    read = parent.recv()
                else:
                    store.publish(bumped)
                    publish = time.perf_counter() - t0
                    read = ray.get(actor.read.remote(store.for_load()), timeout=300)
                samples[name]["publish"].append(publish)
                samples[name]["read"].append(read)
                progress(f"  {name:<12} repeat {rep + 1}/{args.repeats}: publish {publish:.3f} s, read {read:.3f} s")
    finally:
        parent.send(None)
        reader.join(10)
        if reader.is_alive():
            reader.kill()
        ray.shutdown()

    shm_publish = statistics.median(samples["shm"]["publish"])
    rows = [{"transport": name, **spread(s["publish"], "publish"), **spread(s["read"], "read"),
             "publish_vs_shm": statistics.median(s["publish"]) / shm_publish} for name, s in samples.items()]
    record = {"benchmark": "sync", "model": args.model, "bytes": nbytes, "machine": machine(),
              "torch": torch.__version__, "ray": ray.__version__, "ray_start_s": ray_start_s,
              "loadavg_1m": os.getloadavg()[0], "args": asdict(args), "rows": rows}
    save_report(out, "sync", record, markdown(record))
    return record


def markdown(r: dict) -> str:
    lines = [
        f"### Weight publication per version, `{r['model']}` ({r['bytes'] / 1e6:.0f} MB fp32)",
        "",
        f"{machine_line(r['machine'])}; torch {r['torch']}, Ray {r['ray']} (local instance, started in "
        f"{r['ray_start_s']:.1f} s); median of {r['args']['repeats']} repeats, transports alternated; "
        f"one thread each side; load average {r['loadavg_1m']:.2f}.",
        "",
        "| transport | trainer: publish (s) | min..max | worker: read into its model (s) | min..max "
        "| publish / shm |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for x in r["rows"]:
        lines.append(f"| {x['transport']} | {x['publish_median_s']:.3f} | {x['publish_min_s']:.3f}.."
                     f"{x['publish_max_s']:.3f} | {x['read_median_s']:.3f} | {x['read_min_s']:.3f}.."
                     f"{x['read_max_s']:.3f} | {x['publish_vs_shm']:.2f}x |")
    lines += ["", f"Across nodes an object-store read also moves {r['bytes'] / 1e6:.0f} MB per worker per version "
                  f"over the network ({r['bytes'] * 8 / 10e9:.2f} s at 10 Gbit/s)."]
    return "\n".join(lines) + "\n"


def main(args: SyncBenchArgs) -> int:
    record = run(args)
    print_report("sync", record, markdown(record))
    return 0

"""The Ray launcher (cluster.launcher=ray): trainer ranks 1..N-1 and the rollout workers as Ray actors.

Rank 0 stays in the `a3po train` process (the Ray driver), with the controller, admission,
evaluation and checkpoints, exactly as with the local launcher. Every other process is an
actor in one placement group that reserves, per actor, the CPUs (and GPU) it will use, so
the run starts only once the cluster can hold all of it (`cluster.ray_placement` spreads
or packs the bundles over nodes). Weights reach the workers through Ray's object store
(sync/object_store.py): it crosses machines, and a published version is never overwritten.

Each actor runs one function, the one a local process would run, on a thread of its own,
and is seen by the trainer through multiprocessing.Process's interface (`RayProcess`).
A worker's inbox and outbox are queues inside its actor, reached through actor calls:
calls to a threaded actor may run out of order, so inbox messages carry a sequence number
and the actor hands them to the worker in the order they were sent. A killed actor (its
process or node gone) makes every call on it fail: the trainer's reader sees that as the
end of file a dead local process gives, and the worker is replaced the same way.

A trainer rank reaches rank 0 at the driver's node address (torch.distributed, gloo or
NCCL); with several network interfaces, GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME pick one.
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import threading
from collections import deque

import ray
from ray.exceptions import GetTimeoutError, RayError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from a3po import signals
from a3po.config import Config, ConfigError
from a3po.config.choices import AUTO, Device
from a3po.launch.local import WorkerChannels
from a3po.sync.object_store import ObjectStoreWeights

CONNECT_S = 10.0  # to open a connection to the head before ray.init
TAKE_S = 1.0  # how long one call for a worker's messages waits inside the actor
CALL_S = 60.0  # deadline of that call; past it the reader keeps waiting on it (a hung actor is the heartbeat's job)


class _Host:
    """The inside of an actor: one function on a thread, and the worker's inbox and outbox."""

    def __init__(self, name: str):
        self.name = name
        self.inbox: queue.Queue = queue.Queue()
        self.outbox: queue.Queue = queue.Queue()
        self._early: dict[int, object] = {}  # inbox messages that overtook one sent before them
        self._next = 0
        self._lock = threading.Lock()

    def __repr__(self) -> str:  # Ray prefixes the actor's printed lines with it
        return self.name

    def run(self, target, args: tuple, channels: bool) -> int:
        if channels:
            return 0 if target(*args, self.inbox, self) else 1
        return target(*args)

    def send(self, msg) -> None:  # the worker's outbox (worker.Outbox calls .send)
        self.outbox.put(msg)

    def put(self, seq: int, msg) -> None:
        with self._lock:
            self._early[seq] = msg
            while self._next in self._early:
                self.inbox.put(self._early.pop(self._next))
                self._next += 1

    def take(self, timeout: float) -> list:
        try:
            out = [self.outbox.get(timeout=timeout)]
        except queue.Empty:
            return []
        while True:
            try:
                out.append(self.outbox.get_nowait())
            except queue.Empty:
                return out


@ray.remote
class RolloutWorker(_Host):
    pass


@ray.remote
class TrainerRank(_Host):
    pass


class RayProcess:
    """A Ray actor running one function, with the parts of multiprocessing.Process the trainer uses.
    `exitcode` is the function's return value, or -9 (SIGKILL) for an actor that died: killed, its
    node lost, or ended by Ray's out-of-memory monitor."""

    def __init__(self, cls, name: str, target, args: tuple, options: dict, channels: bool = False):
        self.name, self._cls, self._target, self._args, self._options = name, cls, target, args, options
        self._channels = channels
        self.actor = self._ref = None

    @property
    def pid(self):  # multiprocessing's sign of a started process; the actor id stands in for it
        return None if self.actor is None else self.actor._actor_id.hex()

    def start(self) -> None:
        self.actor = self._cls.options(max_concurrency=4, **self._options).remote(self.name)
        self._ref = self.actor.run.remote(self._target, self._args, self._channels)

    def is_alive(self) -> bool:
        return self._ref is not None and not ray.wait([self._ref], timeout=0)[0]

    def join(self, timeout: float | None = None) -> None:
        if self._ref is not None:
            ray.wait([self._ref], timeout=timeout)

    @property
    def exitcode(self) -> int | None:
        if self._ref is None or self.is_alive():
            return None
        try:
            return int(ray.get(self._ref) or 0)
        except ray.exceptions.RayActorError:
            return -9
        except RayError:
            return 1

    def kill(self) -> None:
        if self.actor is not None:
            ray.kill(self.actor, no_restart=True)

    terminate = kill  # an actor has no polite stop; a worker that read Stop has returned already


class _Inbox:
    """A worker actor's inbox as the pool sees it: `put` in order, from any thread."""

    def __init__(self, proc: RayProcess):
        self._proc, self._seq, self._lock = proc, 0, threading.Lock()

    def put(self, msg) -> None:
        with self._lock:
            self._proc.actor.put.remote(self._seq, msg)
            self._seq += 1

    def cancel_join_thread(self) -> None:
        pass

    def close(self) -> None:
        pass


class _Reader:
    """A worker actor's messages, one `recv` at a time; EOFError once the actor is gone."""

    def __init__(self, proc: RayProcess):
        self._proc, self._buffer, self._call = proc, deque(), None

    def recv(self):
        while not self._buffer:
            if self._call is None:
                self._call = self._proc.actor.take.remote(TAKE_S)
            try:
                self._buffer.extend(ray.get(self._call, timeout=CALL_S))
            except GetTimeoutError:
                continue
            except RayError as e:
                raise EOFError(str(e).splitlines()[0] if str(e) else type(e).__name__) from None
            self._call = None
        return self._buffer.popleft()


def _follow(*args) -> int:
    """A trainer rank inside its actor: Ray shows an actor only the GPU it reserved, as cuda:0."""
    from a3po.trainer.ranks import follow

    os.environ.setdefault("LOCAL_RANK", "0")
    return follow(*args)


def _check_reachable(address: str, where: str) -> None:
    """A head that does not answer is one line within CONNECT_S: ray.init itself retries for minutes."""
    if "://" in address or ":" not in address:  # ray://... (Ray Client), auto, local
        return
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=CONNECT_S).close()
    except (OSError, ValueError) as e:
        raise ConfigError(f"cluster.launcher=ray: nothing answers at {address} ({e}); start the head with "
                          "`ray start --head --port PORT`, or fix cluster.ray_address / RAY_ADDRESS") from None


class RayLauncher:
    name = "ray"

    def __init__(self, cfg: Config, followers: int, per_worker: int, trainer_threads: int):
        c = cfg.cluster
        # not Ray's own default: it would join whatever cluster this machine last started, even a dead one
        address = c.ray_address or os.environ.get("RAY_ADDRESS") or "local"
        where = "a Ray instance started for this run" if address == "local" else f"the Ray cluster at {address}"
        _check_reachable(address, where)
        # an instance of its own holds what the run asks for, as the local launcher would start it regardless
        cpus = max(os.cpu_count() or 1, followers * trainer_threads + cfg.rollout.n_workers * per_worker)
        try:
            ray.init(address=address, include_dashboard=False, logging_level=logging.WARNING,
                     log_to_driver=True, configure_logging=True, **({"num_cpus": cpus} if address == "local" else {}))
        except (ConnectionError, RuntimeError, ValueError) as e:
            raise ConfigError(f"cluster.launcher=ray: cannot reach {where} ({' '.join(str(e).split())[:200]}); "
                              "start one with `ray start --head`, or fix cluster.ray_address / RAY_ADDRESS") from None
        signals.install()  # ray.init replaced the SIGTERM handler with one that exits on the spot
        self.where = where
        have = ray.cluster_resources()
        on_gpu = lambda device: int(device.startswith(Device.CUDA) or (device == AUTO and have.get("GPU", 0) > 0))
        gpu_rank, gpu_worker = on_gpu(cfg.actor.device), on_gpu(cfg.rollout.device)
        bundles = ([{"CPU": trainer_threads, **({"GPU": gpu_rank} if gpu_rank else {})}] * followers
                   + [{"CPU": per_worker, **({"GPU": gpu_worker} if gpu_worker else {})}] * cfg.rollout.n_workers)
        self._followers, self._bundles = followers, bundles
        need = {k: sum(b.get(k, 0) for b in bundles) for k in ("CPU", "GPU")}
        short = [f"{need[k]:g} {k} (it has {have.get(k, 0):g})" for k in need if need[k] > have.get(k, 0)]
        if short:
            self.close()
            raise ConfigError(f"cluster.launcher=ray: {where} is too small: the actors need {', '.join(short)}; "
                              "add nodes, or lower rollout.n_workers, rollout.torch_threads or cluster.n_trainer_ranks "
                              "(Ray counts logical CPUs: `ray start --num-cpus N` declares N)")
        self._group = placement_group(bundles, strategy=c.ray_placement, name="a3po")
        try:
            ray.get(self._group.ready(), timeout=c.timeout_s)
        except GetTimeoutError:
            self.close()
            other = "" if c.ray_placement == "PACK" else ", or try cluster.ray_placement=PACK"
            raise ConfigError(f"cluster.launcher=ray: {where} could not place {len(bundles)} actors "
                              f"({bundles}) with strategy {c.ray_placement} within {c.timeout_s:g}s "
                              f"(cluster.timeout_s): each must fit on one node; add nodes or larger ones{other}"
                              ) from None
        self._procs: list[RayProcess] = []

    def host(self) -> str:
        return ray.util.get_node_ip_address()

    def weights(self, state) -> ObjectStoreWeights:
        return ObjectStoreWeights(state)

    def _place(self, bundle: int) -> dict:
        b = self._bundles[bundle]
        where = PlacementGroupSchedulingStrategy(self._group, placement_group_bundle_index=bundle)
        return {"num_cpus": b["CPU"], "num_gpus": b.get("GPU", 0), "scheduling_strategy": where}

    def worker(self, worker_id: int, args: tuple) -> WorkerChannels:
        from a3po.rollout.worker import serve

        proc = RayProcess(RolloutWorker, f"a3po-rollout-{worker_id}", serve, (worker_id, *args),
                          self._place(self._followers + worker_id), channels=True)
        self._procs.append(proc)
        return WorkerChannels(proc, _Inbox(proc), _Reader(proc))

    def follower(self, rank: int, args: tuple) -> RayProcess:
        proc = RayProcess(TrainerRank, f"a3po-rank-{rank}", _follow, args, self._place(rank - 1))
        self._procs.append(proc)
        return proc

    def close(self) -> None:
        """Every actor of the run, its placement group, and (when it started one) the Ray instance end here."""
        for p in getattr(self, "_procs", []):
            try:
                p.kill()
            except RayError:
                pass
        if getattr(self, "_group", None) is not None:
            remove_placement_group(self._group)
        ray.shutdown()

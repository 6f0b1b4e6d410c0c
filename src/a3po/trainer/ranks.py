"""Trainer ranks: build the same engine on every rank, start ranks 1..N-1 and end them.

`a3po train cluster.n_trainer_ranks=N` has the run's launcher start N - 1 followers
(`start_followers`): processes on this machine, or Ray actors; under torchrun each rank is
already a process, WORLD_SIZE and RANK say which, and every rank but 0 becomes a follower
in `train()` (`torchrun_rank`). A follower
builds the engine rank 0 builds, from the same configuration, and runs rank 0's commands
(trainer/parallel.py) until rank 0 says stop, dies, or ends it.
"""

from __future__ import annotations

import os
import re
import sys

import torch

from a3po import child, signals, startup
from a3po.algo.filters import SamplingFilter
from a3po.config import Config, ConfigError
from a3po.devices import resolve_device
from a3po.trainer import parallel

JOIN_S = 30.0  # a follower told to stop ends at once; this is the deadline before it is killed


def build_engine(cfg: Config, model, device: torch.device, dp: parallel.DataParallel | None):
    """The training engine on `model` (as `load_policy(cfg.actor.path, seed=cfg.seed)` gave it), the same on
    every rank; `dp` None for one process."""
    from a3po.trainer.engine import TrainEngine

    torch.manual_seed(cfg.seed)
    total_opt_steps = cfg.total_train_steps * cfg.actor.ppo_n_minibatches
    g = cfg.gconfig
    return TrainEngine(model, cfg.actor, total_opt_steps, temperature=g.temperature, device=device,
                       ranks=dp if dp is not None else parallel.OneProcess(),
                       sampling=SamplingFilter(g.top_k, g.top_p, g.min_p))


def rank_device(name: str, rank: int) -> torch.device:
    """actor.device for one rank: an unnumbered `cuda` means one GPU per rank, cuda:<local rank>."""
    device = resolve_device(name, "actor.device")
    if device.type == "cuda" and ":" not in name:
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    return device


def check_rank_gpus(name: str, world: int, gpus: int) -> None:
    """Ranks this machine starts with an unnumbered `cuda` (or `auto` on a GPU) take cuda:0..world-1, so
    that many GPUs must be visible; NCCL cannot put two ranks on one GPU. Checked before any rank starts,
    or the missing ordinal surfaces inside a follower while rank 0 waits for it at the rendezvous."""
    if world > 1 and ":" not in name and gpus > 0 and gpus < world:
        raise ConfigError(f"cluster.n_trainer_ranks={world} with actor.device={name} takes one GPU per rank, but "
                          f"torch sees {gpus}; set cluster.n_trainer_ranks={gpus}, make more GPUs visible "
                          f"(CUDA_VISIBLE_DEVICES) or train on actor.device=cpu")


def torchrun_rank() -> tuple[int, int]:
    """(rank, world size) that torchrun gave this process; (0, 1) outside torchrun."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def world_size(cfg: Config) -> tuple[int, bool]:
    """(trainer ranks, whether torchrun started them): torchrun's WORLD_SIZE where it is set, else
    cluster.n_trainer_ranks, which `a3po train` starts itself."""
    if "WORLD_SIZE" in os.environ:
        return torchrun_rank()[1], True
    return cfg.cluster.n_trainer_ranks, False


def follow(cfg: Config, rank: int, world: int, addr: str | None, port: int | None, threads: int) -> int:
    """A follower's whole life; its exit code. Errors are rank 0's to report: a follower only ends."""
    torch.set_num_threads(threads)
    device = rank_device(cfg.actor.device, rank)
    try:
        with startup.collector_held():
            from a3po.models import load_policy

            model, _ = load_policy(cfg.actor.path, seed=cfg.seed)
            dp = parallel.init(rank, world, cfg.cluster.data_parallel, cfg.cluster.timeout_s, device, addr=addr,
                               port=port)
            engine = build_engine(cfg, model, device, dp)
        dp.follow(follower_commands(engine))
        return 0
    except Exception as e:  # rank 0 gone, or the same error rank 0 met and reports
        print(f"a3po: trainer rank {rank} stopped: {' '.join(str(e).splitlines())[:300]}", file=sys.stderr)
        return 1
    finally:
        parallel.close()


def lost_rank(error: BaseException) -> str | None:
    """What to tell the user when `error` is a collective that failed because another rank is gone (killed,
    out of memory, its machine down), or None for any other error: that one is not about the ranks."""
    import torch.distributed as dist

    text = " ".join(str(error).split())
    if isinstance(error, dist.DistBackendError) or (
            isinstance(error, RuntimeError) and any(w in text for w in ("gloo", "NCCL", "Connection closed",
                                                                        "Connection reset"))):
        cause = re.sub(r"^\[[^\]]*\] ", "", text).split(". ")[0]  # gloo prefixes its source file and line
        return f"a trainer rank stopped answering ({cause[:160]})"
    return None


def follower_main(cfg: Config, rank: int, world: int, addr: str, port: int, threads: int) -> None:
    """A follower in a process of its own on this machine (launch/local.py)."""
    child.take_signals()
    child.name_process(f"a3po-rank-{rank}")
    child.exit_when_orphaned()
    sys.exit(follow(cfg, rank, world, addr, port, threads))


def start_followers(launcher, cfg: Config, world: int, addr: str, port: int, threads: int) -> list:
    procs = [launcher.follower(r, (cfg, r, world, addr, port, threads)) for r in range(1, world)]
    with signals.blocked_in_children():
        for p in procs:
            p.start()
    return procs


def end_followers(procs: list, dp: parallel.DataParallel | None, finished: bool) -> None:
    """After a finished run, tell them to stop and wait; otherwise (an error, a signal) they may be inside
    a collective rank 0 left, so they are ended outright. Either way none outlives `JOIN_S`."""
    if finished and dp is not None:
        dp.stop()
    for p in procs:
        if not finished:
            p.terminate()
        p.join(JOIN_S)
        if p.is_alive():
            p.kill()
            p.join()


def follower_commands(engine) -> dict:
    """What rank 0 announces, by name: a training step and the collective parts of save and load."""
    from a3po.trainer.checkpoint import load_engine, save_engine

    return {"ppo_update": engine.ppo_update,
            "save": lambda directory, tokenizer=None: save_engine(engine, directory, tokenizer),
            "load": lambda directory: load_engine(engine, directory)}

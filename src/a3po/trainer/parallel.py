"""How the trainer's work is split over processes: `OneProcess`, or `DataParallel` over N ranks.

Both are `Ranks`, the one interface the engine's update calls (share of the batch, passes,
gradient sync, loss scale, the end of a step, checkpoint state), so the update has no branch
for data parallelism: the one-process version does the least each method asks.

Data-parallel training: N trainer ranks over torch.distributed, each on its share of a step's batch.

Rank 0 is `a3po train` itself: it runs the rollout workers, advantages, evaluation, logging
and checkpoint files exactly as a one-process run does. Ranks 1..N-1 only train: they wait
for rank 0's next command (`follow`) and run the same engine method on the same arguments,
so every collective inside it (FSDP2's gathers, DDP's all-reduce, the statistics gather)
meets its partners. Commands travel on a process group of their own with no deadline worth
the name, because a follower idles for as long as rank 0 evaluates or waits on rollout;
it still learns at once when rank 0 dies, as the connection closes. The training
collectives use `cluster.timeout_s`.

How a step's work is split, so that N ranks compute the one-process update:
  - every rank gets the whole batch and takes the rows `i % N == rank` of each minibatch;
  - each row's loss keeps the whole minibatch's normalisers (its token and sequence
    counts), so the ranks' losses sum to the one-process loss; DDP and FSDP2 average
    gradients over ranks, hence each rank scales its loss by N;
  - ranks form micro-batches from their own rows, so their counts may differ; a rank with
    fewer runs extra passes whose loss is multiplied by 0, because under FSDP2 every
    forward is a collective and all ranks must run the same number.
"""

from __future__ import annotations

import copy
import os
import socket
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from datetime import timedelta
from typing import Protocol

import torch
import torch.distributed as dist

from a3po.config.choices import DpMode

COMMAND_TIMEOUT = timedelta(days=7)  # a follower waits as long as rank 0 lives (see the module docstring)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class Pass:
    """One forward pass (and, in training, its backward) of a micro-batch on this rank."""

    rows: list[int]  # the batch rows it runs
    loss_scale: float  # what backward multiplies its loss by: the rank count, 0 for a filler pass
    counts: bool  # False for a filler pass that only keeps the ranks in step: its outputs are dropped


# What `Ranks.finish_step` hands the step's statistics: every rank's micro-batch records and the time
# the ranks took to bring them and the new weights to rank 0 ({} in one process).
Report = Callable[[list, dict[str, float]], dict[str, float]]


class Ranks(Protocol):
    """The processes a training step runs on, as the engine sees them."""

    world: int  # how many ranks train

    @property
    def leader(self) -> bool:
        """Whether this process is rank 0: the one that publishes, evaluates, logs and writes checkpoints."""

    def announce(self, name: str, *args) -> None:
        """Rank 0: the other ranks are to run their command `name` on `args` now, as rank 0 is about to."""

    def wrap(self, policy):
        """The policy as this rank trains it."""

    def whole_copy(self, model):
        """The whole model rank 0 publishes, samples from and saves (None on other ranks)."""

    def share(self, rows: list[int]) -> list[int]:
        """This rank's rows of a minibatch."""

    def passes(self, groups: list[list[int]], filler: list[int]) -> list[Pass]:
        """The passes this rank runs for its micro-batches `groups`; `filler` rows stand in for a pass it has
        not got but must run to keep in step with the others."""

    def sync_grads(self, policy, last: bool) -> AbstractContextManager:
        """Around a micro-batch's backward: whether gradients are reduced across ranks there."""

    def alone(self, check: Callable[[], None]) -> None:
        """Run a check that only this rank could fail."""

    def finish_step(self, policy, whole, pieces: list, report: Report) -> dict[str, float]:
        """After a step's last optimizer step: the new weights into rank 0's whole copy, and the statistics,
        `report` of every rank's `pieces`, on rank 0 ({} on the others)."""

    def optimizer_state(self, policy, optimizer) -> dict:
        """The optimizer state a checkpoint holds (a collective among ranks; empty off rank 0)."""

    def load(self, policy, optimizer, whole, weights: dict[str, torch.Tensor], optim_state: dict) -> None:
        """A checkpoint's weights and optimizer state, read by every rank, into this rank's model, optimizer
        and whole copy."""


class OneProcess:
    """The trainer alone: the whole batch, every pass counts, nothing to synchronise."""

    world = 1
    leader = True

    def announce(self, name: str, *args) -> None:
        pass

    def wrap(self, policy):
        return policy

    def whole_copy(self, model):
        return model

    def share(self, rows: list[int]) -> list[int]:
        return rows

    def passes(self, groups: list[list[int]], filler: list[int]) -> list[Pass]:
        return [Pass(g, 1, True) for g in groups]

    def sync_grads(self, policy, last: bool) -> AbstractContextManager:
        return nullcontext()

    def alone(self, check: Callable[[], None]) -> None:
        check()

    def finish_step(self, policy, whole, pieces: list, report: Report) -> dict[str, float]:
        return report(pieces, {})  # `whole` is the model itself: nothing to copy

    def optimizer_state(self, policy, optimizer) -> dict:
        return optimizer.state_dict()

    def load(self, policy, optimizer, whole, weights: dict[str, torch.Tensor], optim_state: dict) -> None:
        optimizer.load_state_dict(optim_state)
        whole.load_state_dict(weights, strict=False)


@dataclass
class DataParallel:
    """N ranks over torch.distributed, one of them this process (see the module docstring)."""

    rank: int
    world: int
    mode: str  # cluster.data_parallel: DpMode.FSDP2 or DpMode.DDP
    device: torch.device
    commands: object  # the process group commands travel on

    @property
    def leader(self) -> bool:
        return self.rank == 0

    # -- the model ---------------------------------------------------------------------------

    def wrap(self, policy):
        """The policy (train/logprobs.PolicyLogp) as this rank holds it: replicated (ddp), or each decoder
        layer and the rest (embedding, final norm, head) sharded in units of their own (fsdp2)."""
        if self.mode == DpMode.DDP:
            on_gpu = [self.device] if self.device.type == "cuda" else None
            return torch.nn.parallel.DistributedDataParallel(policy, device_ids=on_gpu, broadcast_buffers=False)
        from torch.distributed.fsdp import fully_shard

        for layer in _decoder_layers(policy.model):
            fully_shard(layer)
        fully_shard(policy)
        return policy

    def whole_copy(self, model):
        """Rank 0 keeps the whole model besides its shard, refreshed after every step (`finish_step`)."""
        return copy.deepcopy(model) if self.leader else None

    def full_state_dict(self, model) -> dict[str, torch.Tensor]:
        """Every weight in full, on the CPU, on rank 0 (empty elsewhere): a collective."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(_inner(model), options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def optimizer_state(self, policy, optimizer) -> dict:
        """The optimizer state keyed by parameter name, in full, on rank 0: a collective."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        return get_optimizer_state_dict(_inner(policy), optimizer,
                                        options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def load(self, policy, optimizer, whole, weights: dict[str, torch.Tensor], optim_state: dict) -> None:
        """Full weights (the model's names) and optimizer state (as `optimizer_state` returned it), read by
        every rank, into the shards, and on rank 0 into its whole copy."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        opts = StateDictOptions(full_state_dict=True, strict=False)
        set_model_state_dict(_inner(policy), {f"model.{k}": t for k, t in weights.items()}, options=opts)
        set_optimizer_state_dict(_inner(policy), optimizer, optim_state, options=opts)
        if whole is not None:
            whole.load_state_dict(weights, strict=False)

    # -- the work ----------------------------------------------------------------------------

    def share(self, rows: list[int]) -> list[int]:
        return rows[self.rank::self.world]

    def passes(self, groups: list[list[int]], filler: list[int]) -> list[Pass]:
        """`groups` plus filler passes up to the most any rank has: under FSDP2 every forward of the
        policy is a collective, and DDP reduces on each rank's last backward, so every rank runs
        as many passes (a filler runs `filler`, and its loss counts 0). Each counting loss is
        scaled by N because DDP and FSDP2 average the ranks' gradients."""
        own = [Pass(g, self.world, True) for g in groups]
        return own + [Pass(filler, 0, False)] * (self._most(len(groups)) - len(groups))

    def sync_grads(self, policy, last: bool) -> AbstractContextManager:
        """Gradients are reduced across ranks on the last micro-batch of a minibatch only."""
        if self.mode == DpMode.DDP:
            return nullcontext() if last else policy.no_sync()
        policy.set_requires_gradient_sync(last)
        return nullcontext()

    def alone(self, check: Callable[[], None]) -> None:
        """Skipped: a rank that raised alone would leave the others waiting in the next collective. What
        such a check finds (a loss that is not finite) shows in the gradient norm, alike on every rank."""

    def finish_step(self, policy, whole, pieces: list, report: Report) -> dict[str, float]:
        t0 = time.perf_counter()
        full = self.full_state_dict(policy)
        gathered = self._gather(pieces)
        if not self.leader:
            return {}
        whole.load_state_dict({k.removeprefix("model."): t for k, t in full.items()})
        every = [p for rank in gathered for p in rank]
        # the whole model to rank 0, and the statistics
        return report(every, {"perf/ranks_sync_s": time.perf_counter() - t0})

    def _most(self, n: int) -> int:
        """The largest `n` over the ranks."""
        t = torch.tensor([n], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t)

    def _gather(self, obj) -> list | None:
        """Every rank's `obj`, in rank order, on rank 0 (None elsewhere)."""
        out = [None] * self.world if self.leader else None
        dist.gather_object(obj, out, dst=0)
        return out

    # -- commands from rank 0 ----------------------------------------------------------------

    def announce(self, name: str, *args) -> None:
        """Rank 0: the followers are to run their command `name` on `args` now, as rank 0 is about to."""
        if self.leader:
            dist.broadcast_object_list([(name, args)], src=0, group=self.commands)

    def stop(self) -> None:
        self.announce("stop")

    def follow(self, commands: dict[str, Callable[..., object]]) -> None:
        """Ranks 1..N-1: run rank 0's commands (`follower_commands`) until it says stop."""
        while True:
            box = [None]
            dist.broadcast_object_list(box, src=0, group=self.commands)
            name, args = box[0]
            if name == "stop":
                return
            commands[name](*args)


def init(rank: int, world: int, mode: str, timeout_s: float, device: torch.device,
         addr: str | None = None, port: int | None = None) -> DataParallel:
    """Join the process group: NCCL where the trainer computes on GPUs, else gloo, rank 0 listening at
    addr:port. Without `port` the address comes from the environment (torchrun's MASTER_ADDR and MASTER_PORT)."""
    if port is not None:
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = addr or "127.0.0.1", str(port)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))
    commands = dist.new_group(backend="gloo", timeout=COMMAND_TIMEOUT)
    return DataParallel(rank, world, mode, device, commands)


def close() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def _inner(model):
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model


def _decoder_layers(model) -> list:
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise ValueError(f"cluster.data_parallel=fsdp2 needs a model with model.layers (a decoder stack); "
                         f"{type(model).__name__} has none: use cluster.data_parallel=ddp")
    return list(layers)

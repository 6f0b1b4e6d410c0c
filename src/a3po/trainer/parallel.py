"""Data-parallel training: N trainer ranks over torch.distributed, each on its share of a step's batch.

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

import os
import socket
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from a3po.config.choices import DpMode

COMMAND_TIMEOUT = timedelta(days=7)  # a follower waits as long as rank 0 lives (see the module docstring)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class DataParallel:
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

    def sync_grads(self, model, last: bool):
        """Gradients are reduced across ranks on the last micro-batch of a minibatch only."""
        if self.mode == DpMode.DDP:
            return nullcontext() if last else model.no_sync()
        model.set_requires_gradient_sync(last)
        return nullcontext()

    def full_state_dict(self, model) -> dict[str, torch.Tensor]:
        """Every weight in full, on the CPU, on rank 0 (empty elsewhere): a collective."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(_inner(model), options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def full_optimizer_state(self, model, optimizer) -> dict:
        """The optimizer state keyed by parameter name, in full, on rank 0: a collective."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        return get_optimizer_state_dict(_inner(model), optimizer,
                                        options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def load(self, model, optimizer, weights: dict[str, torch.Tensor], optim_state: dict) -> None:
        """Full weights and optimizer state (as `full_*` returned them), read by every rank, into the shards."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        opts = StateDictOptions(full_state_dict=True, strict=False)
        set_model_state_dict(_inner(model), weights, options=opts)
        set_optimizer_state_dict(_inner(model), optimizer, optim_state, options=opts)

    # -- the work ----------------------------------------------------------------------------

    def share(self, rows: list[int]) -> list[int]:
        return rows[self.rank::self.world]

    def most(self, n: int) -> int:
        """The largest `n` over the ranks."""
        t = torch.tensor([n], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t)

    def gather(self, obj) -> list | None:
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

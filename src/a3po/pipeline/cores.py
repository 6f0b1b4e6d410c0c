"""The trainer borrows the rollout workers' cores while they have nothing to generate.

Cores are split between the trainer and the workers (pipeline/pool.py:split_threads), but a
worker with no prompt in flight uses none of its share: at the staleness bound it waits for
the next version, at eta = 0 it waits for every step. On a small machine that can be half the
CPU left idle for much of a step (docs/results.md). So before every decoder layer's forward and backward the
trainer sets its thread count to its own share plus the idle workers' shares, and back to
its own share as soon as a worker has work again. Torch's CPU threads are per calling
thread and CPU autograd runs on the caller, so module hooks reach every pass the trainer
makes: the update, the proximal recompute, the reference model and greedy evaluation.

The switch costs a call per layer (microseconds); the overlap while a worker restarts is
at most one layer's work, when the trainer briefly runs one thread too many.

Lending applies only where the workers' shares are cores of this machine that the trainer's
threads would run on (`lends_cores`); anywhere else borrowing would oversubscribe the
trainer's own cores. Not under rollout.lockstep either: CPU kernels may split their work
differently for another thread count and round differently, so a thread count that timing
decides would make a lockstep run's numbers depend on timing.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from a3po.config import Config
from a3po.config.choices import Backend, Launcher


def lends_cores(cfg: Config, rollout_device: torch.device) -> bool:
    """Whether the trainer borrows idle workers' cores: `rollout.lend_idle_cores`, and the workers
    compute on this machine's CPU with the share of its threads that split_threads gave them.

    That is the one case where an idle worker frees known cores the trainer's threads can use.
    Not under the Ray launcher (workers may run on other nodes: their shares are not this
    machine's cores), not with rollout on a GPU (a worker's host threads drive its device, and
    its share is not what rollout computes on), not with the vLLM backend (vLLM manages its
    threads itself, its CPU build makes torch.set_num_threads a no-op in the worker, so the
    worker's share is not known to be what it uses)."""
    return (cfg.rollout.lend_idle_cores and not cfg.rollout.lockstep and cfg.cluster.launcher == Launcher.LOCAL
            and cfg.rollout.backend == Backend.LOCAL and rollout_device.type == "cpu")


class CoreLender:
    def __init__(self, own: int, lendable: int, workers_idle: Callable[[], bool]):
        self.own, self.lendable, self.workers_idle = own, lendable, workers_idle
        self.current = own
        self.layers_run = self.layers_borrowed = 0
        torch.set_num_threads(own)

    def threads(self) -> int:
        """The trainer's thread count right now, set if it changed."""
        want = self.own + (self.lendable if self.lendable and self.workers_idle() else 0)
        self.layers_run += 1
        self.layers_borrowed += want > self.own
        if want != self.current:
            torch.set_num_threads(want)
            self.current = want
        return want

    def borrowed_frac(self) -> float:
        """Share of layer passes since the last call that ran on borrowed threads."""
        out = self.layers_borrowed / self.layers_run if self.layers_run else 0.0
        self.layers_run = self.layers_borrowed = 0
        return out

    def attach(self, model: nn.Module) -> None:
        """Re-decide before each decoder layer runs, forwards and backwards."""
        for layer in decoder_layers(model):
            layer.register_forward_pre_hook(self._hook)
            layer.register_full_backward_pre_hook(self._hook)

    def _hook(self, *_) -> None:  # a hook that returned something would replace the layer's inputs
        self.threads()


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The stack of transformer blocks: the longest ModuleList in the model."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    if not lists:
        raise ValueError(f"{type(model).__name__} has no ModuleList of layers to attach to")
    return max(lists, key=len)

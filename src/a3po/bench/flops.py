"""Achieved GFLOP/s against this machine's own matmul rate, measured in the same run.

Why a share and not a number: the same benchmark on another CPU (AVX2 only, AVX-512 BF16,
AMX) or a GPU differs by an order of magnitude, but the share of the machine's dense
matmul rate says how much of it the code uses, and means the same everywhere.

Counted work is the matmuls of the model's linear layers (2 FLOPs per weight per token in a
forward pass, 6 forward and backward), the convention of "model FLOPs utilisation":
attention scores, norms and sampling are overhead by this measure, and so is work an engine
skips (a group's shared prompt prefilled once counts as prefilled for every sample).
"""

from __future__ import annotations

import statistics
import time

import torch

from a3po.devices import synchronize

CPU = torch.device("cpu")
MATMUL_SIZE = 2048  # square matmul for the machine's rate: large enough to run at full speed


def matmul_rate(dtype: torch.dtype, repeats: int = 5, size: int = MATMUL_SIZE,
                device: torch.device = CPU) -> float:
    """GFLOP/s of a (size x size) @ (size x size) matmul in `dtype` on `device` (on the CPU at torch's current
    thread count): the median of `repeats` after one warm-up call."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(size, size, generator=g).to(device, dtype)
    b = torch.randn(size, size, generator=g).to(device, dtype)
    a @ b
    times = []
    for _ in range(repeats):
        synchronize(device)
        t0 = time.perf_counter()
        a @ b
        synchronize(device)
        times.append(time.perf_counter() - t0)
    return 2 * size**3 / statistics.median(times) / 1e9


def linear_weights(model) -> tuple[int, int]:
    """Weights in the linear layers of the body, and in the output layer (counted even when tied)."""
    head = model.get_output_embeddings()
    total = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not head)
    return total, head.weight.numel()


def generation_flops(model, prompt_lens: list[int], new_tokens: int) -> float:
    """Model FLOPs to sample `new_tokens` after each prompt: the prompt and all but the last sampled token
    run through the body, and the output layer runs once per sampled token."""
    body, head = linear_weights(model)
    fed = sum(p + new_tokens - 1 for p in prompt_lens)
    return 2.0 * (body * fed + head * new_tokens * len(prompt_lens))


def training_flops(model, tokens: int) -> float:
    """Model FLOPs of one forward and backward pass over `tokens` tokens (backward costs two forwards)."""
    body, head = linear_weights(model)
    return 6.0 * (body + head) * tokens

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
    thread count): the median of `repeats` after one warm-up call.

    Where the dtype is emulated (bf16 on a CPU without AVX-512 BF16 or AMX), one call of the full square takes
    orders of magnitude longer than in fp32: a smaller square, the largest whose call a first small one predicts to take
    at most MAX_CALL_S, measures the rate instead, so that every benchmark names its rate in seconds."""
    g = torch.Generator().manual_seed(0)
    size = _affordable_size(dtype, size, device)
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


MAX_CALL_S = 2.0  # the longest one call of matmul_rate's square may be predicted to take
PROBE_SIZE = 256  # the square that predicts it: a few milliseconds even where the dtype is emulated


def _affordable_size(dtype: torch.dtype, size: int, device: torch.device) -> int:
    """`size`, or the largest power of two below it whose matmul, predicted from a PROBE_SIZE one (time grows as
    the cube of the side), takes at most MAX_CALL_S; never below PROBE_SIZE."""
    if size <= PROBE_SIZE:
        return size
    a = torch.ones(PROBE_SIZE, PROBE_SIZE).to(device, dtype)
    a @ a
    synchronize(device)
    t0 = time.perf_counter()
    a @ a
    synchronize(device)
    probe_s = time.perf_counter() - t0
    while size > PROBE_SIZE and probe_s * (size / PROBE_SIZE) ** 3 > MAX_CALL_S:
        size //= 2
    return max(size, PROBE_SIZE)


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


def linear_shapes(model) -> tuple[dict[tuple[int, int], int], tuple[int, int]]:
    """The body's linear weight shapes (out, in) with how many layers hold each, and the output layer's shape."""
    head = model.get_output_embeddings()
    body: dict[tuple[int, int], int] = {}
    for m in model.modules():
        if isinstance(m, torch.nn.Linear) and m is not head:
            body[tuple(m.weight.shape)] = body.get(tuple(m.weight.shape), 0) + 1
    return body, tuple(head.weight.shape)


def _gemm_seconds(fn, device: torch.device, repeats: int) -> float:
    """Median seconds of `fn()` after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        synchronize(device)
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def shape_rate(model, rows: int, head_rows: int, dtype: torch.dtype, backward: bool, repeats: int = 3,
               device: torch.device = CPU) -> float:
    """GFLOP/s that the model's own linear-layer matmuls reach alone, in `dtype` on `device`: every body weight
    shape at `rows` tokens and the output layer at `head_rows`, forward only or (`backward`) also both gradient
    matmuls (input: (rows, out) @ (out, in); weight: (out, rows) @ (rows, in)).

    Why: a 2048 x 2048 square runs faster than a micro-batch's thin matmuls, so its rate overstates what a
    training or decode pass could reach. This is the rate the pass's counted model FLOPs (`training_flops`,
    `generation_flops`) would run at if nothing but these matmuls took time: counted FLOPs over the sum of
    each shape's share of them at its own measured rate. The body's and the head's FLOPs are weighted as
    those functions count them (every token through the head), whatever rows the head is timed at."""
    g = torch.Generator().manual_seed(0)
    body, head = linear_shapes(model)
    shapes = [(shape, count, rows) for shape, count in body.items()] + [(head, 1, head_rows)]
    flops = seconds = 0.0
    for (out_f, in_f), count, m in shapes:
        w = torch.randn(out_f, in_f, generator=g).to(device, dtype)
        x = torch.randn(m, in_f, generator=g).to(device, dtype)
        gemms = [lambda x=x, w=w: torch.nn.functional.linear(x, w)]
        if backward:
            gy = torch.randn(m, out_f, generator=g).to(device, dtype)
            gemms += [lambda gy=gy, w=w: gy @ w, lambda gy=gy, x=x: gy.T @ x]
        one = 2.0 * m * in_f * out_f  # FLOPs of one of these matmuls
        per_layer = len(gemms) * one / sum(_gemm_seconds(f, device, repeats) for f in gemms)  # FLOP/s
        counted = count * in_f * out_f  # weights of this shape: FLOPs are proportional to them
        flops += counted
        seconds += counted / per_layer
    return flops / seconds / 1e9

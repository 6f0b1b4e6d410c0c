"""Where each model computes, and in which dtype: `actor.device`, `rollout.device`, `*.dtype: auto`.

`auto` picks CUDA when torch sees a CUDA device, else the CPU. The dtype `auto` is decided
by the device that computes, never by whether CUDA merely exists: bf16 is fast on CUDA
(when the GPU supports it) and on CPUs with AVX512-BF16 or AMX, and much slower than
fp32 on an AVX2-only CPU, where torch emulates it.

Placements: everything on one GPU (both `cuda`), or the trainer on one GPU and the rollout
workers on another (`actor.device=cuda:0 rollout.device=cuda:1`); weights travel through
shared CPU memory either way (sync/shm.py).
"""

from __future__ import annotations

from pathlib import Path

import torch

from a3po.config import ConfigError
from a3po.config.choices import AUTO, Device, Dtype
from a3po.machine import machine

TORCH_DTYPES = {Dtype.FLOAT32: torch.float32, Dtype.BFLOAT16: torch.bfloat16}  # every resolved Dtype name


def resolve_device(name: str, key: str) -> torch.device:
    """The torch device `key` (the config key, for the message) asks for; a one-line error if it is not here."""
    if name == AUTO:
        return torch.device(Device.CUDA if torch.cuda.is_available() else Device.CPU)
    device = torch.device(name)
    if device.type == Device.CUDA:
        if not torch.cuda.is_available():
            raise ConfigError(f"{key}={name}, but this torch ({torch.__version__}) sees no CUDA device; install "
                              f"torch's CUDA build (docs/scaling.md) or set {key}=cpu")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise ConfigError(f"{key}={name}, but torch sees {count} CUDA device(s): cuda:0 to cuda:{count - 1}")
    return device


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on `device`: CUDA kernels run after their launch returns, so a clock read
    without this times the launches, not the work. Nothing to wait for on the CPU."""
    if device.type == Device.CUDA:
        torch.cuda.synchronize(device)


def device_name(device: torch.device) -> str:
    """What a measurement on `device` ran on, for its record: the GPU's name, or the CPU's model."""
    if device.type == Device.CUDA:
        return torch.cuda.get_device_name(device)
    return machine()["cpu"]


def native_bf16(device: torch.device) -> bool:
    """Does `device` compute bf16 matmuls natively (fast), rather than emulate them?"""
    if device.type == Device.CUDA:
        return torch.cuda.is_bf16_supported()
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def resolve_dtype(name: str, device: torch.device) -> str:
    """Dtype.FLOAT32 or Dtype.BFLOAT16 for a dtype key (one of Dtype.CHOICES) on `device`."""
    if name == AUTO:
        return Dtype.BFLOAT16 if native_bf16(device) else Dtype.FLOAT32
    return name


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a resolved dtype name (Dtype.RESOLVED); the one place such a name becomes torch's."""
    try:
        return TORCH_DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype {name!r}: choose from {', '.join(TORCH_DTYPES)}") from None

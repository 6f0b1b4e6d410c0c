"""What the benchmarks take, kept free of heavy imports so that `a3po --help` stays fast."""

from __future__ import annotations

from dataclasses import dataclass, field

METHODS = ("recompute", "loglinear", "linear", "reuse")  # bench step's proximal methods
ARM_NAMES = ("sync", "recompute", "loglinear", "linear", "reuse", "metrics")  # bench e2e's arms, defined in e2e.py


@dataclass
class StepBenchArgs:
    model: str = "smollm2-135m-instruct"
    dtype: str = "auto"
    batch: int = 8
    prompt_len: int = 40
    output_len: int = 64
    minibatches: list[int] = field(default_factory=lambda: [1, 4])
    methods: list[str] = field(default_factory=lambda: list(METHODS))
    repeats: int = 3
    warmup: int = 1
    threads: int | None = None  # None: the trainer's share of the cores in `a3po train`
    eta: int = 2
    out: str = "runs/bench-step"

    def checked(self) -> "StepBenchArgs":
        """Self, or a ConfigError naming the first bad argument."""
        from a3po.config import ConfigError

        problems = [f"--{k.replace('_', '-')} must be at least 1" for k in ("batch", "repeats", "prompt_len", "output_len")
                    if getattr(self, k) < 1]
        problems += ["--threads must be at least 1"] if self.threads is not None and self.threads < 1 else []
        problems += [f"--methods: unknown '{m}' (choose from {','.join(METHODS)})" for m in self.methods if m not in METHODS]
        problems += [f"--minibatches: {m} must be between 1 and --batch" for m in self.minibatches if not 1 <= m <= self.batch]
        if problems:
            raise ConfigError(problems[0])
        return self


@dataclass
class TrainBenchArgs:
    """What every benchmark made of `a3po train` runs takes (bench/runs.py)."""

    preset: str | None = None
    config: str | None = None
    overrides: list[str] = field(default_factory=list)
    seeds: int = 1
    out: str | None = None
    keep_checkpoints: bool = False


@dataclass
class E2EArgs(TrainBenchArgs):
    arms: list[str] = field(default_factory=lambda: list(ARM_NAMES))

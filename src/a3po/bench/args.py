"""What the benchmarks take, kept free of heavy imports so that `a3po --help` stays fast."""

from __future__ import annotations

from dataclasses import dataclass, field

from a3po.algo.variants import PROX_METHODS
from a3po.config.choices import AUTO, Backend, Dtype

# bench step's proximal methods: every way of getting p; metrics is recompute plus error bookkeeping
METHODS = tuple(m for m in PROX_METHODS if m != "metrics")
ROLLOUT_DTYPES = Dtype.RESOLVED  # bench rollout's engine dtypes (rollout.dtype's choices but auto)


class Engine:
    """bench rollout's engines (`--engines`)."""

    LOCAL = "local"  # the local engine, rollout.forward=auto
    LOCAL_HF = "local-hf"  # the local engine, rollout.forward=hf
    GENERATE = "generate"  # Hugging Face model.generate, timed only (no log-probs)
    VLLM = Backend.VLLM  # rollout.backend=vllm, only where vLLM is installed


ROLLOUT_ENGINES = (Engine.LOCAL, Engine.LOCAL_HF, Engine.GENERATE, Engine.VLLM)
ARM_NAMES = ("sync", "recompute", "loglinear", "linear", "reuse", "metrics", "ranks2", "ray")  # bench e2e's (e2e.py)
E2E_DEFAULT_ARMS = ARM_NAMES[:-2]  # ranks2 and ray measure the launchers, not the method: asked for by name
STALENESS_ARMS = ("coupled", "recompute", "loglinear", "reuse")  # bench staleness's arms, defined in staleness.py
# bench staleness's baseline arm, steady-state start and the reason other arms skip eta = 0 (staleness.py)
BASELINE = "coupled"
STEADY_AFTER = 2  # steady state: the steps after the first eta + STEADY_AFTER (the pipeline filling up)
REASON_ETA0 = "eta = 0 is synchronous: every arm's loss is the coupled one there, the coupled baseline stands for it"


@dataclass
class StepBenchArgs:
    model: str = "smollm2-135m-instruct"
    dtype: str = AUTO
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

    def checked(self) -> StepBenchArgs:
        """Self, or a ConfigError naming the first bad argument."""
        from a3po.config import ConfigError

        problems = [f"--{k.replace('_', '-')} must be at least 1"
                    for k in ("batch", "repeats", "prompt_len", "output_len") if getattr(self, k) < 1]
        problems += ["--threads must be at least 1"] if self.threads is not None and self.threads < 1 else []
        problems += [f"--methods: unknown '{m}' (choose from {','.join(METHODS)})"
                     for m in self.methods if m not in METHODS]
        problems += [f"--minibatches: {m} must be between 1 and --batch"
                     for m in self.minibatches if not 1 <= m <= self.batch]
        if problems:
            raise ConfigError(problems[0])
        return self


@dataclass
class RolloutBenchArgs:
    model: str = "smollm2-135m-instruct"
    dtypes: list[str] = field(default_factory=lambda: list(ROLLOUT_DTYPES))
    engines: list[str] = field(default_factory=lambda: [Engine.LOCAL, Engine.LOCAL_HF, Engine.GENERATE])
    trainer_dtype: str = AUTO  # the actor dtype the log-prob gap is measured against
    batch: int = 64  # the rollout worker's max batch: one worker's full load
    group: int = 1  # requests per distinct prompt (gconfig.n_samples in a run): a group's prompt is one prefill
    max_new_tokens: int = 24  # gconfig.max_new_tokens' default
    repeats: int = 3
    threads: int = 1  # a rollout worker's share in `a3po train` on two cores
    update_every: int = 6  # decode steps between in-flight weight updates; 0 = no update arms
    out: str = "runs/bench-rollout"

    def checked(self) -> RolloutBenchArgs:
        """Self, or a ConfigError naming the first bad argument."""
        from a3po.config import ConfigError

        problems = [f"--{k.replace('_', '-')} must be at least 1"
                    for k in ("batch", "max_new_tokens", "repeats", "threads") if getattr(self, k) < 1]
        problems += ["--update-every must be 0 (off) or at least 1"] if self.update_every < 0 else []
        problems += ([f"--group {self.group}: must be at least 1 and divide --batch {self.batch}"]
                     if self.group < 1 or self.batch % self.group else [])
        problems += [f"--dtypes: unknown '{d}' (choose from {','.join(ROLLOUT_DTYPES)})"
                     for d in self.dtypes if d not in ROLLOUT_DTYPES]
        problems += (["--dtypes: give at least one, each once"]
                     if not self.dtypes or len(set(self.dtypes)) < len(self.dtypes) else [])
        problems += [f"--engines: unknown '{e}' (choose from {','.join(ROLLOUT_ENGINES)})"
                     for e in self.engines if e not in ROLLOUT_ENGINES]
        problems += (["--engines: give at least one, each once"]
                     if not self.engines or len(set(self.engines)) < len(self.engines) else [])
        problems += [f"--trainer-dtype: unknown '{self.trainer_dtype}' (choose from {','.join(Dtype.CHOICES)})"
                     ] if self.trainer_dtype not in Dtype.CHOICES else []
        if problems:
            raise ConfigError(problems[0])
        return self


@dataclass
class SyncBenchArgs:
    model: str = "smollm2-135m-instruct"
    repeats: int = 5
    out: str = "runs/bench-sync"

    def checked(self) -> SyncBenchArgs:
        from a3po.config import ConfigError

        if self.repeats < 1:
            raise ConfigError("--repeats must be at least 1")
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
    arms: list[str] = field(default_factory=lambda: list(E2E_DEFAULT_ARMS))


@dataclass
class StalenessArgs(TrainBenchArgs):
    etas: list[int] = field(default_factory=lambda: [0, 2, 4, 8])
    minibatches: list[int] = field(default_factory=lambda: [1, 4])
    arms: list[str] = field(default_factory=lambda: list(STALENESS_ARMS))
    all_arms_at_eta0: bool = False  # default: eta = 0 runs only the coupled baseline

    def checked(self) -> StalenessArgs:
        """Self with --etas and --minibatches sorted and deduplicated, or a ConfigError naming
        the first bad argument (the cells' configurations are checked by the benchmark)."""
        from a3po.config import ConfigError

        problems = [f"--{k} needs at least one value" for k in ("etas", "minibatches", "arms") if not getattr(self, k)]
        problems += [f"--etas: {e} must be at least 0" for e in self.etas if e < 0]
        problems += [f"--minibatches: {m} must be at least 1" for m in self.minibatches if m < 1]
        problems += [f"--arms: unknown arm '{a}'; choose from {', '.join(STALENESS_ARMS)}"
                     for a in self.arms if a not in STALENESS_ARMS]
        problems += [f"--seeds {self.seeds}: must be at least 1"] if self.seeds < 1 else []
        if problems:
            raise ConfigError(problems[0])
        self.etas, self.minibatches = sorted(set(self.etas)), sorted(set(self.minibatches))
        self.arms = list(dict.fromkeys(self.arms))
        return self

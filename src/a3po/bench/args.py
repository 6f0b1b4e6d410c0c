"""What the benchmarks take, kept free of heavy imports so that `a3po --help` stays fast.

Each benchmark's options are one dataclass, and each option is declared once, as a field made
by `option(...)`: its default, its --help line and its rules (`choices`, `ge`, `unique`,
`nonempty`). `add_parsers` builds `a3po bench KIND`'s argparse from those fields (the flag is
the field's name with dashes; a list is a comma-separated flag, a False default a switch) and
`checked` enforces the rules, each in one message form; what a rule cannot say (one option
against another) is a class's `_problems`. `from_namespace` turns the parsed options back into
the benchmark's dataclass, checked.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from a3po.algo.variants import PROX_METHODS, prox_traits
from a3po.config.choices import AUTO, Backend, Device, Dtype

# bench step's proximal methods: every way of getting p; metrics is recompute plus error bookkeeping
METHODS = tuple(m for m in PROX_METHODS if not prox_traits(m).reports_errors)
ROLLOUT_DTYPES = Dtype.RESOLVED  # bench rollout's engine dtypes (rollout.dtype's choices but auto)


class Engine:
    """bench rollout's engines (`--engines`)."""

    LOCAL = "local"  # the local engine, rollout.forward=auto
    LOCAL_HF = "local-hf"  # the local engine, rollout.forward=hf
    GENERATE = "generate"  # Hugging Face model.generate, timed only (no log-probs)
    VLLM = Backend.VLLM  # rollout.backend=vllm, only where vLLM is installed


ROLLOUT_ENGINES = (Engine.LOCAL, Engine.LOCAL_HF, Engine.GENERATE, Engine.VLLM)
# The off-policy corrections and the other surrogates beside the proximal methods, the same in bench e2e and bench
# staleness (asked for by name): name -> (label, prox_logp_method, overrides). Under loglinear the corrections read
# the current ratio exp(theta - b), the one that sees the sampler at d <= 1 (docs/design.md, "Off-policy corrections").
CORRECTION_ARMS = {
    "loglinear-icepop": ("A-3PO with IcePop: tokens whose exp(theta - b) leaves [0.5, 5] dropped", "loglinear",
                         ("actor.correction.ratio=current", "actor.correction.mis=token",
                          "actor.correction.mis_low=0.5", "actor.correction.mis_high=5")),
    "loglinear-geomask": ("A-3PO with geometric sequence masking: sequences whose geometric-mean exp(theta - b) "
                          "leaves [0.99, 1.01] dropped", "loglinear",
                          ("actor.correction.ratio=current", "actor.correction.mis=geometric",
                           "actor.correction.mis_low=0.99", "actor.correction.mis_high=1.01")),
    "recompute-tis": ("recompute with token TIS: the behaviour weight capped at 2", "recompute",
                      ("actor.correction.tis=token", "actor.correction.tis_cap=2")),
    "loglinear-cispo": ("A-3PO's proximal policy with the CISPO surrogate", "loglinear", ("actor.policy_loss=cispo",)),
    "loglinear-sapo": ("A-3PO's proximal policy with the SAPO surrogate", "loglinear", ("actor.policy_loss=sapo",)),
}
ARM_NAMES = ("sync", "recompute", "loglinear", "linear", "reuse", "metrics", "lora", "ranks2", "ray",
             "service", "lockstep", *CORRECTION_ARMS)  # e2e.py's
# these measure training modes, launchers, reward paths, repeatable runs and corrections: asked for by name
E2E_EXTRA_ARMS = ("lora", "ranks2", "ray", "service", "lockstep", *CORRECTION_ARMS)
E2E_DEFAULT_ARMS = tuple(a for a in ARM_NAMES if a not in E2E_EXTRA_ARMS)
# bench staleness's arms, defined in staleness.py; the first four run by default, the rest are asked for by name
STALENESS_ARMS = ("coupled", "recompute", "loglinear", "reuse",
                  "recompute-noclip", "loglinear-noclip", "loglinear-eps04", "loglinear-nodual", *CORRECTION_ARMS)
STALENESS_DEFAULT_ARMS = STALENESS_ARMS[:4]
REFERENCE = "recompute"  # the arm bench staleness pairs every other arm of a cell with (the exact method)
# bench staleness's baseline arm, steady-state start and the reason other arms skip eta = 0 (staleness.py)
BASELINE = "coupled"
STEADY_AFTER = 2  # steady state: the steps after the first eta + STEADY_AFTER (the pipeline filling up)
REASON_ETA0 = "eta = 0 is synchronous: every arm's loss is the coupled one there, the coupled baseline stands for it"
# every bound of the loss off (the -noclip arms of bench staleness and bench fidelity): lower clip 1 - 0.999,
# upper 1 + 1000, no dual clip, no behaviour-weight cap
NO_CLIP_BOUNDS = {"eps_clip": 0.999, "eps_clip_higher": 1000.0, "c_clip": None, "behav_imp_weight_cap": None}
# bench fidelity's arms, defined in fidelity.py; recompute is the reference, replayed a second time as its own arm;
# the first six run by default, the corrections and surrogates when asked for by name
FIDELITY_ARMS = ("recompute", "loglinear", "linear", "coupled", "recompute-noclip", "reuse", *CORRECTION_ARMS)
FIDELITY_DEFAULT_ARMS = FIDELITY_ARMS[:6]
FIDELITY_SPLITS = ("d", "sign")  # bench fidelity's --split: by staleness, by the sign of the advantage
FIDELITY_ALL = "all"  # bench fidelity's name for the whole update, beside the parts of a split ("d=3", "A>0")


def option(default: Any, help: str | None = None, **rules: Any) -> Any:
    """A benchmark option: default, --help line (`{command}` is the benchmark's name) and rules:
    choices (allowed values, of each element for a list), what (the noun an unknown value is called),
    ge (lower bound, of each element for a list), nonempty and unique (for lists)."""
    meta = {"option": True, "help": help, **rules}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


DEVICE_HELP = ("where the model, the batch and the timed work run: cpu, cuda or cuda:N (auto: cuda when torch sees "
               "one); the record names the GPU or CPU")


def _device_problems(device: str) -> list[str]:
    """--device's spelling (actor.device's, Device.PATTERN); whether torch sees it is asked when the benchmark runs."""
    return [] if re.fullmatch(Device.PATTERN, device) else [f"--device {device}: {Device.PATTERN_HELP}"]


def _csv(kind: Callable[[str], Any]) -> Callable[[str], list]:
    return lambda text: [kind(x) for x in text.split(",") if x]


@dataclass
class BenchArgs:
    """What every benchmark's options share: the parser and the checks generated from their fields."""

    command: ClassVar[str]  # `a3po bench <command>`
    summary: ClassVar[str]  # its line in `a3po bench --help`
    description: ClassVar[str]  # the top of `a3po bench <command> --help`

    @classmethod
    def options(cls) -> list[dataclasses.Field]:
        return [f for f in dataclasses.fields(cls) if f.metadata.get("option")]

    def checked(self):
        """Self, or a ConfigError naming the first bad option."""
        from a3po.config import ConfigError

        problems = [p for f in self.options() for p in _field_problems(f, getattr(self, f.name))]
        problems += self._problems()
        if problems:
            raise ConfigError(problems[0])
        return self

    def _problems(self) -> list[str]:
        """What the fields' rules cannot say: one option against another."""
        return []


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _field_problems(f: dataclasses.Field, value: Any) -> list[str]:
    rules, flag = f.metadata, _flag(f.name)
    choices, ge, what = rules.get("choices"), rules.get("ge"), rules.get("what")
    unknown = lambda v: f"{flag}: unknown {what + ' ' if what else ''}'{v}'; choose from {', '.join(choices)}"
    if not isinstance(value, list):
        if value is None:
            return []
        if choices is not None and value not in choices:
            return [unknown(value)]
        return [f"{flag} {value}: must be at least {ge}"] if ge is not None and value < ge else []
    out = [f"{flag} needs at least one value"] if rules.get("nonempty") and not value else []
    out += [unknown(v) for v in value if choices is not None and v not in choices]
    out += [f"{flag}: {v} must be at least {ge}" for v in value if ge is not None and v < ge]
    twice = [v for i, v in enumerate(value) if v in value[:i]]
    out += [f"{flag}: '{twice[0]}' given twice; give each once"] if rules.get("unique") and twice else []
    return out


def _parser_type(tp: Any) -> Callable[[str], Any] | None:
    """What argparse converts one option's text with, from the field's annotation."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):  # X | None
        tp = next(a for a in typing.get_args(tp) if a is not type(None))
    if typing.get_origin(tp) is list:
        return _csv(typing.get_args(tp)[0])
    return tp if tp in (int, float) else None


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def _help(cls: type[BenchArgs], f: dataclasses.Field) -> str | None:
    """The option's help line, led by what it allows when it has choices."""
    rules = f.metadata
    text = rules["help"].replace("{command}", cls.command) if rules["help"] else None
    if rules.get("choices") is None:
        return text
    allowed = f"{'subset' if isinstance(_default(f), list) else 'one'} of {','.join(rules['choices'])}"
    return f"{allowed} ({text})" if text else allowed


def add_parser(kinds, cls: type[BenchArgs], config_args: Callable[[argparse.ArgumentParser], None]) -> None:
    """`a3po bench <cls.command>` with one flag per option of `cls`; `config_args` adds --preset, --config
    and key=value, as `a3po train` takes them, to a benchmark made of training runs."""
    p = kinds.add_parser(cls.command, help=cls.summary, description=cls.description)
    if issubclass(cls, TrainBenchArgs):
        config_args(p)
    hints = typing.get_type_hints(cls)
    for f in cls.options():
        default = _default(f)
        if default is False:
            p.add_argument(_flag(f.name), action="store_true", help=_help(cls, f))
        else:
            p.add_argument(_flag(f.name), type=_parser_type(hints[f.name]), default=default, help=_help(cls, f))


def add_parsers(sub, config_args: Callable[[argparse.ArgumentParser], None]) -> None:
    """`a3po bench` and one subcommand per benchmark (BENCHMARKS)."""
    bench = sub.add_parser("bench", help="measure A-3PO, the rollout engine and staleness side by side "
                                         f"({', '.join(BENCHMARKS)})",
                           description="Benchmarks whose ratios are measured side by side in one run.")
    kinds = bench.add_subparsers(dest="bench", metavar="KIND")
    for cls in BENCHMARKS.values():
        add_parser(kinds, cls, config_args)


def from_namespace(ns: argparse.Namespace) -> BenchArgs:
    """The chosen benchmark's options from argparse's namespace, checked (a ConfigError if not)."""
    from a3po.config import ConfigError

    cls = BENCHMARKS.get(getattr(ns, "bench", None))
    if cls is None:
        raise ConfigError(f"a3po bench: choose {', '.join(BENCHMARKS)} (a3po bench --help)")
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in vars(ns).items() if k in names}).checked()


@dataclass
class StepBenchArgs(BenchArgs):
    command = "step"
    summary = "one training step per proximal method, with its breakdown"
    description = ("Time ppo_update on one fixed batch for each proximal method at each minibatch count, "
                   "and the proximal computation alone.")

    model: str = option("smollm2-135m-instruct", "actor.path (tiny-256x4 for a quick run, tiny-2048x16 for about "
                                                 "600M parameters with no download)")
    device: str = option(Device.CPU, DEVICE_HELP)
    dtype: str = option(AUTO, choices=Dtype.CHOICES)
    batch: int = option(8, "sequences in the batch", ge=1)
    prompt_len: int = option(40, ge=1)
    output_len: int = option(64, ge=1)
    minibatches: list[int] = option([1, 4], "e.g. 1,4")
    methods: list[str] = option(list(METHODS), choices=METHODS)
    repeats: int = option(3, ge=1)
    warmup: int = option(1, "untimed one-row steps per arm first")
    threads: int | None = option(None, "torch threads (default: the trainer's share of the cores in `a3po train`)",
                                 ge=1)
    lora_rank: int = option(0, "R > 0: every arm also runs with LoRA adapters of rank R (actor.lora.rank) beside "
                               "full training", ge=0)
    memory: bool = option(False, "also each arm's peak resident memory: a fresh process loads the model and "
                                 "trains two steps on the batch")
    eta: int = 2  # the spread of token versions in the batch; not an option
    out: str = option("runs/bench-step", "output folder (suffixed -2, -3, ... if taken)")

    def _problems(self) -> list[str]:
        out = _device_problems(self.device)
        if self.memory and self.device != Device.CPU:
            out.append(f"--memory measures the process's resident CPU memory, not the device's: leave it out "
                       f"with --device {self.device}")
        return out + [f"--minibatches: {m} must be between 1 and --batch" for m in self.minibatches
                      if not 1 <= m <= self.batch]


@dataclass
class RolloutBenchArgs(BenchArgs):
    command = "rollout"
    summary = "rollout tokens/s per engine and dtype (local, model.generate, vLLM), and the log-prob gap"
    description = ("Time the local rollout engine in each dtype against model.generate (and vLLM with --engines) "
                   "on the same batch, with the achieved GFLOP/s against this machine's matmul rate, and compare "
                   "its log-probs with the trainer's.")

    model: str = option("smollm2-135m-instruct", "actor.path (tiny for a quick run)")
    device: str = option(Device.CPU, DEVICE_HELP + "; vLLM places itself")
    dtypes: list[str] = option(list(ROLLOUT_DTYPES), choices=ROLLOUT_DTYPES, nonempty=True, unique=True)
    engines: list[str] = option([Engine.LOCAL, Engine.LOCAL_HF, Engine.GENERATE],
                                "vllm: where vLLM is installed, docs/scaling.md", choices=ROLLOUT_ENGINES,
                                nonempty=True, unique=True)
    trainer_dtype: str = option(AUTO, "actor.dtype of the trainer the log-probs are compared with",
                                choices=Dtype.CHOICES)
    batch: int = option(64, "requests in the batch (the worker's max batch)", ge=1)  # one worker's full load
    # a group's prompt is one prefill
    group: int = option(1, "requests per distinct prompt, as gconfig.n_samples makes them in a run", ge=1)
    max_new_tokens: int = option(24, ge=1)  # gconfig.max_new_tokens' default
    repeats: int = option(3, ge=1)
    update_every: int = option(6, "decode steps between in-flight weight updates in the rollout.weight_update arms "
                                  "(0: none)", ge=0)
    turns: int = option(4, "model turns per episode in the multi-turn arm, where an observation follows each turn "
                           "and the next turn's prompt is the whole context (0: no multi-turn arm)", ge=0)
    threads: int = option(1, "torch threads (one rollout worker's share)", ge=1)
    out: str = option("runs/bench-rollout", "output folder (suffixed -2, -3, ... if taken)")

    def _problems(self) -> list[str]:
        divides = self.group < 1 or self.batch % self.group == 0  # below 1 is the field's own problem
        return _device_problems(self.device) + ([] if divides else [f"--group {self.group}: must divide --batch "
                                                                    f"{self.batch}"])


@dataclass
class SyncBenchArgs(BenchArgs):
    command = "sync"
    summary = "weight publication per version: shared memory against Ray's object store"
    description = ("Publish the model's weights through each transport the launchers use and read them into a "
                   "worker's copy, alternating transports (needs Ray).")

    model: str = option("smollm2-135m-instruct", "actor.path (tiny for a quick run)")
    repeats: int = option(5, ge=1)
    out: str = option("runs/bench-sync", "output folder (suffixed -2, -3, ... if taken)")


@dataclass
class TrainBenchArgs(BenchArgs):
    """What every benchmark made of `a3po train` runs takes (bench/runs.py). --preset, --config and
    key=value are `a3po train`'s own (add_parser's config_args), not options declared here."""

    preset: str | None = None
    config: str | None = None
    overrides: list[str] = field(default_factory=list)
    seeds: int = option(1, "repeat every run with seeds seed, seed+1, ...", ge=1)
    out: str | None = option(None, "output folder; an existing one is continued "
                                   "(default: a new <fileroot>/bench-{command})")
    keep_checkpoints: bool = option(False, "keep each run's final checkpoint")


@dataclass
class E2EArgs(TrainBenchArgs):
    command = "e2e"
    summary = "the paper's table: every arm a real training run"
    description = ("Run each arm as a full `a3po train` with the same seeds, steps and data order; write "
                   "results.md, results.json and plots/.")

    arms: list[str] = option(list(E2E_DEFAULT_ARMS), f"default: all but {', '.join(E2E_EXTRA_ARMS)}",
                             choices=ARM_NAMES, what="arm")
    service_delay_s: float = option(1.0, "the service arm's reward model answers each request after this many "
                                         "seconds", ge=0)


@dataclass
class StalenessArgs(TrainBenchArgs):
    command = "staleness"
    summary = "a staleness study: every arm at every eta and minibatch count"
    description = ("Run a grid of full `a3po train` runs over the staleness bound eta "
                   "(rollout.max_head_offpolicyness), actor.ppo_n_minibatches and the arms coupled, recompute "
                   "(run as prox_logp_method=metrics), loglinear and reuse; write results.md, results.json and "
                   "plots/.")

    etas: list[int] = option([0, 2, 4, 8], "staleness bounds, e.g. 0,2,4,8", ge=0, nonempty=True)
    minibatches: list[int] = option([1, 4], "actor.ppo_n_minibatches values, e.g. 1,4 (reuse runs at 1 only)",
                                    ge=1, nonempty=True)
    arms: list[str] = option(list(STALENESS_DEFAULT_ARMS), "eta = 0 runs the coupled baseline whatever this says; "
                             "the clip-free, eps 0.4 and no-dual-clip arms are asked for by name",
                             choices=STALENESS_ARMS, what="arm", nonempty=True)
    all_arms_at_eta0: bool = option(False, "run every arm at eta = 0 too "
                                           "(default: only the coupled baseline, which they all equal there)")
    eval_every: int = option(0, "evaluate held-out accuracy every this many steps as well (0: at step 0 and after "
                                "the last step only; the pauses let asynchronous arms sample ahead unless "
                                "rollout.lockstep=true)", ge=0)

    def checked(self) -> StalenessArgs:
        """Self with --etas and --minibatches sorted and deduplicated, --arms deduplicated, or a ConfigError
        naming the first bad option (the cells' configurations are checked by the benchmark)."""
        super().checked()
        self.etas, self.minibatches = sorted(set(self.etas)), sorted(set(self.minibatches))
        self.arms = list(dict.fromkeys(self.arms))
        return self


@dataclass
class FidelityArgs(TrainBenchArgs):
    command = "fidelity"
    summary = "recorded batches replayed under each proximal method: every update against recompute's"
    description = ("Train one run (--preset, --config, key=value) that records its batch and the trainer's state "
                   "before each of --steps (saver.record_steps), or take the records of --run; replay every record "
                   "once per arm from the same weights and optimizer state, and compare each arm's parameter "
                   "update with recompute's (cosine, relative norm, relative error), overall, per staleness d and "
                   "per sign of the advantage, and the policies after the step by their KL on held-out prompts; "
                   "write results.md and results.json.")

    steps: list[int] | None = option(None, "steps to record and replay (default: four spread over "
                                           "total_train_steps; with --run, every record it holds)", ge=1, unique=True)
    eta: int = option(8, "rollout.max_head_offpolicyness of the recorded run", ge=0)
    minibatches: int = option(4, "actor.ppo_n_minibatches of the recorded run", ge=1)
    run: str | None = option(None, "replay the records of this run folder (trained with saver.record_steps) "
                                   "instead of training one")
    arms: list[str] = option(list(FIDELITY_DEFAULT_ARMS), "recompute: the reference replayed again, its rows the "
                             "determinism check; also: " + ", ".join(FIDELITY_ARMS[6:]), choices=FIDELITY_ARMS,
                             what="arm", unique=True)
    split: list[str] = option(list(FIDELITY_SPLITS), "also one step per part of each split, on that part's tokens "
                              "alone: d (per staleness), sign (A > 0, A < 0); empty: the whole update only",
                              choices=FIDELITY_SPLITS, unique=True)
    heldout: int = option(16, "held-out prompts the KL between the policies after the step is measured on "
                              "(0: no KL)", ge=0)
    threads: int | None = option(None, "torch threads of the replays (default: the trainer's share of the cores "
                                       "in `a3po train`)", ge=1)
    out: str | None = option(None, "output folder, suffixed -2, -3, ... if taken (default: <fileroot>/bench-fidelity)")

    def _problems(self) -> list[str]:
        if self.run is None:
            return []
        given = [name for name, x in (("--preset", self.preset), ("--config", self.config),
                                      ("key=value", self.overrides), ("--seeds", self.seeds != 1)) if x]
        return [f"--run replays the records of {self.run} with that run's own configuration: drop {given[0]}"] \
            if given else []


BENCHMARKS: dict[str, type[BenchArgs]] = {c.command: c for c in (
    StepBenchArgs, RolloutBenchArgs, SyncBenchArgs, E2EArgs, StalenessArgs, FidelityArgs)}

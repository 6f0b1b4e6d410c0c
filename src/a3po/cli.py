"""The `a3po` command line.

    a3po train [--preset NAME] [--config FILE] [--resume RUN_DIR] [key=value ...]
    a3po config [--config FILE] [key=value ...]     print the resolved configuration
    a3po bench step [options]                      time one training step per proximal method
    a3po bench rollout [options]                   rollout tokens/s per engine and dtype, log-prob gap
    a3po bench sync [options]                      weight publication per transport (shared memory, Ray)
    a3po bench e2e [--seeds N] [--arms ...] [key=value ...]   the paper's comparison as real runs
    a3po bench staleness [--etas 0,2,4,8] [--minibatches 1,4] [--arms ...] [--seeds N] [key=value ...]
                                                   every arm's training against the staleness bound eta

With no arguments `a3po train` runs the embedded default (the schema's defaults).
A bad configuration prints one line and exits with code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import atexit
import os
import sys
import textwrap
from typing import NoReturn

from a3po import __version__, signals

# Everything else is imported where it is used, after main() installed the signal handlers:
# a Ctrl-C in the first moments of the command is then one line too, not an import's traceback.

EXIT_USAGE = 2


def keys_help() -> str:
    """Every configuration key with its type, default and meaning, for --help."""
    from a3po.config import all_keys
    from a3po.config.load import default_of, type_name

    lines = ["configuration keys (set in --config YAML or as key=value):"]
    for key, f in all_keys().items():
        default = default_of(f)
        rules = f.metadata
        extra = f" [{' | '.join(map(str, rules['choices']))}]" if "choices" in rules else ""
        lines.append(f"  {key} ({type_name(f.type)}, default {default!r}){extra}")
        lines.extend(textwrap.wrap(rules["help"], width=88, initial_indent=" " * 6, subsequent_indent=" " * 6))
    return "\n".join(lines)


def bad_input(kind: str, e: Exception) -> int:
    """Print the one line a bad input ends in and give its exit code; a wrapped library message may span lines."""
    print(f"a3po: {kind}: {' '.join(str(e).splitlines())}", file=sys.stderr)
    return EXIT_USAGE


def _add_config_args(p: argparse.ArgumentParser) -> None:
    from a3po.config.load import presets

    p.add_argument("--preset", metavar="NAME", help=f"start from a built-in preset ({', '.join(presets())})")
    p.add_argument("--config", metavar="FILE", help="YAML file of configuration keys (applied over the preset)")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="override one key, e.g. actor.prox_logp_method=recompute")


def _csv(kind):
    return lambda text: [kind(x) for x in text.split(",") if x]


def _add_bench_parsers(sub) -> None:
    from a3po.bench.args import (
        ARM_NAMES,
        E2E_DEFAULT_ARMS,
        METHODS,
        ROLLOUT_DTYPES,
        ROLLOUT_ENGINES,
        STALENESS_ARMS,
        RolloutBenchArgs,
        StalenessArgs,
        StepBenchArgs,
        SyncBenchArgs,
    )
    from a3po.config.choices import Dtype

    bench = sub.add_parser("bench", help="measure A-3PO, the rollout engine and staleness side by side "
                                         "(step, rollout, sync, e2e, staleness)",
                           description="Benchmarks whose ratios are measured side by side in one run.")
    kinds = bench.add_subparsers(dest="bench", metavar="KIND")
    d = StepBenchArgs()
    step = kinds.add_parser("step", help="one training step per proximal method, with its breakdown",
                            description="Time ppo_update on one fixed batch for each proximal method at each "
                                        "minibatch count, and the proximal computation alone.")
    step.add_argument("--model", default=d.model, help="actor.path (tiny-256x4 for a quick run)")
    step.add_argument("--dtype", choices=Dtype.CHOICES, default=d.dtype)
    step.add_argument("--batch", type=int, default=d.batch, help="sequences in the batch")
    step.add_argument("--prompt-len", type=int, default=d.prompt_len)
    step.add_argument("--output-len", type=int, default=d.output_len)
    step.add_argument("--minibatches", type=_csv(int), default=d.minibatches, help="e.g. 1,4")
    step.add_argument("--methods", type=_csv(str), default=d.methods, help=f"subset of {','.join(METHODS)}")
    step.add_argument("--repeats", type=int, default=d.repeats)
    step.add_argument("--warmup", type=int, default=d.warmup, help="untimed one-row steps per arm first")
    step.add_argument("--threads", type=int, default=None,
                      help="torch threads (default: the trainer's share of the cores in `a3po train`)")
    step.add_argument("--out", default=d.out, help="output folder (suffixed -2, -3, ... if taken)")

    r = RolloutBenchArgs()
    rollout = kinds.add_parser("rollout", help="rollout tokens/s per engine and dtype (local, model.generate, "
                                                       "vLLM), and the log-prob gap",
                               description="Time the local rollout engine in each dtype against model.generate "
                                           "(and vLLM with --engines) on the same batch, with the achieved "
                                           "GFLOP/s against this machine's matmul rate, and compare its "
                                           "log-probs with the trainer's.")
    rollout.add_argument("--model", default=r.model, help="actor.path (tiny for a quick run)")
    rollout.add_argument("--dtypes", type=_csv(str), default=r.dtypes, help=f"subset of {','.join(ROLLOUT_DTYPES)}")
    rollout.add_argument("--engines", type=_csv(str), default=r.engines,
                         help=f"subset of {','.join(ROLLOUT_ENGINES)} (vllm: where vLLM is installed, docs/scaling.md)")
    rollout.add_argument("--trainer-dtype", default=r.trainer_dtype,
                         help="actor.dtype of the trainer the log-probs are compared with (auto, float32, bfloat16)")
    rollout.add_argument("--batch", type=int, default=r.batch, help="requests in the batch (the worker's max batch)")
    rollout.add_argument("--group", type=int, default=r.group,
                         help="requests per distinct prompt, as gconfig.n_samples makes them in a run")
    rollout.add_argument("--max-new-tokens", type=int, default=r.max_new_tokens)
    rollout.add_argument("--repeats", type=int, default=r.repeats)
    rollout.add_argument("--update-every", type=int, default=r.update_every,
                         help="decode steps between in-flight weight updates in the rollout.weight_update arms "
                              "(0: none)")
    rollout.add_argument("--threads", type=int, default=r.threads, help="torch threads (one rollout worker's share)")
    rollout.add_argument("--out", default=r.out, help="output folder (suffixed -2, -3, ... if taken)")

    y = SyncBenchArgs()
    sync = kinds.add_parser("sync", help="weight publication per version: shared memory against Ray's object store",
                            description="Publish the model's weights through each transport the launchers use and "
                                        "read them into a worker's copy, alternating transports (needs Ray).")
    sync.add_argument("--model", default=y.model, help="actor.path (tiny for a quick run)")
    sync.add_argument("--repeats", type=int, default=y.repeats)
    sync.add_argument("--out", default=y.out, help="output folder (suffixed -2, -3, ... if taken)")

    e2e = kinds.add_parser("e2e", help="the paper's table: every arm a real training run",
                           description="Run each arm as a full `a3po train` with the same seeds, steps and data "
                                       "order; write results.md, results.json and plots/.")
    _add_train_bench_args(e2e, "e2e")
    e2e.add_argument("--arms", type=_csv(str), default=list(E2E_DEFAULT_ARMS),
                     help=f"subset of {','.join(ARM_NAMES)} (default: all but ranks2 and ray)")

    s = StalenessArgs()
    stale = kinds.add_parser("staleness", help="a staleness study: every arm at every eta and minibatch count",
                             description="Run a grid of full `a3po train` runs over the staleness bound eta "
                                         "(rollout.max_head_offpolicyness), actor.ppo_n_minibatches and the arms "
                                         "coupled, recompute (run as prox_logp_method=metrics), loglinear and reuse; "
                                         "write results.md, results.json and plots/.")
    _add_train_bench_args(stale, "staleness")
    stale.add_argument("--etas", type=_csv(int), default=s.etas, help="staleness bounds, e.g. 0,2,4,8")
    stale.add_argument("--minibatches", type=_csv(int), default=s.minibatches,
                       help="actor.ppo_n_minibatches values, e.g. 1,4 (reuse runs at 1 only)")
    stale.add_argument("--arms", type=_csv(str), default=s.arms,
                       help=f"subset of {','.join(STALENESS_ARMS)} "
                            "(eta = 0 runs the coupled baseline whatever this says)")
    stale.add_argument("--all-arms-at-eta0", action="store_true",
                       help="run every arm at eta = 0 too "
                            "(default: only the coupled baseline, which they all equal there)")


def _add_train_bench_args(p: argparse.ArgumentParser, name: str) -> None:
    """What every benchmark made of `a3po train` runs takes (TrainBenchArgs)."""
    _add_config_args(p)
    p.add_argument("--seeds", type=int, default=1, help="repeat every run with seeds seed, seed+1, ...")
    p.add_argument("--out",
                   help=f"output folder; an existing one is continued (default: a new <fileroot>/bench-{name})")
    p.add_argument("--keep-checkpoints", action="store_true", help="keep each run's final checkpoint")


def _from_args(cls, args):
    """The benchmark's arguments dataclass from the parsed options it names, checked where it can check itself."""
    made = cls(**{k: v for k, v in vars(args).items() if k in cls.__dataclass_fields__})
    return made.checked() if hasattr(made, "checked") else made


def _bench(args, argv: list[str]) -> int:
    from a3po.config import ConfigError

    if args.bench == "step":
        from a3po.bench import step

        return step.main(_from_args(step.StepBenchArgs, args))
    if args.bench == "rollout":
        from a3po.bench import rollout

        return rollout.main(_from_args(rollout.RolloutBenchArgs, args))
    if args.bench == "sync":
        from a3po.bench import sync
        from a3po.launch import check_ray

        check_ray("a3po bench sync")
        return sync.main(_from_args(sync.SyncBenchArgs, args))
    if args.bench == "e2e":
        from a3po.bench import e2e

        return e2e.main(_from_args(e2e.E2EArgs, args), argv)
    if args.bench == "staleness":
        from a3po.bench import staleness

        return staleness.main(_from_args(staleness.StalenessArgs, args), argv)
    raise ConfigError("a3po bench: choose step, rollout, sync, e2e or staleness (a3po bench --help)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="a3po",
        description="Asynchronous RL post-training of language models with A-3PO.",
    )
    parser.add_argument("--version", action="version", version=f"a3po {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    train = sub.add_parser(
        "train",
        help="train a policy (no arguments: the embedded default run)",
        description="Train a policy with asynchronous RL. "
                    "With no arguments: SmolLM2-135M-Instruct on chain_sum with A-3PO.",
        epilog=keys_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_config_args(train)
    train.add_argument("--resume", metavar="RUN_DIR", help="continue the run saved in RUN_DIR from its last checkpoint")

    _add_bench_parsers(sub)

    show = sub.add_parser("config", help="print the resolved configuration as YAML", epilog=keys_help(),
                          formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_config_args(show)
    return parser


def main(argv: list[str] | None = None) -> int:
    """The `a3po` command. Run as the program (argv None), it owns the process's SIGINT and SIGTERM
    (a3po/signals.py); a caller passing argv keeps its own handlers."""
    if argv is None:
        signals.install()
    try:
        return _main(argv)
    except (Exception, KeyboardInterrupt) as e:  # a stop train() did not report: start-up or a benchmark
        stop = signals.stop_behind(e)
        if stop is None:
            raise
        print(f"a3po: interrupted by {stop.name}", file=sys.stderr)
        return stop.exit_code


def _leave(code: int) -> NoReturn:
    """End the `a3po train` program here, without the interpreter's and C++'s teardown. Everything the run
    wrote is closed by now (its exit stack ran); a finished run could otherwise be aborted during
    that teardown (std::terminate: a native thread still joinable, exit -6) after its last step."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _main(argv: list[str] | None) -> int:
    from a3po.allocator import keep_freed_memory
    from a3po.config import ConfigError, dump_yaml, load_config
    from a3po.trainer.checkpoint import CheckpointError, resume_config

    keep_freed_memory()
    parser = build_parser()
    program = argv is None  # run as the `a3po` program, not called by other Python code
    argv = sys.argv[1:] if argv is None else argv
    args, rest = parser.parse_known_args(argv)
    # key=value overrides may sit on both sides of options (`--seeds 2 total_train_steps=4`);
    # argparse takes only the first run of positionals, so the later ones are picked up here
    strays = [a for a in rest if a.startswith("-") or "=" not in a or not hasattr(args, "overrides")]
    if strays:
        parser.error(f"unrecognized arguments: {' '.join(strays)}")
    if rest:
        args.overrides = [*args.overrides, *rest]
    if args.command is None:
        parser.print_help()
        return EXIT_USAGE
    if args.command == "bench":
        try:
            return _bench(args, argv[2:])
        except ConfigError as e:
            return bad_input("config error", e)
    try:
        if getattr(args, "resume", None):
            if args.config or args.preset:
                raise ConfigError("--resume takes its configuration from the run directory; "
                                  "drop --config/--preset (key=value overrides are allowed)")
            cfg = resume_config(args.resume, args.overrides)
        else:
            cfg = load_config(args.config, args.overrides, preset=args.preset)
    except ConfigError as e:
        return bad_input("config error", e)
    except CheckpointError as e:
        return bad_input("error", e)
    if args.command == "config":
        sys.stdout.write(dump_yaml(cfg))
        return 0
    if args.command == "train":
        # Importing torch is no place for an exception: raised inside its C++ start-up, one aborted
        # the process (std::terminate) or was dropped. A stop waits until the import is done (seconds).
        with signals.deferred():
            from a3po.pipeline.run import train

        code = train(cfg, resume=args.resume)
        if program:
            _leave(code)
        return code
    return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())

"""The `a3po` command line.

    a3po train [--preset NAME] [--config FILE] [--resume RUN_DIR] [key=value ...]
    a3po eval RUN_OR_MODEL [--samples K] [key=value ...]   held-out accuracy with its interval
    a3po export RUN_OR_CHECKPOINT --out DIR       one plain model folder (a LoRA adapter folded in)
    a3po serve [--model PATH] [--port N]           a model as an OpenAI-compatible chat server on 127.0.0.1
    a3po config [--config FILE] [key=value ...]     print the resolved configuration
    a3po bench step [options]                      time one training step per proximal method
    a3po bench rollout [options]                   rollout tokens/s per engine and dtype, log-prob gap
    a3po bench sync [options]                      weight publication per transport (shared memory, Ray)
    a3po bench e2e [--seeds N] [--arms ...] [key=value ...]   the paper's comparison as real runs
    a3po bench staleness [--etas 0,2,4,8] [--minibatches 1,4] [--arms ...] [--seeds N] [key=value ...]
                                                   every arm's training against the staleness bound eta
    a3po bench fidelity [--steps 4,8] [--run RUN_DIR] [key=value ...]
                                                   recorded batches replayed per proximal method: updates vs recompute

With no arguments `a3po train` runs the embedded default (the schema's defaults).
A bad configuration prints one line and exits with code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import atexit
import importlib
import os
import sys
import textwrap
from typing import NoReturn

from a3po import __version__, signals, startup

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


def ended(error: Exception, phase: str) -> int:
    """Print the one line `error` ends the command in and give its exit code (pipeline/exits.py's table);
    re-raise an error the table does not name (a bug: its traceback)."""
    from a3po.pipeline import exits

    end = exits.ending(error, phase)
    if end is None:
        raise error
    return _print(end)


def _print(end) -> int:
    print(end.line, file=sys.stderr)
    return end.code


def _add_config_args(p: argparse.ArgumentParser) -> None:
    from a3po.config.load import presets

    p.add_argument("--preset", metavar="NAME", help=f"start from a built-in preset ({', '.join(presets())})")
    p.add_argument("--config", metavar="FILE", help="YAML file of configuration keys (applied over the preset)")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="override one key, e.g. actor.prox_logp_method=recompute")


def _bench(args, argv: list[str]) -> int:
    from a3po.bench.args import TrainBenchArgs, from_namespace
    from a3po.config import extras

    options = from_namespace(args)  # checked: a bad option is a ConfigError before anything runs
    if options.command in ("e2e", "staleness"):  # their plots come last: missing, hours of runs would end in an error
        extras.require("plots", f"a3po bench {options.command}")
    if options.command == "step" and options.lora_rank:
        extras.require("lora", f"a3po bench step --lora-rank {options.lora_rank}")
    if options.command == "sync":
        from a3po.launch import check_ray

        check_ray("a3po bench sync")
    with signals.deferred(), startup.collector_held():
        bench = importlib.import_module(f"a3po.bench.{options.command}")
    if isinstance(options, TrainBenchArgs):  # made of `a3po train` runs: argv's key=value overrides go on to them
        return bench.main(options, argv)
    return bench.main(options)


def _eval(args) -> int:
    from a3po.pipeline import exits

    if args.samples < 1:
        return _print(exits.usage_error(f"--samples {args.samples}: must be at least 1"))
    with signals.deferred(), startup.collector_held():
        from a3po import heldout
    try:
        return heldout.main(args.target, args.config, args.preset, args.overrides, args.samples, args.out)
    except Exception as e:
        return ended(e, exits.EVAL)


def _export(args) -> int:
    from a3po.pipeline import exits

    with signals.deferred(), startup.collector_held():
        from a3po import export
    try:
        return export.main(args.target, args.out)
    except Exception as e:
        return ended(e, exits.EXPORT)


def _serve(args) -> int:
    from a3po.pipeline import exits

    if args.max_tokens < 1 or not 0 <= args.port < 65536:
        return _print(exits.usage_error("--max-tokens must be at least 1 and --port in 0..65535"))
    from a3po.models.paths import check_path

    try:  # a mistyped model folder is one line before torch's start-up
        check_path(args.model)
    except Exception as e:
        return ended(e, exits.SERVE)
    with signals.deferred(), startup.collector_held():
        from a3po import serve
    try:
        return serve.main(serve.ServeArgs(args.model, args.host, args.port, args.backend, args.dtype, args.device,
                                          args.max_tokens, args.name, args.seed,
                                          tool_call_format=args.tool_call_format))
    except Exception as e:
        return ended(e, exits.SERVE)


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

    from a3po.bench.args import add_parsers

    add_parsers(sub, config_args=_add_config_args)

    ev = sub.add_parser("eval", help="held-out accuracy of a run, a checkpoint or a model, with its interval",
                        description="Evaluate a run folder (its newest checkpoint), a checkpoint or a model on the "
                                    "held-out split of the task its configuration names; print the accuracy with "
                                    "its 95 % interval and write a JSON record with every problem's result.",
                        epilog=keys_help(), formatter_class=argparse.RawDescriptionHelpFormatter)
    ev.add_argument("target", metavar="RUN_OR_MODEL",
                    help="a run folder, one of its checkpoints, a model folder, a hub id or a built-in model name")
    _add_config_args(ev)
    ev.add_argument("--samples", type=int, default=1, metavar="K",
                    help="1 (default): greedy; K > 1: K completions per problem sampled at gconfig.temperature, "
                         "a problem counting the share of them that solve it")
    ev.add_argument("--out", metavar="FILE", help="where the JSON record goes (default: <run>/eval_step<N>.json "
                                                  "for a run, ./a3po-eval.json for a model)")

    ex = sub.add_parser("export", help="one plain model folder from a run (a LoRA adapter folded into its base)",
                        description="Write a run's newest checkpoint (or the one given) as a plain Hugging Face "
                                    "model folder with its tokenizer; a LoRA run's adapter is folded into the "
                                    "run's base model.")
    ex.add_argument("target", metavar="RUN_OR_CHECKPOINT", help="a run folder or one of its checkpoints")
    ex.add_argument("--out", required=True, metavar="DIR", help="the new model folder")

    sv = sub.add_parser("serve", help="a model as an OpenAI-compatible chat server on 127.0.0.1 (e.g. a judge)",
                        description="Serve a model (a built-in name, a model folder, a hub id, or a run's exported "
                                    "model) at http://HOST:PORT/v1 with POST /v1/chat/completions, POST "
                                    "/v1/completions and GET /v1/models. "
                                    "The first line printed names the URL once the model is loaded.")
    from a3po.config.choices import Backend, Dtype, ToolCallFormat
    from a3po.config.schema import ActorConfig
    from a3po.serve import ServeArgs

    sv.add_argument("--model", default=ActorConfig.path, help="what to serve (default: %(default)s)")
    sv.add_argument("--host", default=ServeArgs.host, help="address to listen on (default: %(default)s, loopback "
                                                           "only; anything else exposes the model to the network)")
    sv.add_argument("--port", type=int, default=ServeArgs.port, help="port (default: 0, a free one)")
    sv.add_argument("--backend", default=ServeArgs.backend, choices=Backend.CHOICES, help="inference engine")
    sv.add_argument("--dtype", default=ServeArgs.dtype, choices=Dtype.CHOICES, help="weights' dtype")
    sv.add_argument("--device", default=ServeArgs.device, help="auto, cpu, cuda or cuda:N")
    sv.add_argument("--max-tokens", type=int, default=ServeArgs.max_tokens,
                    help="the most tokens one reply may generate (default: %(default)s)")
    sv.add_argument("--name", help="the model name it reports (default: --model)")
    sv.add_argument("--seed", type=int, default=ServeArgs.seed, help="sampling seed of requests without one")
    sv.add_argument("--tool-call-format", default=ServeArgs.tool_call_format, choices=ToolCallFormat.CHOICES,
                    help="how tool calls are read from replies: auto (the format the chat template writes), "
                         "none (replies stay text) or a format named (docs/training.md, tool calls)")

    show = sub.add_parser("config", help="print the resolved configuration as YAML", epilog=keys_help(),
                          formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_config_args(show)
    return parser


def main(argv: list[str] | None = None) -> int:
    """The `a3po` command. Run as the program (argv None), it owns the process's SIGINT and SIGTERM
    (a3po/signals.py); a caller passing argv keeps its own handlers."""
    if argv is None:
        signals.install()
    # transformers' and huggingface_hub's own progress bars ("Loading weights", "Writing model shards", downloads)
    # clutter what the commands print: off before either is imported, here and in every process started from
    # here. HF_HUB_DISABLE_PROGRESS_BARS=0 in the environment keeps them.
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    try:
        return _main(argv)
    except (Exception, KeyboardInterrupt) as e:  # a stop train() did not report: start-up or a benchmark
        stop = signals.stop_behind(e)
        if stop is None:
            raise
        print(f"a3po: interrupted by {stop.name}", file=sys.stderr)
        if argv is None:  # torch may be half started: its teardown can abort the process (see _leave)
            _leave(stop.exit_code)
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
    from a3po.config.choices import Launcher
    from a3po.pipeline import exits
    from a3po.trainer.checkpoint import resume_config

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
        except Exception as e:
            return ended(e, exits.BENCH)
    if args.command == "eval":
        return _eval(args)
    if args.command == "export":
        return _export(args)
    if args.command == "serve":
        return _serve(args)
    try:
        if getattr(args, "resume", None):
            if args.config or args.preset:
                raise ConfigError("--resume takes its configuration from the run directory; "
                                  "drop --config/--preset (key=value overrides are allowed)")
            cfg = resume_config(args.resume, args.overrides)
        else:
            cfg = load_config(args.config, args.overrides, preset=args.preset)
    except Exception as e:
        return ended(e, exits.CONFIG)
    if args.command == "config":
        sys.stdout.write(dump_yaml(cfg))
        return 0
    if args.command == "train":
        from a3po.pipeline.inputs import load_inputs

        try:  # the dataset, reward, environment ...: a bad one is one line before torch's start-up
            inputs = load_inputs(cfg)
        except Exception as e:
            return ended(e, exits.INPUTS)
        # Importing torch is no place for an exception: raised inside its C++ start-up, one aborted
        # the process (std::terminate) or was dropped. A stop waits until the import is done (seconds).
        with signals.deferred(), startup.collector_held():
            from a3po.pipeline.run import train
            from a3po.trainer.ranks import torchrun_rank

            # its workers and ranks are forked from this process; torchrun's other ranks start none, they follow
            forks = cfg.cluster.launcher == Launcher.LOCAL and torchrun_rank()[0] == 0
            if forks:  # so they start with their own imports done too
                from a3po.rollout.worker import worker_imports

                worker_imports()
        if forks:
            from a3po.launch import forked

            forked.start()  # before torch runs anything: the workers and ranks are forked from it, imports done
        code = train(cfg, resume=args.resume, inputs=inputs)
        if program:
            _leave(code)
        return code
    return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())

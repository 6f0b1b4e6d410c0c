"""The `a3po` command line.

    a3po train [--preset NAME] [--config FILE] [--resume RUN_DIR] [key=value ...]
    a3po config [--config FILE] [key=value ...]     print the resolved configuration

With no arguments `a3po train` runs the embedded default (the schema's defaults).
A bad configuration prints one line and exits with code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import sys
import textwrap

from a3po import __version__
from a3po.config import ConfigError, all_keys, dump_yaml, load_config
from a3po.config.load import default_of, presets, type_name

EXIT_USAGE = 2


def keys_help() -> str:
    """Every configuration key with its type, default and meaning, for --help."""
    lines = ["configuration keys (set in --config YAML or as key=value):"]
    for key, f in all_keys().items():
        default = default_of(f)
        rules = f.metadata
        extra = f" [{' | '.join(map(str, rules['choices']))}]" if "choices" in rules else ""
        lines.append(f"  {key} ({type_name(f.type)}, default {default!r}){extra}")
        lines.extend(textwrap.wrap(rules["help"], width=88, initial_indent=" " * 6, subsequent_indent=" " * 6))
    return "\n".join(lines)


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", metavar="NAME", help=f"start from a built-in preset ({', '.join(presets())})")
    p.add_argument("--config", metavar="FILE", help="YAML file of configuration keys (applied over the preset)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="override one key, e.g. actor.prox_logp_method=recompute")


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
        description="Train a policy with asynchronous RL. With no arguments: SmolLM2-135M-Instruct on chain_sum with A-3PO.",
        epilog=keys_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_config_args(train)
    train.add_argument("--resume", metavar="RUN_DIR", help="continue the run saved in RUN_DIR from its last checkpoint")

    show = sub.add_parser("config", help="print the resolved configuration as YAML", epilog=keys_help(),
                          formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_config_args(show)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return EXIT_USAGE
    try:
        if getattr(args, "resume", None):
            from a3po.train.run import resume_config

            if args.config or args.preset:
                raise ConfigError("--resume takes its configuration from the run directory; drop --config/--preset (key=value overrides are allowed)")
            cfg = resume_config(args.resume, args.overrides)
        else:
            cfg = load_config(args.config, args.overrides, preset=args.preset)
    except ConfigError as e:
        print(f"a3po: config error: {e}", file=sys.stderr)
        return EXIT_USAGE
    if args.command == "config":
        sys.stdout.write(dump_yaml(cfg))
        return 0
    if args.command == "train":
        from a3po.train.run import train

        return train(cfg, resume=args.resume)
    return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())

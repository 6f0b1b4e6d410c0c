"""Reference pages generated from the code, so that they cannot drift from it.

    python -m a3po.config.docs docs    (or `make docs`) write docs/config.md from the schema and
                                       docs/metrics.md from a3po/metrics.py

tests/test_docs.py fails when a committed page differs from what this generates.
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
import typing
from pathlib import Path

from a3po.config.load import default_of, type_name
from a3po.config.schema import Config
from a3po.metrics import NAMESPACES, NOTATION, REGISTRY, namespace, placeholders

COMMAND = "python -m a3po.config.docs docs"


def _default(f: dataclasses.Field) -> str:
    d = default_of(f)
    if d is None:
        return "null"
    if isinstance(d, bool):
        return str(d).lower()
    if isinstance(d, (list, dict)):
        return json.dumps(d)
    return str(d)


def _allowed(meta: dict) -> str:
    """The values load_config accepts for a key: its choices, pattern or bounds."""
    if "choices" in meta:
        return " | ".join(f"`{c}`" for c in meta["choices"])
    if "pattern" in meta:
        return meta["pattern_help"].removeprefix("use ")
    signs = {"ge": "≥", "gt": ">", "le": "≤", "lt": "<"}
    return ", ".join(f"{sign} {meta[rule]}" for rule, sign in signs.items() if rule in meta)


def _sections(cls: type = Config, prefix: str = "", help: str = "top-level keys"):
    """(dotted prefix, meaning, leaf fields) of every section, parents before their subsections."""
    hints = typing.get_type_hints(cls)
    leaves = [f for f in dataclasses.fields(cls) if not dataclasses.is_dataclass(hints[f.name])]
    yield prefix, help, [(f"{prefix}{f.name}", hints[f.name], f) for f in leaves]
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            yield from _sections(hints[f.name], f"{prefix}{f.name}.", f.metadata["help"])


def config_reference() -> str:
    """docs/config.md: every key of the schema by section, with type, default, allowed values, meaning."""
    out = [
        "# Configuration reference",
        "",
        f"*Generated from `src/a3po/config/schema.py` by `{COMMAND}`: edit the schema, not this page.*",
        "",
        "Every key `a3po train` reads. Set them in a YAML file (`--config FILE`, nested by section) or as "
        "`key=value` overrides on the command line; `a3po config ...` prints the resolved configuration. "
        "A value outside *allowed* is refused before anything starts, in one line (exit code 2).",
    ]
    for prefix, help, keys in _sections():
        title = f"`{prefix.rstrip('.')}`: {help}" if prefix else help
        out += ["", f"## {title}", "",
                "| key | type | default | allowed | meaning |", "|---|---|---|---|---|"]
        for key, tp, f in keys:
            out.append(_row(f"`{key}`", type_name(tp), f"`{_default(f)}`", _allowed(f.metadata),
                            _cell(f.metadata["help"])))
    return "\n".join(out) + "\n"


def metrics_reference() -> str:
    """docs/metrics.md: every entry of a3po/metrics.py by namespace, with the placeholders and the notation."""
    out = [
        "# Metrics reference",
        "",
        f"*Generated from `src/a3po/metrics.py` by `{COMMAND}`: edit the registry, not this page.*",
        "",
        "A run writes one JSON line per step to `<run dir>/metrics.jsonl` and sends the same keys to "
        "TensorBoard (`logging.tensorboard`) and W&B (`logging.wandb`). The line of step 0 holds the initial "
        "evaluation only. A key is logged on every training step unless its *logged* column names a condition.",
        "",
        f"Notation: {NOTATION}",
        "",
        "Placeholders in a name stand for a family of keys:",
        "",
    ]
    out += [f"- `{hole}`: {text}" for hole, (_, text) in placeholders().items()]
    for ns, what in NAMESPACES.items():
        out += ["", f"## {f'`{ns}/`' if ns else '`step`'}: {what}", "",
                "| key | unit | meaning | logged | written by |", "|---|---|---|---|---|"]
        for m in (m for m in REGISTRY if namespace(m) == ns):
            out.append(_row(f"`{m.name}`", _cell(m.unit), _cell(m.meaning), _cell(m.when or "every step"),
                            ", ".join(f"`{p}`" for p in m.producer)))
    return "\n".join(out) + "\n"


def _cell(text: str) -> str:
    """Prose for a table cell: a bare <name> goes in backticks (markdown would take it for an HTML tag)."""
    parts = re.split(r"(`[^`]*`)", text)
    return "".join(p if p.startswith("`") else re.sub(r"(<[^<>\s]+>)", r"`\1`", p) for p in parts)


def _row(*cells: str) -> str:
    return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"


def pages() -> dict[str, str]:
    """Each generated page under docs/, by file name."""
    return {"config.md": config_reference(), "metrics.md": metrics_reference()}


def write_pages(folder: Path) -> list[Path]:
    written = []
    for name, text in pages().items():
        path = folder / name
        path.write_text(text)
        written.append(path)
    return written


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1].startswith("-"):
        sys.exit(f"usage: {COMMAND} (writes config.md and metrics.md into the folder named)")
    for path in write_pages(Path(sys.argv[1])):
        print(f"wrote {path}")

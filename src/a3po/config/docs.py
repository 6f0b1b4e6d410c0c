"""The configuration reference as a markdown table, generated from the schema.

README.md embeds its output between the markers below; a test fails when they differ:
    python -m a3po.config.docs --write README.md
"""

from __future__ import annotations

import sys
from pathlib import Path

from a3po.config.load import all_keys, default_of, type_name

BEGIN, END = "<!-- config-reference:begin -->", "<!-- config-reference:end -->"


def reference_table() -> str:
    rows = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for key, f in all_keys().items():
        d = default_of(f)
        d = "null" if d is None else (str(d).lower() if isinstance(d, bool) else d)
        choices = f.metadata.get("choices")
        allowed = f" One of: {', '.join(f'`{c}`' for c in choices)}." if choices else ""
        rows.append(f"| `{key}` | {type_name(f.type)} | `{d}` | {f.metadata['help']}.{allowed} |")
    return "\n".join(rows)


def embed(text: str) -> str:
    head, _, rest = text.partition(BEGIN)
    _, _, tail = rest.partition(END)
    return f"{head}{BEGIN}\n{reference_table()}\n{END}{tail}"


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--write":
        p = Path(sys.argv[2])
        p.write_text(embed(p.read_text()))
    else:
        print(reference_table())

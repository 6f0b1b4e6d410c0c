"""The generated reference pages (docs/config.md, docs/metrics.md) match the code they are generated from."""

import subprocess
import sys
from pathlib import Path

from a3po.config import all_keys
from a3po.config.docs import COMMAND, pages
from a3po.metrics import REGISTRY

DOCS = Path(__file__).resolve().parents[1] / "docs"


def test_committed_pages_are_current():
    for name, text in pages().items():
        assert (DOCS / name).read_text() == text, f"docs/{name} is out of date; regenerate it: {COMMAND}"


def test_pages_list_every_key_and_metric():
    config, metrics = pages()["config.md"], pages()["metrics.md"]
    assert all(f"| `{key}` |" in config for key in all_keys())
    assert all(f"| `{m.name}` |" in metrics for m in REGISTRY)
    assert all(COMMAND in text.splitlines()[2] for text in (config, metrics))  # the header names the command


def test_the_command_writes_both_pages(tmp_path):
    res = subprocess.run([sys.executable, "-m", "a3po.config.docs", str(tmp_path)], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    assert {p.name: p.read_text() for p in tmp_path.iterdir()} == pages()

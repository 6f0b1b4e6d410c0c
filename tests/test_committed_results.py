"""Every generated page under docs/results/ is what its committed records give today.

docs/results.md promises that each table comes from committed run records by one command. This
runs those commands on a copy of every record folder (trains nothing) and compares the pages
byte for byte, so a change to a report that shifts a committed number, or a record the code can
no longer read (an older run's missing column), fails here instead of on the day someone
regenerates it.
"""

import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from a3po.bench import e2e, fidelity_report, staleness

DOCS = Path(__file__).parent.parent / "docs"
RESULTS = DOCS / "results"
FOLDERS = sorted(p.parent for p in RESULTS.rglob("results.json"))


def _documented_command(start: str) -> list[str]:
    """The shell command in docs/results.md that begins with `start`, continuation lines joined."""
    text = (DOCS / "results.md").read_text()
    found = re.search(re.escape(start) + r"(?:[^\n]*\\\n)*[^\n]*", text)
    assert found, f"docs/results.md lost the command starting {start!r}"
    return shlex.split(found.group(0).replace("\\\n", " "))


def test_there_are_records_of_every_benchmark_that_writes_them():
    kinds = {json.loads((f / "results.json").read_text())["benchmark"] for f in FOLDERS}
    assert kinds == {"e2e", "staleness", "fidelity"}


@pytest.mark.parametrize("folder", FOLDERS, ids=[str(f.relative_to(RESULTS)) for f in FOLDERS])
def test_each_folders_page_regenerates_from_its_record(folder, tmp_path):
    copy = tmp_path / folder.name
    shutil.copytree(folder, copy, ignore=shutil.ignore_patterns("plots"))
    kind = json.loads((folder / "results.json").read_text())["benchmark"]
    {"e2e": e2e.regenerate, "staleness": staleness.regenerate, "fidelity": fidelity_report.regenerate}[kind](copy)
    assert (copy / "results.md").read_text() == (folder / "results.md").read_text()
    assert json.loads((copy / "results.json").read_text()) == json.loads((folder / "results.json").read_text())
    if kind != "fidelity":  # a fidelity record has tables only
        plots = lambda f: sorted(p.name for p in (f / "plots").iterdir())
        assert plots(copy) == plots(folder)


def test_the_summary_page_is_what_its_documented_command_writes(tmp_path):
    argv = _documented_command("python -m a3po.bench.staleness --summary")
    out = argv.index("--summary") + 1
    assert argv[out] == "docs/results/evidence-summary.md"
    folders = [Path(a) for a in argv[out + 1:]]
    assert folders and all(str(f).startswith("docs/results/") for f in folders)
    for f in folders:
        shutil.copytree(DOCS.parent / f, tmp_path / f.name, ignore=shutil.ignore_patterns("plots"))
    staleness.write_summary(tmp_path / "summary.md", [tmp_path / f.name for f in folders])
    assert (tmp_path / "summary.md").read_text() == (RESULTS / "evidence-summary.md").read_text()


def test_the_before_after_page_is_what_its_documented_command_writes(tmp_path):
    argv = _documented_command("python -m a3po.bench.paired --a")
    folder = RESULTS / "default-before-after"
    shutil.copytree(folder, tmp_path / "f")
    (tmp_path / "f" / "results.md").unlink()
    res = subprocess.run([sys.executable, *argv[1:]], cwd=tmp_path / "f", capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert (tmp_path / "f" / "results.md").read_text() == (folder / "results.md").read_text()


def test_no_record_under_docs_results_is_left_out_of_git():
    """A record the tests read but .gitignore hides passes here and fails on every fresh clone."""
    if not (DOCS.parent / ".git").exists():
        pytest.skip("not a git checkout")
    hidden = subprocess.run(
        ["git", "ls-files", "--others", "--ignored", "--exclude-standard", "docs/results"],
        cwd=DOCS.parent, capture_output=True, text=True, check=True,
    ).stdout.split()
    assert hidden == [], f"ignored by .gitignore but read as records: {hidden[:5]}"


def test_the_equivalence_page_is_what_its_design_and_records_give(tmp_path):
    """The study's page as its runs land: per-seed rows only until every seed of the design has run."""
    design = RESULTS / "equivalence" / "DESIGN.yaml"
    res = subprocess.run([sys.executable, "-m", "a3po.bench.equivalence", str(design), "--out", str(tmp_path / "p.md")],
                         cwd=DOCS.parent, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert (tmp_path / "p.md").read_text() == (RESULTS / "equivalence" / "equivalence.md").read_text()

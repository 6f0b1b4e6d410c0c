"""docs/results.md's hand-written sentences say what the committed records say.

tests/test_committed_results.py rewrites every generated page under docs/results/ from its records;
the prose of docs/results.md around those pages is typed by hand, and a typed number drifts from its
record without anything failing. Here the records are read the way the pages read them
(bench/report.py, bench/paired.py, the folders' results.json, which that test keeps equal to what
the code derives from the runs), and the sections that make quality claims are checked against them:
the evidence study (its summary, its defaults, parts 1-9), the reward service, the withdrawn first
study and LoRA.

- Every interval "m [lo, hi]", spread "m (min..max)", per-seed list "a, b, c" and range "a-b" in
  those sections is one the records give, at the precision the prose wrote it. Shares in % are
  checked only where a claim below names them.
- Every other number with three decimals there is one of the values the section's records give.
  That is weaker (a wrong number can equal another right one), so the claims that a reader acts on
  are also checked one by one, by what they say.
- A table said to be copied from a generated page is a copy of its rows.
- Every "no measurable difference" here, in README.md and in docs/training.md states its resolution
  in the same sentence (an interval, or a ± half-width): no difference measured at ±0.2 is not an
  equivalence.

The sections about speed and set-up (one measurement on a named machine, no record folder) are not
checked here.
"""

from __future__ import annotations

import json
import re
import statistics
from functools import cache
from pathlib import Path

import pytest

from a3po import intervals
from a3po.bench import paired, report

ROOT = Path(__file__).parent.parent
DOCS = ROOT / "docs"
RESULTS = DOCS / "results"
NUM = r"[+-]?\d+\.\d+"
INTERVAL = re.compile(rf"({NUM}) \[({NUM}), ({NUM})\]")
BOUNDS = re.compile(rf"\[({NUM}), ({NUM})\]")
SPREAD = re.compile(rf"({NUM}) \(({NUM})\.\.({NUM})\)")
LIST = re.compile(rf"(?<![\w.]){NUM}(?:, {NUM})+(?![\w.])")
RANGE = re.compile(r"(?<![\w.-])(\d+\.\d{2,})-(\d+\.\d{2,})(?![\w.]| ?%)")  # a share in % is no accuracy

STUDY = ("evidence-eta8-lockstep", "evidence-eta2-lockstep", "evidence-free", "evidence-retry-eta8-lockstep",
         "evidence-retry-eta2-lockstep")
SERVICE = ("service-default", "service-eta4", "service-delay0")
LORA = ("lora-default", "lora-lr6e-4", "lora-lr2e-3")
E2E = ("lockstep-cost", "lockstep-cost-no-borrowing", *SERVICE, *LORA)
# one factor at a time against part 3's A-3PO runs (docs/results/collapse-factors/PLAN.md)
COLLAPSE = tuple(f"collapse-factors/{f}" for f in ("lr1e-5", "bounds", "seq-mean", "truncate"))
# the corrections in training, each arm against A-3PO in its folder (docs/results/corrections-yardstick/PLAN.md)
CORRECTIONS = ("corrections-yardstick/local", "corrections-yardstick/vllm")

# each checked section of docs/results.md (by the start of its heading; of another page: "PAGE#start") and the record
# folders its numbers come from
SECTIONS = {
    "A-3PO against recomputing": (*STUDY, "yardstick-base", "yardstick-retry-base", "default-before-after"),
    "Defaults, from this evidence": STUDY,
    "Part 1:": ("evidence-eta8-lockstep", "yardstick-base", "yardstick-pilot"),
    "Part 2:": ("evidence-eta2-lockstep", "yardstick-base"),
    "Part 3:": ("evidence-eta8-lockstep", "yardstick-base"),
    "Part 4:": ("evidence-eta2-lockstep", "yardstick-base"),
    "Part 5:": ("evidence-free",),
    "Part 6:": ("default-before-after", "evidence-free"),
    "Part 7:": ("evidence-eta8-lockstep",),
    "Part 8:": ("lockstep-cost", "lockstep-cost-no-borrowing", "evidence-eta2-lockstep", "evidence-free"),
    "Part 11:": (*COLLAPSE, "evidence-eta8-lockstep", "yardstick-base"),
    "Part 9:": ("evidence-retry-eta8-lockstep", "evidence-retry-eta2-lockstep", "yardstick-retry-base",
                "yardstick-retry-pilot", "evidence-retry-eta2-lockstep/sampled", "evidence-eta2-lockstep",
                "evidence-eta8-lockstep"),
    "A slow reward service": SERVICE,
    "The first staleness study": ("evidence-eta8-lockstep",),
    "LoRA": (*LORA, "lora-step", "lora-memory"),
    "docs/training.md#Which proximal method when": (*STUDY, "fidelity-corrections", *COLLAPSE, *CORRECTIONS),
    # the plans quote the records their screens start from
    **{f"docs/results/collapse-factors/PLAN.md#{h}": ("evidence-eta8-lockstep", "yardstick-base")
       for h in ("Why decoupled PPO fails", "Runs", "Reading")},
    "docs/results/corrections-yardstick/PLAN.md#The off-policy corrections": STUDY,
    "docs/results/equivalence-retry-pilot/PLAN.md#Yardstick": ("evidence-retry-eta8-lockstep",),
    "docs/results/equivalence-retry-pilot/PLAN.md#Reshaped for cost": ("equivalence-retry-pilot/cost-probe",),
    "docs/results/corrections-yardstick/PLAN.md#Cell 1's outcome": ("evidence-eta8-lockstep", *CORRECTIONS),
}
# sections that quote a one-off measurement of another section (one run on a named machine, no record folder)
SECTIONS["Off-policy corrections on SmolLM2"] = ("smollm2-icepop-topp",)
SECTIONS["TextArena's GuessTheNumber on SmolLM2"] = ("textarena-smollm2",)
# folders that hold one `a3po train` run's records (config.yaml, metrics.jsonl, held_out.jsonl)
ONE_RUN = ("smollm2-icepop-topp", "textarena-smollm2", "readme-example-smollm2", "equivalence-retry-pilot/cost-probe")
SECTIONS["The newcomer's example"] = ("readme-example-smollm2",)
SECTIONS["Agent frameworks on SmolLM2"] = ("agent-frameworks-smollm2/openai-agents",
                                           "agent-frameworks-smollm2/pydantic-ai")
QUOTES = {"Part 6:": ("The default run and the staleness study", "The clean clone after multi-turn episodes")}
# sections whose every number with this many decimals or more is looked up (3 elsewhere: at 2, a wrong number too
# often equals some right one)
DECIMALS = {"A slow reward service": 2}


# ----------------------------------------------------------------------------- the page


def normal(text: str) -> str:
    """The prose with one kind of minus and single spaces, so a number broken over two lines still reads as one."""
    return re.sub(r"\s+", " ", text.replace("−", "-"))


@cache
def sections(page: str = "docs/results.md") -> dict[str, str]:
    """A page by heading: each heading's own text up to the next heading, code blocks left out."""
    out: dict[str, list[str]] = {}
    name, in_code = "", False
    for line in (ROOT / page).read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and line.startswith("#"):
            name = line.lstrip("#").strip()
            out[name] = []
        elif not in_code:
            out.setdefault(name, []).append(line)
    return {k: "\n".join(v) for k, v in out.items()}


def section(start: str) -> str:
    """The section of docs/results.md whose heading starts with `start`, or of another page: "PAGE#start"."""
    page, _, start = start.rpartition("#")
    found = [text for name, text in sections(page or "docs/results.md").items() if name.startswith(start)]
    assert len(found) == 1, f"{page or 'docs/results.md'} should have one section whose heading starts {start!r}"
    return found[0]


def sentences(text: str) -> list[str]:
    """Sentences of normalised prose, and each table row as one: a claim and its qualifiers share one."""
    out = []
    for block in re.split(r"\n\s*\n|\n(?=\|)|(?<=\|)\n", text):
        out += [s for s in re.split(r"(?<=[^\d\s.]\.)\s+(?=\S)|(?<=\d\.)\s+(?=[A-Z*])", normal(block)) if s.strip()]
    return out


def shown(x: float, like: str) -> str:
    """x written the way `like` is: its number of decimals, and a sign only where `like` has one."""
    places = len(like.split(".")[1])
    text = f"{x:+.{places}f}" if like[0] in "+-" else f"{x:.{places}f}"
    if float(text) == 0:  # -0.000 reads as +0.000
        text = text.replace("-", "+") if like[0] in "+-" else text.lstrip("-")
    return text


def agree(xs, tokens) -> bool:
    return len(xs) == len(tokens) and all(shown(x, t) == t for x, t in zip(xs, tokens))


# ----------------------------------------------------------------------------- the records


@cache
def load(folder: str) -> dict:
    """A folder's results.json (read only: every caller copies what it changes)."""
    return json.loads((RESULTS / folder / "results.json").read_text())


@cache
def evals(folder: str) -> dict[int, dict]:
    """`a3po eval` records of a folder, by seed."""
    return paired.by_seed([paired.read_record(p) for p in sorted((RESULTS / folder).glob("*.json"))], folder)


def later_turns(run_or_record: dict) -> float | None:
    """What the turns after the first added to a multi-turn accuracy (None where the first turn was not logged)."""
    if "metrics" in run_or_record:
        first = run_or_record["metrics"].get("eval/first_turn_accuracy")
        return None if first is None else run_or_record["accuracy"] - first
    first = run_or_record.get("first_turn_final")
    return None if first is None or first != first else run_or_record["eval_final"] - first


def base_of(folder: str) -> dict[int, dict]:
    """The base model's `a3po eval` records on the held-out problems of a study folder's seeds."""
    retry = next(iter(load(folder)["configs"].values()))["train_dataset"].get("env") == "retry"
    return evals("yardstick-retry-base" if retry else "yardstick-base")


def cells(folder: str) -> dict[tuple[str, int, int], list[dict]]:
    """A study folder's finished runs by (arm, eta, minibatches), seeds in order."""
    out: dict[tuple[str, int, int], list[dict]] = {}
    for r in sorted(load(folder)["runs"], key=lambda r: r["seed"]):
        if r.get("ok"):
            out.setdefault((r["arm"], r["eta"], r["minibatches"]), []).append(r)
    return out


def gain(run: dict, base: dict) -> float:
    """A run's final held-out result minus the base model's on the same problems, mean over problems."""
    return statistics.fmean(a - b for a, b in zip(run["held_out_final"], base["solved"]))


def across(first: tuple[str, str], second: tuple[str, str]) -> dict:
    """(folder, arm) minus (folder, arm) of two e2e folders, paired by seed as report.paired_differences pairs."""
    runs = [dict(r, arm=name) for name, (folder, arm) in (("a", first), ("b", second))
            for r in load(folder)["runs"] if r["arm"] == arm]
    return report.paired_differences(runs, "a", "b")


class Catalogue:
    """What a set of records gives: intervals (mean, lo, hi), spreads (mean, min, max), per-seed lists, ranges
    (min, max) and single values, to look prose up in."""

    def __init__(self):
        self.intervals: list[tuple] = []
        self.spreads: list[tuple] = []
        self.lists: list[tuple] = []
        self.ranges: list[tuple] = []
        self.values: list[float] = []

    def interval(self, p: dict) -> None:
        if p and p["n"] > 1:
            lo, hi = p["interval"]
            self.intervals.append((p["mean"], lo, hi))
            self.values += [p["mean"], lo, hi, (hi - lo) / 2]  # and its half-width, the resolution
            self.list(p["values"])

    def spread(self, s: dict) -> None:
        if s and s.get("n"):
            self.spreads.append((s["mean"], s["min"], s["max"]))
            self.ranges.append((s["min"], s["max"]))
            self.values += [s["mean"], s["min"], s["max"]]

    def list(self, xs: list[float]) -> None:
        xs = [x for x in xs if x is not None and x == x]
        if xs:
            self.lists.append(tuple(xs))
            self.ranges += [(min(xs), max(xs)), (min(xs[:3]), max(xs[:3]))]  # all seeds, and the first three
            self.values += xs
            self.spread(report.mean_spread(xs))


def _study(c: Catalogue, folder: str) -> None:
    record, base = load(folder), base_of(folder)
    for row in record["table"]:
        for v in row.values():
            if isinstance(v, dict) and "mean" in v:
                c.spread(v)
    for p in record["paired"]:
        c.interval(p)
        if p["n"] > 3:  # what the cell read after its first three seeds
            c.interval(report.t_interval(p["values"][:3]))
    by_seed: dict[tuple[int, int, int], list[float]] = {}  # the arms of one eta and minibatch count, seed by seed
    for (_, eta, mb), rs in cells(folder).items():
        for r in rs:
            by_seed.setdefault((eta, mb, r["seed"]), []).append(r["eval_final"])
    for xs in by_seed.values():
        c.list(xs)
    for rs in cells(folder).values():
        for key in ("eval_final", "reward_final", "first_turn_final"):
            c.list([r.get(key) for r in rs])
        c.list([later_turns(r) for r in rs])
        gains = [gain(r, base[r["seed"]]) for r in rs if r["seed"] in base]
        if gains:
            c.list(gains)
            c.interval(report.t_interval(gains))
    for t in record["approx"]:
        for row in t["rows"]:
            c.values += [v for k, v in row.items() if k.endswith("/abs")]


def _e2e(c: Catalogue, folder: str) -> None:
    record = load(folder)
    for row in record["table"]:
        for key, _, _ in report.COLUMNS:
            c.spread(row[key])
    for g in report.held_out_gains(record["runs"]).values():
        c.interval(g)
    arms = [row["arm"] for row in record["table"]]
    for a in arms:
        rs = sorted((r for r in record["runs"] if r.get("ok") and r["arm"] == a), key=lambda r: r["seed"])
        for key, _, _ in report.COLUMNS:
            c.list([r.get(key) for r in rs])
        for b in arms:
            if a != b:
                c.interval(report.paired_differences(record["runs"], a, b))


def _evals(c: Catalogue, folder: str) -> None:
    records = [paired.read_record(p) for p in sorted((RESULTS / folder).glob("*.json"))]
    c.list([r["accuracy"] for r in records])
    c.list([later_turns(r) for r in records])
    for r in records:
        lo, hi = intervals.accuracy_interval(r["solved"])
        c.intervals.append((r["accuracy"], lo, hi))
        c.values += [r["accuracy"], lo, hi]


def _pilot(c: Catalogue, folder: str) -> None:
    rows = [json.loads(line) for line in (RESULTS / folder / "metrics.jsonl").read_text().splitlines() if line]
    c.list([r["eval/accuracy"] for r in rows if "eval/accuracy" in r])


def _run(c: Catalogue, folder: str) -> None:
    """One `a3po train` run's records: its held-out accuracies with their intervals, and its per-step metrics."""
    for line in (RESULTS / folder / "held_out.jsonl").read_text().splitlines():
        solved = json.loads(line)["solved"]
        acc = sum(solved) / len(solved)
        lo, hi = intervals.accuracy_interval(solved)
        c.intervals.append((acc, lo, hi))
        c.values += [acc, lo, hi]
    rows = [json.loads(line) for line in (RESULTS / folder / "metrics.jsonl").read_text().splitlines() if line]
    c.values += [v for r in rows for k, v in r.items() if k.startswith(("loss/", "eval/", "rollout/reward"))
                 and isinstance(v, float)]


def _corrections(c: Catalogue, folder: str) -> None:
    """What each correction did in its runs: per cell, each seed's mean over steps of the shares it masked or
    truncated (read from the run folders kept beside the record)."""
    for rs in cells(folder).values():
        for key in ("loss/corr_masked_frac", "loss/tis_truncated_frac"):
            means = []
            for r in rs:
                rows = [json.loads(x) for x in (RESULTS / folder / "runs" / r["key"] / "metrics.jsonl").read_text()
                        .splitlines() if x]
                means.append(statistics.fmean(row[key] for row in rows if key in row))
            c.list(means)


def _against(c: Catalogue, folder: str, ref: str, ref_arm: str) -> None:
    """Each cell of a study folder minus `ref_arm`'s runs of the same eta and minibatch count in folder `ref`,
    paired by seed: a factor screen's runs against the runs it changes one thing of."""
    for (_, eta, mb), rs in cells(folder).items():
        base = {r["seed"]: r["eval_final"] for r in cells(ref).get((ref_arm, eta, mb), [])}
        c.interval(report.t_interval([r["eval_final"] - base[r["seed"]] for r in rs if r["seed"] in base]))


def _before_after(c: Catalogue, folder: str) -> None:
    before, after = ([paired.read_record(p) for p in sorted((RESULTS / folder / side).glob("*.json"))]
                     for side in ("before", "after"))
    result = paired.compare(before, after)
    c.interval(result)
    for key in ("a", "b", "difference"):
        c.list([r[key] for r in result["rows"]])
    steps = [[row["perf/step_s"] for row in map(json.loads, path.read_text().splitlines()) if "perf/step_s" in row]
             for path in sorted((RESULTS / folder / "before-runs").glob("seed*/metrics.jsonl"))]
    c.list([statistics.fmean(xs) for xs in steps])


def _lora(c: Catalogue) -> None:
    """The comparisons across the LoRA folders the prose makes (one learning rate against another)."""
    for first in (("lora-lr6e-4", "lora"), ("lora-lr2e-3", "lora")):
        for second in (("lora-default", "lora"), ("lora-default", "loglinear"), ("lora-lr6e-4", "lora")):
            if first != second:
                c.interval(across(first, second))


def _step(c: Catalogue, folder: str) -> None:
    """`a3po bench step` records: their numbers are the committed table's (step.md, written with step.json)."""
    c.values += [float(x) for x in re.findall(r"\d+\.\d+", (RESULTS / folder / "step.md").read_text())]


def _fidelity(c: Catalogue, folder: str) -> None:
    """`a3po bench fidelity` records: the summary's means per arm and part, and each record's rows and statistics."""
    record = json.loads((RESULTS / folder / "results.json").read_text())
    for row in record["summary"]:
        c.values += [row[k]["mean"] for k in ("cos", "rel_norm", "rel_err", "kl") if row[k]["mean"] is not None]
    for rec in record["records"]:
        for row in rec.get("rows", []):
            c.values += [row[k] for k in ("cos", "rel_norm", "rel_err", "kl") if isinstance(row.get(k), float)]
            c.values += list(row["stats"].values())


@cache
def catalogue(folders: tuple[str, ...]) -> Catalogue:
    c = Catalogue()
    for folder in folders:
        if folder in STUDY:
            _study(c, folder)
        elif folder in COLLAPSE:
            _study(c, folder)
            _against(c, folder, "evidence-eta8-lockstep", "loglinear")
        elif folder in CORRECTIONS:
            _study(c, folder)
            _corrections(c, folder)
            _against(c, folder, folder, "loglinear")
            if folder == CORRECTIONS[0]:  # the plan's second reference for TIS, on the local engine only
                _against(c, folder, "evidence-eta8-lockstep", "recompute")
        elif folder in E2E:
            _e2e(c, folder)
        elif folder in ("yardstick-base", "yardstick-retry-base", "evidence-retry-eta2-lockstep/sampled"):
            _evals(c, folder)
        elif folder in ("yardstick-pilot", "yardstick-retry-pilot"):
            _pilot(c, folder)
        elif folder == "default-before-after":
            _before_after(c, folder)
        elif folder in ("lora-step", "lora-memory"):
            _step(c, folder)
        elif folder in ONE_RUN or folder.startswith("agent-frameworks-smollm2/"):
            _run(c, folder)
        elif folder == "fidelity-corrections":
            _fidelity(c, folder)
        else:
            raise AssertionError(f"no reader for {folder}")
    if any(f in LORA for f in folders):
        _lora(c)
    return c


# ----------------------------------------------------------------------------- every number of a section


def unaccounted(start: str) -> list[str]:
    """The numbers of a section that no record of its folders gives, each with the words around it."""
    c = catalogue(SECTIONS[start])
    text, missing = normal(section(start)), []

    def check(pattern: re.Pattern, known: list[tuple], what: str, text: str, part=False) -> str:
        def replace(m: re.Match) -> str:
            tokens = list(m.groups()) or re.findall(NUM, m.group(0))
            if not any(agree(k[i:i + len(tokens)], tokens) for k in known
                       for i in (range(len(k) - len(tokens) + 1) if part else [0])):
                missing.append(f"{what} {m.group(0)!r} in ...{text[max(0, m.start() - 60):m.end() + 20]}...")
            return " # "
        return pattern.sub(replace, text)

    text = check(INTERVAL, c.intervals, "interval", text)
    text = check(BOUNDS, [k[1:] for k in c.intervals], "interval", text)
    text = check(SPREAD, c.spreads, "spread", text)
    text = check(LIST, c.lists, "list", text, part=True)
    text = check(RANGE, c.ranges, "range", text)
    quoted = [float(x) for name in QUOTES.get(start, ()) for x in re.findall(r"\d+\.\d+", section(name))]
    for m in re.finditer(rf"(?<![\w.]){NUM}(?![\w.])", text):
        token = m.group(0)
        if len(token.split(".")[1]) >= DECIMALS.get(start, 3) and not any(shown(v, token) == token
                                                                         for v in [*c.values, *quoted]):
            missing.append(f"number {token!r} in ...{text[max(0, m.start() - 60):m.end() + 20]}...")
    return missing


@pytest.mark.parametrize("start", SECTIONS)
def test_every_number_of_the_section_is_one_its_records_give(start):
    assert unaccounted(start) == []


# ----------------------------------------------------------------------------- claims, one by one


def number_word(word: str) -> int:
    return {"one": 1, "two": 2, "three": 3, "four": 4, "five": 5}.get(word) or int(word)


def a3po_half_widths() -> list[float]:
    """The half-widths of every A-3PO - recompute interval of the study: its resolution."""
    return sorted((p["interval"][1] - p["interval"][0]) / 2 for folder in STUDY for p in load(folder)["paired"]
                  if (p["arm"], p["reference"]) == ("loglinear", "recompute"))


def four_minibatch_cells() -> list[dict]:
    """Each four-minibatch cell of the study's lockstep grid: the arms' mean final accuracy and the base model's mean
    on the same seeds' problems."""
    out = []
    for folder in STUDY:
        base = base_of(folder)
        for eta in (2, 8):
            arms = {arm: rs for (arm, e, mb), rs in cells(folder).items() if (e, mb) == (eta, 4)}
            if arms:
                seeds = sorted({r["seed"] for rs in arms.values() for r in rs})
                out.append({"folder": folder, "eta": eta,
                            "base": statistics.fmean(base[s]["accuracy"] for s in seeds),
                            **{arm: statistics.fmean(r["eval_final"] for r in rs) for arm, rs in arms.items()}})
    return out


def test_the_claim_says_what_was_shown_at_its_resolution():
    """The study's claim paragraph states the resolution of its A-3PO - recompute intervals, and that where the two
    methods compute different updates (four minibatches) both mostly failed to learn: what it has shown, no more."""
    claim = next(s for s in section("A-3PO against recomputing").split("\n\n") if "The claim" in s)
    halves = a3po_half_widths()
    found = re.search(rf"half-widths of ±({NUM}) to ±({NUM}) \(median ±({NUM})\)", normal(claim))
    assert found, "the claim paragraph should give the A-3PO - recompute intervals' half-widths"
    assert agree([halves[0], halves[-1], statistics.median(halves)], found.groups())
    assert "not equivalence" in normal(claim)
    collapsed = [c for c in four_minibatch_cells() if max(c["recompute"], c["loglinear"]) < c["base"]]
    assert all(c["coupled"] > c["base"] for c in collapsed)
    found = re.search(r"ended below the base model on average in (\w+) of the (\w+) cells", normal(claim))
    assert found, "the claim paragraph should say where both decoupled methods ended below the base model"
    assert tuple(map(number_word, found.groups())) == (len(collapsed), len(four_minibatch_cells()))


def test_the_readme_states_the_resolution_of_its_claim():
    halves = a3po_half_widths()
    sentence = next(s for s in sentences((ROOT / "README.md").read_text()) if "no measurable difference" in s)
    found = re.search(rf"±({NUM})-({NUM})", sentence)
    assert found and agree([halves[0], halves[-1]], found.groups()), sentence


def resolution_missing(path: Path) -> list[str]:
    """Sentences of a page that read "no measurable difference" (or "nothing measurable", "measured no different",
    at the start of a sentence too) without an interval or a ± half-width in the same sentence. The phrase in quotes
    defines the words rather than reading a result."""
    return [s for s in sentences(path.read_text())
            if re.search(r"(?<!\")(?:no measurable difference|nothing measurable)|measured no different", s, re.I)
            and not re.search(rf"\[{NUM}, {NUM}\]|±\s?\d", s)]


@pytest.mark.parametrize("page", ["README.md", "docs/training.md", "docs/results.md"])
def test_every_no_measurable_difference_states_its_resolution(page):
    assert resolution_missing(ROOT / page) == []


def half_widths_meant(sentence: str, at: int) -> list[float]:
    """The A-3PO - recompute half-widths a "±a to ±b" range at `at` of a sentence speaks of: the one-minibatch cells on
    the table row of one optimizer step, the four-minibatch cells where "four minibatches" comes just before the
    range, every cell otherwise."""
    mb = 1 if sentence.startswith("| 1 ") else 4 if "four minibatches" in sentence[max(0, at - 30):at] else None
    return sorted((p["interval"][1] - p["interval"][0]) / 2 for folder in STUDY for p in load(folder)["paired"]
                  if (p["arm"], p["reference"]) == ("loglinear", "recompute") and mb in (None, p["minibatches"]))


# where the resolution of the A-3PO - recompute comparison is quoted as a range of half-widths
RESOLUTIONS = ("README.md", "docs/training.md#Which proximal method when", "A-3PO against recomputing",
               "Defaults, from this evidence")


@pytest.mark.parametrize("start", RESOLUTIONS)
def test_a_range_of_half_widths_is_that_of_the_cells_it_speaks_of(start):
    text = (ROOT / start).read_text() if start.endswith(".md") else section(start)
    lines = text.splitlines()
    units = [normal(row) for row in lines if row.startswith("|")]  # a table row whole: its first cell says its cells
    units += sentences("\n".join(line for line in lines if not line.startswith("|")))
    found = [(s, m) for s in units for m in re.finditer(rf"±({NUM})(?: to ±|-)({NUM})", s)]
    assert found, f"{start} should give the resolution of its A-3PO - recompute comparison"
    for s, m in found:
        halves = half_widths_meant(s, m.start())
        assert agree([halves[0], halves[-1]], m.groups()), (m.group(0), halves[0], halves[-1], s)


def equivalence_margin() -> str:
    """The margin the equivalence study's plan fixed before its runs."""
    plan = normal((RESULTS / "equivalence-pilot" / "PLAN.md").read_text())
    margins = set(re.findall(r"equivalent within (\d\.\d+)", plan))
    assert len(margins) == 1, f"the equivalence pilot's PLAN.md should name one margin, not {margins}"
    return margins.pop()


@pytest.mark.parametrize("start", ["A-3PO against recomputing", "docs/training.md#Which proximal method when"])
def test_the_claim_says_no_cell_is_shown_equivalent_and_names_the_study_under_way(start):
    """Nothing has been shown equivalent; the claim says so, and names the margin of the study that could show it."""
    text = normal(section(start))
    found = re.search(rf"No cell has been shown equivalent: an equivalence study with a margin of ±({NUM})[^.]*? is "
                      r"under way", text)
    assert found, f"{start} should say that no cell has been shown equivalent and which study is under way"
    assert found.group(1) == equivalence_margin(), (found.group(0), equivalence_margin())
    assert "docs/results/equivalence-pilot/PLAN.md" in text


def test_the_single_turn_base_model_is_quoted_as_recorded():
    """Parts 2-4 set their arms against the base model's mean accuracy over seeds 1-3 (docs/results/yardstick-base)."""
    base = evals("yardstick-base")
    mean = statistics.fmean(r["accuracy"] for r in base.values())
    for part in ("Part 2:", "Part 3:", "Part 4:"):
        quoted = re.findall(rf"base(?: model)?(?:'s| scores)? ({NUM})", normal(section(part)))
        assert quoted, f"{part} should quote the base model's accuracy"
        assert all(shown(mean, q) == q for q in quoted), (part, quoted, mean)


def test_part_2_gains_over_the_base_model_span_what_the_records_give():
    base = evals("yardstick-base")
    gains = [gain(r, base[r["seed"]]) for (_, _, mb), rs in cells("evidence-eta2-lockstep").items() if mb == 1
             for r in rs if r["seed"] in base]
    found = re.search(rf"({NUM}) to ({NUM}) over the base model", normal(section("Part 2:")))
    assert found, "part 2 should say how far over the base model the arms ended"
    assert agree([min(gains), max(gains)], found.groups()), (found.group(0), min(gains), max(gains))


@pytest.mark.parametrize("part,folder,eta", [("Part 3:", "evidence-eta8-lockstep", 8),
                                             ("Part 4:", "evidence-eta2-lockstep", 2)])
def test_four_minibatch_arms_below_the_base_model_as_the_records_say(part, folder, eta):
    """"Below the base model" said of the decoupled arms holds of every seed, or of the means where it says so."""
    base = evals("yardstick-base")
    runs = {arm: cells(folder)[(arm, eta, 4)] for arm in ("recompute", "loglinear")}
    said = [s for s in sentences(section(part)) if "decoupled arms" in s and "below the base" in s]
    assert said, f"{part} should say where the decoupled arms ended against the base model"
    for s in said:
        if "on average" in s:
            seeds = {r["seed"] for rs in runs.values() for r in rs}
            mean_base = statistics.fmean(base[k]["accuracy"] for k in seeds)
            assert all(statistics.fmean(r["eval_final"] for r in rs) < mean_base for rs in runs.values()), s
        else:
            above = [(arm, r["seed"]) for arm, rs in runs.items() for r in rs
                     if r["eval_final"] > base[r["seed"]]["accuracy"]]
            assert not above, f"{s!r}: above the base model on {above}"


def test_the_later_turns_of_the_base_model_as_recorded():
    added = [x for x in map(later_turns, evals("yardstick-retry-base").values()) if x is not None]
    found = re.search(rf"In the base model they added ({NUM})-({NUM})", normal(section("Part 9:")))
    assert found, "part 9 should say what the later turns added to the base model's accuracy"
    assert agree([min(added), max(added)], found.groups()), (found.group(0), added)


def test_the_multi_turn_clip_and_cap_at_eta_8_as_recorded():
    rs = cells("evidence-retry-eta8-lockstep")
    loglinear, recompute = rs[("loglinear", 8, 1)], rs[("recompute", 8, 1)]
    found = re.search(rf"({NUM}) % of loglinear's tokens clipped, ({NUM})-({NUM}) % capped in either arm",
                      normal(section("Part 9:")))
    assert found, "part 9 should say where the clip and the cap acted at eta = 8"
    capped = [100 * r["capped_frac"] for r in loglinear + recompute]
    assert agree([100 * statistics.fmean(r["clipped_frac"] for r in loglinear), min(capped), max(capped)],
                 found.groups()), (found.group(0), capped)


def identical_seeds(folder: str) -> set[int]:
    """Seeds on which the service arm and the rule arm got the same reward at every step and the same result on
    every held-out problem: what "trained the same tokens" can rest on."""
    runs = {(r["arm"], r["seed"]): r for r in load(folder)["runs"]}
    return {s for arm, s in runs if arm == "service"
            and runs[("service", s)]["curves"]["reward"] == runs[("loglinear", s)]["curves"]["reward"]
            and runs[("service", s)]["held_out_final"] == runs[("loglinear", s)]["held_out_final"]}


def test_the_service_arm_trained_the_same_tokens_only_where_the_records_say_so():
    """A sentence that says the two arms trained the same tokens names its seeds and at most one η (2 unless it says
    4), and on each of those seeds the reward curves and the held-out results are identical."""
    said = [s for s in sentences(section("A slow reward service")) if "same tokens" in s]
    assert said, "the service section should say on which runs the two arms trained the same tokens"
    for s in said:
        seeds = {int(d) for d in re.findall(r"\bseeds? (\d)", s)}
        seeds |= {int(d) for d in re.findall(r"\bseeds \d(?:, \d)*,? and (\d)", s)}
        if "both seeds" in s or not seeds:
            seeds = {1, 2}
        etas = set(re.findall(r"η = (\d)", s))
        assert etas <= {"2"} or etas == {"4"}, f"{s!r}: say one η (2 or 4) per sentence"
        folder = "service-eta4" if etas == {"4"} else "service-default"
        assert seeds <= identical_seeds(folder), f"{s!r}: the records show identical runs on {identical_seeds(folder)}"


def test_where_the_service_runs_part_as_recorded():
    """Where the two arms did not train the same tokens, the section says from which step and on how many held-out
    problems they differ."""
    runs = {(r["arm"], r["seed"]): r for r in load("service-default")["runs"]}
    text = normal(section("A slow reward service"))
    found = re.search(r"On seed (\d) at η = 2 the reward curves part at step (\d+) .*? and (\d+) of the (\d+) "
                      r"held-out problems differ, with the same number solved", text)
    assert found, "the service section should say where the runs of the seed that differs part"
    seed = int(found.group(1))
    assert seed not in identical_seeds("service-default")
    a, b = runs[("loglinear", seed)], runs[("service", seed)]
    step = next(s for s, x, y in zip(a["curves"]["step"], a["curves"]["reward"], b["curves"]["reward"]) if x != y)
    differ = sum(x != y for x, y in zip(a["held_out_final"], b["held_out_final"]))
    assert (int(found.group(2)), int(found.group(3)), int(found.group(4))) == (step, differ, len(a["held_out_final"]))
    assert sum(a["held_out_final"]) == sum(b["held_out_final"])


def test_the_service_arms_wall_times_and_their_ratio_as_recorded():
    text = normal(section("A slow reward service"))
    found = re.findall(r"η = (\d): (?:the training loop took )?(\d+) s against (\d+) s \((\d\.\d\d)x\)", text)
    assert [eta for eta, *_ in found] == ["2", "4"]
    for (eta, service, rule, ratio), folder in zip(found, ("service-default", "service-eta4")):
        wall = {row["arm"]: row["train_wall_s"]["mean"] for row in load(folder)["table"]}
        assert (service, rule, ratio) == (f"{wall['service']:.0f}", f"{wall['loglinear']:.0f}",
                                          f"{wall['service'] / wall['loglinear']:.2f}"), (eta, wall)


def lora_interval() -> dict:
    return across(("lora-lr6e-4", "lora"), ("lora-default", "lora"))


def test_the_lora_learning_rate_default_states_what_it_rests_on():
    """The 30 x default of actor.lora.lr against 10 x, paired by seed: the LoRA section gives the interval, and every
    page that explains the default says what it shows: better than 10 x only if the interval excludes 0."""
    p = lora_interval()
    found = re.search(rf"6e-4 - 2e-4[^\[]{{0,60}}? ({NUM}) \[({NUM}), ({NUM})\]", normal(section("LoRA")))
    assert found, "the LoRA section should give the 6e-4 - 2e-4 interval the default rests on"
    assert agree([p["mean"], *p["interval"]], found.groups()), (found.group(0), p)
    words = "better than 10 x" if report.reading(p) == "better" else "not shown better than 10 x"
    for page in ("docs/results.md", "docs/training.md", "docs/config.md"):
        assert words in normal((ROOT / page).read_text()), f"{page} should say the 30 x default is {words}"


def test_the_speed_of_recompute_against_a3po_as_recorded():
    """The study's cost claim: recompute's s/step over A-3PO's, free-running (docs/results/evidence-free)."""
    step = {(row["arm"], row["eta"]): row["step_s"]["mean"] for row in load("evidence-free")["table"]}
    found = re.search(r"(\d\.\d\d) s a step against A-3PO's (\d\.\d\d) at η = 2 \((\d\.\d\d)x\) and (\d\.\d\d) against "
                      r"(\d\.\d\d) at η = 8 \((\d\.\d\d)x\)", normal(section("A-3PO against recomputing")))
    assert found, "the study should say what recompute's step cost against A-3PO's"
    expected = []
    for eta in (2, 8):
        recompute, a3po = step[("recompute", eta)], step[("loglinear", eta)]
        expected += [recompute, a3po, recompute / a3po]
    assert agree(expected, found.groups()), (found.group(0), expected)
    ratios = sorted(expected[2::3])
    for page, text in (("docs/results.md", section("A-3PO against recomputing")), ("README.md", None)):
        text = normal(text or (ROOT / page).read_text())
        assert f"{shown(ratios[0], '0.00')}-{shown(ratios[1], '0.00')}x" in text, page


# tables copied from a generated page: (section, which table of it, the page)
COPIES = [("A-3PO against recomputing", 0, "evidence-summary.md"),
          ("Part 1:", 0, "evidence-eta8-lockstep/results.md"),
          ("LoRA", 0, "lora-step/step.md"),
          ("LoRA", 1, "lora-memory/step.md")]


@pytest.mark.parametrize("start,index,page", COPIES, ids=[f"{s} {p}" for s, _, p in COPIES])
def test_a_copied_table_is_a_copy_of_its_rows(start, index, page):
    tables = re.findall(r"(?:^\|.*\n?)+", section(start), flags=re.M)
    rows = [line for line in tables[index].splitlines()[2:]]
    lines = set((RESULTS / page).read_text().splitlines())
    assert rows and [r for r in rows if r not in lines] == []


def test_the_equivalence_pilot_s_table_and_decision_are_its_records():
    """PLAN.md's held-out table (step 0 -> 24, per lr, arm and seed) and the means behind its choice of lr."""
    folder = RESULTS / "equivalence-pilot"
    text = (folder / "PLAN.md").read_text()
    cols = [("recompute", 1), ("recompute", 2), ("coupled", 1), ("coupled", 2)]
    finals, bases = [], []
    for lr in ("2e-5", "1e-5"):
        cells = []
        for arm, seed in cols:
            record = folder / f"lr{lr}" / "runs" / f"{arm}-eta8-mb4-seed{seed}" / "held_out.jsonl"
            rows = [json.loads(line) for line in record.read_text().splitlines()]
            acc = {r["step"]: sum(r["solved"]) / len(r["solved"]) for r in rows}
            cells.append(f"{acc[0]:.3f} -> {acc[24]:.3f}")
            if lr == "1e-5":
                finals.append(acc[24])
                bases.append(acc[0])
        assert f"| {lr} | " + " | ".join(cells) + " |" in text
    mean_final, mean_base = sum(finals) / 4, sum(bases) / 4
    assert f"mean final accuracy, {mean_final:.3f}, exceeds the mean base, {mean_base:.3f}, by " \
           f"{mean_final - mean_base:.3f}" in " ".join(text.split())


def test_part_10_quotes_the_fidelity_record():
    """Every number of part 10's reading of `a3po bench fidelity` is its committed record's."""
    record = json.loads((DOCS / "results/fidelity-yardstick/results.json").read_text())
    text = normal(section("Part 10:"))
    silent = [r["step"] for r in record["records"] if r["signal_tokens"] == 0]
    assert f"Three of the four recorded steps ({', '.join(map(str, silent))})" in text
    (rec,) = [r for r in record["records"] if r["signal_tokens"] > 0]
    row = {(r["arm"], r["cell"]): r for r in rec["rows"]}
    assert f"Step {rec['step']} trains on {rec['tokens']} tokens, {rec['signal_tokens']} with A ≠ 0" in text
    assert f"{row['loglinear', 'A>0']['tokens']} with A > 0 and {row['loglinear', 'A<0']['tokens']} with A < 0" in text
    ll, co = row["loglinear", "all"], row["coupled", "all"]
    for quoted in (f"a cosine of {ll['cos']:.4f} with recompute's, the same norm ({ll['rel_norm']:.3f}) and a "
                   f"relative error of {ll['rel_err']:.3f}", f"KL of {ll['kl']:.1e} per held-out token",
                   f"(cosine {row['loglinear', 'A<0']['cos']:.4f}; {row['loglinear', 'A>0']['cos']:.4f} on A > 0)",
                   f"Linear: {row['linear', 'all']['cos']:.4f}",
                   f"binds on {co['stats']['loss/clipped_frac']:.3f} of the step's tokens (loglinear "
                   f"{ll['stats']['loss/clipped_frac']:.3f}, recompute 0)",
                   f"cosine {co['cos']:.3f} with recompute's update ({row['coupled', 'A>0']['cos']:.3f} on the A > 0 "
                   f"tokens, {row['coupled', 'A<0']['cos']:.3f} on A < 0), KL {co['kl']:.1e}"):
        assert normal(quoted) in text, quoted
    method_when = normal(section("docs/training.md#Which proximal method when"))
    assert f"A-3PO's update is recompute's to a cosine of {ll['cos']:.4f}" in method_when
    recompute = row["recompute", "all"]["stats"]
    assert all(recompute[k] == 0 for k in ("loss/clipped_frac", "loss/dual_clipped_frac", "loss/behav_capped_frac"))
    assert all(row[arm, "all"]["cos"] == 1.0 and row[arm, "all"]["rel_err"] == 0.0
               for arm in ("recompute-noclip", "reuse"))


def test_the_equivalence_pilot_s_second_stage_and_the_design_are_its_records():
    """PLAN.md's stage-2 table and the pilot command's lines are the committed records'; the design file fixes the
    endpoint and seed count the pilot chose, and the shape the pilot measured."""
    from a3po.bench import equivalence as eq

    folder = RESULTS / "equivalence-pilot" / "stage2"
    text = (RESULTS / "equivalence-pilot" / "PLAN.md").read_text()
    for arm in ("recompute", "loglinear"):
        for seed in range(1, 7):
            rows = [json.loads(line) for line in (folder / "runs" / f"{arm}-eta8-mb4-seed{seed}" / "held_out.jsonl")
                    .read_text().splitlines()]
            acc = {r["step"]: sum(r["solved"]) / len(r["solved"]) for r in rows}
            cells = [f"{acc[s]:.3f}" for s in (0, 8, 16, 24)] + [f"{eq.endpoint(rows, 'area'):.3f}"]
            assert f"| {arm} | {seed} | " + " | ".join(cells) + " |" in text
    printed = eq.pilot(folder, "recompute", "loglinear", 0.02, 0.90)
    printed = printed.replace(str(folder), "docs/results/equivalence-pilot/stage2")
    assert "\n".join("    " + line for line in printed.splitlines()) in text
    design = eq.load_design(RESULTS / "equivalence" / "DESIGN.yaml")
    area = re.search(r"area: .*; (\d+) seeds for a 90 % half-width of 0.02", printed)
    assert design.endpoint == "area" and design.seeds == int(area.group(1)) and design.margin == 0.03
    assert f"**The study runs {design.seeds} seeds a cell**" in " ".join(text.split())
    configs = json.loads((folder / "results.json").read_text())["configs"]
    for key, value in design.fixed.items():
        for config in configs.values():
            for part in key.split("."):
                config = config[part]
            assert config == value, key


def test_the_corrections_reading_quotes_the_fidelity_record():
    """The numbers of "Which proximal method when" on the corrections are docs/results/fidelity-corrections'."""
    record = json.loads((DOCS / "results/fidelity-corrections/results.json").read_text())
    text = normal(section("docs/training.md#Which proximal method when"))
    cos = {r["arm"]: r["cos"]["mean"] for r in record["summary"] if r["cell"] == "all"}
    signal = [r for r in record["records"] if r["signal_tokens"] > 0]
    assert f"steps {signal[0]['step']} and {signal[1]['step']} of one run" in text and len(signal) == 2

    def stat(arm, key):
        return [next(row for row in r["rows"] if row["arm"] == arm and row["cell"] == "all")["stats"][key]
                for r in signal]

    tis, icepop = stat("recompute-tis", "loss/tis_truncated_frac"), stat("loglinear-icepop", "loss/corr_masked_frac")
    for quoted in (f"A-3PO alone {cos['loglinear']:.4f}, with SAPO {cos['loglinear-sapo']:.4f}, with CISPO "
                   f"{cos['loglinear-cispo']:.4f}", f"token TIS (cap 2) {cos['recompute-tis']:.4f}, truncating "
                   f"{tis[0]:.3f} and {tis[1]:.3f} of the tokens", f"IcePop (band 0.5 to 5) "
                   f"{cos['loglinear-icepop']:.4f}, dropping {icepop[0]:.3f} and {icepop[1]:.3f} of the tokens"):
        assert normal(quoted) in text, quoted
    assert stat("loglinear-geomask", "loss/corr_masked_seq_frac") == [1.0, 1.0]
    assert all(next(row for row in r["rows"] if row["arm"] == "loglinear-geomask" and row["cell"] == "all")
               ["rel_norm"] == 0 for r in signal)


def test_only_the_learning_rate_moves_the_four_minibatch_failure():
    """Part 11 reads its screen by the rule its plan fixed before the runs: a factor moves the failure if seed 1 (the
    run that collapsed) ends above the base 0.195 and the mean difference from part 3's run of each seed is positive."""
    text = normal(section("Part 11:"))
    assert "only the learning rate moves the failure" in text
    part3 = {r["seed"]: r["eval_final"] for r in cells("evidence-eta8-lockstep")[("loglinear", 8, 4)]}
    moved = {}
    for folder in COLLAPSE:
        for (arm, _, _), rs in cells(folder).items():
            assert [r["seed"] for r in rs] == [1, 2, 3], "the plan fixed three seeds a factor"
            diff = statistics.fmean(r["eval_final"] - part3[r["seed"]] for r in rs)
            moved[f"{folder}:{arm}"] = rs[0]["eval_final"] > 0.195 and diff > 0
    assert moved == {**{k: False for k in moved}, "collapse-factors/lr1e-5:loglinear": True}
    capped = [r["capped_frac"] for r in load("collapse-factors/truncate")["runs"]]
    assert "acts on 0.12-0.25 % of the tokens" in text and 0.0012 <= min(capped) and max(capped) < 0.0025


def test_the_openmp_waits_quoted_are_the_tools_records():
    """The suite-time section quotes tools/omp_waits.py's medians; they are its committed records'."""
    text = normal(section("Inside 20 minutes"))
    medians = {n: json.loads((RESULTS / "omp-waits" / f"procs{n}.json").read_text())["median_s"] for n in (2, 4)}
    said = re.search(rf"two processes took ({NUM}) s with the default waits and ({NUM}) s with `OMP_WAIT_POLICY="
                     rf"PASSIVE`, four processes ({NUM}) s and ({NUM}) s", text)
    assert said, "the sentence quoting tools/omp_waits.py changed: update this test with it"
    records = [medians[n][p] for n in (2, 4) for p in ("default", "passive")]  # kept to the millisecond
    assert all(abs(float(x) - r) <= 0.0051 for x, r in zip(said.groups(), records)), (said.groups(), records)


def test_the_corrections_plan_quotes_part_1_s_a3po_runs():
    """Cell 1 of the corrections plan names the runs its A-3PO arm was expected to repeat (its band [0.99, 1.01] is a
    setting, not an interval, so the section is checked here rather than number by number)."""
    text = normal(section("docs/results/corrections-yardstick/PLAN.md#Cell 1: the local"))
    finals = [r["eval_final"] for r in cells("evidence-eta8-lockstep")[("loglinear", 8, 1)]]
    assert ", ".join(f"{x:.3f}" for x in finals[:3]) in text, finals


@pytest.mark.parametrize(("record", "heading"), [
    ("38b3344", "The clean clone after the four-minibatch screen"),
    ("183cc96", "The clean clone on an AVX2-only CPU ("),
    ("08b5356", "The clean clone on an AVX2-only CPU, with less"),
    ("6d4ac0e", "Start-up with the collector held back"),
    ("3477e86", "Rollout workers forked after the trainer's imports"),
    ("bc79baf", "Rollout workers forked after the trainer's imports"),
    ("89d710c", "Fewer Ray and vLLM engine starts"),
    ("7993259", "Fewer Ray and vLLM engine starts"),
    ("f790d74", "vLLM engines started eagerly in the tests"),
    ("ade54d4", "vLLM engines started eagerly in the tests")])
def test_the_clean_clone_s_times_are_its_record(record, heading):
    """The clean-clone sections quote what .ci/run and make train printed, kept in their records."""
    rec = json.loads((RESULTS / "clean-clone" / f"{record}.json").read_text())
    ci, tiers, train = rec["ci"], rec["ci"]["tiers_s"], rec["make_train"]
    text = normal(section(heading))
    for quoted in (f"exit {ci['exit']} in **{ci['wall_s'] / 60:.1f} min ({ci['wall_s']} s)**",
                   f"install {tiers['install']} s with `.venv-vllm` beside it ({tiers['vllm-install']} s)",
                   f"main-suite {tiers['main-suite']} s ({ci['main_suite']['passed']:,} passed, "
                   f"{ci['main_suite']['skipped']} skipped)",
                   f"vllm-suite {tiers['vllm-suite']} s ({ci['vllm_suite']['passed']} passed)",
                   f"exit {train['exit']}, {train['wall_s']} s, held-out {train['held_out'][0]} → "
                   f"{train['held_out'][1]}"):
        assert quoted in text, quoted


def test_the_avx2_clean_clone_explains_its_time_with_its_record():
    """The AVX2-only section's other figures (the emulated bf16 rate, the tests before and after the two fixes) are
    the ones its record keeps."""
    ex = json.loads((RESULTS / "clean-clone" / "183cc96.json").read_text())["explain"]
    text = normal(section("The clean clone on an AVX2-only CPU ("))
    rate, before, after = ex["matmul_gflops_1thread"], ex["before_the_fixes_s"], ex["after_the_fixes_s"]
    for quoted in (f"ran {rate['float32_2048'][0]}-{rate['float32_2048'][1]} GFLOP/s in fp32 and "
                   f"{rate['bfloat16_2048']} in bf16, about {rate['bfloat16_512']} on a 512² square",
                   f"spent {before['bench_rollout_fixture']} s there, {after['bench_rollout_fixture']} s now",
                   f"emulated bf16 ({before['vllm_bf16_test']} s;",
                   f"the main suite took {before['main-suite']:,} s here and the vLLM tier {before['vllm-suite']} s",
                   f"alone took {ex['slowest_test_s']['readme_smollm2_check']} s in this clone"):
        assert quoted in text, quoted


def test_the_second_avx2_clean_clone_explains_its_time_with_its_record():
    """The figures behind what changed in set-up and the vLLM tier, and where the main suite's time goes, are the
    ones the record keeps."""
    ex = json.loads((RESULTS / "clean-clone" / "08b5356.json").read_text())["explain"]
    text = normal(section("The clean clone on an AVX2-only CPU, with less"))
    pip, first, pyc, vllm = ex["pip_install_s"], ex["first_import_s"], ex["pyc_files"], ex["vllm_tier_s"]
    tiny, imports, durations = ex["tiny_run"], ex["import_s"], ex["main_suite_durations"]
    for quoted in (f"it took {pip['byte_compiled']} s, {pip['no_compile']} s with `--no-compile`",
                   f"A run imports {pyc['first_import']:,} modules of the {pyc['pip']:,} files pip compiled",
                   f"took {first['compiling']} s, {first['compiled']} s after",
                   f"took {vllm['warm_before']} s on a warm inductor cache",
                   f"as long as each other: {vllm['warm_after']} s", f"the tier took {vllm['cold_before']} s before",
                   f"takes {tiny['wall_s']} s of wall time and {tiny['cpu_s']} s of CPU",
                   f"spend {tiny['import_s']['trainer']} s (the trainer) and {tiny['import_s']['worker']} s (the "
                   "rollout worker) importing",
                   f"`import torch` alone {imports['torch']} s, with transformers' Llama model "
                   f"{imports['llama_from_transformers']} s",
                   f"its tests took {durations['tests_s']:,} s on two pytest processes ({durations['wall_s']:,} s of "
                   f"wall time", f"{durations['tests_over_10_s']:,} s of it in tests of 10 s or more"):
        assert quoted in text, quoted


def test_the_corrections_screen_reads_as_its_plan_says():
    """docs/training.md reads the corrections screen by its plan's rule: paired by seed against A-3PO in the same
    folder, an interval that excludes 0 reads lower or higher, one that holds it reads "no measurable difference"."""
    text = normal(section("docs/training.md#Which proximal method when"))
    by_arm = {arm: {r["seed"]: r["eval_final"] for r in rs} for (arm, _, _), rs in cells(CORRECTIONS[0]).items()}
    assert all(sorted(seeds) == [1, 2, 3] for seeds in by_arm.values()), "the plan fixed seeds 1 to 3"
    reading = {}
    for arm, seeds in by_arm.items():
        if arm != "loglinear":
            lo, hi = report.t_interval([seeds[s] - by_arm["loglinear"][s] for s in seeds])["interval"]
            reading[arm] = "lower" if hi < 0 else "higher" if lo > 0 else "none"
    assert reading == {"loglinear-icepop": "lower", "recompute-tis": "none", "loglinear-cispo": "none",
                       "loglinear-sapo": "none"}
    assert "IcePop at this band ended lower than A-3PO alone on every seed" in text
    assert all(by_arm["loglinear-icepop"][s] < by_arm["loglinear"][s] for s in (1, 2, 3))
    assert "For TIS, CISPO and SAPO there is no measurable difference from A-3PO" in text
    vllm = {arm: {r["seed"]: r["eval_final"] for r in rs} for (arm, _, _), rs in cells(CORRECTIONS[1]).items()}
    icepop = [vllm["loglinear-icepop"][s] - vllm["loglinear"][s] for s in (1, 2, 3)]
    tis = [vllm["recompute-tis"][s] - vllm["loglinear"][s] for s in (1, 2, 3)]
    assert max(icepop) < 0 and report.t_interval(icepop)["interval"][1] < 0
    lo, hi = report.t_interval(tis)["interval"]
    assert lo < 0 < hi
    assert "IcePop again ended lower on every seed, by less; TIS again no measurable difference" in text


def test_the_start_up_figures_are_the_tools_record():
    """The start-up section quotes tools/startup_cost.py's record: the tiny run's CPU time with and without the
    collector held back, their ratio, and the time each process spent collecting."""
    rec = json.loads((RESULTS / "startup-gc" / "c225e93.json").read_text())
    plain, held, ratio = rec["median"]["plain"], rec["median"]["held"], rec["cpu_ratio_held_to_plain"]
    assert rec["commit"].startswith("c225e93") and len(rec["repeats"]) == 6 and not rec["machine"]["avx512_bf16"]
    text = normal(section("Start-up with the collector held back"))
    for quoted in (f"{plain['trainer_collections']:.0f} collections in a tiny run's trainer",
                   f"{plain['cpu_s']:.2f} CPU-s without and {held['cpu_s']:.2f} CPU-s with it (medians), "
                   f"{ratio['median']:.3f} of the CPU time (per-repeat {ratio['min']:.3f} to {ratio['max']:.3f})",
                   f"the trainer {plain['trainer_gc_s']:.2f} s → {held['trainer_gc_s']:.2f} s, the rollout worker "
                   f"{plain['worker_gc_s']:.2f} s → {held['worker_gc_s']:.2f} s",
                   "6 repeats"):
        assert quoted in text, quoted
    assert held["cpu_s"] < plain["cpu_s"] and ratio["max"] < 1, "the record no longer shows a saving"
    tried = json.loads((RESULTS / "startup-gc" / "32121a9.json").read_text())  # a collection before the freeze
    held, ratio = tried["median"]["held"], tried["cpu_ratio_held_to_plain"]
    assert (f"the collecting went back to {held['trainer_gc_s']:.2f} s (trainer) and {held['worker_gc_s']:.2f} s "
            f"(worker), {ratio['median']:.3f} of the CPU time") in text


def test_the_forked_start_up_figures_are_the_tools_record():
    """The forked-workers section quotes tools/startup_cost.py's record (three arms, forked/held computed per repeat
    from it) and the two warm suite runs' record."""
    rec = json.loads((RESULTS / "startup-forked" / "3477e86.json").read_text())
    assert rec["commit"].startswith("3477e86") and rec["arms"] == ["plain", "held", "forked"]
    assert len(rec["repeats"]) == 6 and not rec["machine"]["avx512_bf16"]
    med = rec["median"]
    ratios = [r["forked"]["cpu_s"] / r["held"]["cpu_s"] for r in rec["repeats"]]
    assert max(ratios) < 1, "a repeat where forking saved nothing"
    text = normal(section("Rollout workers forked after the trainer's imports"))
    quoted = (f"{med['plain']['cpu_s']:.2f} CPU-s with neither measure, {med['held']['cpu_s']:.2f} CPU-s with the "
              f"collector held back and the workers spawned, {med['forked']['cpu_s']:.2f} CPU-s with both (medians): "
              f"forked/held {statistics.median(ratios):.3f} of the CPU time (per-repeat {min(ratios):.3f} to "
              f"{max(ratios):.3f}), {med['forked']['wall_s']:.1f} s of wall time against {med['held']['wall_s']:.1f} s")
    assert quoted in text, quoted
    warm = json.loads((RESULTS / "startup-forked" / "suite-warm.json").read_text())
    before, after = warm["before"], warm["after"]
    assert (f"{before['passed']:,} passed in {before['wall_s']:.0f} s at {before['commit']}, {after['passed']:,} "
            f"passed in {after['wall_s']:.0f} s at {after['commit']}") in text
    there = warm["previous_session"]
    assert (f"the warm suite took {before['wall_s']:.0f} s here at {before['commit']}, and {there['wall_s']:.0f} s "
            f"there at {there['commit']} with {there['passed']:,} passed") in text
    for record in ("3477e86", "bc79baf"):  # one clone inside 20 minutes and one outside, as the section says
        clone = json.loads((RESULTS / "clean-clone" / f"{record}.json").read_text())["ci"]
        assert f"CPU {clone['cpu_s']:,} s" in text
        assert (clone["wall_s"] < 20 * 60) == (record == "3477e86")


def test_the_eager_vllm_section_s_test_times_are_its_records():
    """The vLLM tier's engine-starting items before and after, and the CPU time of both clones, as recorded."""
    text = normal(section("vLLM engines started eagerly in the tests"))
    before, after = (json.loads((RESULTS / "clean-clone" / f"{c}.json").read_text()) for c in ("f790d74", "ade54d4"))
    for rec in (before, after):
        assert f"CPU {rec['ci']['cpu_s']:,} s" in text
    b, a = before["explain"]["vllm_durations_s"], after["explain"]["vllm_durations_s"]
    assert (f"The engine fixture's setup took {b['engine_fixture_setup']} s, the fp32-head test (two bf16 engines) "
            f"{b['fp32_head_test']} s, the vLLM-in-Ray-actors test {b['ray_actors_episodes_test']} s") in text
    assert (f"The fixture's setup took {a['engine_fixture_setup']} s, the fp32-head test {a['fp32_head_test']} s, "
            f"the Ray actors' test {a['ray_actors_episodes_test']} s") in text
    assert "beside two `make install`s" in text and before["make_train"]["beside"]


def test_the_retry_pilot_plan_s_times_are_its_records():
    """The cost probe's evaluation and step times (whole seconds) and the pilot runs' process times (minutes) that
    PLAN.md quotes are those of the committed records."""
    plan = (RESULTS / "equivalence-retry-pilot" / "PLAN.md").read_text()
    rows = [json.loads(x) for x in (RESULTS / "equivalence-retry-pilot" / "cost-probe" / "metrics.jsonl")
            .read_text().splitlines() if x]
    evals = [round(r["perf/eval_s"]) for r in rows if "perf/eval_s" in r]
    steps = [round(r["perf/step_s"]) for r in rows if "perf/step_s" in r]
    train = [r["perf/train_s"] for r in rows[2:] if "perf/train_s" in r]
    prox = [r["perf/prox_logp_s"] for r in rows[2:] if "perf/prox_logp_s" in r]
    text = normal(plan)
    assert f"took {evals[0]} s and {evals[1]} s" in text
    assert f"step 1 took {steps[0]} s" in text and f"took {steps[1]}, {steps[2]} and {steps[3]} s" in text
    assert f"training {int(min(train))}-{round(max(train))} s" in text
    assert f"extra forward pass {int(min(prox))}-{round(max(prox))} s" in text
    runs = json.loads((RESULTS / "equivalence-retry-pilot" / "retry-lr1e-5" / "results.json").read_text())["runs"]
    minutes = {r["arm"]: f"{r['process_wall_s'] / 60:.1f}" for r in runs}
    assert f"{minutes['recompute']} and {minutes['coupled']} min a process" in text

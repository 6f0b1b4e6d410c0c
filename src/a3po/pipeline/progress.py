"""The progress bar of `a3po train`: one line that fits the terminal, whatever width it reports.

    bar = ProgressBar(total=16, initial=0, file=sys.stderr)
    bar.show(["reward 0.25", "eval 0.31", ...])   # the step's facts, most important first
    bar.update(1)

`progress_line` draws the line for a given width: the step count and times always, then as many
of the facts as fit, each whole (the least important are dropped first), and the bar in the
room left; the first two facts are kept even where the bar then has no room (the percentage and
the count say what it would). A terminal that reports no size (0 x 0, as some
consoles and containers do) gets FALLBACK_WIDTH columns; a log file (no terminal) gets every fact.
tqdm keeps drawing it, so `tqdm.write` still prints above it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from tqdm import tqdm

FALLBACK_WIDTH = 80  # columns, where the terminal reports none
MIN_BAR, MAX_BAR = 6, 40  # a bar narrower than MIN_BAR is left out; one wider than MAX_BAR says no more
BEFORE_BAR = 2  # facts (the reward, the held-out accuracy) kept even where the bar then has no room
FULL, PARTIAL = "█", " ▏▎▍▌▋▊▉"
SEP = " | "


def clock(seconds: float) -> str:
    """mm:ss, or h:mm:ss from an hour on."""
    s = max(0, int(seconds))
    h, m = divmod(s // 60, 60)
    return f"{h}:{m:02d}:{s % 60:02d}" if h else f"{m:02d}:{s % 60:02d}"


def bar_of(frac: float, width: int) -> str:
    """A bar `width` characters wide, filled to `frac` in eighths of a character."""
    eighths = int(round(max(0.0, min(1.0, frac)) * width * 8))
    full, part = divmod(eighths, 8)
    return (FULL * full + (PARTIAL[part] if part else "")).ljust(width)[:width]


def progress_line(n: int, total: int, elapsed_s: float, rate: float | None, facts: Sequence[str],
                  width: int | None, desc: str = "a3po train", unit: str = "step") -> str:
    """The progress line at step n of total, `rate` steps a second (None: not known yet), for a terminal
    `width` columns wide (None: no terminal, no limit; 0 or less: the terminal reports no size, so
    FALLBACK_WIDTH). It stays one column short of the width, so no terminal wraps it; the facts come after
    the counts, each whole, as many as fit in their order."""
    if not rate:
        speed, left = f"?{unit}/s", "?"
    else:
        speed = f"{1 / rate:.2f}s/{unit}" if rate < 1 else f"{rate:.2f}{unit}/s"
        left = clock((total - n) / rate)
    head = f"{desc}: {100 * n / max(1, total):3.0f}%"
    counts = f" {n}/{total} [{clock(elapsed_s)}<{left}, {speed}]"
    room = None if width is None else (width if width > 0 else FALLBACK_WIDTH) - 1
    kept: list[str] = []
    for fact in facts:
        text = SEP.join([*kept, fact])
        bar = MIN_BAR + 2 if len(kept) >= BEFORE_BAR else 0  # the first facts go before the bar, the rest after
        if room is None or len(head) + len(counts) + len(" " + text) + bar <= room:
            kept.append(fact)
        else:
            break
    tail = counts + (" " + SEP.join(kept) if kept else "")
    bar_width = MAX_BAR if room is None else min(MAX_BAR, room - len(head) - len(tail) - 2)
    if bar_width < MIN_BAR:  # too narrow for a bar: the numbers, cut at the edge if even they do not fit
        return (head + tail)[:room]
    return f"{head}|{bar_of(n / max(1, total), bar_width)}|{tail}"


def terminal_width(stream) -> int | None:
    """The width of the terminal `stream` writes to: 0 where it reports no size (then COLUMNS, if set, is
    taken), None where the stream is no terminal (a file, a pipe)."""
    try:
        if not stream.isatty():
            return None
        columns = os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, OSError, ValueError):
        return None
    if columns <= 0:
        env = os.environ.get("COLUMNS", "")
        columns = int(env) if env.isdigit() else 0
    return columns


class ProgressBar(tqdm):
    """tqdm drawing `progress_line` at the width its terminal has at each redraw."""

    def __init__(self, total: int, initial: int, file, desc: str = "a3po train"):
        self.facts: list[str] = []
        # ncols and nrows given: tqdm asks the terminal nothing itself (a 0 x 0 one made it draw nothing at all)
        super().__init__(total=total, initial=initial, desc=desc, unit="step", file=file,
                         ncols=FALLBACK_WIDTH, nrows=24, dynamic_ncols=False)

    def show(self, facts: Sequence[str]) -> None:
        """The facts drawn after the counts from the next redraw on, most important first."""
        self.facts = list(facts)

    def __str__(self) -> str:
        d = self.format_dict
        done = d["n"] - d["initial"]  # the steps of this process (a resumed run starts at its checkpoint's)
        rate = done / d["elapsed"] if done > 0 and d["elapsed"] > 0 else None
        return progress_line(d["n"], d["total"], d["elapsed"], rate, self.facts, terminal_width(self.fp),
                             desc=self.desc, unit=self.unit)

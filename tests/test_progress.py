"""The progress bar fits any terminal: the line for a given width (progress_line), and the bar itself drawn into
a real pseudo-terminal that reports 0 x 0 (where tqdm alone drew nothing for the whole run) or 140 columns (where
it shrank the bar to one character and cut the text)."""

import fcntl
import os
import re
import select
import struct
import termios

from hypothesis import given
from hypothesis import strategies as st

from a3po.pipeline.progress import FALLBACK_WIDTH, MIN_BAR, SEP, ProgressBar, progress_line

FACTS = ["reward 0.25", "eval 0.31", "stale 1.2/2 ahead 8", "123 tok/s",
         "wait 1.2s train 3.4s prox 0.00s sync 0.12s"]  # what a step of the default run shows (run._facts)


def facts_shown(line: str) -> list[str]:
    """The facts after the counts' closing bracket."""
    rest = line.split("] ", 1)[1] if "] " in line else ""
    return rest.split(SEP) if rest else []


def bar_width(line: str) -> int:
    found = re.search(r"\|([^|]*)\|", line)
    return len(found.group(1)) if found else 0


def test_a_terminal_of_no_size_gets_the_fallback_width():
    line = progress_line(3, 16, 12.3, 3 / 12.3, FACTS, 0)
    assert 0 < len(line) < FALLBACK_WIDTH
    assert "3/16 [00:12<00:53, 4.10s/step]" in line
    assert facts_shown(line) == FACTS[:2]  # the reward and the held-out accuracy, whole


def test_140_columns_keep_a_real_bar_and_whole_facts():
    line = progress_line(3, 16, 12.3, 3 / 12.3, FACTS, 140)
    assert len(line) == 139  # one short of the edge: no terminal wraps it
    assert bar_width(line) >= MIN_BAR and line.startswith("a3po train:  19%|")
    assert facts_shown(line) == FACTS[:4]  # the time breakdown, last and longest, is what gives way


def test_no_terminal_shows_every_fact():
    assert facts_shown(progress_line(3, 16, 12.3, 3 / 12.3, FACTS, None)) == FACTS


@given(width=st.integers(-3, 300), n=st.integers(0, 16),
       facts=st.lists(st.text(st.characters(codec="ascii", exclude_characters="|]\r\n"), min_size=1, max_size=30),
                      max_size=6))
def test_any_width_fits_and_facts_are_whole_in_their_order(width, n, facts):
    line = progress_line(n, 16, 5.0 * n, 0.2 if n else None, facts, width)
    room = (width if width > 0 else FALLBACK_WIDTH) - 1
    assert len(line) <= room and (len(line) > 0 or room == 0)  # a one-column terminal has room for nothing
    shown = facts_shown(line)  # none where even the counts are cut at the edge
    assert SEP.join(shown) == SEP.join(facts[:len(shown)])


def drawn_on_a_terminal(columns: int, rows: int) -> str:
    """What ProgressBar writes over three steps to a pseudo-terminal of the given size."""
    leader, follower = os.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))
    out = b""
    with os.fdopen(follower, "w") as tty:
        bar = ProgressBar(total=16, initial=0, file=tty)
        for _ in range(3):
            bar.show(FACTS)
            bar.update(1)
            bar.refresh()
        bar.close()
    while select.select([leader], [], [], 0)[0]:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # the follower is closed and everything was read
            break
        if not chunk:
            break
        out += chunk
    os.close(leader)
    return out.decode()


def test_the_bar_draws_on_a_terminal_that_reports_no_size():
    text = drawn_on_a_terminal(0, 0)
    assert "3/16" in text and "reward 0.25 | eval 0.31" in text, repr(text)


def test_the_bar_fits_a_terminal_of_140_columns():
    text = drawn_on_a_terminal(140, 40)
    lines = [part.rstrip() for part in re.split(r"[\r\n]+", text) if part.strip()]
    assert lines and all(len(line) <= 139 for line in lines), lines
    last = next(line for line in reversed(lines) if "3/16" in line)
    assert bar_width(last) >= MIN_BAR and facts_shown(last) == FACTS[:4], last

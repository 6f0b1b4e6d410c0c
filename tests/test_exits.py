"""The one table from exception type to exit code and line (pipeline/exits.py), row by row.

The commands' own tests (test_bad_input.py, test_e2e.py, test_signals.py, test_faults.py) run these
endings through real processes; here each row's words and order, and the names of the types that
live in modules importing torch, are pinned without starting anything.
"""

from __future__ import annotations

import importlib

import pytest

from a3po.config import ConfigError
from a3po.data import DataError
from a3po.models import ModelSourceError
from a3po.pipeline import exits
from a3po.trainer.checkpoint import CheckpointError


def test_every_named_type_is_an_exception_class_of_its_module():
    named = {t for rows in exits.TABLE.values() for row in rows for t in row.types if isinstance(t, str)}
    assert named
    for name in named:
        module, _, cls = name.partition(":")
        t = getattr(importlib.import_module(module), cls)
        assert isinstance(t, type) and issubclass(t, Exception), name
    assert all(len(exits.resolved(row.types)) == len(row.types) for rows in exits.TABLE.values() for row in rows)


@pytest.mark.parametrize("phase, error, code, line", [
    (exits.CONFIG, ConfigError("unknown key 'x'"), 2, "a3po: config error: unknown key 'x'"),
    (exits.CONFIG, CheckpointError("runs/gone: no such directory"), 2, "a3po: error: runs/gone: no such directory"),
    (exits.INPUTS, ConfigError("a\nb"), 2, "a3po: error: a b"),  # a library's message on one line
    (exits.INPUTS, DataError("d.jsonl:3: invalid JSON"), 2, "a3po: error: d.jsonl:3: invalid JSON"),
    (exits.RUN, ConfigError("bad"), 2, "a3po: error: bad"),
    (exits.RUN, FloatingPointError("loss is nan\nat 3"), 1, "a3po: training stopped at step 7: loss is nan\nat 3"),
    (exits.EVAL, CheckpointError("no checkpoint"), 2, "a3po: config error: no checkpoint"),
    (exits.EVAL, DataError("few rows"), 2, "a3po: error: few rows"),
    (exits.EXPORT, CheckpointError("no checkpoint"), 2, "a3po: config error: no checkpoint"),  # before ValueError's
    (exits.EXPORT, ValueError("not an adapter"), 2, "a3po: error: not an adapter"),
    (exits.SERVE, OSError("address in use"), 2, "a3po: error: address in use"),
    (exits.BENCH, ConfigError("--etas: bad"), 2, "a3po: config error: --etas: bad"),
    (exits.BENCH, ModelSourceError("actor.path='tiny-1x1': bad"), 2, "a3po: error: actor.path='tiny-1x1': bad"),
])
def test_each_phase_gives_its_code_and_words(phase, error, code, line):
    assert exits.ending(error, phase, step=7) == exits.Ending(code, line)


@pytest.mark.parametrize("phase, error", [
    (exits.BENCH, ValueError("a bug")), (exits.CONFIG, RuntimeError("a bug")), (exits.RUN, KeyError("a bug")),
    (exits.EVAL, ValueError("a bug")),
])
def test_an_error_the_table_does_not_name_is_left_to_its_traceback(phase, error):
    assert exits.ending(error, phase) is None


def test_a_training_failure_names_the_step_and_keeps_its_text():
    from a3po.pipeline.loop import StalenessError
    from a3po.pipeline.pool import WorkerError

    assert exits.ending(WorkerError("w0 died"), exits.RUN, step=3) == exits.Ending(
        1, "a3po: training stopped at step 3: w0 died")
    assert exits.ending(StalenessError("d=3"), exits.RUN, step=0).code == exits.FAILED
    assert exits.ending(WorkerError("w0 died"), exits.EVAL) is None  # only a running run fails that way

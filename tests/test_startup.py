"""a3po/startup.py: the collector held back while a process starts, and what start-up built frozen after."""

import gc

import pytest

from a3po import startup


@pytest.fixture(autouse=True)
def _thresholds():
    before = gc.get_threshold()
    yield
    gc.set_threshold(*before)
    gc.unfreeze()


def test_the_thresholds_are_held_in_the_block_and_restored_after_it():
    gc.set_threshold(700, 10, 10)
    with startup.collector_held():
        assert gc.get_threshold() == startup.HELD
        with startup.collector_held():  # nested (the command's import, then the run's build)
            assert gc.get_threshold() == startup.HELD
        assert gc.get_threshold() == startup.HELD
    assert gc.get_threshold() == (700, 10, 10)
    assert gc.isenabled()


def test_what_start_up_built_is_frozen_out_of_later_collections():
    gc.unfreeze()
    with startup.collector_held():
        built = [{"layer": i} for i in range(1000)]  # tracked containers, like an import's modules and classes
    assert gc.get_freeze_count() >= len(built)
    collected = {id(o) for g in range(3) for o in gc.get_objects(generation=g)}  # what collections walk
    assert not collected & {id(b) for b in built}


def test_an_error_in_start_up_still_restores_the_collector():
    gc.set_threshold(700, 10, 10)
    with pytest.raises(RuntimeError), startup.collector_held():
        raise RuntimeError("the model did not load")
    assert gc.get_threshold() == (700, 10, 10)

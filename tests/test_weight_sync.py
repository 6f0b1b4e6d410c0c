"""Weight publication through shared memory, and how a worker picks what to load.

Proves: with two buffers, publishing v + 1 never touches the buffer of v (a worker still
reading v reads it whole), v + 1 lands where v - 1 was, and a worker started at any point
reads the version published last; a worker that finds several versions waiting loads only
the newest, before every prompt group that arrived with them, and keeps everything else in
order.
"""

import torch

from a3po.rollout.worker import LoadWeights, Stop, Work, newest_weights_first
from a3po.sync import SharedWeights


def test_publishing_the_next_version_leaves_the_one_being_read_whole():
    state = {"w": torch.zeros(4, 3), "b": torch.zeros(3)}
    shm = SharedWeights(state)
    given = shm.at_start()  # a worker started at version 0
    assert torch.equal(given.take()["w"], state["w"])
    shm.publish({k: v + 1 for k, v in state.items()})
    v1 = shm.for_load()
    assert torch.equal(given.take()["w"], state["w"])  # what the worker started from is untouched
    assert torch.equal(v1.tensors(given)["w"], state["w"] + 1)
    shm.publish({k: v + 2 for k, v in state.items()})
    v2 = shm.for_load()
    assert torch.equal(v1.tensors(given)["w"], state["w"] + 1)  # a worker still reading v1 reads it whole
    assert v2.index == given.current  # v2 went where v0 was
    assert torch.equal(v2.tensors(given)["b"], state["b"] + 2)
    assert torch.equal(shm.at_start().take()["w"], state["w"] + 2)  # a worker starting now reads v2


def test_a_worker_loads_only_the_newest_version_and_before_the_groups_that_came_with_it():
    a, b = Work(0, None), Work(1, None)
    l1, l2, l3 = LoadWeights(1, None), LoadWeights(2, None), LoadWeights(3, None)
    assert newest_weights_first([l1, a, l2, b, l3]) == [l3, a, b]
    assert newest_weights_first([a, l1, b, Stop()]) == [a, l1, b, Stop()]  # one version: nothing reordered
    assert newest_weights_first([a, b]) == [a, b]

"""Admission control on its own: the staleness bound, refills and resume offsets.

Proves: at version v exactly the slots below (eta + v + 1) * B may start, so the pipeline
can hold (eta + 1) batches and no more; the running cap holds whatever the bound allows;
a refilled slot is handed out again before any new slot; with whole_batches (lockstep) a batch
starts whole or waits; a run resumed at version v
starts at slot v * B; each version's batch is its own B consecutive slots.
"""

from a3po.config import load_config
from a3po.pipeline.admission import Admission
from a3po.pipeline.controller import MAX_SEQUENCES_IN_FLIGHT, max_running_groups


def drain(adm: Admission, version: int) -> list[int]:
    out = []
    while (slot := adm.take(version)) is not None:
        out.append(slot)
    return out


def test_the_bound_admits_eta_plus_one_batches_then_one_batch_per_version():
    adm = Admission(batch_size=4, eta=2, max_running=1000)
    assert drain(adm, 0) == list(range(12))  # (eta + 0 + 1) * B: slots 0..11, consumed at versions 0, 1, 2
    for s in range(12):
        adm.done(s)
    assert drain(adm, 0) == []  # finishing work does not open capacity; a new version does
    assert drain(adm, 1) == list(range(12, 16))
    assert drain(adm, 3) == list(range(16, 24))  # a jump of two versions opens two batches


def test_every_admitted_slot_is_consumed_within_eta_versions():
    B, eta = 3, 4
    adm = Admission(B, eta, max_running=1000)
    for v in range(10):
        for slot in drain(adm, v):
            consumed_at = slot // B
            assert v <= consumed_at <= v + eta
            adm.done(slot)
        assert adm.next_slot == (eta + v + 1) * B  # the ceiling is reached, not just respected


def test_eta_zero_is_synchronous():
    adm = Admission(batch_size=2, eta=0, max_running=1000)
    assert drain(adm, 0) == [0, 1]
    assert drain(adm, 1) == [2, 3]
    assert list(adm.batch_slots(1)) == [2, 3]


def test_running_cap_holds_and_finishing_frees_a_place():
    adm = Admission(batch_size=4, eta=8, max_running=5)
    assert drain(adm, 0) == [0, 1, 2, 3, 4]
    adm.done(2)
    assert drain(adm, 0) == [5]


def test_refills_go_to_the_same_slot_first():
    adm = Admission(batch_size=2, eta=1, max_running=3)
    assert drain(adm, 0) == [0, 1, 2]
    adm.done(1, refill=True)  # slot 1's group was filtered out: it is sampled again
    assert drain(adm, 0) == [1]
    adm.done(0)
    adm.done(1)
    assert drain(adm, 0) == [3]  # then new slots, still within (eta + 1) * B = 4


def test_resume_restarts_at_the_first_slot_of_its_version():
    adm = Admission(batch_size=4, eta=2, max_running=1000, version=5)
    assert drain(adm, 5)[0] == 20 and adm.next_slot == 32
    assert list(adm.batch_slots(5)) == [20, 21, 22, 23]


def test_default_concurrency_is_what_the_bound_allows_with_a_memory_cap():
    cfg = load_config(None, ["rollout.max_head_offpolicyness=8", "train_dataset.batch_size=4"])
    assert max_running_groups(cfg) == 36  # (8 + 1) x 4
    cfg = load_config(None, ["rollout.max_head_offpolicyness=8", "rollout.max_concurrent_rollouts=5"])
    assert max_running_groups(cfg) == 5
    big = load_config(None, ["rollout.max_head_offpolicyness=64", "train_dataset.batch_size=64",
                             "gconfig.n_samples=16"])
    assert max_running_groups(big) == MAX_SEQUENCES_IN_FLIGHT // 16


def test_whole_batches_are_admitted_together_or_not_at_all():
    adm = Admission(batch_size=4, eta=2, max_running=6, whole_batches=True)
    assert drain(adm, 0) == [0, 1, 2, 3]  # a second batch would pass the cap of 6: none of it starts
    adm.done(0)
    assert drain(adm, 0) == []  # 3 running + 4 > 6
    adm.done(1)
    assert drain(adm, 0) == [4, 5, 6, 7]
    plain = Admission(batch_size=4, eta=2, max_running=6)
    assert drain(plain, 0) == list(range(6))  # without it the cap splits a batch

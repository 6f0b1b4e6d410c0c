"""Admission control (docs/design.md §3): how far rollout may run ahead of training.

Every admitted prompt group gets a slot number k in admission order, and the training
step that turns version v into v + 1 consumes exactly the groups of slots
[v * B, (v + 1) * B) (B = prompts per step). A new group may start only while

    accepted + running  <  (eta + v + 1) * B,

i.e. while the next slot k satisfies k // B <= v + eta. A group admitted at trainer
version v_a is trained on at version k // B <= v_a + eta, and its tokens carry versions
>= v_a (a worker loads the weights of v_a before it starts the group), so every consumed
token has staleness d <= eta. eta = 0 admits one batch per version: synchronous training.

Consuming slots in order, rather than whichever groups finished first, is what makes the
bound exact: a slow group is waited for, never trained on late and never dropped.
A group removed by dynamic filtering is refilled into the same slot, so the bound holds
for refills too. With `whole_batches` (rollout.lockstep) a batch's groups are admitted
together or not at all, so that they reach the workers as one cohort.
"""

from __future__ import annotations


class Admission:
    def __init__(self, batch_size: int, eta: int, max_running: int, version: int = 0, whole_batches: bool = False):
        self.B, self.eta, self.max_running, self.whole_batches = batch_size, eta, max_running, whole_batches
        self.next_slot = version * batch_size  # groups in flight when a run stopped are admitted again
        self.running = 0
        self.refills: list[int] = []  # slots whose group was filtered out and must be sampled again

    def capacity_ok(self, version: int) -> bool:
        return self.next_slot < (self.eta + version + 1) * self.B

    def take(self, version: int) -> int | None:
        """The slot to start next, or None if admission must wait."""
        if self.running >= self.max_running:
            return None
        if self.whole_batches and self.next_slot % self.B == 0 and self.running + self.B > self.max_running:
            return None
        if self.refills:
            slot = self.refills.pop(0)
        elif self.capacity_ok(version):
            slot = self.next_slot
            self.next_slot += 1
        else:
            return None
        self.running += 1
        return slot

    def done(self, slot: int, refill: bool = False) -> None:
        self.running -= 1
        if refill:
            self.refills.append(slot)

    def batch_slots(self, version: int) -> range:
        return range(version * self.B, (version + 1) * self.B)

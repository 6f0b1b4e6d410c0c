"""The rollout controller's invariants (controller.py's docstring, I1-I7) over generated schedules.

Hypothesis draws a run: the bound eta, prompts per step B, workers, lockstep or dynamic filtering
with refills (the configuration refuses both at once), and workers lost at chosen steps, while the
trainer trains or while it writes the weight buffer. Each schedule runs on the scripted pool of
tests/test_controller.py (no sleeps, exact), with the controller asserting its invariants after
every change of state; an assertion there reaches the trainer's wait as the controller's error. On
top, what the invariants are for: every slot is consumed once, in order, every consumed token
within the bound, and every loss is one restart.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_controller import make, train

LOSS = st.tuples(st.integers(0, 5), st.sampled_from(["training", "writing"]), st.integers(0, 2))  # step, when, who


@st.composite
def schedules(draw):
    n_workers = draw(st.integers(1, 3))
    steps = draw(st.integers(2, 6))
    losses = draw(st.lists(LOSS, max_size=3, unique_by=lambda x: x[:2]))
    lockstep = draw(st.booleans())
    return {
        "eta": draw(st.integers(0, 3)), "B": draw(st.integers(1, 3)), "n_workers": n_workers, "steps": steps,
        "lockstep": lockstep, "filtering": not lockstep and draw(st.booleans()),  # the config refuses both at once
        "losses": [(step, when, who % n_workers) for step, when, who in losses if step < steps],
    }


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(schedules())
def test_every_schedule_keeps_the_invariants_and_consumes_each_slot_once_within_the_bound(s):
    eta, B, steps = s["eta"], s["B"], s["steps"]
    # with filtering, a slot's first group has all-equal rewards and is refilled once; later ones are informative
    reward = (lambda slot, attempt, i: 1.0 if attempt == 1 else float(i % 2)) if s["filtering"] else None
    pool, ctl, log = make(eta, f"rollout.n_workers={s['n_workers']}", f"rollout.lockstep={str(s['lockstep']).lower()}",
                          f"train_dataset.dynamic_filtering={str(s['filtering']).lower()}", B=B, reward=reward)

    def lose(when):
        def at(v):
            for step, w, who in s["losses"]:
                if step == v and w == when:
                    pool.settle()
                    pool.lose(who)
                    pool.settle()
        return at

    try:
        out = train(ctl, pool, steps, training=lose("training"), writing=lose("writing"))
        pool.settle()  # a worker lost while the last weights were written is replaced once they are published
        with ctl._cond:
            ctl.check_invariants()
    finally:
        ctl.close()
    consumed = [[g.slot for g in got.groups] for got, _, _ in out]
    assert consumed == [list(range(B * v, B * (v + 1))) for v in range(steps)]
    assert all(0 <= d <= eta for _, ds, _ in out for d in ds)
    assert ctl.restarts == len(s["losses"]) == len(pool.restarts)

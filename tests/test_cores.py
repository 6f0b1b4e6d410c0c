"""The trainer borrows idle workers' threads layer by layer (pipeline/cores.py), on a real tiny model:
the thread count seen inside each decoder layer follows whether the workers are idle, in the
forward pass, in the backward pass and in no-grad passes; and it borrows only where the workers
compute on this machine's CPU with the local engine under the local launcher."""

import pytest
import torch

from a3po.config import load_config
from a3po.models import load_policy
from a3po.pipeline.cores import CoreLender, decoder_layers, lends_cores


@pytest.fixture(autouse=True)
def keep_thread_count():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_layers_run_on_borrowed_threads_only_while_the_workers_are_idle():
    model, _ = load_policy("tiny")
    model.train()
    idle = {"now": True}
    lender = CoreLender(own=1, lendable=2, workers_idle=lambda: idle["now"])
    lender.attach(model)
    seen = []
    for i, layer in enumerate(decoder_layers(model)):
        layer.register_forward_hook(lambda *_, i=i: seen.append(("fwd", i, torch.get_num_threads())))
        layer.register_full_backward_hook(lambda *_, i=i: seen.append(("bwd", i, torch.get_num_threads())))
    ids = torch.randint(0, 100, (2, 8))
    loss = model(input_ids=ids).logits.float().pow(2).mean()
    idle["now"] = False  # a worker got a prompt: the backward pass gives the threads back
    loss.backward()
    with torch.no_grad():
        idle["now"] = True
        model(input_ids=ids)
    n = len(decoder_layers(model))
    assert seen == ([("fwd", i, 3) for i in range(n)] + [("bwd", i, 1) for i in reversed(range(n))]
                    + [("fwd", i, 3) for i in range(n)])
    assert lender.borrowed_frac() == 2 / 3 and lender.borrowed_frac() == 0.0  # counted per call, then reset


def test_nothing_is_borrowed_when_lending_is_off():
    model, _ = load_policy("tiny")
    lender = CoreLender(own=1, lendable=0, workers_idle=lambda: True)
    lender.attach(model)
    threads = []
    decoder_layers(model)[0].register_forward_hook(lambda *_: threads.append(torch.get_num_threads()))
    with torch.no_grad():
        model(input_ids=torch.randint(0, 100, (1, 4)))
    assert threads == [1] and lender.borrowed_frac() == 0.0


@pytest.mark.parametrize("overrides, device, lends", [
    ([], "cpu", True),  # the local launcher, the local engine, rollout on this machine's CPU
    (["rollout.lend_idle_cores=false"], "cpu", False),
    (["cluster.launcher=ray"], "cpu", False),  # workers may be on other nodes
    (["rollout.backend=vllm"], "cpu", False),  # vLLM manages its own threads
    (["rollout.lockstep=true"], "cpu", False),  # a thread count timing decides: numbers timing decides
    ([], "cuda", False),  # rollout on a GPU
    ([], "cuda:1", False),
])
def test_lending_applies_only_to_local_workers_on_this_machines_cpu(overrides, device, lends):
    cfg = load_config(None, overrides)
    assert lends_cores(cfg, torch.device(device)) is lends

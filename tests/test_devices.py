"""Device and dtype resolution: `actor.device`, `rollout.device`, `dtype: auto`.

Proves: auto is CUDA exactly when torch sees one; a CUDA device that is not there is a
one-line ConfigError naming the key and the way out; a misspelt device is refused at load
time; `dtype: auto` on the CPU follows the CPU's bf16 support, whether or not a GPU exists
(it used to turn bf16 on for a CPU trainer whenever CUDA was present); a model and its
batches really end up on the device asked for, and training and sampling work there; a benchmark's
record names the GPU (torch's name for it) or the CPU model it ran on.
"""

from pathlib import Path

import pytest
import torch

from a3po.config import ConfigError, load_config
from a3po.config.choices import Dtype
from a3po.devices import device_name, native_bf16, resolve_device, resolve_dtype, synchronize, torch_dtype
from a3po.machine import machine
from a3po.rollout import GenerationRequest, generate
from a3po.rollout.local import LocalEngine
from a3po.trainer.engine import TrainEngine
from a3po.trajectories import Trajectory, collate

CPU = torch.device("cpu")
CUDA = torch.cuda.is_available()


def test_auto_is_cuda_exactly_when_torch_sees_one():
    assert resolve_device("auto", "actor.device") == torch.device("cuda" if CUDA else "cpu")
    assert resolve_device("cpu", "actor.device") == CPU


@pytest.mark.skipif(CUDA, reason="this machine has a CUDA device")
@pytest.mark.parametrize("name", ["cuda", "cuda:0", "cuda:3"])
def test_a_missing_gpu_is_one_line_naming_the_key(name):
    with pytest.raises(ConfigError) as e:
        resolve_device(name, "rollout.device")
    msg = str(e.value)
    assert "\n" not in msg and f"rollout.device={name}" in msg and "rollout.device=cpu" in msg


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_a_gpu_index_past_the_last_is_refused():
    n = torch.cuda.device_count()
    with pytest.raises(ConfigError, match=f"cuda:0 to cuda:{n - 1}"):
        resolve_device(f"cuda:{n}", "actor.device")


@pytest.mark.parametrize("value", ["gpu", "cuda:", "cuda:x", "CPU", "mps"])
def test_a_misspelt_device_is_refused_when_the_config_loads(value):
    with pytest.raises(ConfigError, match="use auto, cpu, cuda or cuda:N"):
        load_config(None, [f"actor.device={value}"])
    assert load_config(None, ["actor.device=cuda:1", "rollout.device=cpu"]).actor.device == "cuda:1"


def cpu_has_bf16() -> bool:
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    return "avx512_bf16" in flags or "amx_bf16" in flags


def test_dtype_auto_on_the_cpu_follows_the_cpu_even_when_a_gpu_exists(monkeypatch):
    expected = "bfloat16" if cpu_has_bf16() else "float32"
    assert resolve_dtype("auto", CPU) == expected
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU beside this CPU
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert resolve_dtype("auto", CPU) == expected
    assert native_bf16(torch.device("cuda")) is True
    assert resolve_dtype("float32", torch.device("cuda")) == "float32"


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if CUDA else []))
def test_a_record_names_the_gpu_or_the_cpu_it_ran_on(device):
    d = torch.device(device)
    expected = torch.cuda.get_device_name(d) if d.type == "cuda" else machine()["cpu"]
    assert device_name(d) == expected and expected
    x = torch.ones(256, 256, device=d)
    y = x @ x
    synchronize(d)  # a no-op on the CPU; on CUDA it waits for the matmul
    assert y[0, 0].item() == 256


def test_every_dtype_choice_resolves_to_a_torch_dtype():
    assert {torch_dtype(resolve_dtype(name, CPU)) for name in Dtype.CHOICES} <= {torch.float32, torch.bfloat16}
    assert torch_dtype("bfloat16") is torch.bfloat16
    with pytest.raises(ValueError, match="choose from float32, bfloat16"):
        torch_dtype("auto")  # resolved first, by resolve_dtype


DEVICES = ["cpu"] + (["cuda"] if CUDA else [])


@pytest.mark.parametrize("device", DEVICES)
def test_training_and_sampling_run_on_the_device_asked_for(tiny, device):
    model, tok = tiny
    cfg = load_config(None, ["actor.dtype=float32", "actor.ppo_n_minibatches=2"])
    engine = TrainEngine(model, cfg.actor, total_optimizer_steps=4, device=device)
    assert {p.device.type for p in engine.model.parameters()} == {torch.device(device).type}
    trajs = [Trajectory([1, 2, 3], [4, 5, 6 + i], [-1.0, -1.2, -0.9], [0, 0, 0], reward=float(i % 2))
             for i in range(4)]
    batch = collate(trajs, pad_id=tok.pad_token_id).with_advantages(torch.tensor([1.0, -1.0, 0.5, -0.5]))
    before = {k: v.detach().cpu().clone() for k, v in engine.weights().items()}
    stats = engine.ppo_update(batch)
    assert all(torch.isfinite(torch.tensor(v)) for v in stats.values())
    assert any(not torch.equal(before[k], v.cpu()) for k, v in engine.weights().items())

    sampler = LocalEngine(engine.model, eos_token_ids=[tok.eos_token_id])
    assert sampler.forward.device.type == torch.device(device).type
    outs = generate(sampler, [GenerationRequest([1, 2, 3], 5, rid=i, seed=i) for i in range(3)])
    assert [len(o.output_ids) for o in outs] == [len(o.output_logprobs) for o in outs]
    assert all(lp <= 0 for o in outs for lp in o.output_logprobs)

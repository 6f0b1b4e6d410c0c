"""Shared fixtures: a real tiny random Llama with a real byte-level tokenizer."""

import copy
import importlib.util
import os
import signal

# The suite runs several processes per core (pytest-xdist, and each test's own a3po processes). OpenMP's
# default keeps a thread spinning at every barrier for its peers: with a peer descheduled, a small op then
# costs milliseconds of spinning instead of microseconds. Passive waits yield the core. Set before torch
# loads OpenMP, here and in every process a test starts (they inherit the environment).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402
from procs import Run

from a3po.config import load_config
from a3po.models import load_policy

# A shell starts background jobs (`cmd &`) with SIGINT ignored, and an ignored signal stays
# ignored across exec: the signal tests, and every a3po process they start, would never see
# Ctrl-C. Python's own handler here is reset to the default in the children it starts.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="session")
def _tiny():
    return load_policy("tiny", seed=0)


@pytest.fixture
def tiny(_tiny):
    """(model, tokenizer); the model is a fresh copy each test may change."""
    model, tok = _tiny
    return copy.deepcopy(model), tok


def actor_cfg(*overrides: str):
    return load_config(None, ["actor.dtype=float32", "actor.optimizer.lr=1e-3", *overrides]).actor


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def launch(tmp_path):
    """launch(*args) starts `a3po train *args` in tmp_path (procs.Run); what is left of it is killed after the test."""
    runs = []

    def start(*args) -> Run:
        runs.append(Run(args, tmp_path))
        return runs[-1]

    yield start
    for run in runs:
        run.kill_all()


def pytest_collection_modifyitems(config, items):
    """vLLM tests run where vLLM is installed (.venv-vllm); there, A3PO_REQUIRE_VLLM=1 turns a
    missing vLLM into failures instead of skips, so CI cannot pass by skipping them."""
    if importlib.util.find_spec("vllm") is not None or os.environ.get("A3PO_REQUIRE_VLLM") == "1":
        return
    skip = pytest.mark.skip(reason="vLLM is not installed here; make test runs these in .venv-vllm")
    for item in items:
        if "vllm" in item.keywords:
            item.add_marker(skip)

"""Every bad input ends in one line on stderr, exit status 2, no traceback, and nothing saved changed.

Each case runs `python -m a3po.cli train ...` as a user would, in a fresh tmp_path holding
the bad file, folder or module, and a run folder that already exists (runs/tiny, where a new
tiny run would go). After the failure every file under runs/ must be byte-identical and no
file may have appeared there: a failed start creates no run folder and a failed resume
rewrites nothing. The resume cases start from a real run folder made once by a real run.

Configuration, dataset, reward, environment and logging errors fail before torch is imported (a
fraction of a second); the rest load torch first and are marked slow.
"""

import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from procs import TINY, a3po, without

FILE = ["train_dataset.task=file"]
PREFIXES = ("a3po: error: ", "a3po: config error: ")
ROWS = "".join(json.dumps({"question": f"What is {i} + 1?", "answer": str(i + 1)}) + "\n" for i in range(40))


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory) -> Path:
    """A real run folder with one checkpoint, from one real step of the tiny preset."""
    cwd = tmp_path_factory.mktemp("trained")
    res = a3po("train", *TINY, "total_train_steps=1", "saver.freq_steps=1", "evaluator.freq_steps=0", cwd=cwd)
    assert res.returncode == 0, res.stderr[-2000:]
    return cwd / "runs" / "tiny"


def write_inputs(d: Path) -> None:
    """The bad (and a few good) inputs the cases point at, relative to the working directory d."""
    (d / "runs" / "tiny").mkdir(parents=True)
    (d / "runs" / "tiny" / "keep.txt").write_text("written before the failing command\n")
    (d / "bad.yaml").write_text("actor: [unclosed\n")
    (d / "unknown.yaml").write_text("actor:\n  pth: tiny\n")
    (d / "latin1.yaml").write_bytes(b"experiment_name: caf\xe9\n")
    (d / "good.jsonl").write_text(ROWS)
    (d / "latin1.jsonl").write_bytes(ROWS.encode() + b'{"question": "caf\xe9?", "answer": "1"}\n')
    (d / "broken.jsonl").write_text(ROWS + '{"question": oops}\n')
    (d / "nocol.jsonl").write_text(ROWS + '{"q": "a", "answer": "1"}\n')
    (d / "empty.jsonl").write_text("")
    (d / "few.jsonl").write_text(ROWS[: ROWS.index("\n", 100) + 1])
    (d / "data.csv").write_text("question,answer\n1+1,2\n")
    (d / "afile").write_text("not a model\n")
    (d / "brokencfg").mkdir()
    (d / "brokencfg" / "config.json").write_text("{not json")
    (d / "noweights").mkdir()
    (d / "noweights" / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 300}))
    (d / "rw_value.py").write_text("score = 3\n")
    (d / "rw_good.py").write_text("def score(completion, example):\n    return 1.0\n")
    (d / "env_hints.py").write_text("class Hints:\n    def __init__(self, example):\n        pass\n\n"
                                    "    def reset(self):\n        return 'hi'\n\n"
                                    "    def step(self, action):\n        return ('', 1.0, True)\n")
    (d / "agent_good.py").write_text("async def run(example, client):\n    return 0.0\n")
    (d / "rw_arity.py").write_text("def score(completion):\n    return 1.0\n")
    (d / "rw_raises.py").write_text("raise RuntimeError('configure me first')\n")
    (d / "env_nostep.py").write_text("class Env:\n    def __init__(self, example):\n        pass\n\n"
                                     "    def reset(self):\n        return 'hi'\n")
    (d / "env_badstop.py").write_text("class Env:\n    stop = '</calc>'\n\n    def __init__(self, example):\n"
                                      "        pass\n\n    def reset(self):\n        return 'hi'\n\n"
                                      "    def step(self, action):\n        return ('', 1.0, True)\n")


def model_without_tokenizer(d: Path, run: Path) -> None:
    src = run / "checkpoints" / "step_000001"
    (d / "notok").mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(src / name, d / "notok" / name)


REWRITING_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n"
                      "{% if m.role == 'assistant' and not loop.last %}(earlier){% else %}{{ m.content }}{% endif %}"
                      "<|im_end|>\n{% endfor %}"
                      "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def model_rewriting_history(d: Path, run: Path) -> None:
    """The trained model with a chat template that replaces earlier assistant messages (as some reasoning
    models' templates drop earlier thoughts)."""
    shutil.copytree(run / "checkpoints" / "step_000001", d / "rewrites")
    (d / "rewrites" / "chat_template.jinja").unlink(missing_ok=True)
    config = d / "rewrites" / "tokenizer_config.json"
    settings = json.loads(config.read_text())
    settings["chat_template"] = REWRITING_TEMPLATE
    config.write_text(json.dumps(settings))


def copy_run(d: Path, run: Path, change: Callable[[Path], None] = lambda run: None) -> None:
    """The trained run copied over runs/tiny, then damaged by `change`."""
    shutil.rmtree(d / "runs" / "tiny")
    shutil.copytree(run, d / "runs" / "tiny")
    change(d / "runs" / "tiny")


def ckpt(run: Path) -> Path:
    return run / "checkpoints" / "step_000001"


@dataclass
class Case:
    args: list[str]
    needle: str  # a piece of the one line that says what is wrong
    prepare: Callable[[Path, Path], None] | None = None  # (tmp_path, trained run) -> None
    env: dict = field(default_factory=dict)  # "{tmp}" stands for the case's tmp_path
    fast: bool = False  # fails before torch is imported


def early(args: list[str], needle: str) -> Case:
    """A case that fails before torch is imported (a fraction of a second): it runs with torch's import blocked."""
    return Case(args, needle, fast=True)


NO_CACHE = {"HF_HOME": "{tmp}/hf", "HF_HUB_CACHE": "{tmp}/hf/hub"}  # an empty Hugging Face cache

CASES = {
    # configuration
    "malformed-yaml": early([*TINY, "--config", "bad.yaml"], "not valid YAML at line 2"),
    "unknown-key": early([*TINY, "actor.foo=1"], "unknown key 'actor.foo'"),
    "unknown-key-in-yaml": early([*TINY, "--config", "unknown.yaml"], "unknown key 'actor.pth'"),
    "bad-value": early([*TINY, "actor.optimizer.lr=abc"], "actor.optimizer.lr='abc' is not a number"),
    "out-of-range": early([*TINY, "rollout.max_head_offpolicyness=-1"], "must be >= 0"),
    "config-not-utf8": early([*TINY, "--config", "latin1.yaml"], "is not UTF-8"),
    "config-missing": early([*TINY, "--config", "nope.yaml"], "'nope.yaml' does not exist"),
    "config-is-a-folder": early([*TINY, "--config", "runs"], "is a directory"),
    "top-p-zero": early([*TINY, "gconfig.top_p=0"], "gconfig.top_p=0"),
    "min-p-of-one": early([*TINY, "gconfig.min_p=1"], "gconfig.min_p=1"),
    "vllm-missing": Case([*TINY, "rollout.backend=vllm"], "rollout.backend=vllm needs vLLM, which is not installed"),
    "device-misspelt": early([*TINY, "actor.device=gpu"], "use auto, cpu, cuda or cuda:N"),
    "ranks-on-one-gpu": early([*TINY, "cluster.n_trainer_ranks=2", "actor.device=cuda:0"],
                              "each rank takes a GPU of its own"),
    "data-parallel-misspelt": early([*TINY, "cluster.data_parallel=fsdp"], "cluster.data_parallel"),
    "no-cuda-trainer": Case([*TINY, "actor.device=cuda"], "actor.device=cuda, but this torch"),
    "no-cuda-rollout": Case([*TINY, "rollout.device=cuda:1"], "rollout.device=cuda:1, but this torch"),
    # dataset files
    "data-missing": early([*TINY, *FILE, "train_dataset.path=missing.jsonl"], "'missing.jsonl' does not exist"),
    "data-not-utf8": early([*TINY, *FILE, "train_dataset.path=latin1.jsonl"], "latin1.jsonl:41: not UTF-8"),
    "data-broken-row": early([*TINY, *FILE, "train_dataset.path=broken.jsonl"], "broken.jsonl:41: invalid JSON"),
    "data-missing-column": early([*TINY, *FILE, "train_dataset.path=nocol.jsonl"], "nocol.jsonl:41: missing key"),
    "data-empty": early([*TINY, *FILE, "train_dataset.path=empty.jsonl"], "holds no rows"),
    "data-too-few-rows": early([*TINY, *FILE, "train_dataset.path=few.jsonl"], "lower evaluator.size"),
    "data-unsupported-type": early([*TINY, *FILE, "train_dataset.path=data.csv"], "unsupported file type .csv"),
    "path-without-task-file": early([*TINY, "train_dataset.path=good.jsonl"],
                                    "train_dataset.path='good.jsonl' conflicts: only read with "
                                    "train_dataset.task=file"),
    "task-params-with-a-file": early([*TINY, *FILE, "train_dataset.path=good.jsonl", "train_dataset.task_params={}"],
                                     "train_dataset.task_params={} conflicts"),
    "unknown-task": early([*TINY, "train_dataset.task=chain_summ"], "did you mean 'chain_sum'"),
    # model folders and hub ids
    "model-missing": early([*TINY, "actor.path=./no-such-model"], "no such directory"),
    "model-is-a-file": early([*TINY, "actor.path=./afile"], "is a file, not a model folder"),
    "model-broken-config": early([*TINY, "actor.path=./brokencfg"], "config.json' is not valid JSON"),
    "model-no-weights": early([*TINY, "actor.path=./noweights"], "has config.json but no weights"),
    "model-tiny-misshapen": early([*TINY, "actor.path=tiny-65x2"], "hidden a positive multiple of 64"),
    "model-no-tokenizer": Case([*TINY, "actor.path=./notok"], "could not load a tokenizer", model_without_tokenizer),
    "hub-unreachable": Case([*TINY, "actor.path=a3po-nobody/no-such-model"], "hub cannot be reached",
                            env={"HF_ENDPOINT": "http://127.0.0.1:9", **NO_CACHE}),  # refused at once
    "hub-offline": Case([*TINY, "actor.path=a3po-nobody/no-such-model"], "HF_HUB_OFFLINE is set",
                        env={"HF_HUB_OFFLINE": "1", **NO_CACHE}),
    # rewards
    "reward-module-missing": early([*TINY, "train_dataset.reward=no_such_rewards:score"], "cannot import"),
    "reward-not-callable": early([*TINY, "train_dataset.reward=rw_value:score"], "not a function"),
    "reward-wrong-signature": early([*TINY, "train_dataset.reward=rw_arity:score"], "must accept (completion,"),
    "reward-import-raises": early([*TINY, "train_dataset.reward=rw_raises:score"], "configure me first"),
    "reward-unknown-name": early([*TINY, "train_dataset.reward=exactt"], "did you mean 'exact'"),
    "reward-attribute-misspelt": early([*TINY, "train_dataset.reward=rw_good:scor"],
                                       "has no attribute 'scor' (did you mean 'rw_good:score'?)"),
    "reward-module-misspelt": early([*TINY, "train_dataset.reward=rw_god:score"], "did you mean 'rw_good:score'"),
    # environments
    "env-unknown-name": early([*TINY, "train_dataset.env=retri"], "did you mean 'retry'"),
    "env-module-missing": early([*TINY, "train_dataset.env=no_such_env:Env"], "cannot import"),
    "env-attribute-misspelt": early([*TINY, "train_dataset.env=env_hints:Hint"], "did you mean 'env_hints:Hints'"),
    "env-without-step": early([*TINY, "train_dataset.env=env_nostep:Env"], "not an environment class: it needs step"),
    "env-stop-a-string": early([*TINY, "train_dataset.env=env_badstop:Env"], "stop attribute must be a tuple"),
    "env-template-rewrites-history": Case([*TINY, "actor.path=./rewrites", "train_dataset.env=retry",
                                           "train_dataset.turn_context=append"],
                                          "renders earlier messages differently", model_rewriting_history),
    "env-textarena-without-game": early([*TINY, "train_dataset.env=textarena"], "train_dataset.env_id=None"),
    "env-textarena-game-misspelt": early([*TINY, "train_dataset.env=textarena",
                                          "train_dataset.env_id=GuessTheNumbr-v0"], "did you mean 'GuessTheNumber-v0'"),
    "env-discount-out-of-range": early([*TINY, "train_dataset.turn_discount=1.5"], "turn_discount"),
    # agents
    "agent-attribute-misspelt": early([*TINY, "train_dataset.agent=agent_good:rn"], "did you mean 'agent_good:run'"),
    # resume folders
    "resume-missing": early(["--resume", "runs/gone"], "no such directory"),
    "resume-a-file": early(["--resume", "runs/tiny/keep.txt"], "is a file, not a run directory"),
    "resume-not-a-run": early(["--resume", "runs/tiny"], "not a run directory"),
    "resume-with-preset": early(["--resume", "runs/tiny", "--preset", "tiny"], "drop --config/--preset"),
    "resume-no-checkpoint": Case(["--resume", "runs/tiny"], "saved no checkpoint",
                                 lambda d, run: copy_run(d, run, lambda r: shutil.rmtree(r / "checkpoints"))),
    "resume-broken-config": Case(["--resume", "runs/tiny"], "not valid YAML",
                                 lambda d, run: copy_run(d, run, lambda r: (r / "config.yaml").write_text("a: [\n"))),
    "resume-corrupt-state": Case(["--resume", "runs/tiny"], "trainer_state.pt is corrupt",
                                 lambda d, run: copy_run(d, run, lambda r: (ckpt(r) / "trainer_state.pt")
                                                         .write_bytes(b"garbage"))),
    "resume-truncated-weights": Case(["--resume", "runs/tiny"], "SafetensorError",
                                     lambda d, run: copy_run(d, run, lambda r: os.truncate(
                                         ckpt(r) / "model.safetensors", 100))),
    "resume-half-copied": Case(["--resume", "runs/tiny"], "run_state.json: No such file",
                               lambda d, run: copy_run(d, run, lambda r: (ckpt(r) / "run_state.json").unlink())),
    # logging backends
    "wandb-not-installed": early([*TINY, "logging.wandb=true"], "needs the wandb package"),
}


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if c.fast else pytest.mark.slow) for n, c in CASES.items()])
def test_bad_input_is_one_line_exit_2_and_changes_nothing(name, tmp_path, request):
    case = CASES[name]
    if name == "wandb-not-installed" and _installed("wandb"):
        pytest.skip("wandb is installed here")
    if name == "env-textarena-game-misspelt" and not _installed("textarena"):
        pytest.skip("the textarena extra is not installed here (make installs it)")
    if name == "vllm-missing" and _installed("vllm"):
        pytest.skip("vLLM is installed here")
    if name.startswith("no-cuda") and _cuda():
        pytest.skip("this machine has a CUDA device")
    write_inputs(tmp_path)
    if case.prepare is not None:
        case.prepare(tmp_path, request.getfixturevalue("trained_run"))
    env = {k: v.replace("{tmp}", str(tmp_path)) for k, v in case.env.items()}
    if case.fast:  # an import of torch would now fail with a traceback
        env.update(without("torch", tmp_path / "no-torch"))
    before = snapshot(tmp_path / "runs")

    res = a3po("train", *case.args, cwd=tmp_path, env=env)

    lines = res.stderr.splitlines()
    assert res.returncode == 2, res.stderr[-3000:]
    assert "Traceback" not in res.stderr
    assert len(lines) == 1, res.stderr[-3000:]
    assert lines[0].startswith(PREFIXES) and case.needle in lines[0], lines[0]
    assert res.stdout == ""
    assert snapshot(tmp_path / "runs") == before, "a failed command changed or added files under runs/"


def _installed(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()

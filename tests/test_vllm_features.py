"""vLLM under a3po's other paths, against the real vLLM CPU build (`make test` runs these in .venv-vllm, beside
tests/test_vllm.py: the engine itself and training on it).

Proves: multi-turn episodes train on vLLM engines inside Ray actors; an agent's calls are served
by vLLM; `a3po serve` answers the OpenAI client (top_logprobs included); `a3po bench rollout` times vLLM beside
the local engine.
"""

import json
import math
from pathlib import Path

import pytest
from procs import a3po
from test_vllm import RUN, TOL

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_vllm_workers_run_as_ray_actors_and_train_episodes(tmp_path):
    """The choices together: a vLLM engine inside a rollout worker that is a Ray actor (on a Ray instance the
    run starts for itself), weights from the object store into vLLM's reload, multi-turn episodes. One worker:
    tests/test_ray.py has two, and a second vLLM engine on these two cores doubled the test's time."""

    env = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled"}
    res = a3po("train", *RUN, "total_train_steps=4", "cluster.launcher=ray", "rollout.n_workers=1",
               "train_dataset.env=retry", "train_dataset.max_turns=3", cwd=tmp_path, env=env, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "Ray actors on a Ray instance started for this run" in res.stderr
    rows = [json.loads(line) for line in (tmp_path / "runs" / "tiny" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(5)) and max(r["stale/max"] for r in rows if r["step"] > 0) == 2
    assert all(r["episode/turns_mean"] >= 1 for r in rows if r["step"] > 0)


def test_an_agent_trains_on_vllm(tmp_path):
    """An agent's two calls per episode served by vLLM: the second continues the first (one row per episode),
    with the versions the bound allows."""

    res = a3po("train", *RUN, "total_train_steps=3", "train_dataset.agent=scripted_agents:two_turns", cwd=tmp_path,
               env={"PYTHONPATH": str(Path(__file__).parent)}, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "runs" / "tiny" / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if r["step"] > 0]
    assert len(trained) == 3 and all(r["episode/turns_mean"] == 2 and r["rollout/reward_failures"] == 0
                                     for r in trained)
    assert all(r["stale/max"] <= 2 and 0 < r["episode/observation_token_frac"] < 1 for r in trained)


def test_a3po_serve_on_vllm_answers_the_openai_client():
    import openai
    from procs import served

    with served("--model", "tiny", "--backend", "vllm", "--max-tokens", "8", timeout=600) as (proc, url):
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0)
        ask = dict(model="tiny", messages=[{"role": "user", "content": "hi"}], temperature=0)
        first, again = client.chat.completions.create(**ask), client.chat.completions.create(**ask)
        top = client.chat.completions.create(**{**ask, "temperature": 0.8, "top_p": 0.9, "seed": 1}, logprobs=True,
                                             top_logprobs=3).choices[0].logprobs.content
    assert first.choices[0].message.content == again.choices[0].message.content
    assert 1 <= first.usage.completion_tokens <= 8
    for t in top:  # vLLM's alternatives of the distribution it sampled from (temperature and top-p applied)
        alts = [a.logprob for a in t.top_logprobs]
        assert 1 <= len(alts) <= 3 and alts == sorted(alts, reverse=True) and t.logprob <= alts[0] + 1e-6
        assert sum(math.exp(a) for a in alts) <= 1 + 1e-5


def test_bench_rollout_times_vllm_beside_the_local_engine_on_the_same_work(tmp_path):

    res = a3po("bench", "rollout", "--model", "tiny", "--engines", "local,vllm", "--dtypes", "float32",
               "--trainer-dtype", "float32", "--batch", "4", "--max-new-tokens", "8", "--repeats", "2",
               "--update-every", "0", "--out", "out", cwd=tmp_path, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    rec = json.loads((tmp_path / "out" / "rollout.json").read_text())
    rows = {r["engine"]: r for r in rec["arms"]}
    assert list(rows) == ["local", "vllm"] and all(r["tokens"] == 4 * 8 for r in rows.values())
    assert rows["vllm"]["over_local"] > 0 and rows["vllm"]["over_generate"] is None  # no generate arm asked for
    assert rec["vllm_start_s"]["float32"] > 0
    gap = {g["engine"]: g for g in rec["gap"]}
    assert gap["vllm"]["tokens"] == 4 * 8 and gap["vllm"]["abs_max"] < TOL  # fp32 both sides: rounding only
    assert "| vllm | float32 | 32 |" in (tmp_path / "out" / "rollout.md").read_text()

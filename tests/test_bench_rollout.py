"""`a3po bench rollout`: the fast CI variant on the tiny model, run as a user runs it (a real
subprocess), and its argument checks.

Proves: every engine (local on each forward, generate) ran in both dtypes on the same work
(every arm generated the same number of tokens, every ratio is positive); the output files and
the last stdout line have the documented structure; the fp32 engine's log-probs are the
trainer's own, token for token, when the trainer also computes in fp32 (the bound is far below
what a one-position misalignment gives on the tiny model, about 1 nat per token); bf16 rounding
opens a larger gap, and the k3 KL estimate is never negative; in the multi-turn arm, a turn after
the first computes only its new tokens when the episode's KV cache is kept, all of them when not.
Timing is printed, never asserted.

    pytest tests/test_bench_rollout.py
"""

import importlib.util
import json

import pytest
import torch
from procs import a3po

TINY = ["bench", "rollout", "--model", "tiny", "--batch", "4", "--group", "2", "--max-new-tokens", "8", "--repeats",
        "2", "--out", "out", "--update-every", "2", "--turns", "3"]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    # the trainer computes in fp32 here whatever this CPU's `auto` resolves to, so that the fp32 gap is rounding only
    cwd = tmp_path_factory.mktemp("rollout")
    res = a3po(*TINY, "--trainer-dtype", "float32", cwd=cwd)
    assert res.returncode == 0, res.stderr[-3000:]
    return res, cwd / "out", json.loads((cwd / "out" / "rollout.json").read_text())


@pytest.mark.slow
def test_bench_rollout_runs_both_engines_in_both_dtypes_on_the_same_work(tiny_run):
    _, _, rec = tiny_run
    arms = [(a["engine"], a["dtype"]) for a in rec["arms"]]
    update_dtype = "bfloat16" if rec["machine"]["native_bf16"] else "float32"  # rollout.dtype=auto
    assert arms == [(e, d) for d in ("float32", "bfloat16") for e in ("local", "local-hf", "generate")] + [
        ("update:keep_kv", update_dtype), ("update:reprefill", update_dtype)]
    for a in rec["arms"]:
        assert a["tokens"] == 4 * 8, a  # no row stopped early, in any arm, weight updates or not
        assert a["tok_per_s_n"] == a["call_n"] == 2
        assert 0 < a["tok_per_s_min"] <= a["tok_per_s_median"] <= a["tok_per_s_max"]
        if not a["engine"].startswith("update:"):
            assert a["over_first_dtype"] > 0 and (a["dtype"] != "float32" or a["over_first_dtype"] == 1.0)
        assert (a["over_generate"] > 0) if a["engine"].startswith("local") else a["over_generate"] is None
        assert (a["over_local"] > 0) if a["engine"] == "local-hf" else a["over_local"] is None
        assert a["gflops"] > 0 and a["of_matmul"] == pytest.approx(a["gflops"] / rec["matmul_gflops"][a["dtype"]])
        assert a["of_shapes"] == pytest.approx(a["gflops"] / rec["shape_gflops"][a["dtype"]])
    assert rec["update_every"] == 2 and rec["keep_kv_over_reprefill"] > 0
    assert rec["local_bf16_over_fp32"] > 0
    assert rec["dtypes"] == ["float32", "bfloat16"] and rec["trainer_dtype"] == "float32"
    assert rec["engines"] == ["local", "local-hf", "generate"] and rec["vllm_start_s"] == {}
    assert rec["batch"] == 4 and rec["group"] == 2 and rec["max_new_tokens"] == 8 and rec["threads"] == 1
    assert set(rec["matmul_gflops"]) >= {"float32", "bfloat16"} and min(rec["matmul_gflops"].values()) > 0
    assert rec["machine"]["cpu"] and isinstance(rec["machine"]["avx512_bf16"], bool)
    assert rec["device"] == "cpu" and rec["device_name"] == rec["machine"]["cpu"]  # --device's default, named


@pytest.mark.slow
def test_bench_rollout_multi_turn_arm_computes_only_new_tokens_with_kept_kv(tiny_run):
    _, _, rec = tiny_run
    turns = rec["multi_turn"]["turns"]
    assert [t["turn"] for t in turns] == [1, 2, 3]
    assert turns[0]["kept_computed"] == turns[0]["fresh_computed"] == turns[0]["context"]
    for before, t in zip(turns, turns[1:]):  # fresh: the whole context; kept: last turn's last token + observation
        assert t["fresh_computed"] == t["context"]
        assert t["kept_computed"] == t["context"] - before["context"] - 8 + 1
    assert rec["multi_turn"]["fresh_over_kept"] > 0


@pytest.mark.slow
def test_bench_rollout_fp32_log_probs_are_the_trainers_and_bf16_drifts(tiny_run):
    _, _, rec = tiny_run
    assert [g["engine"] for g in rec["gap"]] == ["local", "local-hf"] * 2
    gap = {g["dtype"]: g for g in rec["gap"] if g["engine"] == "local"}
    hf = {g["dtype"]: g for g in rec["gap"] if g["engine"] == "local-hf"}
    assert hf["float32"]["abs_max"] < 1e-4  # both forwards give the trainer's log-probs in fp32
    assert set(gap) == {"float32", "bfloat16"}
    for g in gap.values():
        assert g["tokens"] == 4 * 8
        assert g["k3_kl"] >= 0 and 0 <= g["abs_mean"] <= g["abs_max"]
    # same weights, same dtype, same temperature: only summation order differs (~1e-7); misaligned by
    # one position, the tiny model's log-probs differ by ~1 nat
    assert gap["float32"]["abs_max"] < 1e-4 and gap["float32"]["k3_kl"] < 1e-8
    assert gap["bfloat16"]["abs_mean"] > 10 * gap["float32"]["abs_mean"]  # bf16 weights really were used


@pytest.mark.slow
def test_bench_rollout_writes_markdown_json_and_ends_stdout_with_one_json_line(tiny_run):
    res, out, rec = tiny_run
    md = (out / "rollout.md").read_text()
    assert "| local | float32 | 32 |" in md and "| generate | bfloat16 | 32 |" in md
    assert "### Behaviour log-probs b against the trainer's θ (float32)" in md and "| local | bfloat16 | 32 |" in md
    assert "avx512_bf16" in md and md in res.stdout
    last = json.loads(res.stdout.strip().splitlines()[-1])
    assert last == {**{k: v for k, v in rec.items() if k != "args"}, "out": "out"}
    assert rec["args"]["model"] == "tiny" and rec["benchmark"] == "rollout"


def test_bench_rollout_groups_ask_each_question_group_times_in_a_row(tiny):
    from a3po.bench.rollout import arithmetic_prompts

    _, tok = tiny
    p = arithmetic_prompts(tok, 6, group=3)
    assert p[0] == p[1] == p[2] and p[3] == p[4] == p[5] and p[0] != p[3]
    assert arithmetic_prompts(tok, 6)[:2] == [p[0], p[3]]  # the same questions, asked once each


@pytest.mark.parametrize("bad, named", [(["--dtypes", "float32,float16"], "float16"), (["--batch", "0"], "--batch"),
                                        (["--trainer-dtype", "fp16"], "fp16"),
                                        (["--engines", "local,sglang"], "sglang"),
                                        (["--engines", "local,local"], "each once"), (["--group", "3"], "--group"),
                                        (["--device", "cuda:x"], "use auto, cpu, cuda or cuda:N")])
def test_bench_rollout_refuses_bad_arguments_in_one_line(tmp_path, bad, named):
    res = a3po("bench", "rollout", *bad, cwd=tmp_path)
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and named in res.stderr, res.stderr
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_bench_rollout_without_vllm_refuses_its_arm_in_one_line(tmp_path):
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here: tests/test_vllm_features.py runs its arm")
    res = a3po("bench", "rollout", "--model", "tiny", "--engines", "local,vllm", cwd=tmp_path)
    assert res.returncode == 2 and res.stderr.count("\n") == 1, res.stderr
    assert "--engines vllm" in res.stderr and ".venv-vllm" in res.stderr
    assert not (tmp_path / "runs").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_bench_rollout_on_a_gpu_that_is_not_there_is_refused_before_its_folder(tmp_path):
    # in this process (a subprocess would spend seconds importing torch); the CLI prints a ConfigError as one line
    # with exit code 2 (test_exits.py)
    from a3po.bench import rollout
    from a3po.bench.args import RolloutBenchArgs
    from a3po.config import ConfigError

    with pytest.raises(ConfigError, match="--device=cuda, but this torch .* or set --device=cpu"):
        rollout.run(RolloutBenchArgs(device="cuda", model="tiny", out=str(tmp_path / "out")).checked())
    assert not (tmp_path / "out").exists()

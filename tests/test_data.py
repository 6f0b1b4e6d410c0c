"""The data side: tasks split without overlap, rewards score what they should, a reward cannot hang a worker.

Real reasoning-gym generators and scorers, real math-verify, real files written to tmp_path,
real threads and a real second Python process for pickled rewards; no mocks.
"""

import importlib.util
import json
import pickle
import subprocess
import sys
import threading

import pytest
from hypothesis import given
from hypothesis import strategies as st

from a3po.config.schema import DatasetConfig
from a3po.data import (
    DataError,
    Example,
    build_messages,
    build_reward,
    extract_final_answer,
    extract_final_expression,
    load_task,
)
from a3po.data.tasks import normalise_question

SMALL_PARAMS = {
    "chain_sum": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2},
    "basic_arithmetic": {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 2},
    "gsm_symbolic": {},
    "countdown": {"min_numbers": 3, "max_numbers": 3},
}


def error_of(fn, *args) -> str:
    with pytest.raises(DataError) as e:
        fn(*args)
    msg = str(e.value)
    assert "\n" not in msg, "DataError messages are one line"
    return msg


def chain_sum_example(question: str, answer: str) -> Example:
    entry = {"question": question, "answer": answer, "metadata": {"source_dataset": "chain_sum"}}
    return Example(question, answer, 0, {"entry": entry})


# ---------------------------------------------------------------- procedural tasks


@pytest.mark.parametrize("task", list(SMALL_PARAMS))
def test_procedural_task_loads_with_disjoint_held_out_split_and_scores_its_own_answers(task):
    cfg = DatasetConfig(task=task, task_params=SMALL_PARAMS[task], size=12)
    data = load_task(cfg, eval_size=4, seed=3)
    assert data.name == task and len(data.eval) == 4 and 0 < len(data.train) <= 12
    held = {normalise_question(e.question) for e in data.eval}
    assert len(held) == 4
    assert not held & {normalise_question(e.question) for e in data.train}
    assert [e.index for e in data.train] == list(range(len(data.train)))
    assert [e.index for e in data.eval] == list(range(4))
    reward = build_reward(cfg, data)
    for ex in data.eval[:2]:
        assert reward(ex.answer, ex) == 1.0  # the reference answer, as a completion, is correct
        assert reward(f"After some thought: \\boxed{{{ex.answer}}}", ex) == 1.0
        assert pickle.loads(pickle.dumps(ex)) == ex


def test_small_problem_space_is_deduplicated_against_the_held_out_split():
    # two one-digit terms: ~200 distinct problems, so independent draws overlap heavily
    cfg = DatasetConfig(task_params={"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}, size=2000)
    data = load_task(cfg, eval_size=64, seed=1)
    held = {normalise_question(e.question) for e in data.eval}
    assert len(held) == 64
    assert not held & {normalise_question(e.question) for e in data.train}
    assert 1000 < len(data.train) < 2000  # about 64/200 of the draws were dropped


def test_split_depends_on_the_seed_only():
    cfg = DatasetConfig(size=50)
    a, b, c = load_task(cfg, 8, seed=5), load_task(cfg, 8, seed=5), load_task(cfg, 8, seed=6)
    assert [e.question for e in a.train] == [e.question for e in b.train]
    assert [e.question for e in a.eval] == [e.question for e in b.eval]
    assert [e.question for e in a.eval] != [e.question for e in c.eval]


def test_unknown_task_lists_the_allowed_names_with_did_you_mean():
    msg = error_of(load_task, DatasetConfig(task="chain_summ"), 4, 0)
    assert "did you mean 'chain_sum'" in msg and "countdown" in msg and "file" in msg


def test_bad_task_params_name_the_task_and_the_parameter():
    msg = error_of(load_task, DatasetConfig(task_params={"min_term": 2}), 4, 0)
    assert "chain_sum" in msg and "min_term" in msg and "did you mean 'min_terms'" in msg
    msg = error_of(load_task, DatasetConfig(task_params={"min_terms": 0}), 4, 0)
    assert "chain_sum" in msg and "min_terms must be positive" in msg
    msg = error_of(load_task, DatasetConfig(task="gsm_symbolic"), 4, 0)  # chain_sum's default task_params
    assert "not a parameter of gsm_symbolic" in msg and "task_params={}" in msg
    msg = error_of(load_task, DatasetConfig(task_params={"seed": 3}), 4, 0)
    assert "task_params.seed" in msg


def test_eval_larger_than_the_problem_space_is_refused():
    cfg = DatasetConfig(task_params={"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}, size=10)
    assert "evaluator.size=500" in error_of(load_task, cfg, 500, 0)


# ---------------------------------------------------------------- rewards on chain_sum


def test_chain_sum_reward_scores_the_final_number_not_any_number_in_the_text():
    import reasoning_gym

    ex = chain_sum_example("State the final answer to the following arithmetic problem: 12 + 7 =", "19")
    reward = build_reward(DatasetConfig(), load_task(DatasetConfig(size=5), 2, 0))
    assert reward("12 + 7 = 19", ex) == 1.0
    assert reward("The answer is 19.", ex) == 1.0
    assert reward("The answer is 18", ex) == 0.0
    wrong_last = "I first thought 19 was right, but the answer is 18."
    assert reward(wrong_last, ex) == 0.0
    # why extraction matters: the task's own scorer gives the raw text partial credit
    assert reasoning_gym.create_dataset("chain_sum", seed=0, size=1).score_answer(wrong_last, ex.meta["entry"]) > 0


# ---------------------------------------------------------------- files


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def file_cfg(path, **kw):
    return DatasetConfig(task="file", path=str(path), **kw)


def test_jsonl_with_gsm8k_answers_splits_without_shared_questions(tmp_path):
    rows = [{"question": f"What is {i} + {i}?", "answer": f"{i} plus {i} is {2 * i}.\n#### {2 * i}"} for i in range(10)]
    rows.append({"question": "How many?", "answer": "Lots.\n#### 1,234"})
    rows.append({"question": "A number answer", "answer": 72})
    rows.append({"question": "  what IS 3 +  3? ", "answer": "6"})  # row 4's question, spaced and cased differently
    data = load_task(file_cfg(write_jsonl(tmp_path / "d.jsonl", rows)), eval_size=5, seed=0)
    by_q = {e.question: e for e in data.train + data.eval}
    assert by_q["What is 7 + 7?"].answer == "14"
    assert by_q["How many?"].answer == "1234"
    assert by_q["A number answer"].answer == "72"
    held = {normalise_question(e.question) for e in data.eval}
    assert len(data.eval) == 5 and not held & {normalise_question(e.question) for e in data.train}
    assert len(data.train) + len(data.eval) in (12, 13)  # 13 rows, one duplicate dropped if its twin is held out
    assert [e.index for e in data.train] == list(range(len(data.train)))
    assert data.eval[0].meta["source"].startswith(str(tmp_path / "d.jsonl") + ":")
    other = load_task(file_cfg(tmp_path / "d.jsonl"), eval_size=5, seed=1)
    assert {e.question for e in other.eval} != {e.question for e in data.eval}  # seeded choice


def test_custom_keys(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"problem": f"q{i}", "solution": str(i)} for i in range(4)])
    data = load_task(file_cfg(path, question_key="problem", answer_key="solution"), 1, 0)
    assert sorted(e.answer for e in data.train + data.eval) == ["0", "1", "2", "3"]


@pytest.mark.parametrize("bad_row, expected", [
    ('{"question": "q3", "answer": ', "invalid JSON"),
    ({"question": "q3"}, "missing key 'answer'"),
    ({"question": "q3", "answer": ["7"]}, "must be a string or number"),
    ({"question": "   ", "answer": "7"}, "'question' is empty"),
    ({"question": "q3", "answer": "no final answer ####"}, "nothing after '####'"),
    ('[1, 2]', "expected a JSON object"),
])
def test_broken_jsonl_row_names_file_line_and_key(tmp_path, bad_row, expected):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"question": "q1", "answer": "1"}, {"question": "q2", "answer": "2"},
                                                bad_row, {"question": "q4", "answer": "4"}])
    msg = error_of(load_task, file_cfg(path), 1, 0)
    assert "bad.jsonl:3" in msg and expected in msg


def test_missing_empty_and_too_small_files(tmp_path):
    assert "nowhere.jsonl" in error_of(load_task, file_cfg(tmp_path / "nowhere.jsonl"), 1, 0)
    assert "no rows" in error_of(load_task, file_cfg(write_jsonl(tmp_path / "empty.jsonl", [])), 1, 0)
    two = write_jsonl(tmp_path / "two.jsonl", [{"question": "a", "answer": "1"}, {"question": "b", "answer": "2"}])
    assert "evaluator.size=2" in error_of(load_task, file_cfg(two), 2, 0)
    (tmp_path / "d.csv").write_text("question,answer\n")
    assert "unsupported file type .csv" in error_of(load_task, file_cfg(tmp_path / "d.csv"), 1, 0)
    assert "train_dataset.path" in error_of(load_task, DatasetConfig(task="file"), 1, 0)


def test_non_utf8_jsonl_names_the_line_and_a_bom_is_fine(tmp_path):
    rows = "".join(json.dumps({"question": f"q{i}", "answer": str(i)}) + "\n" for i in range(3))
    (tmp_path / "latin1.jsonl").write_bytes(rows.encode() + b'{"question": "caf\xe9", "answer": "4"}\n')
    msg = error_of(load_task, file_cfg(tmp_path / "latin1.jsonl"), 1, 0)
    assert "latin1.jsonl:4: not UTF-8" in msg and "0xe9" in msg and "save the file as UTF-8" in msg
    (tmp_path / "bom.jsonl").write_bytes(b"\xef\xbb\xbf" + rows.encode())
    data = load_task(file_cfg(tmp_path / "bom.jsonl"), 1, 0)
    assert sorted(e.question for e in data.train + data.eval) == ["q0", "q1", "q2"]


@pytest.mark.skipif(importlib.util.find_spec("pyarrow") is not None, reason="pyarrow is installed")
def test_parquet_without_pyarrow_says_what_to_install(tmp_path):
    (tmp_path / "d.parquet").write_bytes(b"PAR1")
    assert "pip install pyarrow" in error_of(load_task, file_cfg(tmp_path / "d.parquet"), 1, 0)


@pytest.mark.skipif(importlib.util.find_spec("datasets") is not None, reason="datasets is installed")
def test_saved_dataset_without_datasets_says_what_to_install(tmp_path):
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "state.json").write_text("{}")
    assert "pip install datasets" in error_of(load_task, file_cfg(tmp_path / "ds"), 1, 0)
    (tmp_path / "plain").mkdir()
    assert "save_to_disk" in error_of(load_task, file_cfg(tmp_path / "plain"), 1, 0)


def test_build_messages():
    ex = Example("What is 2 + 2?", "4", 0, {})
    assert build_messages(ex, None) == [{"role": "user", "content": "What is 2 + 2?"}]
    assert build_messages(ex, "Be brief.") == [{"role": "system", "content": "Be brief."},
                                              {"role": "user", "content": "What is 2 + 2?"}]


# ---------------------------------------------------------------- exact, math_verify, user rewards


def file_example(answer: str) -> Example:
    return Example("q", answer, 0, {"row": {}, "source": "test"})


@pytest.mark.parametrize("completion, answer, expected", [
    ("So the total is 72.", "72", 1.0),
    ("The total is 72.0", "72", 1.0),
    ("The total is 1,234 apples", "1234", 1.0),
    ("The total is 1234", "1,234", 1.0),
    ("We get 3.50", "3.5", 1.0),
    ("x = -3", "-3", 1.0),
    ("10 - 3", "-3", 0.0),
    ("72 at first, then 71", "72", 0.0),
    ("no number here", "72", 0.0),
    ("The capital is\nParis.", "paris", 1.0),
    ("The capital is\nLyon", "Paris", 0.0),
])
def test_exact_reward(completion, answer, expected):
    reward = build_reward(DatasetConfig(task="file", path="unused", reward="exact"), replace_task_name("file"))
    assert reward(completion, file_example(answer)) == expected


@pytest.mark.parametrize("completion, answer, expected", [
    ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("The answer is $\\frac{1}{2}$", "1/2", 1.0),
    ("The answer is \\boxed{72}", "72", 1.0),
    ("\\boxed{\\frac{1}{3}}", "0.5", 0.0),
    ("I do not know", "0.5", 0.0),
])
def test_math_verify_reward_works_off_the_main_thread(completion, answer, expected):
    # math_verify's own signal timeouts would raise outside the main thread; they are off
    for reward_name in ("math_verify", "task"):  # task falls back to math_verify for files
        cfg = DatasetConfig(task="file", path="unused", reward=reward_name)
        reward = build_reward(cfg, replace_task_name("file"))
        box = []
        t = threading.Thread(target=lambda r=reward, b=box: b.append(r(completion, file_example(answer))))
        t.start()
        t.join(60)
        assert box == [expected]


def replace_task_name(name):
    from a3po.data import TaskData
    return TaskData(name, [], [])


def test_unknown_reward_name_has_did_you_mean():
    msg = error_of(build_reward, DatasetConfig(reward="math_verfy"), replace_task_name("chain_sum"))
    assert "did you mean 'math_verify'" in msg and "module:function" in msg


USER_REWARD = '''
def length_bonus(completion, example):
    return 1.0 if example.answer in completion else len(completion) / 1000

NOT_CALLABLE = 3

def wrong_arity(completion):
    return 0.0
'''


def test_user_module_function_reward(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(USER_REWARD)
    monkeypatch.syspath_prepend(str(tmp_path))
    task = replace_task_name("chain_sum")
    reward = build_reward(DatasetConfig(reward="my_rewards:length_bonus"), task)
    ex = file_example("42")
    assert reward("it is 42", ex) == 1.0 and reward("x" * 10, ex) == 0.01
    assert pickle.loads(pickle.dumps(reward))("it is 42", ex) == 1.0
    (tmp_path / "needs_more.py").write_text("import no_such_dependency_xyz\n")
    for spec, expected in [("no_such_module_xyz:f", "cannot import 'no_such_module_xyz'"),
                           ("needs_more:f", "'needs_more' imports 'no_such_dependency_xyz', which is not installed"),
                           ("my_rewards:missing", "has no attribute 'missing'"),
                           ("my_rewards:NOT_CALLABLE", "not a function"),
                           ("my_rewards:wrong_arity", "must accept (completion, example)"),
                           ("my_rewards:", "module:function")]:
        assert expected in error_of(build_reward, DatasetConfig(reward=spec), task)


@pytest.mark.slow
def test_pickled_rewards_score_in_a_fresh_process(tmp_path, monkeypatch):
    """Spawned rollout workers receive the reward pickled; a user module is found there without PYTHONPATH."""
    (tmp_path / "mods").mkdir()
    (tmp_path / "mods" / "my_rewards2.py").write_text(USER_REWARD)
    monkeypatch.syspath_prepend(str(tmp_path / "mods"))
    data = load_task(DatasetConfig(size=5), 2, 0)
    ex = data.eval[0]
    rewards = [build_reward(DatasetConfig(reward=name), data) for name in ("task", "my_rewards2:length_bonus", "exact")]
    blob = tmp_path / "rewards.pkl"
    blob.write_bytes(pickle.dumps((rewards, ex, f"so {ex.answer}")))
    code = ("import pickle, sys; rewards, ex, c = pickle.load(open(sys.argv[1], 'rb'));"
            "print([r(c, ex) for r in rewards])")
    out = subprocess.run([sys.executable, "-c", code, str(blob)],
                         capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[1.0, 1.0, 1.0]"


# ---------------------------------------------------------------- extraction


@pytest.mark.parametrize("text, expected", [
    ("12 + 7 = 19", "19"),
    ("The answer is 19.", "19"),
    ("The answer is -3", "-3"),
    ("x = -3", "-3"),
    ("(-3)", "-3"),
    ("12 - 7", "7"),
    ("10-3", "3"),
    ("It costs $1,234.", "1234"),
    ("about 1,234,567 people", "1234567"),
    ("numbers 6,61,94", "94"),
    ("It is 3.50 dollars", "3.50"),
    ("Solution...\n#### 72", "72"),
    ("#### 1,234\nmore text 5", "1234"),
    ("So \\boxed{72}. Check: 70 + 2", "72"),
    ("\\boxed{-4}", "-4"),
    ("\u22125 degrees", "-5"),
    ("no digits", None),
    ("", None),
])
def test_extract_final_answer(text, expected):
    assert extract_final_answer(text) == expected


@given(st.integers(min_value=-10**12, max_value=10**12), st.sampled_from(["The answer is", "...", "= ", "So:\n"]))
def test_extract_final_answer_returns_the_trailing_integer(n, prefix):
    assert extract_final_answer(f"{prefix} {n}") == str(n)
    assert extract_final_answer(f"Earlier 17 and 4.5, finally {n}.") == str(n)


@pytest.mark.parametrize("text, expected", [
    ("94*4 - 61 - 6", "94*4 - 61 - 6"),
    ("The answer is 94*4 - 61 - 6.", "94*4 - 61 - 6"),
    ("94*4 - 61 - 6 = 309", "94*4 - 61 - 6"),
    ("Using 6, 61, 94, 4:\n(94*4) - 61 - 6", "(94*4) - 61 - 6"),
    ("\\boxed{94 \u00d7 4 - 61 - 6} done", "94 * 4 - 61 - 6"),
    ("(use 94*4 - 61 - 6)", "94*4 - 61 - 6"),
    ("nothing", None),
])
def test_extract_final_expression(text, expected):
    assert extract_final_expression(text) == expected


def failing_generator(monkeypatch, bad, cache):
    """reasoning-gym's chain_sum, registered in its place, except that the draws i in bad(i) raise, as a generator's
    rare bug does; with an empty cache (`cache`, a new folder), so that the draws are made, not read back."""
    from reasoning_gym.factory import DATASETS

    monkeypatch.setenv("A3PO_CACHE", str(cache))
    real, config = DATASETS["chain_sum"]

    class FailsOn(real):
        def __getitem__(self, i):
            if i in bad(i):
                raise ZeroDivisionError("division by zero")
            return super().__getitem__(i)

    monkeypatch.setitem(DATASETS, "chain_sum", (FailsOn, config))


def test_a_rare_generator_failure_is_skipped_not_fatal(monkeypatch, tmp_path):
    cfg = DatasetConfig(size=200)
    clean = load_task(cfg, eval_size=4, seed=1)
    failing_generator(monkeypatch, lambda i: {30, 150}, tmp_path)  # past the few draws the held-out split takes
    data = load_task(cfg, eval_size=4, seed=1)
    assert [e.question for e in data.eval] == [e.question for e in clean.eval]
    # the same training draws in the same order, less the two that failed
    kept, rest = [e.question for e in data.train], iter(e.question for e in clean.train)
    assert all(q in rest for q in kept) and len(kept) == len(clean.train) - 2


def test_a_generator_failing_often_is_a_one_line_error(monkeypatch, tmp_path):
    failing_generator(monkeypatch, lambda i: {i} if i % 2 else set(), tmp_path)  # every second draw
    msg = error_of(load_task, DatasetConfig(size=200), 4, 1)
    assert "chain_sum failed to generate" in msg and "ZeroDivisionError" in msg and "task_params" in msg


# ---------------------------------------------------------------- draws kept on disk


def test_kept_draws_read_back_equal_and_a_start_then_skips_reasoning_gym(monkeypatch, tmp_path):
    """The second load reads the first one's draws (tuples in the metadata included) and, in a fresh process,
    without importing reasoning-gym; a different seed is drawn anew."""
    monkeypatch.setenv("A3PO_CACHE", str(tmp_path))
    cfg = DatasetConfig(task="countdown", task_params=SMALL_PARAMS["countdown"], size=30)
    first = load_task(cfg, eval_size=4, seed=2)
    assert len(list((tmp_path / "tasks").glob("countdown-*.json"))) == 1
    assert load_task(cfg, eval_size=4, seed=2) == first
    assert isinstance(first.eval[0].meta["entry"]["metadata"]["difficulty"]["numbers"], tuple)
    code = ("import sys; from a3po.config.schema import DatasetConfig; from a3po.data import load_task; "
            f"cfg = DatasetConfig(task='countdown', task_params={SMALL_PARAMS['countdown']!r}, size=30); "
            "d = load_task(cfg, 4, 2); "
            "print(len(d.train), 'reasoning_gym' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**__import__("os").environ, "A3PO_CACHE": str(tmp_path)})
    assert out.stdout.split() == [str(len(first.train)), "False"], out.stderr[-2000:]
    assert load_task(cfg, eval_size=4, seed=3) != first
    assert len(list((tmp_path / "tasks").glob("countdown-*.json"))) == 2


def test_a_torn_or_unwritable_cache_never_fails_a_load(monkeypatch, tmp_path):
    monkeypatch.setenv("A3PO_CACHE", str(tmp_path))
    cfg = DatasetConfig(size=40)
    first = load_task(cfg, eval_size=4, seed=1)
    (kept,) = (tmp_path / "tasks").glob("chain_sum-*.json")
    kept.write_text(kept.read_text()[:100])  # a crash mid-write, or a foreign file
    assert load_task(cfg, eval_size=4, seed=1) == first
    assert load_task(cfg, eval_size=4, seed=1) == first  # rewritten whole by the load before
    (tmp_path / "file").write_text("not a folder")
    monkeypatch.setenv("A3PO_CACHE", str(tmp_path / "file"))
    assert load_task(cfg, eval_size=4, seed=1) == first

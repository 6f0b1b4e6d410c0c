"""Reward services in real `a3po train` runs of the tiny model: the weighted sum, each failure policy, a
service that never answers, and a judge served by `a3po serve`."""

import json

import pytest
from http_servers import FakeService
from procs import TINY, a3po, assert_one_clean_line, served

pytestmark = pytest.mark.slow
RUN = [*TINY, "total_train_steps=3", "evaluator.freq_steps=0", "evaluator.initial=false", "saver.freq_steps=0"]


def metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def constant(score):
    return lambda body, n: (200, {"scores": [score] * len(body["items"])})


def test_the_reward_is_rule_weight_times_the_rule_plus_weight_times_the_service(tmp_path):
    (tmp_path / "alone").mkdir()
    (tmp_path / "both").mkdir()
    with FakeService(constant(0.25)) as server:
        alone = a3po("train", *RUN, "reward_service.kind=scorer", f"reward_service.url={server.url}",
                     "reward_service.rule_weight=0", "reward_service.weight=2", "reward_service.batch_size=3",
                     cwd=tmp_path / "alone", timeout=300)
        calls = server.calls
    assert alone.returncode == 0, alone.stderr[-3000:]
    rows = metrics(tmp_path / "alone" / "runs" / "tiny")
    assert [r["rollout/reward_mean"] for r in rows] == [0.5] * 3 and all(r["rollout/reward_std"] == 0 for r in rows)
    assert all(r["rollout/reward_service_s"] > 0 and r["rollout/reward_failures"] == 0 for r in rows)
    assert calls >= 3 * 4 * 2  # every group of 4 samples in ceil(4 / 3) = 2 requests (some may run ahead)
    with FakeService(constant(0.25)) as server:
        both = a3po("train", *RUN, "reward_service.kind=scorer", f"reward_service.url={server.url}",
                    cwd=tmp_path / "both", timeout=300)
    assert both.returncode == 0, both.stderr[-3000:]
    for r in metrics(tmp_path / "both" / "runs" / "tiny"):  # exact's 0 or 1 plus 0.25, over 16 samples
        solved = (r["rollout/reward_mean"] - 0.25) * 16
        assert abs(solved - round(solved)) < 1e-6


def test_drop_refills_the_group_the_service_failed_on(tmp_path):
    first_fails = lambda body, n: (400, {"error": "no"}) if n == 1 else constant(1.0)(body, n)  # noqa: E731
    with FakeService(first_fails) as server:
        res = a3po("train", *RUN, "reward_service.kind=scorer", f"reward_service.url={server.url}",
                   "reward_service.on_failure=drop", cwd=tmp_path, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = metrics(tmp_path / "runs" / "tiny")
    assert sum(r["rollout/dropped_groups"] for r in rows) == 1
    assert sum(r["rollout/reward_failures"] for r in rows) == 0  # the dropped group never reached training


def test_stop_ends_the_run_with_one_line_naming_the_service(tmp_path):
    with FakeService(lambda body, n: (400, {"error": "bad key"})) as server:
        res = a3po("train", *RUN, "reward_service.kind=scorer", f"reward_service.url={server.url}",
                   "reward_service.on_failure=stop", cwd=tmp_path, timeout=300)
    assert res.returncode != 0
    line = assert_one_clean_line(res.stderr, "a3po: training stopped")
    assert "reward service (scorer" in line and "HTTP 400" in line and "on_failure=stop" in line


def test_a_service_that_never_answers_scores_zero_at_its_deadline_and_is_counted(tmp_path):
    with FakeService(constant(1.0)) as server:
        server.hold = __import__("threading").Event()
        res = a3po("train", *RUN, "reward_service.kind=scorer", f"reward_service.url={server.url}",
                   "reward_service.timeout_s=0.5", "reward_service.retries=0", "reward_service.rule_weight=0",
                   "train_dataset.max_reward_failure_frac=1", cwd=tmp_path, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = metrics(tmp_path / "runs" / "tiny")
    assert all(r["rollout/reward_failures"] == 16 and r["rollout/reward_mean"] == 0 for r in rows)
    assert all(0.5 <= r["rollout/reward_service_s"] < 10 for r in rows)


def test_a_dead_service_stops_the_run_at_the_failure_share_with_its_reason(tmp_path):
    with FakeService(constant(1.0)) as server:
        url = server.url
    res = a3po("train", *RUN, "reward_service.kind=scorer", f"reward_service.url={url}", "reward_service.retries=0",
               cwd=tmp_path, timeout=300)
    assert res.returncode != 0
    line = assert_one_clean_line(res.stderr, "a3po: training stopped")
    assert f"cannot reach {url}" in line and "max_reward_failure_frac" in line


def test_a_run_rewarded_by_a_judge_that_a3po_serves(tmp_path):
    with served("--model", "tiny", "--max-tokens", "8") as (proc, url):
        res = a3po("train", *RUN, "reward_service.kind=judge", f"reward_service.url={url}",
                   "reward_service.max_tokens=8", "train_dataset.max_reward_failure_frac=1", cwd=tmp_path,
                   timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = metrics(tmp_path / "runs" / "tiny")
    assert len(rows) == 3 and all(r["rollout/reward_service_s"] > 0 for r in rows)


@pytest.mark.parametrize("overrides, says", [
    (["reward_service.kind=judge"], "reward_service.url=None"),
    (["reward_service.kind=scorer", "reward_service.url=localhost:8000"], "an http:// URL"),
    (["reward_service.kind=oracle"], "reward_service.kind"),
    (["reward_service.url=http://127.0.0.1:1"], "only used with reward_service.kind=judge or scorer"),
    (["reward_service.kind=judge", "reward_service.url=http://127.0.0.1:1", "reward_service.score_regex=[0-"],
     "is not a regular expression"),
    (["reward_service.kind=scorer", "reward_service.url=http://127.0.0.1:1", "train_dataset.env=retry"],
     "gives its episodes' rewards itself"),
    (["reward_service.kind=scorer", "reward_service.url=http://127.0.0.1:1", "reward_service.on_failure=retry"],
     "reward_service.on_failure"),
])
def test_bad_reward_service_settings_are_one_line_before_anything_starts(overrides, says, tmp_path):
    res = a3po("train", *TINY, *overrides, cwd=tmp_path, timeout=120)
    assert res.returncode == 2 and says in res.stderr, res.stderr[-2000:]
    assert res.stderr.strip().count("\n") == 0


def test_a3po_serve_refuses_a_bad_port_in_one_line():
    res = a3po("serve", "--port", "70000", timeout=60)
    assert res.returncode == 2 and "--port" in res.stderr and res.stderr.strip().count("\n") == 0

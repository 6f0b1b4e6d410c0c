"""Reward services against real HTTP servers on 127.0.0.1: scores, batching, the concurrency cap, retries,
deadlines and every kind of bad answer, through the client a rollout worker uses (a3po/services/)."""

import math
import threading
import time

import pytest
from http_servers import FakeService, judge_saying, scores_by_length

from a3po.config.schema import RewardServiceConfig
from a3po.services import JudgeItem, ServiceConfigError, build_service, check_service

ITEMS = [JudgeItem(f"q{i}", str(i), "x" * i) for i in range(10)]


def service(kind: str, url: str, **kw):
    return build_service(RewardServiceConfig(kind=kind, url=url, **kw))


def results(client, keys: int = 1, timeout: float = 30.0) -> dict:
    got, deadline = {}, time.monotonic() + timeout
    while len(got) < keys:
        assert time.monotonic() < deadline, f"no answer within {timeout}s"
        got.update({r.key: r for r in client.poll(block_s=0.1)})
    return got


def test_a_scorer_scores_every_completion_in_order_in_ceil_n_over_batch_calls():
    with FakeService(scores_by_length) as server:
        client = service("scorer", server.url + "/score", batch_size=4)
        client.submit("g", ITEMS)
        got = results(client)["g"]
    assert got.scores == [float(i) for i in range(10)] and got.failures == [None] * 10
    assert server.calls == math.ceil(10 / 4) == 3
    assert [len(b["items"]) for b in sorted(server.bodies, key=lambda b: b["items"][0]["prompt"])] == [4, 4, 2]
    assert server.bodies[0]["items"][0].keys() == {"prompt", "completion", "answer"}


def test_requests_in_flight_never_pass_the_cap_and_reach_it():
    with FakeService(scores_by_length, delay_s=0.1) as server:
        client = service("scorer", server.url, batch_size=1, max_concurrency=3)
        client.submit("a", ITEMS[:6])
        client.submit("b", ITEMS[6:])
        got = results(client, keys=2)
    assert server.peak == 3
    assert got["a"].scores + got["b"].scores == [float(i) for i in range(10)]


def test_a_flaky_service_is_retried_until_it_answers():
    flaky = lambda body, n: (503, {"error": "busy"}) if n <= 2 else scores_by_length(body, n)  # noqa: E731
    with FakeService(flaky) as server:
        client = service("scorer", server.url, retries=3, backoff_s=0.01)
        client.submit("g", ITEMS[:3])
        got = results(client)["g"]
    assert got.scores == [0.0, 1.0, 2.0] and server.calls == 3


def test_a_service_that_never_answers_fails_at_its_deadline_after_its_retries_and_submit_never_waits():
    with FakeService(scores_by_length) as server:
        server.hold = threading.Event()  # no answer until the test ends
        client = service("scorer", server.url, timeout_s=0.3, retries=1, backoff_s=0.01)
        t0 = time.monotonic()
        client.submit("g", ITEMS[:2])
        assert time.monotonic() - t0 < 0.1  # the caller (a worker's decode loop) goes on at once
        got = results(client, timeout=10)["g"]
        assert got.scores == [None, None]
        assert "within 0.3s (2 attempts)" in got.failures[0] and server.calls == 2
        assert 0.6 <= got.seconds < 5


@pytest.mark.parametrize("status, payload, why", [
    (400, {"error": "bad"}, "HTTP 400"),
    (200, {"scores": [1.0]}, "1 scores for 3 completions"),
    (200, {"scores": [1.0, float("nan"), 0.0]}, "not a finite number"),
    (200, {"scores": ["high", 1, 0]}, "not a finite number"),
    (200, {"nothing": 1}, "no scores in the answer"),
    (200, b"<html>oops</html>", "is not JSON"),
])
def test_an_answer_that_cannot_be_used_fails_its_batch_once_without_retrying(status, payload, why):
    with FakeService(lambda body, n: (status, payload)) as server:
        client = service("scorer", server.url, retries=3, backoff_s=0.01)
        client.submit("g", ITEMS[:3])
        got = results(client)["g"]
    assert got.scores == [None] * 3 and why in got.failures[0] and server.calls == 1


def test_other_answer_shapes_are_read():
    for payload in ({"rewards": [0.5, 1]}, {"data": [{"score": 0.5}, {"score": 1}]}, [0.5, 1]):
        with FakeService(lambda body, n, p=payload: (200, p)) as server:
            client = service("scorer", server.url)
            client.submit("g", ITEMS[:2])
            assert results(client)["g"].scores == [0.5, 1.0]


def test_nothing_listening_is_a_failure_naming_the_url():
    with FakeService(scores_by_length) as server:
        url = server.url
    client = service("scorer", url, retries=1, backoff_s=0.01)
    client.submit("g", ITEMS[:1])
    assert f"cannot reach {url}" in results(client)["g"].failures[0]


def test_a_judge_gets_the_filled_template_and_its_last_number_over_score_max_is_the_score():
    with FakeService(judge_saying("Between 3 and 10 I would give it 7.")) as server:
        client = service("judge", server.url + "/v1", model="j",
                         template='{"q": "{question}"} -> {completion} ({answer})')
        client.submit("g", ITEMS[2:4])
        got = results(client)["g"]
    assert got.scores == [0.7, 0.7] and server.calls == 2  # one chat request per completion
    first = min(server.bodies, key=lambda b: b["messages"][0]["content"])
    assert first["messages"] == [{"role": "user", "content": '{"q": "q2"} -> xx (2)'}]
    assert first["model"] == "j" and first["temperature"] == 0


def test_a_judge_answer_without_a_score_is_a_failure_quoting_it():
    with FakeService(judge_saying("I cannot judge this.")) as server:
        client = service("judge", server.url + "/v1", retries=2)
        client.submit("g", ITEMS[:1])
        got = results(client)["g"]
    assert got.scores == [None] and "no score in the judge's answer 'I cannot judge this.'" in got.failures[0]
    assert server.calls == 1


@pytest.mark.parametrize("kw, why", [
    ({"score_regex": "([0-9]"}, "is not a regular expression"),
    ({"score_regex": "[0-9]+"}, "needs a group"),
    ({"template": "Grade {question}"}, "has no {completion}"),
])
def test_judge_settings_that_cannot_work_are_refused_before_the_run(kw, why):
    with pytest.raises(ServiceConfigError, match=why.replace("{", "\\{").replace("}", "\\}")):
        check_service(RewardServiceConfig(kind="judge", url="http://127.0.0.1:9/v1", **kw))


def test_the_api_key_comes_from_the_named_environment_variable(monkeypatch):
    with FakeService(scores_by_length) as server:
        monkeypatch.setenv("MY_RM_KEY", "s3cret")
        client = service("scorer", server.url, api_key_env="MY_RM_KEY")
        client.submit("g", ITEMS[:2])
        assert results(client)["g"].scores == [0.0, 1.0]
        assert server.headers[-1]["Authorization"] == "Bearer s3cret"
    monkeypatch.delenv("MY_RM_KEY")
    with pytest.raises(ServiceConfigError, match="MY_RM_KEY.*not set"):
        check_service(RewardServiceConfig(kind="scorer", url="http://127.0.0.1:9", api_key_env="MY_RM_KEY"))

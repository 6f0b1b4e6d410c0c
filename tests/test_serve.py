"""`a3po serve`: a real model behind the OpenAI chat-completions protocol on 127.0.0.1, used through the `openai`
client, raw HTTP and a3po's own judge client."""

import http.client
import json
import re
import socket
import threading

import openai
import pytest
from procs import a3po, served

from a3po.config.schema import RewardServiceConfig
from a3po.services import JudgeItem, build_service

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny_server():
    with served("--model", "tiny", "--max-tokens", "16") as (proc, url):
        yield url


def post(url: str, path: str, body: bytes, headers: dict | None = None) -> tuple[int, dict]:
    host, port = url.split("//")[1].split("/")[0].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
    response = conn.getresponse()
    status, data = response.status, json.loads(response.read())
    conn.close()
    return status, data


def test_the_openai_client_lists_the_model_and_gets_completions(tiny_server):
    client = openai.OpenAI(base_url=tiny_server, api_key="none", max_retries=0)
    assert [m.id for m in client.models.list().data] == ["tiny"]
    ask = dict(model="tiny", messages=[{"role": "user", "content": "2+3?"}], temperature=0, max_tokens=8)
    first, again = client.chat.completions.create(**ask), client.chat.completions.create(**ask)
    assert first.choices[0].message.content == again.choices[0].message.content  # greedy
    assert first.choices[0].finish_reason in ("stop", "length")
    assert 1 <= first.usage.completion_tokens <= 8 and first.usage.prompt_tokens > 5
    seeded = dict(ask, temperature=1.0, seed=7, logprobs=True)
    a, b = client.chat.completions.create(**seeded), client.chat.completions.create(**seeded)
    assert a.choices[0].message.content == b.choices[0].message.content  # a seed fixes the sample
    lps = [t.logprob for t in a.choices[0].logprobs.content]
    assert len(lps) == a.usage.completion_tokens and all(lp <= 0 for lp in lps)


def test_concurrent_requests_are_all_answered(tiny_server):
    client = openai.OpenAI(base_url=tiny_server, api_key="none", max_retries=0)
    out = [None] * 12

    def ask(i):
        out[i] = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": f"n{i}"}],
                                                max_tokens=6, seed=i)
    threads = [threading.Thread(target=ask, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert all(o is not None and o.usage.completion_tokens >= 1 for o in out)


@pytest.mark.parametrize("body, why", [
    (b"{not json", "not JSON"),
    (b"[1, 2]", "JSON list"),
    (b'{"messages": []}', "messages: a non-empty list"),
    (b'{"messages": [{"role": "wizard", "content": "x"}]}', "messages[0]: an object whose role"),
    (b'{"messages": [{"role": "user", "content": 5}]}', "messages[0].content: a string"),
    (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": -1}', "max_tokens=-1"),
    (b'{"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}', "temperature='hot'"),
    (b'{"messages": [{"role": "user", "content": "x"}], "n": 3}', "n=3"),
    (b'{"messages": [{"role": "user", "content": "x"}], "stream": true}', "stream=true"),
    (b'{"messages": [{"role": "user", "content": "x"}], "stop": [""]}', "stop="),
])
def test_a_malformed_request_is_a_400_with_its_reason_and_the_server_goes_on(tiny_server, body, why):
    status, data = post(tiny_server, "/v1/chat/completions", body)
    assert status == 400 and why in data["error"]["message"]
    ok, _ = post(tiny_server, "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}]}')
    assert ok == 200


def test_unknown_paths_are_404s(tiny_server):
    assert post(tiny_server, "/v2/complete", b"{}")[0] == 404


def _outward_address() -> str | None:
    """This machine's address on a non-loopback interface, if it has one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))  # no packet is sent: this only picks the outgoing interface
            address = s.getsockname()[0]
        except OSError:
            return None
    return None if address.startswith("127.") else address


def test_it_listens_on_loopback_and_answers_only_loopback_peers_whatever_it_binds():
    outward = _outward_address()
    if outward is None:
        pytest.skip("no non-loopback interface on this machine")
    with served("--model", "tiny") as (proc, url):
        assert url.startswith("http://127.0.0.1:")
        port = int(url.rsplit(":", 1)[1].split("/")[0])
        with pytest.raises(OSError):
            socket.create_connection((outward, port), timeout=5).close()
    with served("--model", "tiny", "--host", "0.0.0.0") as (proc, url):
        port = int(url.rsplit(":", 1)[1].split("/")[0])
        status, data = post(f"http://{outward}:{port}/v1", "/v1/models", b"{}")
        assert status == 403 and "loopback" in data["error"]["message"]


def test_a3po_serve_as_a_judge_scores_with_its_own_greedy_answer():
    """The built-in SmolLM2 served by a3po grades; the judge client's score is the last number of the answer the
    same server gives to the same message, over score_max (or, without a number, a failure quoting it)."""
    with served("--max-tokens", "24") as (proc, url):
        cfg = RewardServiceConfig(kind="judge", url=url, max_tokens=24)
        judge = build_service(cfg)
        item = JudgeItem("What is 2 + 3?", "5", "The answer is 5.")
        judge.submit("g", [item])
        got = judge.poll(block_s=120)[0]
        prompt = cfg.template.replace("{question}", item.question).replace("{answer}", item.answer) \
            .replace("{completion}", item.completion)
        direct = openai.OpenAI(base_url=url, api_key="none").chat.completions.create(
            model="x", messages=[{"role": "user", "content": prompt}], temperature=0, max_tokens=24)
    text = direct.choices[0].message.content
    numbers = re.findall(cfg.score_regex, text)
    if numbers:
        assert got.scores == [float(numbers[-1]) / cfg.score_max]
    else:
        assert got.scores == [None] and text[:40] in got.failures[0]


def test_a_model_that_does_not_exist_is_one_line():
    res = a3po("serve", "--model", "/nonexistent/model", timeout=120)
    assert res.returncode == 2 and res.stderr.strip().count("\n") == 0 and "a3po: error:" in res.stderr

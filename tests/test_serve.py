"""`a3po serve`: a real model behind the OpenAI chat-completions protocol on 127.0.0.1, used through the `openai`
client, raw HTTP and a3po's own judge client."""

import http.client
import json
import math
import re
import select
import socket
import threading
import time

import openai
import pytest
from procs import a3po, served, without

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
    top = client.chat.completions.create(**seeded, top_logprobs=4).choices[0].logprobs.content
    assert [t.logprob for t in top] == lps  # the same sample: asking for alternatives changes nothing else
    for t in top:  # each token's 4 most likely, sorted, from the distribution the token was drawn from
        alts = [a.logprob for a in t.top_logprobs]
        assert len(alts) == 4 and alts == sorted(alts, reverse=True) and sum(math.exp(a) for a in alts) <= 1 + 1e-6
        assert t.logprob <= alts[0] + 1e-6
    greedy = client.chat.completions.create(**ask, logprobs=True, top_logprobs=2).choices[0].logprobs.content
    assert all(t.logprob == t.top_logprobs[0].logprob for t in greedy)  # the argmax: the most likely alternative


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


# a request offering one tool, less its closing brace
_ADD = (b'{"messages": [{"role": "user", "content": "x"}], '
        b'"tools": [{"type": "function", "function": {"name": "add"}}], ')


@pytest.mark.parametrize("body, why", [
    (b"{not json", "not JSON"),
    (b"[1, 2]", "JSON list"),
    (b'{"messages": []}', "messages: a non-empty list"),
    (b'{"messages": [{"role": "wizard", "content": "x"}]}', "messages[0]: an object whose role"),
    (b'{"messages": [{"role": "user", "content": 5}]}', "messages[0].content: a string"),
    (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": -1}', "max_tokens=-1"),
    (b'{"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}', "temperature='hot'"),
    (b'{"messages": [{"role": "user", "content": "x"}], "n": 17}', "n=17"),
    (b'{"messages": [{"role": "user", "content": "x"}], "stream": "yes"}', "stream='yes'"),
    (b'{"messages": [{"role": "user", "content": "x"}], "stream": true, "stream_options": 3}', "stream_options"),
    (b'{"messages": [{"role": "user", "content": "x"}], "stop": [""]}', "stop="),
    (b'{"messages": [{"role": "user", "content": "x"}], "logprobs": true, "top_logprobs": 21}', "limit of 20"),
    (b'{"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}', "top_logprobs=3 needs logprobs=true"),
    (b'{"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}}',
     'response_format={"type": "json_object"} is not served'),
    (b'{"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}', "offers no tools"),
    (_ADD + b'"tool_choice": {"type": "function", "function": {"name": "sub"}}}',
     "tool 'sub', which is not among the request's tools ('add')"),
    (_ADD + b'"tool_choice": "required"}', "tool-call format"),  # the tiny model's template shows none
    (_ADD + b'"tool_choice": "any"}', "tool_choice:"),
    (b'{"messages": [{"role": "user", "content": "x"}], "frequency_penalty": 0.5}', "frequency_penalty=0.5"),
    (b'{"messages": [{"role": "user", "content": "x"}], "logit_bias": {"5": 1}}', "logit_bias="),
])
def test_a_malformed_request_is_a_400_with_its_reason_and_the_server_goes_on(tiny_server, body, why):
    status, data = post(tiny_server, "/v1/chat/completions", body)
    assert status == 400 and why in data["error"]["message"]
    ok, _ = post(tiny_server, "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}]}')
    assert ok == 200


def test_the_developer_role_is_the_system_role_and_harmless_defaults_are_accepted(tiny_server):
    ask = {"model": "tiny", "max_tokens": 3, "temperature": 0, "logprobs": True}
    question = {"role": "user", "content": "2+3?"}
    as_system = post(tiny_server, "/v1/chat/completions", json.dumps(
        {**ask, "messages": [{"role": "system", "content": "Be brief."}, question]}).encode())
    as_developer = post(tiny_server, "/v1/chat/completions", json.dumps(
        {**ask, "messages": [{"role": "developer", "content": "Be brief."}, question], "top_logprobs": 0,
         "tool_choice": "auto", "response_format": {"type": "text"}, "stream": False,
         "frequency_penalty": 0}).encode())
    assert as_system[0] == as_developer[0] == 200
    assert as_system[1]["usage"] == as_developer[1]["usage"]  # the same prompt tokens: rendered as system
    assert as_system[1]["choices"][0]["message"] == as_developer[1]["choices"][0]["message"]


def test_streamed_replies_are_the_replies_as_chunks(tiny_server):
    """stream=true through the openai client: the role first, the content, a finish reason, the usage chunk when
    asked; greedy, the streamed text is the text of the same request unstreamed."""
    client = openai.OpenAI(base_url=tiny_server, api_key="none", max_retries=0)
    ask = dict(model="tiny", messages=[{"role": "user", "content": "2+3?"}], temperature=0, max_tokens=8)
    whole = client.chat.completions.create(**ask)
    chunks = list(client.chat.completions.create(**ask, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    finished = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finished == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1]) and len({c.id for c in chunks}) == 1
    plain = list(client.chat.completions.create(**ask, stream=True))
    assert all(c.choices for c in plain) and all(c.usage is None for c in plain)  # no usage chunk unasked


def test_n_choices_are_sampled_each_on_its_own(tiny_server):
    client = openai.OpenAI(base_url=tiny_server, api_key="none", max_retries=0)
    ask = dict(model="tiny", messages=[{"role": "user", "content": "2+3?"}], max_tokens=8, n=4, seed=3)
    got = client.chat.completions.create(**ask)
    assert [c.index for c in got.choices] == [0, 1, 2, 3]
    assert len({c.message.content for c in got.choices}) > 1  # four samples of a random model differ
    assert got.choices[2].message.content == client.chat.completions.create(**ask).choices[2].message.content
    one = client.chat.completions.create(**dict(ask, n=1))
    assert got.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt counted once
    assert got.usage.total_tokens == got.usage.prompt_tokens + got.usage.completion_tokens
    assert got.usage.completion_tokens >= 4  # every choice's tokens
    streamed = list(client.chat.completions.create(**ask, stream=True))
    texts = ["".join(c.choices[0].delta.content or "" for c in streamed if c.choices[0].index == i) for i in range(4)]
    assert texts == [c.message.content for c in got.choices]  # seeded: the same samples, streamed


def test_completions_take_a_prompt_as_text_or_token_ids(tiny_server, _tiny):
    """/v1/completions: a text prompt and the same prompt as its ids give the same greedy completion; n, logprobs,
    streaming; what is not served (echo, best_of, several prompts, an id past the vocabulary) is a 400."""
    client = openai.OpenAI(base_url=tiny_server, api_key="none", max_retries=0)
    ask = dict(model="tiny", temperature=0, max_tokens=6)
    text = client.completions.create(prompt="One, two, three,", **ask)
    assert text.object == "text_completion" and text.choices[0].finish_reason in ("stop", "length")
    assert 1 <= text.usage.completion_tokens <= 6
    ids = _tiny[1].encode("One, two, three,", add_special_tokens=False)  # the served model's tokenizer
    by_ids = client.completions.create(prompt=ids, **ask)
    assert by_ids.choices[0].text == text.choices[0].text and by_ids.usage.prompt_tokens == len(ids)
    sampled = client.completions.create(prompt="One,", model="tiny", max_tokens=4, n=3, seed=1, logprobs=1)
    assert [c.index for c in sampled.choices] == [0, 1, 2]
    assert all(len(c.logprobs.token_logprobs) == len(c.logprobs.tokens) >= 1 for c in sampled.choices)
    top = client.completions.create(prompt="One,", **ask, logprobs=3).choices[0].logprobs
    for token, lp, alts in zip(top.tokens, top.token_logprobs, top.top_logprobs):  # greedy: the chosen is the top
        assert 1 <= len(alts) <= 4 and alts[token] == lp == max(alts.values())  # texts may coincide
    chunks = list(client.completions.create(prompt="One, two, three,", stream=True, **ask))
    assert "".join(c.choices[0].text for c in chunks) == text.choices[0].text
    for body, why in ((b'{"prompt": "x", "echo": true}', "echo=true"), (b'{"prompt": "x", "best_of": 3}', "best_of=3"),
                      (b'{"prompt": ["x", "y"]}', "one prompt a request"), (b'{"prompt": [99999999]}', "vocabulary"),
                      (b'{"prompt": "x", "logprobs": 21}', "limit of 20"), (b'{"messages": []}', "prompt:"),
                      (b'{"prompt": [1, -2]}', "prompt:")):
        status, data = post(tiny_server, "/v1/completions", body)
        assert status == 400 and why in data["error"]["message"], (body, data)


def test_a_required_or_named_call_is_forced_by_its_opening_after_the_prompt(tiny):
    """`a3po serve`'s engine loop in this process, the format named (the tiny template shows none): the call's
    opening is prompt (counted in prompt_tokens, never in the completion), and the reply is read from it and the
    generated text; the random model's continuation completes no call, so it comes back as text, malformed."""
    from a3po.rollout.chat import ChatQueue
    from a3po.rollout.local import LocalEngine
    from a3po.serve import EngineLoop
    from a3po.serving.protocol import parse_chat_request
    from a3po.serving.toolcalls import call_opening

    model, tok = tiny
    chat = ChatQueue(60.0)
    loop = EngineLoop(LocalEngine(model, eos_token_ids=[tok.eos_token_id], decode=tok.decode, max_batch=4), tok,
                      chat, max_tokens=8, max_context=512, tool_call_format="hermes")
    messages = [{"role": "user", "content": "2+3?"}]
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    rendered = len(tok.encode(tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                                      tokenize=False), add_special_tokens=False))
    for choice, name in (("required", None), ({"type": "function", "function": {"name": "add"}}, "add")):
        request = parse_chat_request(json.dumps({"messages": messages, "tools": tools, "tool_choice": choice,
                                                 "temperature": 0, "logprobs": True}).encode())
        out = []
        asker = threading.Thread(target=lambda r=request, o=out: o.append(loop.answer(None, r)))
        asker.start()
        deadline = time.monotonic() + 60
        while asker.is_alive():
            assert time.monotonic() < deadline, "no reply from the engine loop"
            loop.step()
        [reply] = out[0]
        opening = call_opening("hermes", name)
        assert reply.prompt_tokens == rendered + len(tok.encode(opening, add_special_tokens=False))
        assert reply.completion_tokens == len(reply.token_logprobs) <= 8
        assert reply.malformed_tool_call and not reply.tool_calls and reply.text.startswith(opening)
    chat.close()


def test_unknown_paths_are_404s(tiny_server):
    assert post(tiny_server, "/v2/complete", b"{}")[0] == 404
    status, data = post(tiny_server, "/abc/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}]}')
    assert status == 404 and "/abc/v1/chat/completions" in data["error"]["message"]  # serve has no episode routes
    assert raw(tiny_server, b"GET /abc/v1/models HTTP/1.1\r\nHost: x\r\n\r\n")[0] == 404


def raw(url: str, request: bytes) -> tuple[int, dict, str]:
    """(status, JSON body, head) of one request written byte for byte on a real socket."""
    host, port = url.split("//")[1].split("/")[0].split(":")
    with socket.create_connection((host, int(port)), timeout=60) as s:
        s.sendall(request)
        return _reply(s)


def _reply(s: socket.socket) -> tuple[int, dict, str]:
    got = b""
    while b"\r\n\r\n" not in got or len(got.split(b"\r\n\r\n", 1)[1]) < _length(got):
        chunk = s.recv(65536)
        assert chunk, f"the server closed the connection without a full reply: {got!r}"
        got += chunk
    head, body = got.split(b"\r\n\r\n", 1)
    return int(head.split()[1]), json.loads(body[:_length(got)]), head.decode()


def _length(got: bytes) -> int:
    m = re.search(rb"(?i)content-length: *(\d+)", got.split(b"\r\n\r\n", 1)[0])
    return int(m[1]) if m else 1 << 30


def test_protocol_edges_get_json_errors_that_name_what_is_wrong(tiny_server):
    deep = b"[" * 100_000
    status, data = post(tiny_server, "/v1/chat/completions", deep)
    assert status == 400 and "nested deeper than" in data["error"]["message"]
    tools = b'[{"type": "function", "function": {"name": "f", "parameters": ' + b'{"a": ' * 200 + b"1" + b"}" * 200
    status, data = post(tiny_server, "/v1/chat/completions",
                        b'{"messages": [{"role": "user", "content": "x"}], "tools": ' + tools + b"}}]}")
    assert status == 400 and "nested deeper than" in data["error"]["message"]  # parses, but past the bound
    status, data, _ = raw(tiny_server, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n")
    assert status == 400 and "Content-Length: -1" in data["error"]["message"]
    for method in (b"DELETE", b"PUT", b"PATCH", b"BREW"):
        status, data, head = raw(tiny_server, method + b" /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                                 b"Content-Length: 0\r\n\r\n")
        assert status == 405 and method.decode() in data["error"]["message"], (method, data)
        assert "Allow: GET, POST" in head
    status, data = post(tiny_server, "/v1/chat/completions",
                        b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 100000}')
    assert status == 400 and "max_tokens=100000" in data["error"]["message"] and "16" in data["error"]["message"]
    assert post(tiny_server, "/v1/chat/completions",
                b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 16}')[0] == 200


SMALL = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "temperature": 0}).encode()


def test_a_small_request_is_not_held_up_while_a_5_mb_one_is_refused(tiny_server):
    """Small requests sent one after another while a 5 MB one that cannot fit is on its socket unanswered (checked
    with select before each, not by waiting), against the same request alone just before: within 100 ms. Held up,
    every try has a small request late by the whole refusal (seconds of tokenising); a loaded machine delays
    some tries by chance, so the test asks for one clean try in five."""
    host, port = tiny_server.split("//")[1].split("/")[0].split(":")
    huge = json.dumps({"messages": [{"role": "user", "content": "hello world " * 420_000}]}).encode()
    assert len(huge) > 5_000_000
    late = []  # per try: the most a small request beside the huge one took over the same request alone
    for _ in range(5):
        alone = _timed(tiny_server, SMALL)
        beside = []
        with socket.create_connection((host, int(port)), timeout=60) as s:
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: %d\r\n\r\n" % len(huge) + huge)
            while not select.select([s], [], [], 0)[0]:
                beside.append(_timed(tiny_server, SMALL))
            status, data, _ = _reply(s)
        assert status == 400 and "context" in data["error"]["message"]
        if beside:
            late.append(max(beside) - alone)
    assert late, "the huge request was answered before any small one was sent: nothing overlapped"
    assert min(late) < 0.1, late


def _timed(url: str, body: bytes) -> float:
    start = time.perf_counter()
    status, _ = post(url, "/v1/chat/completions", body)
    assert status == 200
    return time.perf_counter() - start


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


def test_a_reply_ends_at_any_end_of_reply_id_the_models_generation_config_names(tmp_path, _tiny):
    """As Llama 3 ends a tool call with <|eom_id|> (beside <|eot_id|>): here the id the model writes first."""
    import copy

    import torch

    from a3po.rollout.prompts import encode_messages

    model, tok = copy.deepcopy(_tiny[0]), _tiny[1]
    messages = [{"role": "user", "content": "2+3?"}]
    with torch.no_grad():  # greedy, as the server samples at temperature 0
        first = int(model(torch.tensor([encode_messages(tok, messages)])).logits[0, -1].argmax())
    assert first != tok.eos_token_id
    model.generation_config.eos_token_id = [tok.eos_token_id, first]
    model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    with served("--model", str(tmp_path / "m")) as (proc, url):
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0)
        reply = client.chat.completions.create(model="m", messages=messages, temperature=0, max_tokens=8)
    assert reply.choices[0].finish_reason == "stop" and reply.usage.completion_tokens == 1


def test_a_model_that_does_not_exist_is_one_line_before_torch_loads(tmp_path):
    res = a3po("serve", "--model", "/nonexistent/model", env=without("torch", tmp_path / "no-torch"), timeout=120)
    assert res.returncode == 2 and res.stderr.strip().count("\n") == 0, res.stderr[-2000:]
    assert "a3po: error:" in res.stderr and "no such directory" in res.stderr

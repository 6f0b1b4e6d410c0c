"""Agents for tests/test_agents.py, written as a user would: against the `openai` client the worker gives them.
They run in the agent process of a rollout worker (a3po/agents/host.py), which imports this module by name."""

import asyncio
import json
import time
import urllib.error
import urllib.request

import openai

FOLLOW_UP = "Now check it: what is the final number?"


async def two_turns(example, client):
    first = [{"role": "user", "content": example.question}]
    a = await client.chat.completions.create(model="policy", messages=first, max_tokens=6)
    said = {"role": "assistant", "content": a.choices[0].message.content}
    b = await client.chat.completions.create(model="policy", messages=[*first, said,
                                             {"role": "user", "content": FOLLOW_UP}], max_tokens=6)
    return 0.25 + 0.5 * (b.choices[0].finish_reason == "length")


async def two_turns_streamed(example, client):
    """two_turns, its replies streamed (with the usage chunk) and put together from the chunks."""
    async def ask(messages):
        text, finish = "", None
        async for chunk in await client.chat.completions.create(model="policy", messages=messages, max_tokens=6,
                                                                stream=True, stream_options={"include_usage": True}):
            for c in chunk.choices:
                text += c.delta.content or ""
                finish = c.finish_reason or finish
        return text, finish
    first = [{"role": "user", "content": example.question}]
    text, _ = await ask(first)
    _, finish = await ask([*first, {"role": "assistant", "content": text}, {"role": "user", "content": FOLLOW_UP}])
    return 0.25 + 0.5 * (finish == "length")


async def three_choices_then_continue(example, client):
    """n=3 samples of one question, n=2 more when one call of the episode's four is left (a 400: none of them is
    generated), then the second sample continued."""
    first = [{"role": "user", "content": example.question}]
    a = await client.chat.completions.create(model="policy", messages=first, max_tokens=5, n=3)
    try:
        await client.chat.completions.create(model="policy", messages=first, max_tokens=5, n=2)
        refused = False
    except openai.BadRequestError as e:
        refused = "n=2 choices" in str(e)
    said = {"role": "assistant", "content": a.choices[1].message.content}
    await client.chat.completions.create(model="policy", messages=[*first, said, {"role": "user", "content": "ok"}],
                                         max_tokens=5)
    return float([c.index for c in a.choices] == [0, 1, 2] and refused)


async def completes(example, client):
    """Prompts it renders itself: token ids (from the example), then that prompt's text with the reply and more
    (continues the row), then a text that does not start with it (a new row)."""
    ids, text = example.meta["ids"], example.meta["text"]
    a = await client.completions.create(model="policy", prompt=ids, max_tokens=4)
    await client.completions.create(model="policy", prompt=text + a.choices[0].text + " Next:", max_tokens=4)
    await client.completions.create(model="policy", prompt="Other: " + text, max_tokens=4)
    return 1.0


async def retry_then_continue(example, client):
    """Two answers to the same question (a branch), then the first one continued."""
    first = [{"role": "user", "content": example.question}]
    a = await client.chat.completions.create(model="policy", messages=first, max_tokens=5)
    await client.chat.completions.create(model="policy", messages=first, max_tokens=5)
    said = {"role": "assistant", "content": a.choices[0].message.content}
    await client.chat.completions.create(model="policy", messages=[*first, said, {"role": "user", "content": "ok"}],
                                         max_tokens=5)
    return 1.0


async def parallel(example, client):
    asks = [client.chat.completions.create(model="policy", max_tokens=4,
                                           messages=[{"role": "user", "content": f"{example.question} ({k})"}])
            for k in range(3)]
    await asyncio.gather(*asks)
    return 0.5


def sync_agent(example, client):
    reply = client.chat.completions.create(model="policy", max_tokens=4,
                                           messages=[{"role": "user", "content": example.question}])
    return float(len(reply.choices[0].message.content) >= 0)


def _post(url: str, body: bytes) -> tuple[int, str]:
    request = urllib.request.Request(url, data=body, method="POST", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())["error"]["message"]


async def malformed(example, client):
    """Bad requests to its own endpoint, then a good call asking for more tokens than the run gives a call: returns 1
    only if every bad one was a 400 with a reason and the endpoint still answered after them, within the run's
    budget (the test's max_new_tokens, 8) rather than refusing the larger max_tokens."""
    url = str(client.base_url).rstrip("/") + "/chat/completions"
    bad = [b"{oops", b'{"messages": "hi"}', b'{"messages": [{"role": "user", "content": "x"}], "n": 17}',
           b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}']
    answers = [await asyncio.to_thread(_post, url, body) for body in bad]
    ok = all(status == 400 and reason for status, reason in answers)
    reply = await client.chat.completions.create(model="policy", max_tokens=100,
                                                 messages=[{"role": "user", "content": example.question}])
    capped = reply.usage.completion_tokens <= 8 and reply.choices[0].finish_reason in ("length", "stop")
    return float(ok and capped and reply.choices[0].message.content is not None)


async def huge_beside_small(example, client):
    """Small calls while a 5 MB one that cannot fit is unanswered, against a small call alone just before: returns 1
    if in one of five tries none was later than 100 ms over (as tests/test_serve.py asks of `a3po serve`)."""
    url = str(client.base_url).rstrip("/") + "/chat/completions"
    huge = json.dumps({"messages": [{"role": "user", "content": "hello world " * 420_000}]}).encode()

    async def small() -> float:
        start = time.perf_counter()
        await client.chat.completions.create(model="policy", max_tokens=1, messages=[{"role": "user", "content": "hi"}])
        return time.perf_counter() - start

    late = []
    for _ in range(5):
        alone = await small()
        refused = asyncio.ensure_future(asyncio.to_thread(_post, url, huge))
        beside = []
        while not refused.done():
            beside.append(await small())
        status, reason = await refused
        if status != 400 or "context" not in reason:
            return 0.0
        if beside:
            late.append(max(beside) - alone)
    return float(bool(late) and min(late) < 0.1)


async def calls_a_tool(example, client):
    """One function tool (its first request with the example's tool_choice, if any); the call the reply makes is
    answered with a tool message: 1 if it was `add`."""
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    first = [{"role": "user", "content": example.question}]
    choice = {"tool_choice": example.meta["tool_choice"]} if "tool_choice" in example.meta else {}
    a = await client.chat.completions.create(model="policy", messages=first, tools=tools, max_tokens=48, **choice)
    said = a.choices[0].message
    if a.choices[0].finish_reason != "tool_calls" or not said.tool_calls:
        return 0.0
    call = said.tool_calls[0]
    echo = {"role": "assistant", "content": said.content, "tool_calls": [c.model_dump() for c in said.tool_calls]}
    await client.chat.completions.create(model="policy", tools=tools, max_tokens=48, messages=[
        *first, echo, {"role": "tool", "tool_call_id": call.id, "content": "7"}])
    return float(call.function.name == "add" and json.loads(call.function.arguments) == {})


async def cuts_its_call(example, client):
    """Asks for a reply too short to close the call the model starts: 1 if it came back as text, not an error."""
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    a = await client.chat.completions.create(model="policy", tools=tools, max_tokens=example.meta["max_tokens"],
                                             messages=[{"role": "user", "content": example.question}])
    said = a.choices[0]
    return float(said.finish_reason == "length" and not said.message.tool_calls
                 and said.message.content.startswith("<tool_call>"))


async def wrong_url(example, client):
    status, reason = await asyncio.to_thread(_post, str(client.base_url).replace("/v1", "x/v1") + "chat/completions",
                                             b'{"messages": [{"role": "user", "content": "x"}]}')
    return float(status == 404 and "no running episode" in reason)


async def hangs(example, client):
    await client.chat.completions.create(model="policy", max_tokens=3,
                                         messages=[{"role": "user", "content": example.question}])
    await asyncio.sleep(3600)


async def blocks_its_loop(example, client):
    time.sleep(3600)  # noqa: ASYNC251 - the mistake under test


async def raises(example, client):
    raise ValueError("the agent broke")


async def returns_text(example, client):
    return "high"


async def too_many_calls(example, client):
    for _ in range(5):
        await client.chat.completions.create(model="policy", max_tokens=2,
                                             messages=[{"role": "user", "content": example.question}])
    return 1.0


async def by_example(example, client):
    """The agent named in the example's meta: one agent process holding episodes of different behaviours."""
    return await globals()[example.meta["agent"]](example, client)

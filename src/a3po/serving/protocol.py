"""The OpenAI chat-completions protocol as a3po serves it: a request checked into a typed record, a reply built.

Only what a chat client sends is read: `messages` (roles system, developer (read as system),
user, assistant, tool; content a string, or a list of text parts), `max_tokens` /
`max_completion_tokens`, `temperature`, `top_p`, `seed`, `stop`, `n` (1 only), `logprobs`,
and the tool-call fields (`tools`, an assistant message's `tool_calls`, a tool message's
`tool_call_id`), which go to the model's chat template as they are; `tool_choice` "auto" or
"none" (whether a reply's tool-call text is read into `tool_calls`, serving/toolcalls.py, where
the server reads them). A field in UNSERVED, asked for with a value that
would change the reply, is refused by name rather than ignored (a client that asked for JSON
output or a required tool call must not get plain text as if it had); any other field is
ignored, as the protocol's servers do. A request that cannot be served is a `BadRequest`
whose message says which field is wrong and what it must be: the server answers it with a
400, never an exception.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from a3po.serving.toolcalls import ToolCall

ROLES = ("system", "developer", "user", "assistant", "tool")
AS_ROLE = {"developer": "system"}  # the newer name for the system role; chat templates know only "system"
MAX_BODY_BYTES = 8 << 20
MAX_NESTING = 64  # JSON arrays and objects inside one another: tool schemas nest, but not this deep
_TOO_DEEP = f"the body's JSON is nested deeper than {MAX_NESTING} levels; send a flatter request"


class BadRequest(ValueError):
    """A request the server cannot serve; its message is the 400's reason."""


def _off(value: Any) -> bool:
    return value is None or value is False or value == 0 or value == {} or value == []


# field -> (whether its value asks for nothing this server would have to do, what to send instead)
UNSERVED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "stream": (_off, "leave stream unset or false: replies come whole"),
    "top_logprobs": (_off, "leave it unset or 0; logprobs=true gives each chosen token's log-prob"),
    "response_format": (lambda v: _off(v) or v == {"type": "text"}, "leave it unset: replies are free text"),
    "tool_choice": (lambda v: v in (None, "auto", "none"),
                    "send 'auto' or 'none' (or leave it unset): nothing makes the model write a call, so a "
                    "required or named one cannot be promised"),
    "frequency_penalty": (_off, "leave it unset or 0"),
    "presence_penalty": (_off, "leave it unset or 0"),
    "logit_bias": (_off, "leave it unset"),
    "functions": (_off, "describe functions in 'tools'"),
    "function_call": (_off, "describe functions in 'tools'"),
    "audio": (_off, "leave it unset: replies are text"),
    "modalities": (lambda v: _off(v) or v == ["text"], "leave it unset or ['text']"),
}


@dataclass(frozen=True)
class ChatRequest:
    messages: list[dict]
    max_tokens: int | None = None  # None: the server's limit
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    logprobs: bool = False
    tools: list[dict] | None = None
    model: str = ""
    tool_choice: str = "auto"  # or "none": the reply's tool-call text is left as text


@dataclass(frozen=True)
class ChatReply:
    text: str
    finish_reason: str  # "stop" or "length"
    prompt_tokens: int
    completion_tokens: int
    token_texts: list[str] = field(default_factory=list)
    token_logprobs: list[float] = field(default_factory=list)
    tool_calls: tuple[ToolCall, ...] = ()  # read from the text (serving/toolcalls.py); text is then the rest
    malformed_tool_call: bool = False  # call text the model wrote that could not be read: returned as text


def parse_chat_request(body: bytes) -> ChatRequest:
    """The request a chat-completions body asks for, or BadRequest saying what is wrong with it."""
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BadRequest(f"the body is not JSON ({e}); send a JSON object with 'messages'") from None
    except RecursionError:  # the parser's own bound, far past ours
        raise BadRequest(_TOO_DEEP) from None
    if _nesting(data) > MAX_NESTING:
        raise BadRequest(_TOO_DEEP)
    if not isinstance(data, dict):
        raise BadRequest(f"the body is a JSON {type(data).__name__}; send an object with 'messages'")
    for key, (served, instead) in UNSERVED.items():
        if not served(data.get(key)):
            shown = json.dumps(data[key])
            raise BadRequest(f"{key}={shown if len(shown) <= 60 else shown[:57] + '...'} is not served; {instead}")
    n = data.get("n", 1)
    if n not in (1, None):
        raise BadRequest(f"n={n!r}: one choice per request (n=1); send several requests for several samples")
    max_tokens = data.get("max_completion_tokens", data.get("max_tokens"))
    if max_tokens is not None and (not _is_int(max_tokens) or max_tokens < 1):
        raise BadRequest(f"max_tokens={max_tokens!r}: a positive integer")
    temperature = _number(data, "temperature", 1.0, 0.0, 2.0)
    top_p = _number(data, "top_p", 1.0, 0.0, 1.0)
    if top_p == 0.0:
        raise BadRequest("top_p=0: a number in (0, 1]")
    seed = data.get("seed")
    if seed is not None and not _is_int(seed):
        raise BadRequest(f"seed={seed!r}: an integer")
    stop = data.get("stop")
    stop = () if stop is None else (stop,) if isinstance(stop, str) else stop
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop) or len(stop) > 8:
        raise BadRequest(f"stop={data.get('stop')!r}: a non-empty string or a list of up to 8 of them")
    tools = data.get("tools")
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
        raise BadRequest("tools: a list of tool objects")
    model = data.get("model", "")
    return ChatRequest(_messages(data.get("messages")), max_tokens, temperature, top_p, seed, tuple(stop),
                       bool(data.get("logprobs")), tools, model if isinstance(model, str) else "",
                       data.get("tool_choice") or "auto")


def _messages(value: Any) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise BadRequest("messages: a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise BadRequest(f"messages[{i}]: an object whose role is one of {', '.join(ROLES)}")
        content = m.get("content")
        if isinstance(content, list):  # text parts
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise BadRequest(f"messages[{i}].content: only text parts ({{type: text, text}}) are served")
            content = "".join(p["text"] for p in content)
        if content is None and m["role"] == "assistant" and m.get("tool_calls"):
            content = ""
        if not isinstance(content, str):
            raise BadRequest(f"messages[{i}].content: a string (or a list of text parts)")
        msg = {"role": AS_ROLE.get(m["role"], m["role"]), "content": content}
        for key in ("tool_calls", "tool_call_id", "name"):
            if m.get(key) is not None:
                msg[key] = m[key]
        out.append(msg)
    return out


def _nesting(value: Any) -> int:
    """How deep arrays and objects sit inside one another (a scalar is 0), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, depth = stack.pop()
        children = v.values() if isinstance(v, dict) else v if isinstance(v, list) else None
        if children is None:
            continue
        deepest = max(deepest, depth)
        if depth <= MAX_NESTING:
            stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return deepest


def check_max_tokens(request: ChatRequest, limit: int, setting: str) -> None:
    """A request that asks for more tokens than the server gives a reply is refused, not quietly cut: its client
    would read a reply cut at `limit` as the model's choice."""
    if request.max_tokens is not None and request.max_tokens > limit:
        raise BadRequest(f"max_tokens={request.max_tokens} is more than this server's {limit} tokens a reply "
                         f"({setting}); ask for at most {limit}, or leave it unset")


def _number(data: dict, key: str, default: float, lo: float, hi: float) -> float:
    value = data.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not lo <= value <= hi:
        raise BadRequest(f"{key}={value!r}: a number in [{lo:g}, {hi:g}]")
    return float(value)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def chat_completion(reply: ChatReply, model: str) -> dict:
    """The chat.completion object for one reply."""
    choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": reply.text},
                              "finish_reason": reply.finish_reason}
    if reply.tool_calls:
        choice["message"] = {"role": "assistant", "content": reply.text or None,
                             "tool_calls": [c.as_message_field() for c in reply.tool_calls]}
        choice["finish_reason"] = "tool_calls"
    if reply.token_logprobs:
        choice["logprobs"] = {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                                          for t, lp in zip(reply.token_texts, reply.token_logprobs)]}
    n_out = reply.completion_tokens
    return {"id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "object": "chat.completion", "created": int(time.time()),
            "model": model, "choices": [choice],
            "usage": {"prompt_tokens": reply.prompt_tokens, "completion_tokens": n_out,
                      "total_tokens": reply.prompt_tokens + n_out}}


def model_list(model: str) -> dict:
    return {"object": "list", "data": [{"id": model, "object": "model", "created": 0, "owned_by": "a3po"}]}


def error(message: str, kind: str = "invalid_request_error") -> dict:
    return {"error": {"message": message, "type": kind, "param": None, "code": None}}

"""The OpenAI chat-completions and completions protocol as a3po serves it: a request checked into a typed record,
a reply built, whole or as the chunks of a stream.

Only what a chat client sends is read: `messages` (roles system, developer (read as system), user,
assistant, tool; content a string, or a list of text parts), `max_tokens` / `max_completion_tokens`,
`temperature`, `top_p`, `seed`, `stop`, `n` (up to MAX_CHOICES), `logprobs` and `top_logprobs`
(up to MAX_TOP_LOGPROBS), `stream` with `stream_options.include_usage`, and the tool-call fields
(`tools`, an assistant message's `tool_calls`, a tool message's `tool_call_id`), which go to the
model's chat template as they are, and `tool_choice`:
- "auto" (unset) or "none": whether a reply's tool-call text is read into `tool_calls`
  (serving/toolcalls.py, where the server reads them);
- "required", or {"type": "function", "function": {"name": N}} with N among `tools`: the server
  puts the opening of a call in the model's format (toolcalls.call_opening; N written in it when
  named) after the rendered prompt, as prompt tokens (never sampled, never trained), and reads the
  reply from that opening and the generated text; a continuation that completes no call is text,
  counted as malformed. "required" without tools, or N not among them, is refused here; a model
  whose template shows no format is refused by the server (rollout/chat.py, forced_call).
`top_logprobs` k (with `logprobs`) gives each generated token's k most likely alternatives from the
distribution it was drawn from (after temperature and the sampling filters: the one whose log-prob
`logprobs` reports and the trainer records), most likely first; tokens the filters left no mass
are left out. A field in UNSERVED (UNSERVED_TEXT as well on the completions route), asked for with
a value that would change the reply, is refused by name rather than ignored (a client that asked
for JSON output must not get plain text as if it had); any other field is ignored, as the
protocol's servers do. A request that cannot
be served is a `BadRequest` whose message says which field is wrong and what it must be: the server
answers it with a 400, never an exception.

A completions request (`/v1/completions`, for clients that render their own prompts) has a
`prompt` instead of `messages`: one text, or one list of token ids; `logprobs` there is k from 0 to
MAX_TOP_LOGPROBS (the chosen tokens' log-probs, and each `top_logprobs` entry the k alternatives
and the chosen token, by text), and `echo`, `suffix`, `best_of` above 1, `top_logprobs` and a
forced `tool_choice` are refused. A streamed reply is sent once the whole reply is generated (a
reply is only known to be a tool call once it is whole), as a short sequence of chunks: the role,
the content, each tool call, the finish reason, the usage if asked.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from a3po.serving.toolcalls import ToolCall

ROLES = ("system", "developer", "user", "assistant", "tool")
AS_ROLE = {"developer": "system"}  # the newer name for the system role; chat templates know only "system"
MAX_BODY_BYTES = 8 << 20
MAX_CHOICES = 16  # `n`: samples of one prompt per request
MAX_PROMPT_IDS = 1 << 20  # a completions prompt given as ids: far past any context, refused before it is read
MAX_TOP_LOGPROBS = 20  # alternatives per token (`top_logprobs`; `logprobs` on the completions route)
MAX_NESTING = 64  # JSON arrays and objects inside one another: tool schemas nest, but not this deep
_TOO_DEEP = f"the body's JSON is nested deeper than {MAX_NESTING} levels; send a flatter request"


class BadRequest(ValueError):
    """A request the server cannot serve; its message is the 400's reason."""


def _off(value: Any) -> bool:
    return value is None or value is False or value == 0 or value == {} or value == []


# field -> (whether its value asks for nothing this server would have to do, what to send instead)
UNSERVED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "response_format": (lambda v: _off(v) or v == {"type": "text"}, "leave it unset: replies are free text"),
    "frequency_penalty": (_off, "leave it unset or 0"),
    "presence_penalty": (_off, "leave it unset or 0"),
    "logit_bias": (_off, "leave it unset"),
    "functions": (_off, "describe functions in 'tools'"),
    "function_call": (_off, "describe functions in 'tools'"),
    "audio": (_off, "leave it unset: replies are text"),
    "modalities": (lambda v: _off(v) or v == ["text"], "leave it unset or ['text']"),
}

# the completions route's own fields, refused the same way
UNSERVED_TEXT: dict[str, tuple[Callable[[Any], bool], str]] = {
    "top_logprobs": (_off, f"send logprobs: k (0 to {MAX_TOP_LOGPROBS}) for each token's k most likely alternatives"),
    "tool_choice": (lambda v: v in (None, "auto", "none"),
                    "leave it unset: a completions prompt is the client's own, no call can be forced into it"),
    "echo": (_off, "leave it unset: the prompt is not sent back"),
    "suffix": (lambda v: v is None or v == "", "leave it unset: text after the completion is not served"),
    "best_of": (lambda v: v in (None, 1), "leave it unset or 1; n gives several samples"),
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
    tool_choice: str = "auto"  # auto, none, required or function (one named tool): "none" leaves call text as text
    tool_name: str | None = None  # the tool a tool_choice "function" names
    top_logprobs: int = 0  # per generated token, this many most likely alternatives (logprobs must be on)
    n: int = 1  # choices: each is sampled on its own
    stream: bool = False  # the reply as server-sent events (chunks), not one object
    include_usage: bool = False  # a stream's last chunk before [DONE] carries the usage
    prompt: str | tuple[int, ...] | None = None  # a completions request's prompt (then messages is empty)

    @property
    def is_text(self) -> bool:
        """A completions request: its prompt is given, not rendered from messages."""
        return self.prompt is not None


@dataclass(frozen=True)
class ChatReply:
    text: str
    finish_reason: str  # "stop" or "length"
    prompt_tokens: int
    completion_tokens: int
    token_texts: list[str] = field(default_factory=list)
    token_logprobs: list[float] = field(default_factory=list)
    token_top: list[tuple[tuple[str, float], ...]] = field(default_factory=list)  # per token: (text, log-prob)
    tool_calls: tuple[ToolCall, ...] = ()  # read from the text (serving/toolcalls.py); text is then the rest
    malformed_tool_call: bool = False  # call text the model wrote that could not be read: returned as text


def parse_chat_request(body: bytes) -> ChatRequest:
    """The request a chat-completions body asks for, or BadRequest saying what is wrong with it."""
    data = _object(body, "messages")
    fields = _common(data, UNSERVED)
    tools = data.get("tools")
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
        raise BadRequest("tools: a list of tool objects")
    logprobs, top = bool(data.get("logprobs")), _top(data.get("top_logprobs"), "top_logprobs")
    if top and not logprobs:
        raise BadRequest(f"top_logprobs={top} needs logprobs=true; send both")
    choice, name = _tool_choice(data.get("tool_choice"), tools)
    return ChatRequest(_messages(data.get("messages")), **fields, logprobs=logprobs, tools=tools,
                       tool_choice=choice, tool_name=name, top_logprobs=top)


def parse_completion_request(body: bytes) -> ChatRequest:
    """The request a completions body (a prompt, not messages) asks for, or BadRequest saying what is wrong."""
    data = _object(body, "prompt")
    fields = _common(data, {**UNSERVED, **UNSERVED_TEXT})
    prompt = data.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, list) and len(prompt) > MAX_PROMPT_IDS:
        raise BadRequest(f"prompt: {len(prompt)} token ids, far more than any context; send a shorter prompt")
    if isinstance(prompt, list) and prompt and all(_is_int(i) and i >= 0 for i in prompt):
        prompt = tuple(prompt)
    elif not isinstance(prompt, str) or not prompt:
        raise BadRequest("prompt: one non-empty string or one non-empty list of token ids (one prompt a request; "
                         "n gives several samples of it)")
    logprobs = data.get("logprobs")
    top = 0 if logprobs is None or isinstance(logprobs, bool) else _top(logprobs, "logprobs")
    return ChatRequest([], **fields, logprobs=logprobs is not None and logprobs is not False, top_logprobs=top,
                       prompt=prompt)


def _top(value: Any, key: str) -> int:
    """A count of alternatives per token, checked against MAX_TOP_LOGPROBS."""
    if value is None:
        return 0
    if not _is_int(value) or value < 0:
        raise BadRequest(f"{key}={value!r}: an integer from 0 to {MAX_TOP_LOGPROBS}")
    if value > MAX_TOP_LOGPROBS:
        raise BadRequest(f"{key}={value} is more than this server's limit of {MAX_TOP_LOGPROBS} alternatives a "
                         f"token; ask for at most {MAX_TOP_LOGPROBS}")
    return value


def _tool_choice(value: Any, tools: list[dict] | None) -> tuple[str, str | None]:
    """(auto, none, required or function, the named tool or None), checked against the tools the request offers."""
    if value is None:
        return "auto", None
    if value in ("auto", "none"):
        return value, None
    names = [t["function"].get("name") for t in tools or () if isinstance(t.get("function"), dict)]
    if value == "required":
        if not names:
            raise BadRequest('tool_choice="required" asks for a tool call and the request offers no tools; '
                             "send tools, or leave tool_choice unset")
        return value, None
    function = value.get("function") if isinstance(value, dict) and value.get("type") == "function" else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str) or not name:
        raise BadRequest('tool_choice: "auto", "none", "required" or {"type": "function", "function": '
                         '{"name": ...}}')
    if name not in names:
        offered = ", ".join(repr(n) for n in names) or "none"
        raise BadRequest(f"tool_choice names the tool {name!r}, which is not among the request's tools ({offered}); "
                         "name one of them")
    return "function", name


def _object(body: bytes, needs: str) -> dict:
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BadRequest(f"the body is not JSON ({e}); send a JSON object with '{needs}'") from None
    except RecursionError:  # the parser's own bound, far past ours
        raise BadRequest(_TOO_DEEP) from None
    if _nesting(data) > MAX_NESTING:
        raise BadRequest(_TOO_DEEP)
    if not isinstance(data, dict):
        raise BadRequest(f"the body is a JSON {type(data).__name__}; send an object with '{needs}'")
    return data


def _common(data: dict, unserved: dict[str, tuple[Callable[[Any], bool], str]]) -> dict:
    """The fields both routes read, checked; the unserved ones refused by name."""
    for key, (served, instead) in unserved.items():
        if not served(data.get(key)):
            shown = json.dumps(data[key])
            raise BadRequest(f"{key}={shown if len(shown) <= 60 else shown[:57] + '...'} is not served; {instead}")
    n = data.get("n")
    n = 1 if n is None else n
    if not _is_int(n) or not 1 <= n <= MAX_CHOICES:
        raise BadRequest(f"n={n!r}: an integer from 1 to {MAX_CHOICES}; send several requests for more samples")
    stream = data.get("stream")
    if stream not in (None, True, False):
        raise BadRequest(f"stream={stream!r}: true or false")
    options = data.get("stream_options")
    if options is not None and (not isinstance(options, dict)
                                or options.get("include_usage") not in (None, True, False)):
        raise BadRequest("stream_options: an object such as {\"include_usage\": true}")
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
    model = data.get("model", "")
    return dict(max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed, stop=tuple(stop),
                model=model if isinstance(model, str) else "", n=n, stream=bool(stream),
                include_usage=bool(stream) and bool((options or {}).get("include_usage")))


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


def _choice(reply: ChatReply, index: int) -> dict:
    choice: dict[str, Any] = {"index": index, "message": {"role": "assistant", "content": reply.text},
                              "finish_reason": reply.finish_reason}
    if reply.tool_calls:
        choice["message"] = {"role": "assistant", "content": reply.text or None,
                             "tool_calls": [c.as_message_field() for c in reply.tool_calls]}
        choice["finish_reason"] = "tool_calls"
    if reply.token_logprobs:
        choice["logprobs"] = _chat_logprobs(reply)
    return choice


def _chat_logprobs(reply: ChatReply) -> dict:
    tops = reply.token_top or [()] * len(reply.token_texts)
    return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()),
                         "top_logprobs": [{"token": a, "logprob": alp, "bytes": list(a.encode())} for a, alp in top]}
                        for t, lp, top in zip(reply.token_texts, reply.token_logprobs, tops)]}


def _text_top(reply: ChatReply) -> list[dict]:
    """The completions route's top_logprobs: per token its alternatives by text, and the chosen token (as that
    route always gave it), the most likely first where two tokens decode to one text."""
    out = []
    for k, (t, lp) in enumerate(zip(reply.token_texts, reply.token_logprobs)):
        top: dict[str, float] = {}
        for a, alp in (reply.token_top[k] if reply.token_top else ()):
            top.setdefault(a, alp)
        top.setdefault(t, lp)
        out.append(top)
    return out


def _usage(replies: Sequence[ChatReply]) -> dict:
    """The prompt counted once (every choice samples the same one), the completions of all choices."""
    prompt, out = replies[0].prompt_tokens, sum(r.completion_tokens for r in replies)
    return {"prompt_tokens": prompt, "completion_tokens": out, "total_tokens": prompt + out}


def _head(kind: str, model: str) -> dict:
    prefix = "chatcmpl" if kind.startswith("chat") else "cmpl"
    return {"id": f"{prefix}-{uuid.uuid4().hex[:24]}", "object": kind, "created": int(time.time()), "model": model}


def chat_completion(replies: Sequence[ChatReply], model: str) -> dict:
    """The chat.completion object for a request's replies, one choice each."""
    return {**_head("chat.completion", model), "choices": [_choice(r, i) for i, r in enumerate(replies)],
            "usage": _usage(replies)}


def text_completion(replies: Sequence[ChatReply], model: str) -> dict:
    """The text_completion object (the completions route) for a request's replies, one choice each."""
    choices = []
    for i, r in enumerate(replies):
        logprobs = None
        if r.token_logprobs:
            offsets = [sum(len(t) for t in r.token_texts[:k]) for k in range(len(r.token_texts))]
            logprobs = {"tokens": r.token_texts, "token_logprobs": r.token_logprobs,
                        "top_logprobs": _text_top(r),
                        "text_offset": offsets}
        choices.append({"index": i, "text": r.text, "logprobs": logprobs, "finish_reason": r.finish_reason})
    return {**_head("text_completion", model), "choices": choices, "usage": _usage(replies)}


def stream_chunks(replies: Sequence[ChatReply], model: str, text: bool, include_usage: bool) -> list[dict]:
    """The chunks a streamed reply is sent as, in order (each an SSE `data:` line, then `data: [DONE]`).

    Chat: per choice its role, its content if any (with its log-probs), each tool call whole (one delta per
    call, at its index), then its finish reason. Completions: per choice its text, then its finish reason.
    With include_usage every chunk has `usage: null` and a last one with no choices carries the usage."""
    head = _head("text_completion" if text else "chat.completion.chunk", model)
    chunks = []
    for i, r in enumerate(replies):
        if text:
            lp = text_completion([r], model)["choices"][0]["logprobs"]
            chunks.append({"index": i, "text": r.text, "logprobs": lp, "finish_reason": None})
            chunks.append({"index": i, "text": "", "logprobs": None, "finish_reason": r.finish_reason})
            continue
        chunks.append({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                       "finish_reason": None})
        if r.text:
            chunks.append({"index": i, "delta": {"content": r.text},
                           "logprobs": _chat_logprobs(r) if r.token_logprobs else None, "finish_reason": None})
        for k, call in enumerate(r.tool_calls):
            chunks.append({"index": i, "delta": {"tool_calls": [{"index": k, **call.as_message_field()}]},
                           "logprobs": None, "finish_reason": None})
        chunks.append({"index": i, "delta": {}, "logprobs": None,
                       "finish_reason": "tool_calls" if r.tool_calls else r.finish_reason})
    out = [{**head, "choices": [c], **({"usage": None} if include_usage else {})} for c in chunks]
    if include_usage:
        out.append({**head, "choices": [], "usage": _usage(replies)})
    return out


def model_list(model: str) -> dict:
    return {"object": "list", "data": [{"id": model, "object": "model", "created": 0, "owned_by": "a3po"}]}


def error(message: str, kind: str = "invalid_request_error") -> dict:
    return {"error": {"message": message, "type": kind, "param": None, "code": None}}

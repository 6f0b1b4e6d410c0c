"""Tool calls read out of a reply's text in the model family's own format: a view of the reply, nothing more.

    fmt = resolve(ToolCallFormat.AUTO, tokenizer.chat_template)  # "hermes" when the template writes <tool_call>
    view = read_tool_calls(fmt, text)                             # ToolView(content, calls, malformed)

The model writes its calls as text in the format its chat template taught it; the server
returns them as the protocol's `tool_calls` (finish_reason "tool_calls") and keeps the tokens
exactly as they were generated (nothing is re-tokenised: this module only reads the decoded
text). Formats (names in config/choices.py, ToolCallFormat), each found by a marker its
templates contain, tried in this order:

- hermes (Qwen2.5, Qwen3, SmolLM2 and others), marker `<tool_call>`:
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per call; any text
  around them is the message's content.
- mistral (Mistral 7B v0.3, Nemo, Small), marker `[TOOL_CALLS]`: `[TOOL_CALLS] [{"name": ...,
  "arguments": {...}, "id": ...}, ...]`. Its templates refuse a call id that is not 9
  characters, so the ids given out are 9 alphanumerics (the model's own when it wrote one).
  `[TOOL_CALLS]` is a special token the reply's decoding drops, so a reply that is nothing
  but a JSON list of call objects is read as the calls too. The newer `[TOOL_CALLS]name[ARGS]{...}`
  form is not read (its two markers decode away: text).
- llama3 (Llama 3.1, 3.2 with custom tools), marker `"parameters": `: the whole reply is one
  call `{"name": ..., "parameters": {...}}` (or several joined by `;`), perhaps after
  `<|python_tag|>`. A reply with any other text is text; so is the code Llama writes after
  `<|python_tag|>` for its built-in tools (`brave_search.call(...)`), which is no JSON call.

A request with `tool_choice` "required" or a named function gets the opening of a call
(`call_opening`: each format's call as its templates render one, up to the name's value, or with
the name written up to the arguments' value) after its prompt; the server reads the reply from
that opening and the generated text together.

A reply whose call text is malformed (not JSON, no name, arguments not an object) is returned
as plain text with `malformed` set, never as an error: the model wrote it, the client reads it,
and the trainer counts it (episode/tool_calls_malformed_mean). A reply that is JSON but no call
(an object without "name") is plain text, not malformed.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from a3po.config.choices import AUTO, ToolCallFormat


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object, as text (the protocol's form)

    def as_message_field(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ToolView:
    content: str  # the text outside the calls (all of it when there are none)
    calls: tuple[ToolCall, ...] = ()
    malformed: bool = False  # call text was there but could not be read: content is the whole reply


def _long_id(given) -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


_MISTRAL_ID = re.compile(r"[A-Za-z0-9]{9}")


def _mistral_id(given) -> str:
    return given if isinstance(given, str) and _MISTRAL_ID.fullmatch(given) else uuid.uuid4().hex[:9]


def _call(obj, args_keys: tuple[str, ...], id_of: Callable[[object], str]) -> ToolCall | None:
    """One call object as the model wrote it, or None when it is not one (no name, arguments not an object)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = next((obj[k] for k in args_keys if k in obj), {})
    if not isinstance(args, dict):
        return None
    return ToolCall(id_of(obj.get("id")), obj["name"], json.dumps(args))


_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)


def _hermes(text: str) -> ToolView:
    blocks = list(_HERMES.finditer(text))
    if not blocks:
        return ToolView(text, malformed="<tool_call>" in text)  # opened and never closed
    calls = []
    for b in blocks:
        try:
            call = _call(json.loads(b[1]), ("arguments",), _long_id)
        except json.JSONDecodeError:
            call = None
        if call is None:
            return ToolView(text, malformed=True)
        calls.append(call)
    return ToolView(_HERMES.sub("", text).strip(), tuple(calls))


_TOOL_CALLS = "[TOOL_CALLS]"


def _mistral(text: str) -> ToolView:
    at = text.find(_TOOL_CALLS)
    if at >= 0:
        before, body = text[:at].strip(), text[at + len(_TOOL_CALLS):].strip()
    elif text.strip().startswith("[{"):  # the marker decoded away: a list of calls, or a JSON answer
        before, body = "", text.strip()
    else:
        return ToolView(text)
    marked = at >= 0
    try:
        value, end = json.JSONDecoder().raw_decode(body)
    except json.JSONDecodeError:
        return ToolView(text, malformed=marked or '"name"' in body)
    calls = [_call(o, ("arguments",), _mistral_id) for o in (value if isinstance(value, list) else [value])]
    if not calls or None in calls:
        return ToolView(text, malformed=marked)
    return ToolView(" ".join(s for s in (before, body[end:].strip()) if s), tuple(calls))


_PYTHON_TAG = "<|python_tag|>"
_SEPARATOR = re.compile(r"\s*;\s*")


def _llama3(text: str) -> ToolView:
    body = text.strip().removeprefix(_PYTHON_TAG).strip()
    if not body.startswith("{"):
        return ToolView(text)  # prose, or built-in tool code after <|python_tag|>
    decoder, objects, at = json.JSONDecoder(), [], 0
    try:
        while True:
            value, at = decoder.raw_decode(body, at)
            objects.append(value)
            if at == len(body):
                break
            sep = _SEPARATOR.match(body, at)
            if sep is None:
                raise ValueError("text after the call")
            at = sep.end()
            if at == len(body):
                break
    except ValueError:  # JSONDecodeError included
        return ToolView(text, malformed='"name"' in body)
    if not all(isinstance(o, dict) and "name" in o for o in objects):
        return ToolView(text)  # an answer in JSON, not a call
    calls = [_call(o, ("parameters", "arguments"), _long_id) for o in objects]
    if None in calls:
        return ToolView(text, malformed=True)
    return ToolView("", tuple(calls))


@dataclass(frozen=True)
class Format:
    marker: str  # a string the family's chat templates contain, and no other family's before it in FORMATS
    read: Callable[[str], ToolView]
    call_head: str  # how a call opens, up to its name's value, as the family's templates render a call
    arguments: str  # the key its templates put a call's arguments under


FORMATS: dict[str, Format] = {  # ToolCallFormat.READ, in its order
    ToolCallFormat.HERMES: Format("<tool_call>", _hermes, '<tool_call>\n{"name": ', "arguments"),
    ToolCallFormat.MISTRAL: Format(_TOOL_CALLS, _mistral, _TOOL_CALLS + ' [{"name": ', "arguments"),
    ToolCallFormat.LLAMA3: Format('"parameters": ', _llama3, '{"name": ', "parameters"),
}


def call_opening(fmt: str, name: str | None) -> str:
    """The text a call in `fmt` opens with: up to the opening quote of its name (any tool), or with `name` written
    and up to its arguments' value (that tool). A server puts it after the prompt so that the model's reply is
    a call: `tool_choice` "required" or a named function."""
    f = FORMATS[fmt]
    if name is None:
        return f.call_head + '"'
    return f"{f.call_head}{json.dumps(name, ensure_ascii=False)}, \"{f.arguments}\": "


def format_of(template: str | None) -> str | None:
    """The tool-call format a chat template writes, or None if it shows no known one."""
    return next((name for name, f in FORMATS.items() if template and f.marker in template), None)


def resolve(choice: str, template: str | None) -> str | None:
    """The format to read: `choice` (a ToolCallFormat choice) with auto found from the template, none as None."""
    if choice == AUTO:
        return format_of(template)
    return None if choice == ToolCallFormat.NONE else choice


def read_tool_calls(fmt: str | None, text: str) -> ToolView:
    if fmt is None:
        return ToolView(text)
    return FORMATS[fmt].read(text)

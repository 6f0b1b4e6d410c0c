"""Tool calls read out of a reply's text in the model family's own format: a view of the reply, nothing more.

    fmt = format_of(tokenizer.chat_template)         # "hermes" when the template writes <tool_call>
    view = read_tool_calls(fmt, text)                # ToolView(content, calls, malformed)

The model writes its calls as text in the format its chat template taught it; the server
returns them as the protocol's `tool_calls` (finish_reason "tool_calls") and keeps the tokens
exactly as they were generated (nothing is re-tokenised: this module only reads the decoded
text). Formats, keyed by a marker their templates contain:

- hermes (Qwen2.5, Qwen3, SmolLM2 and others): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
  one block per call, any text around them is the message's content.

A reply whose call text is malformed (not JSON, no name, arguments not an object) is returned
as plain text with `malformed` set, never as an error: the model wrote it, the client reads it.
`tool_choice` (protocol.py): "auto" reads calls, "none" returns text as written; "required"
and a named tool are refused, since nothing makes the model write a call.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass


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


_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)


def _hermes(text: str) -> ToolView:
    blocks = list(_HERMES.finditer(text))
    if not blocks:
        return ToolView(text, malformed="<tool_call>" in text)  # opened and never closed
    calls = []
    for b in blocks:
        try:
            call = json.loads(b[1])
        except json.JSONDecodeError:
            return ToolView(text, malformed=True)
        if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"] \
                or not isinstance(call.get("arguments", {}), dict):
            return ToolView(text, malformed=True)
        calls.append(ToolCall(f"call_{uuid.uuid4().hex[:24]}", call["name"], json.dumps(call.get("arguments", {}))))
    content = _HERMES.sub("", text).strip()
    return ToolView(content, tuple(calls))


FORMATS: dict[str, tuple[str, Callable[[str], ToolView]]] = {  # name -> (marker in the template, reader)
    "hermes": ("<tool_call>", _hermes),
}


def format_of(template: str | None) -> str | None:
    """The tool-call format a chat template writes, or None if it shows no known one."""
    return next((name for name, (marker, _) in FORMATS.items() if template and marker in template), None)


def read_tool_calls(fmt: str | None, text: str) -> ToolView:
    if fmt is None:
        return ToolView(text)
    return FORMATS[fmt][1](text)

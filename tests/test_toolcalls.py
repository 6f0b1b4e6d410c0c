"""Tool-call readers (serving/toolcalls.py) on replies as each model family writes them: calls become ToolCalls,
anything else stays the text it is, and call text that cannot be read is text marked malformed, never an error."""

from __future__ import annotations

import json
import re

import pytest

from a3po.config.choices import AUTO, ToolCallFormat
from a3po.serving.toolcalls import FORMATS, format_of, read_tool_calls, resolve

# Excerpts of the tool-call parts of the families' real chat templates (tokenizer_config.json).
QWEN25 = ('{{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments '
          'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": '
          '<args-json-object>}\\n</tool_call><|im_end|>\\n" }}')
MISTRAL_V03 = ('{%- elif message.tool_calls is defined and message.tool_calls is not none %}\n'
               '{{- "[TOOL_CALLS] [" }}\n{%- for tool_call in message.tool_calls %}\n'
               '{%- set out = tool_call.function|tojson %}\n{{- out[:-1] }}')
LLAMA31 = ("{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}\n"
           "{{- '{\"name\": \"' + tool_call.name + '\", ' }}\n{{- '\"parameters\": ' }}\n"
           "{{- tool_call.arguments | tojson }}\n{{- \"}\" }}")
PLAIN = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"


def calls(view):
    return [(c.name, json.loads(c.arguments)) for c in view.calls]


def test_the_format_is_found_from_the_template_and_a_config_choice_overrides_it():
    assert [format_of(t) for t in (QWEN25, MISTRAL_V03, LLAMA31, PLAIN, None)] == \
           ["hermes", "mistral", "llama3", None, None]
    assert tuple(FORMATS) == ToolCallFormat.READ  # one reader per named choice, matched in that order
    assert resolve(AUTO, LLAMA31) == "llama3" and resolve(AUTO, PLAIN) is None
    assert resolve(ToolCallFormat.NONE, QWEN25) is None and resolve(ToolCallFormat.MISTRAL, PLAIN) == "mistral"


def test_llama3_reads_a_whole_reply_json_call_with_or_without_the_python_tag():
    v = read_tool_calls("llama3", '{"name": "get_current_conditions", "parameters": {"location": "San Francisco, CA", '
                                  '"unit": "Fahrenheit"}}')
    assert calls(v) == [("get_current_conditions", {"location": "San Francisco, CA", "unit": "Fahrenheit"})]
    assert v.content == "" and not v.malformed and v.calls[0].id.startswith("call_")
    v = read_tool_calls("llama3", '<|python_tag|>{"name": "add", "parameters": {"a": 1}}; {"name": "add", '
                                  '"arguments": {"a": 2}};')
    assert calls(v) == [("add", {"a": 1}), ("add", {"a": 2})] and len({c.id for c in v.calls}) == 2
    assert calls(read_tool_calls("llama3", '{"name": "now"}')) == [("now", {})]


@pytest.mark.parametrize("text, malformed", [
    ("The weather in Menlo Park is sunny.", False),
    ('<|python_tag|>brave_search.call(query="Menlo Park weather")', False),  # a built-in tool's code, not JSON
    ('{"answer": 42}', False),  # an answer in JSON, no call
    ('It is {"name": "add", "parameters": {}}', False),  # a call inside prose is prose
    ('{"name": "get_weather", "parameters": {"location": "Paris"', True),  # cut short
    ('{"name": "get_weather", "parameters": "Paris"}', True),
    ('{"name": "", "parameters": {}}', True),
    ('{"name": "add", "parameters": {}} and then I will add', True),
])
def test_llama3_leaves_anything_else_as_text(text, malformed):
    v = read_tool_calls("llama3", text)
    assert (v.content, v.calls, v.malformed) == (text, (), malformed)


def test_mistral_reads_the_tool_calls_list_with_or_without_its_marker():
    v = read_tool_calls("mistral", '[TOOL_CALLS] [{"name": "get_current_weather", "arguments": {"location": '
                                   '"Paris, France", "format": "celsius"}, "id": "a5Bc9dE1f"}]')
    assert calls(v) == [("get_current_weather", {"location": "Paris, France", "format": "celsius"})]
    assert v.calls[0].id == "a5Bc9dE1f" and v.content == "" and not v.malformed  # the model's own id, kept
    v = read_tool_calls("mistral", 'Two sums.[TOOL_CALLS][{"name": "add", "arguments": {"a": 1}, "id": "toolong_id"},'
                                   ' {"name": "add", "arguments": {"a": 2}}]')
    assert calls(v) == [("add", {"a": 1}), ("add", {"a": 2})] and v.content == "Two sums."
    assert all(re.fullmatch(r"[A-Za-z0-9]{9}", c.id) for c in v.calls)  # what Mistral's templates accept back
    v = read_tool_calls("mistral", '[{"name": "add", "arguments": {"a": 1}}]')  # [TOOL_CALLS] decoded away
    assert calls(v) == [("add", {"a": 1})]


@pytest.mark.parametrize("text, malformed", [
    ("Paris is at 20 degrees.", False),
    ("[1, 2, 3]", False),
    ('[{"city": "Paris"}]', False),  # a JSON answer that is no list of calls
    ('[TOOL_CALLS] [{"name": "get_current_weather", "arguments": {"location": "Par', True),
    ('[{"name": "get_current_weather", "arguments": {"location": "Par', True),
    ('[TOOL_CALLS] [{"arguments": {}}]', True),
    ('[TOOL_CALLS] [{"name": "add", "arguments": [1]}]', True),
    ("[TOOL_CALLS] []", True),
    ("[TOOL_CALLS] get_weather", True),
])
def test_mistral_leaves_anything_else_as_text(text, malformed):
    v = read_tool_calls("mistral", text)
    assert (v.content, v.calls, v.malformed) == (text, (), malformed)


def test_hermes_reads_qwen_style_blocks_and_keeps_broken_ones_as_text():
    v = read_tool_calls("hermes", 'Let me check.\n<tool_call>\n{"name": "get_current_temperature", "arguments": '
                                  '{"location": "San Francisco, CA, USA"}}\n</tool_call>')
    assert calls(v) == [("get_current_temperature", {"location": "San Francisco, CA, USA"})]
    assert v.content == "Let me check."
    for bad in ('<tool_call>\n{"name": "get_current_temperature", "arguments": {"location": \n</tool_call>',
                '<tool_call>\n{"name": "get_current_temperature"'):
        assert read_tool_calls("hermes", bad) == type(v)(bad, (), True)
    assert read_tool_calls(None, '<tool_call>{"name": "x"}</tool_call>').calls == ()  # no format: text

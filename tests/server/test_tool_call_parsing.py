"""server/tool_calls.py: parsing finished messages and streams, formats, forced-call grammars."""

from __future__ import annotations

import json

import pytest

from strata.errors import RequestError
from strata.protocol import structured
from strata.server.tool_calls import (
    HERMES,
    LLAMA3_JSON,
    ToolCallStream,
    check_tools,
    forced_call_grammar,
    parse_tool_calls,
    template_format,
)
from tests.server.tool_templates import HERMES as HERMES_TEMPLATE
from tests.server.tool_templates import LLAMA3 as LLAMA3_TEMPLATE

HERMES_TEXT = ('Let me look.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
               '<tool_call>\n{"name": "time", "arguments": {}}\n</tool_call>')
LLAMA_TEXT = '<|python_tag|>{"name": "weather", "parameters": {"city": "a;b"}}; {"name": "time", "parameters": {}}'


def _names_args(calls):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def test_formats_from_templates():
    assert template_format(HERMES_TEMPLATE) == HERMES
    assert template_format(LLAMA3_TEMPLATE) == LLAMA3_JSON
    assert template_format("{{ messages }}") is None and template_format(None) is None


@pytest.mark.parametrize("fmt, text, content", [(HERMES, HERMES_TEXT, "Let me look."), (LLAMA3_JSON, LLAMA_TEXT, None)])
def test_parse_finished_message(fmt, text, content):
    got, calls = parse_tool_calls(text, fmt)
    assert got == content
    assert _names_args(calls) == [("weather", {"city": "Paris" if fmt == HERMES else "a;b"}), ("time", {})]
    assert all(c["type"] == "function" and c["id"].startswith("chatcmpl-tool-") for c in calls)


@pytest.mark.parametrize("fmt, text", [
    (HERMES, "no calls here"), (HERMES, "<tool_call>\n{not json}\n</tool_call>"),
    (HERMES, '<tool_call>{"arguments": {}}</tool_call>'), (LLAMA3_JSON, '{"city": "x"}'), (LLAMA3_JSON, "plain text"),
])
def test_text_that_is_not_a_call_stays_content(fmt, text):
    assert parse_tool_calls(text, fmt) == (text, [])


@pytest.mark.parametrize("fmt, text", [(HERMES, HERMES_TEXT), (LLAMA3_JSON, LLAMA_TEXT), (HERMES, "plain <tool text"),
                                       (LLAMA3_JSON, "plain text"), (HERMES, "<tool_call>\n{bad}\n</tool_call> x")])
@pytest.mark.parametrize("piece", [1, 3, 7, 1000])
def test_stream_equals_the_finished_parse(fmt, text, piece):
    stream, content, calls = ToolCallStream(fmt), "", []
    chunks = [text[i:i + piece] for i in range(0, len(text), piece)]
    for i, chunk in enumerate(chunks):
        c, new = stream.feed(chunk, final=i == len(chunks) - 1)
        content += c
        calls += new
    want_content, want_calls = parse_tool_calls(text, fmt)
    assert _names_args(calls) == _names_args(want_calls)
    assert [c["index"] for c in calls] == list(range(len(calls)))
    if want_calls:
        assert content.strip() == (want_content or "")
    else:
        assert content == text


def test_check_tools_errors():
    tools = [{"name": "weather", "parameters": {"type": "object"}}]
    with pytest.raises(RequestError, match="not among tools"):
        check_tools(tools, {"type": "function", "function": {"name": "nope"}}, HERMES_TEMPLATE)
    with pytest.raises(RequestError, match="does not render tools"):
        check_tools(tools, "auto", "{{ messages }}")
    with pytest.raises(RequestError, match="needs tools"):
        check_tools([], "required", HERMES_TEMPLATE)
    with pytest.raises(RequestError, match="letters, digits"):
        check_tools([{"name": "bad name"}], "auto", HERMES_TEMPLATE)
    assert check_tools(tools, "required", HERMES_TEMPLATE) == (HERMES, tools)
    assert check_tools(tools, "auto", LLAMA3_TEMPLATE) == (LLAMA3_JSON, [])


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3_JSON])
def test_forced_call_grammars_compile(fmt):
    tools = [{"name": "weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
             {"name": "time"}]
    for parallel in (True, False):
        structured.check(forced_call_grammar(fmt, tools, parallel), "tool_choice")

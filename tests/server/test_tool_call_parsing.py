"""server/tool_calls.py: parsing finished messages and streams, formats, forced-call grammars."""

from __future__ import annotations

import json

import pytest

from strata.demo.model import demo_model_path
from strata.engine.grammar import GrammarCompiler
from strata.errors import RequestError
from strata.protocol import structured
from strata.protocol.tokenizer import Tokenizer
from strata.server.tool_calls import (
    HERMES,
    LLAMA3_JSON,
    MAX_PARALLEL_CALLS,
    ToolCallStream,
    check_tools,
    forced_call_grammar,
    forced_call_limit,
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
    for max_calls in (1, MAX_PARALLEL_CALLS):
        structured.check(forced_call_grammar(fmt, tools, max_calls), "tool_choice")


def test_forced_call_limits():
    assert forced_call_limit({"type": "function", "function": {"name": "f"}}, True) == 1  # named: one call, as vLLM
    assert forced_call_limit("required", False) == 1
    assert forced_call_limit("required", True) == MAX_PARALLEL_CALLS


@pytest.mark.parametrize("fmt, call, sep", [
    (HERMES, '<tool_call>\n{"name": "time", "arguments": {}}\n</tool_call>', "\n"),
    (LLAMA3_JSON, '{"name": "time", "parameters": {}}', ";"),
])
@pytest.mark.parametrize("max_calls", [1, 3])
def test_forced_grammar_is_stopped_after_its_last_call(fmt, call, sep, max_calls):
    """Once the last call the grammar allows is complete nothing may follow, so the engine ends
    the sequence there (finish_reason "tool_calls") instead of running on to max_tokens."""
    tok = Tokenizer.from_dir(demo_model_path())
    compiler = GrammarCompiler(tok.to_json(), tok.vocab_size, [tok.eos_token_id])
    matcher = compiler.matcher(forced_call_grammar(fmt, [{"name": "time"}], max_calls))
    for k in range(1, max_calls + 1):
        text = call if k == 1 else sep + call
        assert matcher.consume_tokens(tok.encode(text, add_special_tokens=False)), matcher.get_error()
        assert matcher.is_accepting()
        assert matcher.is_stopped() == (k == max_calls), k

"""`strata serve` tool calling through the official openai client: tool_choice required / named are
enforced by a grammar and come back as message.tool_calls (streamed and not), role "tool" messages
round-trip through the template, and what cannot work is a 400 naming it."""

from __future__ import annotations

import json
import shutil

import jsonschema
import openai
import pytest

from strata.demo.model import demo_model_path
from strata.protocol.tokenizer import Tokenizer
from strata.server.tool_calls import MAX_PARALLEL_CALLS
from tests.server import tool_templates
from tests.server.serverproc import start_server

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "The time now",
                                           "parameters": {"type": "object", "properties": {}}}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": {"type": "object", "properties": {}}}
ASK = [{"role": "user", "content": "What is the weather in Verona?"}]


@pytest.fixture(scope="module", params=["HERMES", "LLAMA3"])
def tool_model(request, tmp_path_factory):
    """The demo model with a template that renders tools, served."""
    path = tmp_path_factory.mktemp("tools") / "demo-tools"
    shutil.copytree(demo_model_path(), path)
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    cfg["chat_template"] = getattr(tool_templates, request.param)
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    server = start_server("--model", str(path), "--served-model-name", "demo-tools")
    yield path, server
    server.stop()


@pytest.fixture(scope="module")
def client(tool_model):
    return openai.OpenAI(base_url=tool_model[1].url + "/v1", api_key="unused", max_retries=0)


def _check_calls(calls, names):
    assert calls, "no tool calls"
    for c in calls:
        assert c.type == "function" and c.id and c.function.name in names
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])


@pytest.mark.parametrize("seed", [0, 1])
def test_required_tool_choice(client, seed):
    # one call: with parallel calls allowed this small model rarely ends the list (it is trained on
    # plays, not on tools) and writes the grammar's MAX_PARALLEL_CALLS (test_forced_call_ends_the_completion)
    r = client.chat.completions.create(model="demo-tools", messages=ASK, tools=TOOLS, tool_choice="required",
                                       temperature=1.0, seed=seed, max_tokens=200, parallel_tool_calls=False)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls"
    _check_calls(c.message.tool_calls, {"get_weather", "get_time"})


def test_named_tool_choice_streamed_and_not(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    kw = dict(model="demo-tools", messages=ASK, tools=TOOLS, tool_choice=named, temperature=0.8, seed=5,
              max_tokens=200, parallel_tool_calls=False)
    r = client.chat.completions.create(**kw)
    _check_calls(r.choices[0].message.tool_calls, {"get_weather"})
    assert len(r.choices[0].message.tool_calls) == 1
    chunks = list(client.chat.completions.create(**kw, stream=True))
    streamed = [tc for ch in chunks if ch.choices for tc in (ch.choices[0].delta.tool_calls or [])]
    assert [tc.function.name for tc in streamed] == ["get_weather"] and streamed[0].index == 0
    assert json.loads(streamed[0].function.arguments) == json.loads(r.choices[0].message.tool_calls[0].function.arguments)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def _rendered(calls, hermes: bool) -> str:
    """The text the forced grammar makes the model write for `calls` (compact JSON, as parsed back)."""
    key = "arguments" if hermes else "parameters"
    bodies = [json.dumps({"name": c.function.name, key: json.loads(c.function.arguments)}, ensure_ascii=False)
              for c in calls]
    return "\n".join(f"<tool_call>\n{b}\n</tool_call>" for b in bodies) if hermes else ";".join(bodies)


@pytest.mark.parametrize("choice", ["named", "required"])
def test_forced_call_ends_the_completion(client, tool_model, choice):
    """Parallel calls allowed (the default): the completion ends with the last call the grammar
    allows (one for a named function, at most MAX_PARALLEL_CALLS for "required"), never at
    max_tokens with a call cut in half; no token follows the calls but the end token."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(model="demo-tools", messages=ASK, tools=TOOLS, max_tokens=1200, seed=2,
                                       tool_choice=named if choice == "named" else "required", temperature=1.0,
                                       logprobs=True)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls", c
    calls = c.message.tool_calls
    _check_calls(calls, {"get_weather"} if choice == "named" else {"get_weather", "get_time"})
    assert 1 <= len(calls) <= (1 if choice == "named" else MAX_PARALLEL_CALLS)
    tok = Tokenizer.from_dir(tool_model[0])
    tokens = [t.token for t in c.logprobs.content]
    eos = json.loads((tool_model[0] / "generation_config.json").read_text())["eos_token_id"]
    if tokens[-1] in {tok.decode([i], skip_special_tokens=False) for i in eos}:
        tokens.pop()  # the model may end the list of calls itself, before the grammar's limit
    written = "".join(tokens)
    assert written == _rendered(calls, "<tool_call>" in written)  # nothing after the last call
    assert r.usage.completion_tokens == len(c.logprobs.content)
    assert r.usage.completion_tokens <= len(tok.encode(written, add_special_tokens=False)) + 1


def test_tool_results_round_trip(client, tool_model):
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": '{"city": "Verona", "unit": "celsius"}'}}
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees and sunny"}]
    r = client.chat.completions.create(model="demo-tools", messages=messages, tools=TOOLS, temperature=0, max_tokens=4)
    tok = Tokenizer.from_dir(tool_model[0])
    rendered_messages = [*ASK, {"role": "assistant", "tool_calls": [{**call, "function": {
        "name": "get_weather", "arguments": {"city": "Verona", "unit": "celsius"}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees and sunny"}]
    text = tok.apply_chat_template(rendered_messages, add_generation_prompt=True, tools=TOOLS)
    assert "21 degrees and sunny" in text and '"city": "Verona"' in text
    assert r.usage.prompt_tokens == len(tok.encode(text, add_special_tokens=False))


@pytest.mark.parametrize("body, param, words", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "fly"}}}, "tool_choice.function.name",
     "not among tools"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objec"}}}]},
     "tools[0].function.parameters", "Invalid type"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice", "one"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type", "function"),
])
def test_bad_tool_requests_are_400s(tool_model, body, param, words):
    r = tool_model[1].post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err


def test_tools_on_a_template_without_them_is_a_400(server):
    r = server.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 4, "tools": TOOLS})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
    assert "does not render tools" in r.json()["error"]["message"]

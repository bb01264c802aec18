"""Every bad request is a 4xx in the OpenAI error shape naming the field, through the real server.

One table, sent with the official `openai` client where it can send the input and with raw
httpx where it cannot (NaN, lone surrogates, 5,000-digit integers, deep nesting: the client's
JSON encoder refuses them). The server runs once for the module with its log in a file, so the
tests can also check what reached the log (no traceback for a bad request or a hang-up).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest

from strata.protocol.sampling_params import MAX_N
from tests.server.serverproc import STARTUP_TIMEOUT, Server, free_port, without_model_label

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
BASE = {COMPLETIONS: {"model": "demo-v2", "prompt": "Once", "max_tokens": 2, "temperature": 0},
        CHAT: {"model": "demo-v2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0}}
ERROR_KEYS = {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def logged(tmp_path_factory):
    """The demo model, its log in a file (with -v: info lines too), a planted fault for the 500 path."""
    log_path = tmp_path_factory.mktemp("serve") / "server.log"
    port = free_port()
    cmd = [sys.executable, "-m", "strata.cli", "-v", "serve", "--port", str(port), "--dtype", "float32"]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "STRATA_TEST_FAULTS": "raise_on=PLANTED-FAULT"})
    server = Server(proc, port)
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while True:
            assert proc.poll() is None, f"server exited during start-up:\n{log_path.read_text()[-3000:]}"
            assert time.monotonic() < deadline, "server not ready in time"
            try:
                if httpx.get(server.url + "/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        server.log_path = log_path
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def client(logged):
    return openai.OpenAI(base_url=logged.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def error_of(body: dict) -> dict:
    assert set(body) == {"error"} and set(body["error"]) == ERROR_KEYS, body
    return body["error"]


def raw(endpoint: str, **fields) -> bytes:
    """The base body with `fields`, encoded as Python's json does by default (NaN, \\ud800 escapes)."""
    return json.dumps({**BASE[endpoint], **fields}).encode()


def raw_with(endpoint: str, name: str, literal: str) -> bytes:
    """The base body with `name` set to a JSON literal no encoder writes (a 5,000-digit integer)."""
    body = json.dumps(BASE[endpoint])
    return (body[:-1] + f', "{name}": {literal}}}').encode()


NESTED = "[" * 200 + "]" * 200
FLOATS = ["temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"]

# (case id, endpoint, request: kwargs for the openai client, or bytes for raw httpx, status, param, words)
CASES = [
    # 500s before: now 400s naming the field
    ("int-5000-digits", COMPLETIONS, raw_with(COMPLETIONS, "max_tokens", "9" * 5000), 400, "max_tokens", "5000 digits"),
    ("int-5000-digits-chat-seed", CHAT, raw_with(CHAT, "seed", "-" + "1" * 5000), 400, "seed", "5000 digits"),
    ("nesting-100k", COMPLETIONS, b"[" * 100_000, 400, None, "request body is nested"),
    ("nesting-in-field", COMPLETIONS, raw_with(COMPLETIONS, "prompt", NESTED), 400, "prompt", "nested"),
    ("nesting-in-chat", CHAT, raw_with(CHAT, "metadata", '{"a":' * 100 + "1" + "}" * 100), 400, "metadata", "nested"),
    ("surrogate-prompt", COMPLETIONS, raw(COMPLETIONS, prompt="ab\ud800"), 400, "prompt", "surrogate"),
    ("surrogate-prompt-list", COMPLETIONS, raw(COMPLETIONS, prompt=["ok", "\udc00"]), 400, "prompt[1]", "surrogate"),
    ("surrogate-chat", CHAT, raw(CHAT, messages=[{"role": "user", "content": "\ud83d"}]), 400,
     "messages[0].content", "surrogate"),
    ("surrogate-stop", CHAT, raw(CHAT, stop=["\udfff"]), 400, "stop[0]", "surrogate"),
    ("seed-2**64", COMPLETIONS, {"seed": 2**64}, 400, "seed", "64 bits"),
    ("seed-below-int64", CHAT, {"seed": -(2**63) - 1}, 400, "seed", "64 bits"),
    ("seed-100-digits", CHAT, {"seed": 10**99}, 400, "seed", "64 bits"),
    # accepted but wrong before: NaN/inf, booleans as integers, n without a bound, any role
    *[(f"{name}-{lit}", endpoint, raw_with(endpoint, name, lit), 400, name, "finite")
      for name in FLOATS for lit in ("NaN", "Infinity", "-Infinity", "1e999") for endpoint in (COMPLETIONS, CHAT)],
    ("temperature-1e-300", CHAT, {"temperature": 1e-300}, 400, "temperature", "0 (greedy) or >= 1e-06"),
    ("repetition_penalty-0", COMPLETIONS, {"extra_body": {"repetition_penalty": 0}}, 400, "repetition_penalty", ">="),
    ("max_tokens-true", COMPLETIONS, {"max_tokens": True}, 400, "max_tokens", "valid integer"),
    ("n-true", COMPLETIONS, {"n": True}, 400, "n", "valid integer"),
    ("n-true-chat", CHAT, {"n": True}, 400, "n", "valid integer"),
    ("logprobs-true", COMPLETIONS, {"logprobs": True}, 400, "logprobs", "valid integer"),
    ("top_k-false", CHAT, {"extra_body": {"top_k": False}}, 400, "top_k", "valid integer"),
    ("seed-float", CHAT, {"seed": 1.0}, 400, "seed", "valid integer"),
    ("temperature-string", CHAT, {"temperature": "0.5"}, 400, "temperature", "valid number"),
    ("stream-int", COMPLETIONS, {"extra_body": {"stream": 1}}, 400, "stream", "valid boolean"),
    ("n-1000", COMPLETIONS, {"n": 1000}, 400, "n", f"<= {MAX_N}"),
    (f"n-{MAX_N + 1}-chat", CHAT, {"n": MAX_N + 1}, 400, "n", f"<= {MAX_N}"),
    ("role-wizard", CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role", "'user'"),
    ("role-empty", CHAT, {"messages": [{"role": "user", "content": "a"}, {"role": "", "content": "hi"}]}, 400,
     "messages[1].role", "'user'"),
    ("role-function", CHAT, {"messages": [{"role": "function", "content": "hi", "name": "f"}]}, 400,
     "messages[0].role", "'tool'"),
    ("content-null", CHAT, {"messages": [{"role": "user", "content": None}]}, 400, "messages[0].content", "string"),
    ("content-image", CHAT, {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, 400, "messages[0].content[0].type", "text parts"),
    ("messages-empty", CHAT, {"messages": []}, 400, "messages", "at least 1"),
    # fields Strata does not implement: 400 naming them, never a silent no-op
    ("response_format-bad-type", CHAT, {"response_format": {"type": "yaml"}}, 400, "response_format.type",
     "json_schema"),
    ("tools-template-without-tools", CHAT, {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]},
     400, "tools", "does not render tools"),
    ("tool_choice-without-tools", CHAT, {"tool_choice": "auto"}, 400, "tool_choice", "needs tools"),
    ("parallel_tool_calls-str", CHAT, {"parallel_tool_calls": "no"}, 400, "parallel_tool_calls", "valid boolean"),
    ("functions", CHAT, {"functions": [{"name": "f", "parameters": {}}]}, 400, "functions", "not implemented"),
    ("function_call", CHAT, {"function_call": "auto"}, 400, "function_call", "not implemented"),
    ("logit_bias", CHAT, {"logit_bias": {"50": 100}}, 400, "logit_bias", "not implemented"),
    ("logit_bias-completions", COMPLETIONS, {"logit_bias": {"50": -100}}, 400, "logit_bias", "not implemented"),
    ("best_of", COMPLETIONS, {"best_of": 3}, 400, "best_of", "not implemented"),
    ("best_of-true", COMPLETIONS, {"best_of": True}, 400, "best_of", "not implemented"),
    ("suffix", COMPLETIONS, {"suffix": " the end"}, 400, "suffix", "not implemented"),
    ("use_beam_search", COMPLETIONS, {"extra_body": {"use_beam_search": True}}, 400, "use_beam_search", "not impl"),
    ("prompt_logprobs", COMPLETIONS, {"extra_body": {"prompt_logprobs": 1}}, 400, "prompt_logprobs", "not impl"),
    ("guided_json-bad-schema", CHAT, {"extra_body": {"guided_json": {"type": "objekt"}}}, 400, "guided_json",
     "Invalid type"),
    ("reasoning_effort", CHAT, {"reasoning_effort": "high"}, 400, "reasoning_effort", "not implemented"),
    ("modalities-audio", CHAT, {"modalities": ["text", "audio"]}, 400, "modalities", "not implemented"),
    ("message-tool_calls", CHAT, {"messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "1", "type": "function",
                                                             "function": {"name": "f", "arguments": "{x"}}]}]},
     400, "messages[1].tool_calls[0].function.arguments", "JSON text"),
    ("unknown-field", COMPLETIONS, {"extra_body": {"typical_p": 0.5}}, 400, "typical_p", "unknown field"),
    ("unknown-field-chat", CHAT, {"extra_body": {"mirostat": 2}}, 400, "mirostat", "unknown field"),
    ("unknown-message-field", CHAT, {"messages": [{"role": "user", "content": "hi", "weight": 2}]}, 400,
     "messages[0].weight", "unknown field"),
    ("unknown-stream-option", CHAT, {"stream": True, "stream_options": {"include_usage": True, "x": 1}}, 400,
     "stream_options.x", "unknown field"),
    ("max_completion_tokens-in-completions", COMPLETIONS, {"extra_body": {"max_completion_tokens": 3}}, 400,
     "max_completion_tokens", "unknown field"),
    ("echo-logprobs-too-many", COMPLETIONS, {"echo": True, "logprobs": 6}, 400, "logprobs", "[0, 5]"),
    # ranges (SamplingParams.validate): unchanged rules, now with strict types before them
    ("top_k-huge", CHAT, {"extra_body": {"top_k": 2**70}}, 400, "top_k", "top_k"),
    ("min_tokens-huge-chat", CHAT, {"extra_body": {"min_tokens": 2**70}, "max_tokens": None}, 400, "min_tokens",
     "2**63"),
    ("min_tokens-over-context-chat", CHAT, {"extra_body": {"min_tokens": 100_000}, "max_tokens": None}, 400,
     "min_tokens", "<= max_tokens"),
    ("stop_token_ids-huge", COMPLETIONS, {"extra_body": {"stop_token_ids": [2**80]}}, 400, "stop_token_ids", "[0,"),
    ("top_logprobs-21", CHAT, {"logprobs": True, "top_logprobs": 21}, 400, "top_logprobs", "[0, 20]"),
    ("invalid-json", COMPLETIONS, b'{"prompt": "x",', 400, None, "request body is not valid JSON"),
    ("invalid-utf8", COMPLETIONS, b'{"prompt": "\xff\xfe"}', 400, None, "request body is not valid JSON"),
    ("not-an-object", CHAT, b'["messages"]', 400, None, "request body must be a JSON object"),
]


@pytest.mark.parametrize(("endpoint", "request_", "status", "param", "words"), [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_bad_request_is_4xx_naming_the_field(logged, client, endpoint, request_, status, param, words):
    if isinstance(request_, bytes):
        r = httpx.post(logged.url + endpoint, content=request_, headers={"Content-Type": "application/json"},
                       timeout=60)
        got_status, body = r.status_code, r.json()
    else:
        create = client.completions.create if endpoint == COMPLETIONS else client.chat.completions.create
        with pytest.raises(openai.APIStatusError) as info:
            create(**{**BASE[endpoint], **request_})
        got_status, body = info.value.status_code, info.value.response.json()
        assert info.value.param == param
    err = error_of(body)
    assert got_status == status and err["type"] == "invalid_request_error", body
    assert err["param"] == param and words in err["message"], err


def test_neutral_values_of_unimplemented_fields_and_ignored_fields_are_accepted(client):
    r = client.chat.completions.create(
        **BASE[CHAT], response_format={"type": "text"}, tools=[], tool_choice="none", logit_bias={},
        modalities=["text"], user="u1", metadata={"k": "v"}, store=False, service_tier="auto", n=None,
        logprobs=None, presence_penalty=None, stream_options=None,
        extra_body={"add_generation_prompt": True, "chat_template_kwargs": {}, "safety_identifier": "s"})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 2
    r = client.completions.create(**BASE[COMPLETIONS], best_of=2, n=2, suffix="", user="u", logit_bias={},
                                  extra_body={"use_beam_search": False})
    assert [c.index for c in r.choices] == [0, 1]
    # developer is rendered as system; a tool message and a replayed assistant message are accepted
    messages = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello", "refusal": None, "tool_calls": None, "annotations": []},
                {"role": "tool", "content": "42", "tool_call_id": "c1"}, {"role": "user", "content": [
                    {"type": "text", "text": "and "}, {"type": "text", "text": "then?"}]}]
    as_system = [{**messages[0], "role": "system"}, *messages[1:]]
    want = client.chat.completions.create(**{**BASE[CHAT], "messages": as_system}).choices[0].message.content
    assert client.chat.completions.create(**{**BASE[CHAT], "messages": messages}).choices[0].message.content == want


def test_n_at_the_limit_is_served(client):
    r = client.completions.create(**{**BASE[COMPLETIONS], "max_tokens": 1}, n=MAX_N)
    assert len(r.choices) == MAX_N


@pytest.mark.parametrize(("method", "path", "status", "words"), [
    ("GET", "/v1/nope", 404, "no route GET /v1/nope"),
    ("POST", "/v1/embeddings", 404, "/v1/chat/completions"),
    ("GET", "/", 404, "no route"),
    ("GET", "/v1/models/gpt-9", 404, "'gpt-9' does not exist"),
    ("GET", COMPLETIONS, 405, "use POST"),
    ("PUT", CHAT, 405, "does not accept PUT"),
    ("DELETE", "/v1/models", 405, "use GET"),
])
def test_unknown_route_and_wrong_method_use_the_openai_error_shape(logged, method, path, status, words):
    r = httpx.request(method, logged.url + path, json={}, timeout=30)
    err = error_of(r.json())
    assert r.status_code == status and words in err["message"], (r.status_code, err)
    assert err["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    if status == 405:
        assert r.headers["Allow"]


def test_unknown_route_through_the_client(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.get("/nope", cast_to=object)
    assert info.value.body["message"].startswith("no route GET /v1/nope")
    with pytest.raises(openai.APIStatusError) as info:
        client.get("/completions", cast_to=object)
    assert info.value.status_code == 405 and "use POST" in info.value.body["message"]
    assert client.models.retrieve("demo-v2").id == "demo-v2"


def test_500_says_nothing_internal_and_gives_a_request_id(logged):
    r = httpx.post(logged.url + CHAT, json={"messages": [{"role": "user", "content": "PLANTED-FAULT"}]}, timeout=60)
    err = error_of(r.json())
    assert r.status_code == 500 and err["type"] == "server_error" and err["code"] == "internal_error"
    rid = r.headers["X-Request-Id"]
    assert rid in err["message"] and "planted" not in err["message"] and "RuntimeError" not in err["message"]
    deadline = time.monotonic() + 10
    while rid not in (log := logged.log_path.read_text()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert "planted fault" in log[log.index(rid):]  # the details are in the log, once
    assert log.count("Traceback") == 1, log[-4000:]


def test_client_hanging_up_mid_upload_is_a_disconnect_not_a_failure(logged):
    labels = 'endpoint="/v1/completions",status="499"'
    before, tracebacks = _metric_count(logged, labels), logged.log_path.read_text().count("Traceback")
    with socket.create_connection(("127.0.0.1", logged.port), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 5000\r\n\r\n{\"prompt\": \"Once upon")
        time.sleep(0.3)
    deadline = time.monotonic() + 10
    while _metric_count(logged, labels) == before:
        assert time.monotonic() < deadline, "the hang-up was not counted as a client disconnect (499)"
        time.sleep(0.1)
    log = logged.log_path.read_text()
    assert "client disconnected while sending the body of POST /v1/completions" in log
    assert log.count("Traceback") == tracebacks, log[-3000:]


def test_bad_requests_left_no_traceback_and_the_server_serves(logged, client):
    """Runs after the table: nothing but the planted fault reached the log as a traceback."""
    assert logged.log_path.read_text().count("Traceback") <= 1
    r = client.completions.create(**BASE[COMPLETIONS])
    assert r.usage.completion_tokens == 2
    lines = [line for line in without_model_label(httpx.get(logged.url + "/metrics", timeout=30).text).splitlines()
             if line.startswith("strata_requests_total{")]
    assert any('endpoint="other"' in line for line in lines) and not any("/v1/nope" in line for line in lines)
    assert [line for line in lines if 'status="500"' in line] in (
        [], ['strata_requests_total{endpoint="/v1/chat/completions",status="500"} 1.0'])  # the planted fault


def _metric_count(server, labels: str) -> float:
    for line in without_model_label(httpx.get(server.url + "/metrics", timeout=30).text).splitlines():
        if line.startswith("strata_requests_total{") and labels in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0

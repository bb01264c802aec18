"""Property-based fuzz of the request schema against one real server (started once per module).

Random JSON values (null, bools, huge and negative integers, non-finite floats and their string
spellings, nested lists and objects, long and odd Unicode including lone surrogates) go into every
field of /v1/completions and /v1/chat/completions, plus fields Strata does not know. Every answer
must be < 500, every 4xx must be in the OpenAI error shape, a stream must not end in a server error,
and a greedy request must answer the same text before and after the fuzz.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server.serverproc import start_server

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
GREEDY = {COMPLETIONS: {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0},
          CHAT: {"messages": [{"role": "user", "content": "What is a cache?"}], "max_tokens": 8, "temperature": 0}}
BASE = {COMPLETIONS: {"prompt": "Once", "max_tokens": 2}, CHAT: {"messages": [{"role": "user", "content": "hi"}],
                                                                 "max_tokens": 2}}
COMMON = ["model", "n", "stop", "stop_token_ids", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed",
          "presence_penalty", "frequency_penalty", "repetition_penalty", "ignore_eos", "min_tokens",
          "skip_special_tokens", "include_stop_str_in_output", "stream", "stream_options", "user", "metadata",
          "store", "service_tier", "logit_bias", "response_format", "tools", "tool_choice", "best_of",
          "use_beam_search", "prompt_logprobs", "guided_json", "logprobs"]
FIELDS = {COMPLETIONS: [*COMMON, "prompt", "echo", "suffix"],
          CHAT: [*COMMON, "messages", "max_completion_tokens", "top_logprobs", "functions", "function_call",
                 "parallel_tool_calls", "modalities", "add_generation_prompt", "chat_template_kwargs"]}
SETTINGS = settings(max_examples=100, deadline=None, derandomize=True, database=None, print_blob=True,
                    suppress_health_check=list(HealthCheck))

surrogates = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)
odd_text = st.one_of(
    st.text(max_size=24),
    st.text(st.one_of(st.characters(), surrogates), max_size=12),
    st.sampled_from(["", " ", "NaN", "nan", "inf", "-Infinity", "1e999", "0x10", "true", "null", "demo-v2",
                     "<|eot_id|>", "<|start_header_id|>", "\x00", "\u202e\u0301", "\U0001f600" * 50, "\ud800",
                     "x" * 5000, "ü" * 3000]),
)
scalars = st.one_of(
    st.none(), st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, 1, -1, 2, 128, 129, 4159, 4160, 2**31, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, 10**40]),
    st.floats(allow_nan=True, allow_infinity=True),
    odd_text,
)
json_values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(st.one_of(st.characters(), surrogates), max_size=8), inner,
                                                 max_size=4)), max_leaves=12)
deep = st.integers(min_value=20, max_value=60).map(lambda d: json.loads("[" * d + "]" * d))

# plausible values too, so that some requests pass the types and reach later checks and the engine
PLAUSIBLE = {
    "n": st.integers(1, 3), "max_tokens": st.integers(1, 6), "max_completion_tokens": st.integers(1, 6),
    "min_tokens": st.integers(0, 4), "temperature": st.floats(0, 2), "top_p": st.floats(0, 1),
    "top_k": st.integers(-1, 50), "seed": st.integers(-(2**63), 2**63 - 1), "logprobs": st.one_of(st.integers(0, 5),
                                                                                                   st.booleans()),
    "top_logprobs": st.integers(0, 20), "stop": st.one_of(st.text(max_size=3), st.lists(st.text(max_size=3),
                                                                                        max_size=3)),
    "stop_token_ids": st.lists(st.integers(0, 4200), max_size=3), "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "prompt": st.one_of(st.text(max_size=30), st.lists(st.integers(0, 4200), max_size=6),
                        st.lists(st.text(max_size=10), max_size=3)),
    "echo": st.booleans(), "ignore_eos": st.booleans(), "best_of": st.integers(0, 3),
    "min_p": st.floats(0, 1), "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.5, 2), "skip_special_tokens": st.booleans(),
    "include_stop_str_in_output": st.booleans(), "model": st.sampled_from(["demo-v2", None]),
    "user": st.text(max_size=8), "metadata": st.dictionaries(st.text(max_size=4), st.text(max_size=4), max_size=2),
    "store": st.booleans(), "service_tier": st.sampled_from(["auto", "default"]),
    "logit_bias": st.sampled_from([{}, None, {"5": 1}]), "response_format": st.sampled_from([{"type": "text"},
                                                                                             {"type": "json_object"}]),
    "tools": st.sampled_from([[], None]), "tool_choice": st.sampled_from(["none", "auto"]),
    "use_beam_search": st.booleans(), "modalities": st.sampled_from([["text"], ["audio"]]),
    "add_generation_prompt": st.booleans(), "chat_template_kwargs": st.sampled_from([{}, {"x": 1}]),
}
roles = st.one_of(st.sampled_from(["system", "user", "assistant", "tool", "developer", "wizard", "", "USER"]),
                  json_values)
message = st.fixed_dictionaries(
    {"role": roles, "content": st.one_of(odd_text, json_values,
                                         st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": odd_text}),
                                                  max_size=2))},
    optional={"name": json_values, "tool_calls": json_values, "tool_call_id": json_values, "refusal": json_values},
).flatmap(lambda m: st.one_of(st.just(m), st.tuples(st.text(min_size=1, max_size=6), json_values).map(
    lambda kv: {**m, kv[0]: kv[1]})))
PLAUSIBLE["messages"] = st.lists(message, max_size=3)


def value_for(field: str):
    options = [json_values, deep] + ([PLAUSIBLE[field]] * 6 if field in PLAUSIBLE else [])
    return st.one_of(*options)


def bodies(endpoint: str):
    known = st.sampled_from(FIELDS[endpoint]).flatmap(lambda k: st.tuples(st.just(k), value_for(k)))
    unknown = st.tuples(st.text(min_size=1, max_size=10), json_values)
    changes = st.lists(st.one_of(known, known, known, known, known, unknown), min_size=1, max_size=3).map(dict)
    return changes.map(lambda c: {**BASE[endpoint], **c})


@pytest.fixture(scope="module")
def fuzzed():
    """A short context bounds what a valid random request can cost (n <= 128 of <= 128 tokens)."""
    s = start_server("--max-model-len", "128", "--max-request-bytes", "256KiB")
    try:
        s.before = {ep: greedy_text(s, ep) for ep in (COMPLETIONS, CHAT)}
        yield s
    finally:
        s.stop()


def greedy_text(server, endpoint: str) -> str:
    r = server.post(endpoint, json=GREEDY[endpoint])
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return choice["text"] if endpoint == COMPLETIONS else choice["message"]["content"]


STATUSES: dict[str, dict[int, int]] = {COMPLETIONS: {}, CHAT: {}}  # printed by the last test (-s)


def check_answer(server, endpoint: str, body: dict) -> None:
    data = json.dumps(body).encode()  # Python's default: NaN/Infinity literals, \\ud800 escapes
    r = httpx.post(server.url + endpoint, content=data, headers={"Content-Type": "application/json"}, timeout=120)
    assert r.status_code < 500, (r.status_code, r.text[:500], data[:500])
    if r.status_code >= 400:
        err = r.json()
        assert set(err) == {"error"} and set(err["error"]) == {"message", "type", "param", "code"}, err
        e = err["error"]
        assert isinstance(e["message"], str) and e["message"] and isinstance(e["type"], str), e
        assert e["param"] is None or isinstance(e["param"], str), e
    elif r.headers["content-type"].startswith("text/event-stream"):
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", r.text[-500:]
        for ev in events[:-1]:
            chunk = json.loads(ev)
            assert chunk.get("error", {}).get("type") != "server_error", (chunk, data[:500])
    else:
        assert isinstance(r.json()["choices"], list)
    STATUSES[endpoint][r.status_code] = STATUSES[endpoint].get(r.status_code, 0) + 1


@SETTINGS
@given(body=bodies(COMPLETIONS))
def test_fuzz_completions(fuzzed, body):
    check_answer(fuzzed, COMPLETIONS, body)


@SETTINGS
@given(body=bodies(CHAT))
def test_fuzz_chat(fuzzed, body):
    check_answer(fuzzed, CHAT, body)


def test_greedy_answer_unchanged_after_the_fuzz(fuzzed):
    for ep in (COMPLETIONS, CHAT):
        assert greedy_text(fuzzed, ep) == fuzzed.before[ep]
    lines = [line for line in fuzzed.get("/metrics").text.splitlines() if line.startswith("strata_requests_total{")]
    assert not any('status="5' in line for line in lines if "/ready" not in line), lines
    print("fuzz statuses:", STATUSES)
    deadline = time.monotonic() + 10
    while fuzzed.metric("strata_num_requests_running") or fuzzed.metric("strata_kv_cache_usage_ratio"):
        assert time.monotonic() < deadline, "the fuzz left requests running or KV blocks in use"
        time.sleep(0.1)

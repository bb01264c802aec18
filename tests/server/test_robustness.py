"""Bad requests, disconnects, auth, backpressure and drain: each costs nothing beyond itself."""

from __future__ import annotations

import concurrent.futures as cf
import json
import signal
import time

import httpx
import pytest

from tests.server.serverproc import start_server, without_model_label

COMPLETIONS = "/v1/completions"


def error_of(r: httpx.Response) -> dict:
    body = r.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def still_serves(server) -> None:
    r = server.post(COMPLETIONS, json={"prompt": "Once", "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def wait_idle(server, timeout: float = 10.0, headers: dict | None = None) -> None:
    """KV usage and running requests in /metrics back to 0 (the engine reports at least each second)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (server.metric("strata_kv_cache_usage_ratio", headers) == 0
                and server.metric("strata_num_requests_running", headers) == 0):
            return
        time.sleep(0.1)
    raise AssertionError("KV blocks still in use after the client went away")


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"prompt": "x", "temperature": "hot"}, "temperature", "valid number"),
    ({"prompt": "x", "top_p": 7}, "top_p", "(0, 1]"),
    ({"prompt": "x", "n": 0}, "n", ">= 1"),
    ({"prompt": "x", "max_tokens": -1}, "max_tokens", ">= 1"),
    ({"prompt": "x", "logprobs": 99}, "logprobs", "[0, 5]"),
    ({"temperature": 0}, "prompt", "Field required"),
    ({"prompt": [5, 10**9]}, "prompt", "[0,"),
])
def test_invalid_field_is_400_naming_it(server, body, param, words):
    r = server.post(COMPLETIONS, json=body)
    assert r.status_code == 400
    err = error_of(r)
    assert err["param"] == param and words in err["message"], err


def test_too_long_states_both_numbers(server):
    r = server.post(COMPLETIONS, json={"prompt": "x y z", "max_tokens": 5000})
    assert r.status_code == 400
    msg = error_of(r)["message"]
    assert "5000" in msg and "2048" in msg and "tokens" in msg


def test_other_errors_and_server_survives(server):
    r = server.post(COMPLETIONS, content=b"{not json", headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "JSON" in error_of(r)["message"]
    r = server.post(COMPLETIONS, json={"model": "gpt-9", "prompt": "x"})
    assert r.status_code == 404 and "demo-v2" in error_of(r)["message"]
    r = server.post(COMPLETIONS, json={"prompt": "x" * 70_000})
    assert r.status_code == 413 and "65536" in error_of(r)["message"]
    r = server.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "PLANTED-FAULT"}]})
    assert r.status_code == 500 and error_of(r)["type"] == "server_error"
    still_serves(server)


def test_disconnect_mid_stream_frees_blocks(server):
    body = {"prompt": "Once upon a time", "max_tokens": 1500, "ignore_eos": True, "stream": True, "temperature": 0}
    with httpx.Client(timeout=30) as c, c.stream("POST", server.url + COMPLETIONS, json=body) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: ") for line in got)
        assert server.metric("strata_kv_cache_usage_ratio") > 0
    wait_idle(server)
    still_serves(server)


def test_disconnect_while_waiting_for_a_full_response_frees_blocks(server):
    body = {"prompt": "Once upon a time", "max_tokens": 1500, "ignore_eos": True, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + COMPLETIONS, json=body, timeout=httpx.Timeout(30, read=1.0))
    wait_idle(server)
    still_serves(server)


def test_metrics_exposes_the_issue_families(server):
    raw = server.get("/metrics").text
    assert 'strata_num_requests_running{model_name="' in raw  # every series names its model, as vLLM's
    text = without_model_label(raw)
    for name in ("strata_requests_total", "strata_time_to_first_token_seconds_bucket",
                 "strata_time_per_output_token_seconds_bucket", "strata_inter_token_latency_seconds_bucket",
                 "strata_e2e_request_latency_seconds_bucket", "strata_request_queue_time_seconds_bucket",
                 "strata_num_requests_running", "strata_num_requests_waiting", "strata_kv_cache_usage_ratio",
                 "strata_kv_cache_reserved_bytes", "strata_kv_cache_waste_bytes", "strata_prompt_tokens_total",
                 "strata_generation_tokens_total", "strata_preemptions_total", "strata_engine_step_seconds_total"):
        assert name in text, name
    for stage in ("tokenize", "queue", "prefill", "decode", "detokenize", "stream"):
        assert f'strata_request_stage_seconds_total{{stage="{stage}"}}' in text
    assert 'strata_requests_total{endpoint="/v1/completions",status="200"}' in text
    assert server.metric("strata_prefill_cap_tokens") > 0  # CPU: the decode-first cap, tuned by step times


@pytest.fixture(scope="module")
def guarded():
    """An API key, one running sequence at a time and a queue of two."""
    s = start_server("--api-key", "s3cret", "--max-num-seqs", "1", "--max-queue", "2")
    yield s
    s.stop()


def test_api_key(guarded):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
        r = guarded.post(COMPLETIONS, json={"prompt": "x", "max_tokens": 2}, headers=headers)
        assert r.status_code == 401 and "API key" in error_of(r)["message"]
    assert guarded.get("/v1/models").status_code == 401
    assert guarded.get("/health").status_code == 200 and guarded.get("/ready").status_code == 200
    ok = {"Authorization": "Bearer s3cret"}
    assert guarded.post(COMPLETIONS, json={"prompt": "x", "max_tokens": 2}, headers=ok).status_code == 200


def test_queue_full_is_429_with_retry_after(guarded):
    ok = {"Authorization": "Bearer s3cret"}
    body = {"prompt": "Once upon a time", "max_tokens": 60, "ignore_eos": True, "temperature": 0}

    def send(_):
        return httpx.post(guarded.url + COMPLETIONS, json=body, headers=ok, timeout=120)

    with cf.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(send, range(8)))
    codes = sorted(r.status_code for r in results)
    assert 429 in codes and 200 in codes, codes
    for r in results:
        if r.status_code == 429:
            assert r.headers["Retry-After"] == "1" and "--max-queue" in error_of(r)["message"]
        else:
            assert r.json()["usage"]["completion_tokens"] == 60
    wait_idle(guarded, headers=ok)


def _stream_text(url: str, body: dict) -> tuple[str, str | None]:
    text, finish = [], None
    with httpx.Client(timeout=120) as c, c.stream("POST", url + COMPLETIONS, json={**body, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return "".join(text), "error"
                for ch in chunk["choices"]:
                    text.append(ch["text"])
                    finish = ch["finish_reason"] or finish
    return "".join(text), finish


def test_sigterm_drains_in_flight_requests():
    s = start_server("--drain-timeout", "300")  # generous: the box may be busy; they must finish, not time out
    body = {"prompt": "Once upon a time", "max_tokens": 600, "ignore_eos": True, "temperature": 0}
    try:
        with cf.ThreadPoolExecutor(2) as pool:
            futures = [pool.submit(_stream_text, s.url, body) for _ in range(2)]
            deadline = time.monotonic() + 10
            while s.metric("strata_num_requests_running") < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
            s.proc.send_signal(signal.SIGTERM)
            time.sleep(0.3)
            r = s.post(COMPLETIONS, json=body)
            assert r.status_code == 503 and error_of(r)["code"] == "unavailable"
            assert s.get("/ready").status_code == 503
            results = [f.result() for f in futures]
        assert [finish for _, finish in results] == ["length", "length"]
        assert results[0][0] == results[1][0] and results[0][0]
        assert s.proc.wait(60) == 0
    finally:
        s.stop()


def test_drain_timeout_aborts_the_rest_and_exits_0():
    s = start_server("--drain-timeout", "1")
    body = {"prompt": "Once upon a time", "max_tokens": 1900, "ignore_eos": True, "temperature": 0}
    try:
        with cf.ThreadPoolExecutor(1) as pool:
            fut = pool.submit(_stream_text, s.url, body)
            deadline = time.monotonic() + 10
            while s.metric("strata_num_requests_running") < 1 and time.monotonic() < deadline:
                time.sleep(0.05)
            s.proc.send_signal(signal.SIGTERM)
            _, finish = fut.result()
        assert finish == "error"
        assert s.proc.wait(60) == 0
    finally:
        s.stop()

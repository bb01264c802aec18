"""`strata bench serve` against a tiny fake OpenAI-compatible server run by uvicorn in a thread."""

from __future__ import annotations

import asyncio
import json
import math
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from strata.bench.common import parse_range
from strata.bench.serve import (
    ServeBenchConfig,
    benchmark,
    load_tokenizer,
    parse_rate,
    parse_slo,
    plan_requests,
    server_root,
)
from strata.cli import main
from strata.errors import StrataError

TOKEN_SLEEP_S = 0.005
MODEL = "fake-model"


@dataclass
class FakeState:
    """How the fake server behaves, and what it saw. Reset before every test."""

    api_key: str | None = None
    fail: Callable[[dict], int | None] = lambda body: None  # body -> HTTP status to fail with
    error_chunk: Callable[[dict], bool] = lambda body: False  # send an error chunk mid-stream
    no_usage: bool = False
    in_flight: int = 0
    max_in_flight: int = 0
    bodies: list[dict] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


STATE = FakeState()


def _authorised(request: Request) -> bool:
    return STATE.api_key is None or request.headers.get("authorization") == f"Bearer {STATE.api_key}"


async def models(request: Request):
    if not _authorised(request):
        return JSONResponse({"error": {"message": "bad key"}}, status_code=401)
    return JSONResponse({"object": "list", "data": [{"id": MODEL, "object": "model"}]})


async def completions(request: Request):
    if not _authorised(request):
        return JSONResponse({"error": {"message": "bad key"}}, status_code=401)
    body = await request.json()
    STATE.bodies.append(body)
    status = STATE.fail(body)
    if status is not None:
        return JSONResponse({"error": {"message": f"planned failure {status}"}}, status_code=status)
    chat = request.url.path.endswith("/chat/completions")
    n = int(body["max_tokens"])
    error_chunk = STATE.error_chunk(body)

    def chunk(i: int) -> str:
        choice = {"index": 0, "delta": {"content": "x"}} if chat else {"index": 0, "text": "x"}
        return "data: " + json.dumps({"id": "c", "choices": [choice]}) + "\n\n"

    async def stream():
        with STATE.lock:
            STATE.in_flight += 1
            STATE.max_in_flight = max(STATE.max_in_flight, STATE.in_flight)
        try:
            for i in range(n):
                await asyncio.sleep(TOKEN_SLEEP_S)
                yield chunk(i)
                if error_chunk and i == 0:
                    yield "data: " + json.dumps({"error": {"message": "engine died", "code": 500}}) + "\n\n"
                    return
            if not STATE.no_usage:
                usage = {"prompt_tokens": 7, "completion_tokens": n, "total_tokens": 7 + n}
                yield "data: " + json.dumps({"id": "c", "choices": [], "usage": usage}) + "\n\n"
            yield "data: [DONE]\n\n"
        finally:
            with STATE.lock:
                STATE.in_flight -= 1

    return StreamingResponse(stream(), media_type="text/event-stream")


APP = Starlette(routes=[
    Route("/v1/models", models),
    Route("/v1/completions", completions, methods=["POST"]),
    Route("/v1/chat/completions", completions, methods=["POST"]),
])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server_url():
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(APP, host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "fake server did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=5)


@pytest.fixture(autouse=True)
def _fresh_state(monkeypatch):
    global STATE
    STATE = FakeState()
    for name in ("STRATA_API_KEY", "OPENAI_API_KEY"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(None)


def _cfg(url: str, **kw) -> ServeBenchConfig:
    base = dict(num_prompts=8, input_len=(4, 12), output_len=(2, 6), seed=1, progress=False)
    return ServeBenchConfig(url=url, **(base | kw))


def test_all_requests_complete_with_their_token_counts(server_url, tok):
    res = benchmark(_cfg(server_url + "/v1/", num_prompts=12), tok)
    assert res.model == MODEL and res.url == server_url
    assert (res.completed, res.failed, res.errors) == (12, 0, {})
    assert len(STATE.bodies) == 12
    for rec in res.records:
        assert rec.success and rec.error is None and rec.usage_reported
        assert rec.output_tokens == rec.text_chunks == rec.output_len
        assert rec.prompt_tokens == 7  # from usage
        assert len(rec.itl_s) == rec.output_len - 1
        assert 0 < rec.ttft_s <= rec.latency_s
        assert rec.tpot_s == pytest.approx((rec.latency_s - rec.ttft_s) / (rec.output_len - 1))
    assert res.total_output_tokens == sum(r.output_len for r in res.records)
    assert res.total_input_tokens == 7 * 12
    assert res.output_throughput == pytest.approx(res.total_output_tokens / res.duration_s)
    assert res.request_throughput == pytest.approx(12 / res.duration_s)
    assert res.total_token_throughput == pytest.approx((res.total_output_tokens + 7 * 12) / res.duration_s)
    for stats in (res.ttft_ms, res.tpot_ms, res.itl_ms, res.e2e_ms):
        assert 0 < stats["p50"] <= stats["p90"] <= stats["p99"] and stats["mean"] > 0
    assert res.ttft_ms["mean"] >= TOKEN_SLEEP_S * 1e3 * 0.5  # the server sleeps before every chunk
    assert 1 <= res.max_concurrency_observed <= 12
    assert res.goodput is None and res.good_requests is None
    # what was sent
    plan = plan_requests(_cfg(server_url, num_prompts=12), tok)
    by_prompt = {b["prompt"]: b for b in STATE.bodies}
    for p in plan:
        b = by_prompt[p.prompt]
        assert b["model"] == MODEL and b["max_tokens"] == p.output_len
        assert b["stream"] is True and b["ignore_eos"] is True and b["temperature"] == 0
        assert b["stream_options"] == {"include_usage": True}


def test_chat_endpoint_without_usage_counts_chunks(server_url, tok):
    STATE.no_usage = True
    res = benchmark(_cfg(server_url, endpoint="chat", num_prompts=4), tok)
    assert res.completed == 4
    for rec in res.records:
        assert not rec.usage_reported
        assert rec.output_tokens == rec.output_len  # counted from content chunks
        assert rec.prompt_tokens == rec.prompt_len  # planned length
    assert all(b["messages"][0]["role"] == "user" and "prompt" not in b for b in STATE.bodies)


def test_plan_is_seeded_and_follows_the_flags(tok):
    cfg = _cfg("http://x", num_prompts=30, request_rate=5.0, input_len=(10, 20), output_len=(3, 9))
    a, b = plan_requests(cfg, tok), plan_requests(cfg, tok)
    assert a == b
    assert plan_requests(_cfg("http://x", num_prompts=30, request_rate=5.0, seed=2), tok) != a
    assert all(10 <= p.prompt_len <= 20 and 3 <= p.output_len <= 9 for p in a)
    assert len({p.prompt_len for p in a}) > 1 and len({p.output_len for p in a}) > 1
    for p in a:
        ids = tok.encode(p.prompt, add_special_tokens=False)
        assert 0 < len(ids) <= p.prompt_len
        assert not set(ids) & tok.all_special_ids and "\ufffd" not in p.prompt
        assert all(c.isprintable() or c.isspace() for c in p.prompt)
    # the rate changes arrivals only, not the prompts
    other = plan_requests(_cfg("http://x", num_prompts=30, request_rate=50.0, input_len=(10, 20),
                               output_len=(3, 9)), tok)
    assert [p.prompt for p in other] == [p.prompt for p in a]
    assert [p.arrival_s for p in other] != [p.arrival_s for p in a]
    inf = plan_requests(_cfg("http://x", num_prompts=5), tok)
    assert [p.arrival_s for p in inf] == [0.0] * 5


@pytest.mark.parametrize("burstiness, cv", [(1.0, 1.0), (0.25, 2.0), (16.0, 0.25)])
def test_arrival_gaps_are_gamma_with_mean_one_over_rate(tok, burstiness, cv):
    cfg = _cfg("http://x", num_prompts=4000, input_len=(1, 1), output_len=(1, 1),
               request_rate=10.0, burstiness=burstiness)
    arrivals = np.array([p.arrival_s for p in plan_requests(cfg, tok)])
    gaps = np.diff(arrivals)
    assert arrivals[0] == 0 and (gaps >= 0).all()
    assert gaps.mean() == pytest.approx(0.1, rel=0.1)
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.15)  # CV of gamma = 1 / sqrt(shape)


def test_request_rate_paces_the_run(server_url, tok):
    # near-constant gaps (burstiness 100) of 1/20 s: 10 requests span ~0.45 s plus one request
    res = benchmark(_cfg(server_url, num_prompts=10, request_rate=20.0, burstiness=100.0,
                         output_len=(2, 2)), tok)
    assert res.completed == 10
    assert 0.35 <= res.duration_s <= 3.0
    starts = [r.start_s for r in sorted(res.records, key=lambda r: r.index)]
    assert starts == sorted(starts)
    for r in res.records:
        assert r.start_s >= r.arrival_s - 1e-3  # never sent before its time


def test_max_concurrency_is_never_exceeded(server_url, tok):
    res = benchmark(_cfg(server_url, num_prompts=12, max_concurrency=3, output_len=(6, 8)), tok)
    assert res.completed == 12
    assert 2 <= STATE.max_in_flight <= 3
    assert 2 <= res.max_concurrency_observed <= 3


def test_failures_are_counted_and_reported_not_raised(server_url, tok, capsys):
    from strata.bench.serve import print_result

    STATE.fail = lambda body: 500 if body["max_tokens"] == 2 else None
    STATE.error_chunk = lambda body: body["max_tokens"] == 3
    res = benchmark(_cfg(server_url, num_prompts=16, output_len=(2, 5)), tok)
    n500 = sum(r.output_len == 2 for r in res.records)
    nchunk = sum(r.output_len == 3 for r in res.records)
    assert n500 > 0 and nchunk > 0
    assert res.failed == n500 + nchunk and res.completed == 16 - res.failed
    assert res.errors == {"HTTP 500: {\"error\":{\"message\":\"planned failure 500\"}}": n500,
                          "error in stream: engine died": nchunk}
    for r in res.records:
        assert r.success == (r.output_len > 3)
        assert (r.error is None) == r.success
    ok = [r for r in res.records if r.success]
    assert res.total_output_tokens == sum(r.output_len for r in ok)
    print_result(res)
    out = capsys.readouterr().out
    assert f"{res.failed} requests failed" in out and "planned failure 500" in out and "engine died" in out


def test_slo_goodput(server_url, tok):
    tight = benchmark(_cfg(server_url, slo_ttft_ms=1e-3), tok)
    assert tight.completed == 8 and tight.good_requests == 0 and tight.goodput == 0
    loose = benchmark(_cfg(server_url, slo_ttft_ms=60_000, slo_tpot_ms=60_000), tok)
    assert loose.good_requests == 8 and loose.goodput == pytest.approx(8 / loose.duration_s)
    tpot_only = benchmark(_cfg(server_url, slo_tpot_ms=1e-3), tok)
    assert tpot_only.good_requests == 0
    # the goodput counts exactly the requests within a bound between the measured values
    res = benchmark(_cfg(server_url, num_prompts=8, output_len=(2, 6)), tok)
    ttfts = sorted(r.ttft_s * 1e3 for r in res.records)
    bound = (ttfts[3] + ttfts[4]) / 2
    if ttfts[3] < ttfts[4]:
        from strata.bench.serve import summarize

        res.config.slo_ttft_ms = bound
        again = summarize(res.config, res.url, res.model, res.records, res.duration_s,
                          res.max_concurrency_observed)
        assert again.good_requests == 4


def test_api_key_from_env_and_missing_key(server_url, tok, monkeypatch):
    STATE.api_key = "sekrit"
    with pytest.raises(StrataError, match="--api-key"):
        benchmark(_cfg(server_url), tok)
    monkeypatch.setenv("OPENAI_API_KEY", "sekrit")
    assert benchmark(_cfg(server_url), tok).completed == 8
    monkeypatch.delenv("OPENAI_API_KEY")
    with pytest.raises(StrataError, match="rejected the API key"):
        benchmark(_cfg(server_url, model="m", api_key="wrong"), tok)
    # a server that checks keys on completions only: every request fails, the run still reports
    STATE.api_key, STATE.fail = None, lambda body: 401
    res = benchmark(_cfg(server_url, model="m"), tok)
    assert res.failed == 8 and res.completed == 0
    assert list(res.errors) == ['HTTP 401: {"error":{"message":"planned failure 401"}}']
    assert math.isnan(res.ttft_ms["mean"]) and res.output_throughput == 0


def test_unreachable_server_names_the_url():
    url = f"http://127.0.0.1:{_free_port()}"
    with pytest.raises(StrataError, match=r"127\.0\.0\.1.*strata serve"):
        benchmark(_cfg(url))


def test_cli_writes_json(server_url, tmp_path, capsys):
    out = tmp_path / "serve.json"
    rc = main(["bench", "serve", "--url", server_url, "--num-prompts", "6", "--request-rate", "inf",
               "--max-concurrency", "2", "--input-len", "4:8", "--output-len", "3", "--seed", "5",
               "--slo", "ttft=60000", "--no-progress", "--api-key", "k", "--json", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    for label in ("completed requests", "output token throughput tok/s", "goodput req/s (TTFT <= 60000 ms)",
                  "TTFT", "TPOT", "ITL", "e2e", "max concurrent requests", MODEL):
        assert label in printed
    data = json.loads(out.read_text())
    assert data["benchmark"] == "serve" and data["model"] == MODEL
    assert data["completed"] == 6 and data["failed"] == 0 and data["good_requests"] == 6
    assert data["total_output_tokens"] == 18
    assert data["max_concurrency_observed"] <= 2
    assert data["slo"] == {"ttft_ms": 60000.0, "tpot_ms": None}
    for key in ("duration_s", "request_throughput", "output_throughput", "total_token_throughput", "goodput"):
        assert data[key] > 0
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert set(data[key]) == {"mean", "p50", "p90", "p99"}
    cfg = data["config"]
    assert cfg["num_prompts"] == 6 and cfg["max_concurrency"] == 2 and cfg["request_rate"] is None  # inf
    assert cfg["input_len"] == [4, 8] and cfg["output_len"] == [3, 3] and cfg["seed"] == 5
    assert cfg["api_key"] is None and cfg["api_key_set"] is True  # never written out
    assert len(data["requests"]) == 6
    rec = data["requests"][0]
    for key in ("index", "success", "error", "ttft_s", "tpot_s", "itl_s", "latency_s", "output_tokens",
                "prompt_tokens", "start_s", "arrival_s"):
        assert key in rec
    assert all(r["output_tokens"] == 3 for r in data["requests"])


def test_parse_helpers():
    assert parse_rate("inf") == math.inf and parse_rate("2.5") == 2.5
    assert parse_slo("ttft=200,tpot=50") == (200.0, 50.0)
    assert parse_slo("tpot=5") == (None, 5.0) and parse_slo(None) == (None, None)
    assert server_root("127.0.0.1:8000/v1/") == "http://127.0.0.1:8000"
    assert server_root("https://h/v1") == "https://h"
    for bad in ("0", "-1", "fast", "nan"):
        with pytest.raises(StrataError, match="--request-rate"):
            parse_rate(bad)
    for bad in ("ttft", "ttft=abc", "e2e=5", "ttft=0", "ttft=1,ttft=2", "", "ttft=1;tpot=2"):
        with pytest.raises(StrataError, match="--slo"):
            parse_slo(bad)
    for bad in ("0", "9:3", "a:b", "1:2:3"):
        with pytest.raises(StrataError, match="--input-len"):
            parse_range(bad, "--input-len")
    with pytest.raises(StrataError, match="--burstiness"):
        ServeBenchConfig(url="x", burstiness=0).validate()
    with pytest.raises(StrataError, match="--max-concurrency"):
        ServeBenchConfig(url="x", max_concurrency=0).validate()


@pytest.mark.parametrize("flag, value", [("--input-len", "9:3"), ("--slo", "ttft=fast"),
                                         ("--request-rate", "zero"), ("--output-len", "0")])
def test_cli_bad_flags_fail_before_sending(flag, value, capsys):
    url = f"http://127.0.0.1:{_free_port()}"  # nothing listens: a flag error must come first
    assert main(["bench", "serve", "--url", url, "--no-progress", flag, value]) == 2
    err = capsys.readouterr().err
    assert flag in err and "cannot reach" not in err

"""The shutdown contract the chart relies on (preStop sleep, then SIGTERM, then up to
terminationGracePeriodSeconds): `strata serve` receives SIGTERM with 20 streaming requests in
flight and a drain timeout longer than they need; /ready turns 503 at once (the Service stops
sending new work), all 20 streams finish whole, and the process exits 0."""

from __future__ import annotations

import concurrent.futures as cf
import json
import signal
import time

import httpx

from tests.server.serverproc import kill_tree, start_server

STREAMS = 20
MAX_TOKENS = 256  # seconds of streaming after SIGTERM here; /ready is checked within ms of it


def _stream(url: str) -> tuple[int, str | None, int]:
    """(HTTP status, finish_reason, completion tokens from the usage chunk) of one streamed completion."""
    body = {"prompt": "Once upon a time", "max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    finish, tokens = None, -1
    with httpx.Client(timeout=300) as c, c.stream("POST", url + "/v1/completions", json=body) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return r.status_code, "error", tokens
            for ch in chunk["choices"]:
                finish = ch["finish_reason"] or finish
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
        return r.status_code, finish, tokens


def test_sigterm_with_20_streams_in_flight_drains_all_and_exits_0():
    s = start_server("--drain-timeout", "600", "--max-num-seqs", str(STREAMS))
    try:
        with cf.ThreadPoolExecutor(STREAMS) as pool:
            futures = [pool.submit(_stream, s.url) for _ in range(STREAMS)]
            deadline = time.monotonic() + 60
            while s.metric("strata_num_requests_running") < STREAMS and time.monotonic() < deadline:
                assert not any(f.done() for f in futures), [f.result() for f in futures if f.done()]
                time.sleep(0.05)
            assert s.metric("strata_num_requests_running") == STREAMS
            s.proc.send_signal(signal.SIGTERM)
            t0 = time.monotonic()
            status = None
            while time.monotonic() - t0 < 2.0:
                status = httpx.get(s.url + "/ready", timeout=2).status_code
                if status == 503:
                    break
                time.sleep(0.01)
            turned = time.monotonic() - t0
            assert status == 503, f"/ready still {status} 2 s after SIGTERM"
            still_streaming = sum(not f.done() for f in futures)
            assert still_streaming == STREAMS, "the streams finished before /ready turned: not a drain test"
            r = httpx.post(s.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}, timeout=10)
            assert r.status_code == 503  # no new work while draining
            results = [f.result(timeout=300) for f in futures]
        assert results == [(200, "length", MAX_TOKENS)] * STREAMS
        assert s.proc.wait(60) == 0
        assert turned < 2.0
    finally:
        kill_tree(s.proc)

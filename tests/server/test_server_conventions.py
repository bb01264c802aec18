"""The server as vLLM users expect it: log lines with timestamps and levels, one access line per
request (tokens, request id), X-Request-Id honoured and echoed, several --served-model-name
aliases, --chat-template, metrics with a model_name label, --disable-log-requests."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import httpx
import pytest
from starlette.testclient import TestClient

from strata.logs import LINE
from strata.server import routes_ops
from strata.server.app import build_app
from strata.server.metrics import Metrics
from strata.server.state import ServerOptions, ServerState
from tests.server.serverproc import STARTUP_TIMEOUT, Server, free_port

TEMPLATE = "{% for m in messages %}<<{{ m.role }}>> {{ m.content }} {% endfor %}<<assistant>>"
ACCESS = re.compile(r"strata\.access: \S+ (GET|POST) (\S+) (\d{3}) ([0-9.]+)ms(?: in=(\d+) out=(\d+))? id=(\S+)$")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The demo model under two names, a chat template from a file, its stderr in a file."""
    root = tmp_path_factory.mktemp("conventions")
    (root / "chat.jinja").write_text(TEMPLATE)
    log_path = root / "server.log"
    port = free_port()
    cmd = [sys.executable, "-m", "strata.cli", "serve", "--port", str(port), "--dtype", "float32",
           "--served-model-name", "demo", "shakespeare", "--chat-template", str(root / "chat.jinja"),
           "--tokenizer-workers", "1", "--max-num-seqs", "4"]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))
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


def _access_lines(server, path: str) -> list[re.Match]:
    found = [ACCESS.search(line) for line in server.log_path.read_text().splitlines()]
    return [m for m in found if m and m.group(2) == path]


def _wait_for_access(server, path: str, rid: str) -> re.Match:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for m in _access_lines(server, path):
            if m.group(7) == rid:
                return m
        time.sleep(0.05)
    raise AssertionError(f"no access line for {rid}:\n{server.log_path.read_text()[-2000:]}")


def test_request_id_is_honoured_echoed_and_logged_with_tokens(served):
    r = served.post("/v1/completions", json={"model": "shakespeare", "prompt": "To be, or not",
                                             "max_tokens": 5, "temperature": 0, "ignore_eos": True},
                    headers={"X-Request-Id": "client-42"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert r.headers["x-request-id"] == "client-42"
    assert body["id"] == "cmpl-client-42" and body["model"] == "demo"  # the alias is accepted; the first name answers
    m = _wait_for_access(served, "/v1/completions", "client-42")
    assert (m.group(1), m.group(3)) == ("POST", "200") and float(m.group(4)) > 0
    assert int(m.group(5)) == body["usage"]["prompt_tokens"] and int(m.group(6)) == 5


def test_the_same_request_id_twice_at_once_is_two_requests(served):
    import concurrent.futures as cf

    def one(_):
        return served.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 4, "temperature": 0,
                                                     "ignore_eos": True}, headers={"X-Request-Id": "dup"})

    with cf.ThreadPoolExecutor(2) as pool:
        rs = list(pool.map(one, range(2)))
    assert [r.status_code for r in rs] == [200, 200]
    assert all(r.json()["usage"]["completion_tokens"] == 4 for r in rs)


def test_without_a_request_id_one_is_minted_and_used_for_the_body(served):
    r = served.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "temperature": 0})
    rid = r.headers["x-request-id"]
    assert re.fullmatch(r"[0-9a-f]{32}", rid) and r.json()["id"] == "cmpl-" + rid
    _wait_for_access(served, "/v1/completions", rid)


def test_streaming_access_line_counts_the_streamed_tokens(served):
    with httpx.stream("POST", served.url + "/v1/chat/completions", timeout=60, headers={"X-Request-Id": "s-1"},
                      json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "stream": True,
                            "temperature": 0, "ignore_eos": True}) as r:
        assert r.status_code == 200 and r.headers["x-request-id"] == "s-1"
        chunks = [line for line in r.iter_lines() if line.startswith("data: {")]
    assert chunks and '"id": "chatcmpl-s-1"' in chunks[0].replace('":"', '": "')
    m = _wait_for_access(served, "/v1/chat/completions", "s-1")
    assert m.group(6) == "3"


def test_chat_template_flag_replaces_the_checkpoints(served):
    from strata.demo.model import demo_model_path
    from strata.protocol.tokenizer import Tokenizer

    messages = [{"role": "user", "content": "Good morrow"}]
    r = served.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1, "temperature": 0})
    assert r.status_code == 200, r.text
    tok = Tokenizer.from_dir(demo_model_path())
    ours = tok.encode("<<user>> Good morrow <<assistant>>", add_special_tokens=False)
    assert r.json()["usage"]["prompt_tokens"] == len(ours)


def test_models_lists_every_served_name_and_metrics_carry_model_name(served):
    ids = [m["id"] for m in served.get("/v1/models").json()["data"]]
    assert ids == ["demo", "shakespeare"]
    assert served.get("/v1/models/shakespeare").status_code == 200
    r = served.post("/v1/completions", json={"model": "other", "prompt": "x", "max_tokens": 1})
    assert r.status_code == 404 and "'demo' or 'shakespeare'" in r.json()["error"]["message"]
    text = served.get("/metrics").text
    assert 'strata_num_requests_running{model_name="demo"}' in text
    assert re.search(r'strata_requests_total\{endpoint="/v1/completions",model_name="demo",status="200"\}', text)


def test_every_log_line_has_a_timestamp_and_a_level(served):
    """The front end's, the engine process's and the tokenizer worker's lines alike."""
    lines = [ln for ln in served.log_path.read_text().splitlines() if ln.strip()]
    assert lines and all(LINE.match(ln) for ln in lines), [ln for ln in lines if not LINE.match(ln)][:5]
    text = "\n".join(lines)
    for summary in ("strata.server: model ", "strata.server: dtype float32", "strata.server: KV cache",
                    "strata.server: threads:", "strata.server: serving on http://127.0.0.1:"):
        assert summary in text, summary
    assert "strata.server.engine:" in text  # the engine process logs through the same format


# --- the HTTP side alone (no processes) ---------------------------------------------------------
def _client(**opts) -> TestClient:
    state = ServerState(options=ServerOptions(served_model_name="m", **opts), metrics=Metrics("m"), ready=True)
    app = build_app(state)
    routes_ops.install(app, state)
    return TestClient(app)


def test_disable_log_requests_writes_no_access_line(caplog):
    with caplog.at_level("INFO", logger="strata.access"):
        _client(log_requests=False).get("/v1/models")
        assert not [r for r in caplog.records if r.name == "strata.access"]
        _client().get("/v1/models", headers={"X-Request-Id": "abc"})
    lines = [r.getMessage() for r in caplog.records if r.name == "strata.access"]
    assert len(lines) == 1 and lines[0].endswith("GET /v1/models 200 " + lines[0].split()[-2] + " id=abc")


@pytest.mark.parametrize("bad", ["has space", "x" * 257, "tab\there"])
def test_a_bad_request_id_is_a_400_naming_the_header(bad):
    r = _client().get("/v1/models", headers={"X-Request-Id": bad})
    assert r.status_code == 400 and r.json()["error"]["param"] == "X-Request-Id"

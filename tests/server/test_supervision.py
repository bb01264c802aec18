"""A child process of `strata serve` dies: the server notices, answers 503, restarts it, serves again.

Real processes and real signals: the engine and tokenizer workers are SIGKILLed; a planted fault
(STRATA_TEST_FAULTS) makes engine restarts crash or a tokenizer input kill its worker.
"""

from __future__ import annotations

import concurrent.futures as cf
import signal
import time

import httpx
import pytest
from fastapi.testclient import TestClient

from strata.server import procs, routes_ops
from strata.server.app import build_app
from strata.server.metrics import Metrics
from strata.server.state import ServerOptions, ServerState
from tests.server.serverproc import (
    child,
    children_of,
    ipc_dirs,
    kill_tree,
    leftovers,
    start_server,
    wait_gone,
    wait_status,
)

COMPLETIONS = "/v1/completions"
BODY = {"prompt": "Once upon a time", "max_tokens": 4, "temperature": 0}
RESTART_BOUND = 120.0  # seconds for a restarted engine to load and warm up again on a busy box


def error_of(r: httpx.Response) -> dict:
    body = r.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


def completes(server) -> None:
    r = server.post(COMPLETIONS, json=BODY)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4


@pytest.fixture(scope="module")
def supervised():
    """Default layout (one tokenizer worker on this box); slow tokenisation so a job is in flight
    when its worker is killed; a planted input that kills the worker handling it."""
    s = start_server(env={"STRATA_TEST_FAULTS": "tokenize_delay=1.0,tokenizer_exit_on=POISON-PILL"})
    kids = children_of(s.proc)
    try:
        yield s
    finally:
        try:
            assert s.stop() == 0
        finally:
            kill_tree(s.proc, kids)


def test_engine_sigkill_is_503_then_restarted(supervised):
    s = supervised
    completes(s)
    engine = child(s.proc, "engine_proc")
    engine.send_signal(signal.SIGKILL)
    assert wait_status(s, "/ready", lambda c: c == 503, timeout=5) == 503
    for stream in (False, True):  # refused up front, so a stream gets a 503 status too
        r = s.post(COMPLETIONS, json={**BODY, "stream": stream})
        assert r.status_code == 503, r.text
        err = error_of(r)
        assert "engine" in err["message"] and "restart" in err["message"], err
        assert err["type"] == "service_unavailable" and r.headers["Retry-After"] == "1"
    assert s.get("/health").status_code == 200  # still recovering: live
    assert wait_status(s, "/ready", lambda c: c == 200, timeout=RESTART_BOUND) == 200
    assert child(s.proc, "engine_proc").pid != engine.pid
    completes(s)


def test_tokenizer_worker_sigkill_retries_its_job_and_respawns(supervised):
    s = supervised
    worker = child(s.proc, "tokenizer_worker")
    with cf.ThreadPoolExecutor(1) as pool:
        fut = pool.submit(s.post, COMPLETIONS, json=BODY)
        time.sleep(0.5)  # the job sleeps 1 s in the worker (tokenize_delay)
        worker.send_signal(signal.SIGKILL)
        assert wait_status(s, "/ready", lambda c: c == 503, timeout=5, poll=0.02) == 503
        r = fut.result(timeout=60)  # retried on the respawned worker, not a hang
    assert r.status_code == 200, r.text
    assert wait_status(s, "/ready", lambda c: c == 200, timeout=60) == 200
    assert child(s.proc, "tokenizer_worker").pid != worker.pid
    completes(s)


def test_input_that_kills_workers_fails_alone_with_503(supervised):
    s = supervised
    t0 = time.monotonic()
    r = s.post(COMPLETIONS, json={**BODY, "prompt": "a POISON-PILL prompt"})
    assert r.status_code == 503 and time.monotonic() - t0 < 60, r.text
    err = error_of(r)
    assert "tokenizer worker died" in err["message"], err
    assert wait_status(s, "/ready", lambda c: c == 200, timeout=60) == 200
    completes(s)


def test_engine_crash_loop_gives_up_and_exits_nonzero():
    s = start_server(env={"STRATA_TEST_FAULTS": "engine_exit_from=1"})  # every restart crashes
    kids = children_of(s.proc)
    try:
        child(s.proc, "engine_proc").send_signal(signal.SIGKILL)
        seen = set()
        deadline = time.monotonic() + 90
        while s.proc.poll() is None and time.monotonic() < deadline:
            seen.add(wait_status(s, "/health", lambda c: True, timeout=1))
            time.sleep(0.05)
        assert s.proc.poll() == 1
        assert {200, 503} <= seen <= {200, 503, 0}, seen  # live while retrying; 503 once given up
        assert wait_gone(kids, 10) == [] and leftovers(s.proc.pid) == []
        assert ipc_dirs(s.proc.pid) == []
    finally:
        kill_tree(s.proc, kids)


# --- the HTTP side alone (no processes) ---------------------------------------------------------
class _Down:
    outage = "the engine process died (killed by SIGKILL) and is restarting (restart 1 of 3)"


def _app(**state_fields) -> TestClient:
    state = ServerState(options=ServerOptions(served_model_name="m"), metrics=Metrics(), ready=True)
    for k, v in state_fields.items():
        setattr(state, k, v)
    app = build_app(state)
    routes_ops.install(app, state)
    return TestClient(app)


def test_health_is_503_only_once_the_server_gave_up():
    assert _app(engine=_Down()).get("/health").status_code == 200
    r = _app(failed="the engine process died 4 times").get("/health")
    assert r.status_code == 503 and "died 4 times" in error_of(r)["message"]


def test_outage_gate_names_the_outage():
    c = _app(engine=_Down())
    assert c.get("/ready").status_code == 503
    r = c.post(COMPLETIONS, json=BODY)
    assert r.status_code == 503 and error_of(r)["message"] == _Down.outage
    assert c.get("/v1/models").status_code == 200


def test_restart_policy_backs_off_then_gives_up():
    p = procs.RestartPolicy(max_restarts=3, window=300, backoff=0.5)
    assert [p.next_delay() for _ in range(4)] == [0.5, 1.0, 2.0, None]


def _tp_ranks(proc) -> list:
    return [k for k in children_of(proc, want=3) if "strata.engine.tp_worker" in " ".join(k.cmdline())]


def test_tensor_parallel_rank_sigkill_restarts_the_engine():
    """A TP rank dies under the server: the request that finds it dead fails with an error (no
    hang), the engine process exits and is restarted with fresh ranks, and serving resumes."""
    s = start_server("--tensor-parallel-size", "2", "--comm-timeout", "30")
    kids = children_of(s.proc, want=3)
    try:
        completes(s)
        (rank1,) = _tp_ranks(s.proc)
        rank1.send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        r = s.post(COMPLETIONS, json=BODY)
        assert r.status_code in (500, 503) and time.monotonic() - t0 < 60, r.text
        assert wait_status(s, "/ready", lambda c: c == 200, timeout=RESTART_BOUND) == 200
        completes(s)
        (new_rank1,) = _tp_ranks(s.proc)
        assert new_rank1.pid != rank1.pid
        assert not wait_gone([rank1], timeout=10)
    finally:
        try:
            assert s.stop() == 0
        finally:
            kill_tree(s.proc, kids)

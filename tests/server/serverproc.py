"""A real `strata serve` on loopback, started as a subprocess, for the server tests.

A plain module, not conftest.py: a second conftest module would shadow tests/conftest.py for
the tests that `from conftest import ...`."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

import httpx
import pytest

STARTUP_TIMEOUT = 180.0


def without_model_label(text: str) -> str:
    """/metrics text with the model_name label (on every series, as vLLM's) taken out, so tests can
    match the other labels exactly: {endpoint="/v1/completions",model_name="m",status="200"} ->
    {endpoint="/v1/completions",status="200"}."""
    return re.sub(r'model_name="[^"]*",?', "", text).replace(",}", "}").replace("{}", "")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    proc: subprocess.Popen
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def get(self, path: str, **kw) -> httpx.Response:
        return httpx.get(self.url + path, timeout=30, **kw)

    def post(self, path: str, **kw) -> httpx.Response:
        return httpx.post(self.url + path, timeout=60, **kw)

    def metric(self, name: str, headers: dict | None = None) -> float:
        for line in self.get("/metrics", headers=headers).text.splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(name)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise


def start_server(*args: str, env: dict | None = None, wait_ready: bool = True) -> Server:
    port = free_port()
    cmd = [sys.executable, "-m", "strata.cli", "serve", "--port", str(port), "--dtype", "float32", *args]
    proc = subprocess.Popen(cmd, env={**os.environ, **(env or {})})
    server = Server(proc, port)
    if not wait_ready:
        return server
    deadline = time.monotonic() + STARTUP_TIMEOUT
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited during start-up with code {proc.returncode}")
        try:
            if httpx.get(server.url + "/ready", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("server not ready in time")


@pytest.fixture(scope="module")
def server():
    """The demo model in fp32 with a small body limit and a planted fault for the 500 path."""
    s = start_server("--max-request-bytes", "64KiB", env={"STRATA_TEST_FAULTS": "raise_on=PLANTED-FAULT"})
    yield s
    s.stop()


@pytest.fixture(scope="module")
def offline():
    """The same model offline, the reference for the server's greedy text."""
    from strata import LLM

    return LLM(None, dtype="float32")


# --- process trees: the server's children, what is left of them, its IPC directory --------------
def children_of(proc: subprocess.Popen, want: int = 2, timeout: float = 60) -> list:
    """The server's child processes (psutil), once `want` of them exist."""
    import psutil

    deadline = time.monotonic() + timeout
    while True:
        try:
            kids = psutil.Process(proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            kids = []
        if len(kids) >= want or time.monotonic() > deadline or proc.poll() is not None:
            return kids
        time.sleep(0.05)


def child(proc: subprocess.Popen, module: str):
    """The one child running `python -m strata.server.<module>`."""
    kids = [k for k in children_of(proc) if f"strata.server.{module}" in " ".join(k.cmdline())]
    assert len(kids) == 1, kids
    return kids[0]


def ipc_dirs(server_pid: int) -> list[str]:
    import glob
    import tempfile

    return glob.glob(os.path.join(tempfile.gettempdir(), f"strata-{server_pid}-*"))


def leftovers(server_pid: int) -> list:
    """Live (non-zombie) processes started by that server: their command lines name its IPC directory."""
    import psutil

    mark = f"strata-{server_pid}-"
    out = []
    for p in psutil.process_iter(["cmdline", "status"]):
        if mark in " ".join(p.info["cmdline"] or []) and p.info["status"] != psutil.STATUS_ZOMBIE:
            out.append(p)
    return out


def wait_gone(procs: list, timeout: float) -> list:
    """Wait up to `timeout` for the psutil processes to exit; the ones still alive (zombies count as gone)."""
    import psutil

    deadline = time.monotonic() + timeout
    alive = list(procs)
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        time.sleep(0.05)
    return alive


def kill_tree(proc: subprocess.Popen, kids: list = ()) -> None:
    """Teardown whatever happened: SIGKILL the server and every child still alive, and reap them."""
    import psutil

    kids = list(kids)
    with contextlib.suppress(psutil.Error):
        kids += psutil.Process(proc.pid).children(recursive=True)
    if proc.poll() is None:
        proc.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(30)
    kids = kids + leftovers(proc.pid)
    for k in kids:
        with contextlib.suppress(psutil.Error):
            k.kill()
    psutil.wait_procs(kids, timeout=10)


def wait_status(server: Server, path: str, ok, timeout: float, poll: float = 0.1) -> int:
    """Poll GET `path` until `ok(status)` (a connection error counts as status 0); the last status."""
    deadline = time.monotonic() + timeout
    status = -1
    while time.monotonic() < deadline:
        try:
            status = httpx.get(server.url + path, timeout=5).status_code
        except httpx.HTTPError:
            status = 0
        if ok(status):
            return status
        time.sleep(poll)
    return status

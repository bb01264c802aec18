"""A real `strata serve` on loopback, started as a subprocess, for the server tests.

A plain module, not conftest.py: a second conftest module would shadow tests/conftest.py for
the tests that `from conftest import ...`."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

import httpx
import pytest

STARTUP_TIMEOUT = 180.0


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

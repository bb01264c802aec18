"""How `strata serve` and `strata generate` start and stop as processes: a port in use, the server
SIGKILLed, Ctrl-C during load or while streaming. Real subprocesses and real signals; every process
started here is reaped, whatever the outcome."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from strata.logs import LINE
from tests.server.serverproc import (
    children_of,
    free_port,
    ipc_dirs,
    kill_tree,
    leftovers,
    start_server,
    wait_gone,
    wait_status,
)

SERVE = [sys.executable, "-m", "strata.cli", "serve", "--dtype", "float32"]
GENERATE = [sys.executable, "-m", "strata.cli", "generate", "--random-model", "smol-135m",
            "--kv-cache-memory", "64MiB", "--max-model-len", "1024", "--swap-space", "16MiB"]


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class Captured:
    """A subprocess whose stdout and stderr are read as they come (threads), to wait for markers."""

    def __init__(self, cmd: list[str], env: dict | None = None) -> None:
        # its own session, so os.killpg sends what a terminal's Ctrl-C sends to the foreground group;
        # and SIGINT at its default, as under a terminal: a test run started where SIGINT is ignored
        # (a shell's background job) would pass that on, and a Python started so keeps ignoring it
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                                     env={**os.environ, **(env or {})}, preexec_fn=_default_sigint)
        self.out, self.err = bytearray(), bytearray()
        self._threads = [threading.Thread(target=self._pump, args=(s, b), daemon=True)
                         for s, b in ((self.proc.stdout, self.out), (self.proc.stderr, self.err))]
        for t in self._threads:
            t.start()

    @staticmethod
    def _pump(stream, buf: bytearray) -> None:
        while chunk := os.read(stream.fileno(), 4096):
            buf += chunk

    def wait_for(self, pred, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            if pred():
                return True
            time.sleep(0.01)
        return pred()

    def interrupt(self) -> None:
        os.killpg(self.proc.pid, signal.SIGINT)

    def finish(self, timeout: float) -> tuple[int, str, str]:
        rc = self.proc.wait(timeout)
        for t in self._threads:
            t.join(10)
        return rc, self.out.decode(errors="replace"), self.err.decode(errors="replace")


def _listening() -> tuple[socket.socket, int]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock, sock.getsockname()[1]


@pytest.mark.parametrize("faults", ["", "skip_port_check=1"], ids=["checked-first", "lost-late"])
def test_port_in_use_is_one_line_and_leaves_nothing(faults):
    """Checked before any child starts; and if the port is lost later (the check skipped, so
    uvicorn's own bind fails after the children started), torn down the same way."""
    holder, port = _listening()
    try:
        c = Captured([*SERVE, "--port", str(port)], env={"STRATA_TEST_FAULTS": faults})
        try:
            rc, _, err = c.finish(120)
        finally:
            kill_tree(c.proc)
    finally:
        holder.close()
    # serve logs its start-up at INFO (a port lost late comes after the first lines): the rest is one line
    lines = [ln for ln in err.strip().splitlines() if not (LINE.match(ln) and " INFO " in ln)]
    assert rc == 2 and len(lines) == 1, err
    assert f"port {port}" in lines[0] and "--port N" in lines[0] and "already in use" in lines[0]
    assert leftovers(c.proc.pid) == [] and ipc_dirs(c.proc.pid) == []


def test_server_sigkill_takes_its_children_and_next_start_cleans_ipc():
    s = start_server()
    kids = children_of(s.proc)
    second = None
    try:
        assert len(kids) == 2
        stale = ipc_dirs(s.proc.pid)
        assert len(stale) == 1
        s.proc.kill()
        s.proc.wait(30)
        assert os.path.isdir(stale[0])  # nobody could clean it up
        assert wait_gone(kids, 10) == [], "children outlived their server"
        second = start_server(wait_ready=False)
        deadline = time.monotonic() + 60
        while os.path.exists(stale[0]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not os.path.exists(stale[0]), "the next start did not remove the dead server's IPC directory"
    finally:
        kill_tree(s.proc, kids)
        if second is not None:
            second.stop()
            kill_tree(second.proc)


def test_sigint_during_serve_load_stops_children_without_traceback():
    """Ctrl-C while the engine loads: children stopped, no traceback, exit 130 (SIGINT; SIGTERM is 0)."""
    port = free_port()
    c = Captured([*SERVE, "--port", str(port)], env={"STRATA_TEST_FAULTS": "engine_start_delay=60"})
    kids = []
    try:
        kids = children_of(c.proc)
        assert len(kids) == 2, c.err.decode()
        time.sleep(0.5)
        s = type("S", (), {"url": f"http://127.0.0.1:{port}"})()
        assert wait_status(s, "/ready", lambda st: st == 503, timeout=5) == 503  # still loading
        c.interrupt()
        rc, _, err = c.finish(60)
        assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
        assert rc == 130, err
        assert err.strip().splitlines()[-1].endswith("SIGINT during start-up: stopping"), err
        assert wait_gone(kids, 5) == [] and leftovers(c.proc.pid) == [] and ipc_dirs(c.proc.pid) == []
    finally:
        kill_tree(c.proc, kids)


def test_sigint_while_generate_streams_ends_the_line():
    prompt = "Once upon a time"
    c = Captured([*GENERATE, "--prompt", prompt, "--max-tokens", "1000", "--ignore-eos"])
    try:
        assert c.wait_for(lambda: len(c.out) > len(prompt) + 20, timeout=120), c.err.decode()
        c.interrupt()
        rc, out, err = c.finish(60)
    finally:
        kill_tree(c.proc)
    assert rc == 130, err
    said = [ln for ln in err.strip().splitlines() if not ln.startswith("note: ")]  # the model's note
    assert "Traceback" not in err and said == ["interrupted"], err
    assert out.startswith(prompt) and out.endswith("\n"), out[-80:]


def test_sigint_during_generate_load_is_one_line():
    c = Captured([sys.executable, "-m", "strata.cli", "-v", *GENERATE[3:], "--prompt", "Hi"])
    try:
        # the first log line of the load: imports are done, the checkpoint is about to be read
        assert c.wait_for(lambda: b" INFO    strata." in c.err, timeout=120), c.err.decode()
        c.interrupt()
        rc, _, err = c.finish(60)
    finally:
        kill_tree(c.proc)
    assert rc == 130, err
    assert "Traceback" not in err, err
    said = [ln for ln in err.splitlines() if not (LINE.match(ln) and " INFO " in ln)]
    assert [ln for ln in said if not ln.startswith("note: ")] == ["interrupted"], err  # + the model's note


@pytest.mark.parametrize("delay", [0.05, 0.3, 0.8])
def test_sigint_while_the_command_starts_is_one_line(delay):
    """Ctrl-C whenever it comes during start-up (torch still importing, or the model loading): the
    `strata` command (strata/__main__.py) answers one line and exit 130, never a traceback."""
    c = Captured([sys.executable, "-m", "strata", *GENERATE[3:], "--prompt", "Hi"])
    try:
        time.sleep(delay)
        c.interrupt()
        rc, _, err = c.finish(60)
    finally:
        kill_tree(c.proc)
    assert rc == 130, err
    assert "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == "interrupted", err

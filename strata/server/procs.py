"""Child processes of the server: started with plain command lines (no pickled state), stopped
together, bound to their parent's life, and restarted within a budget.

- `spawn` starts `python -m module` in a session of its own, so a terminal's Ctrl-C reaches only
  the front end (which stops the children itself) and never prints a child's traceback.
- A child calls `die_with_parent()` first thing: on Linux PR_SET_PDEATHSIG (SIGKILL when the
  front end's thread that spawned it dies, so spawn from the event loop's thread), then getppid()
  is checked to close the race with a parent that died before prctl ran, and, everywhere, a
  daemon thread polls getppid() as the portable fallback. A SIGKILLed server leaves no children.
- `IpcDir` names its directory after the owner's pid (`strata-<pid>-*`); `clean_stale()` at the
  next start removes those whose owner is gone (a SIGKILLed server cannot clean up itself).
- `listen_socket` binds the HTTP port before any child exists and hands uvicorn the bound socket:
  a port in use is one line and no processes, and nobody can take the port in between.
- `RestartPolicy`: at most N restarts within a sliding window, with exponential backoff.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import deque
from pathlib import Path

from strata.errors import StrataError
from strata.hardware import processes

PARENT_ENV = processes.PARENT_ENV
_STALE = re.compile(r"^strata-(\d+)-")


class ChildUnavailable(StrataError):
    """A child process the request needs is down (dead, restarting): HTTP 503, retry later."""

    status = 503


class IpcDir:
    """A private directory for this server's ZeroMQ ipc:// sockets, named after our pid."""

    def __init__(self, root: str | None = None) -> None:
        self.path = Path(tempfile.mkdtemp(prefix=f"strata-{os.getpid()}-", dir=root))

    def address(self, name: str) -> str:
        return f"ipc://{self.path / name}"

    def cleanup(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)

    @staticmethod
    def clean_stale(root: str | None = None) -> list[Path]:
        """Remove the IPC directories of servers that are gone (pid no longer alive)."""
        removed = []
        base = Path(root or tempfile.gettempdir())
        with contextlib.suppress(OSError):
            for d in base.iterdir():
                m = _STALE.match(d.name)
                if m is None or not d.is_dir() or d.stat().st_uid != os.getuid():
                    continue
                if owner_alive(int(m.group(1)), d.stat().st_mtime):
                    continue
                shutil.rmtree(d, ignore_errors=True)
                removed.append(d)
        return removed


def owner_alive(pid: int, made: float) -> bool:
    """Whether process `pid` lives and is old enough to have made a directory at time `made`
    (a reused pid belongs to a younger process)."""
    import psutil

    try:
        return psutil.Process(pid).create_time() <= made + 1.0
    except psutil.NoSuchProcess:
        return False
    except psutil.Error:
        return True  # cannot tell: keep it


def spawn(module: str, *args: str) -> subprocess.Popen:
    """`python -m module args...` with this interpreter, sharing our stderr for its logs.

    Its own session (setsid, no preexec_fn): the terminal's SIGINT goes to the front end only.
    Call from the event loop's (main) thread: PR_SET_PDEATHSIG follows the spawning thread."""
    env = {**os.environ, PARENT_ENV: str(os.getpid())}
    return subprocess.Popen([sys.executable, "-m", module, *args], env=env, stdin=subprocess.DEVNULL,
                            start_new_session=True)


def stop(procs: list[subprocess.Popen], timeout: float = 5.0) -> None:
    """SIGTERM each live process, wait up to `timeout` for all, SIGKILL the rest; all are reaped."""
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                p.terminate()
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                p.kill()
            p.wait()


def describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


# --- the child's side: hardware/processes.py (engine ranks use it too) ---------------------------
die_with_parent = processes.die_with_parent


# --- the HTTP port ------------------------------------------------------------------------------
def listen_socket(host: str, port: int) -> socket.socket:
    """The bound (not yet listening) TCP socket uvicorn will serve on; one-line StrataError if not."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        raise StrataError(f"cannot listen on {host}:{port}: {e.strerror} (check --host)") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as asyncio/uvicorn bind
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise port_error(host, port, e) from None
    sock.set_inheritable(False)
    return sock


def port_error(host: str, port: int, e: OSError) -> StrataError:
    import errno

    if e.errno == errno.EADDRINUSE:
        free = next((p for p in range(port + 1, min(port + 20, 65536)) if _bindable(host, p)), None)
        hint = f" (--port {free} is free)" if free is not None else ""
        return StrataError(f"port {port} on {host} is already in use (another server?): start with --port N "
                           f"for a free port{hint}, or stop the process listening on {host}:{port}")
    return StrataError(f"cannot listen on {host}:{port}: {e.strerror or e} (check --host and --port)")


def _bindable(host: str, port: int) -> bool:
    try:
        listen_socket(host, port).close()
    except StrataError:
        return False
    return True


# --- restarts -----------------------------------------------------------------------------------
class RestartPolicy:
    """At most `max_restarts` restarts within `window` seconds; the k-th waits base * 2**k (capped)."""

    def __init__(self, max_restarts: int, window: float, backoff: float, max_backoff: float = 8.0) -> None:
        self.max_restarts, self.window = max_restarts, window
        self.backoff, self.max_backoff = backoff, max_backoff
        self.times: deque[float] = deque()

    def _recent(self, now: float) -> int:
        while self.times and now - self.times[0] > self.window:
            self.times.popleft()
        return len(self.times)

    def next_delay(self) -> float | None:
        """Seconds to wait before the next restart (and count it), or None: the budget is spent."""
        now = time.monotonic()
        k = self._recent(now)
        if k >= self.max_restarts:
            return None
        self.times.append(now)
        return min(self.backoff * 2 ** k, self.max_backoff)

    @property
    def used(self) -> int:
        return self._recent(time.monotonic())

    def describe(self) -> str:
        return f"{self.max_restarts} restarts within {self.window:.0f}s"

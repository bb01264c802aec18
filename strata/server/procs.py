"""Child processes of the server: started with plain command lines (no pickled state), stopped
together, and watched so a crash is reported instead of hanging requests."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path


class IpcDir:
    """A private directory for this server's ZeroMQ ipc:// sockets."""

    def __init__(self) -> None:
        self.path = Path(tempfile.mkdtemp(prefix="strata-"))

    def address(self, name: str) -> str:
        return f"ipc://{self.path / name}"

    def cleanup(self) -> None:
        for f in self.path.glob("*"):
            f.unlink(missing_ok=True)
        self.path.rmdir()


def spawn(module: str, *args: str) -> subprocess.Popen:
    """`python -m module args...` with this interpreter, sharing our stderr for its logs."""
    env = dict(os.environ)
    return subprocess.Popen([sys.executable, "-m", module, *args], env=env, stdin=subprocess.DEVNULL)


def stop(procs: list[subprocess.Popen], timeout: float = 5.0) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()

"""Child processes that live and die with their parent (server children, tensor-parallel ranks).

A parent puts its pid in the child's environment (PARENT_ENV); the child calls
`die_with_parent()` first thing: on Linux PR_SET_PDEATHSIG (SIGKILL when the parent's spawning
thread dies), then getppid() is checked to close the race with a parent that died before prctl
ran, and, everywhere, a daemon thread polls getppid() as the portable fallback.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
import time

from strata.settings import SETTINGS

PARENT_ENV = "STRATA_PARENT_PID"
PR_SET_PDEATHSIG = 1


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment for a child that must die with it."""
    return {**os.environ, PARENT_ENV: str(os.getpid()), **(extra or {})}


def die_with_parent(poll_seconds: float = 0.5) -> None:
    """In a child: exit as soon as the process that spawned us (PARENT_ENV) is gone."""
    parent = SETTINGS.parent_pid
    if parent is None:
        return  # started by hand (or by torchrun), not by a Strata parent
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)

    def watch() -> None:
        while True:
            time.sleep(poll_seconds)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()

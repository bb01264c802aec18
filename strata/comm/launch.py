"""Start the ranks of a local world as subprocesses and reap them.

Each rank is a plain command line (`python -m MODULE ...` or `python SCRIPT ...`, never
multiprocessing with pickled state) in its own session, given the torchrun-style environment of
its rank (world.World.env) on a loopback rendezvous. `LocalRanks` is a context manager: on the
way out, normal or not, every rank still running is killed (its whole process group) and waited
for, so a failed test or an interrupted benchmark leaves no process behind.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from strata.comm.world import World, local_world


class RanksFailed(RuntimeError):
    """A rank exited non-zero or the ranks ran past their timeout (the message has their logs)."""


class LocalRanks:
    def __init__(self, world_size: int, argv: list[str], *, env: dict[str, str] | None = None,
                 threads_per_rank: int | None = None, world: World | None = None) -> None:
        self.world = world or local_world(world_size)
        self.argv = list(argv)
        self.env = dict(env or {})
        self.threads = threads_per_rank or max(1, (os.cpu_count() or 1) // world_size)
        self.procs: list[subprocess.Popen] = []
        self._logdir = tempfile.TemporaryDirectory(prefix="strata-ranks-")
        self.returncodes: list[int | None] = []

    def log_path(self, rank: int) -> Path:
        return Path(self._logdir.name) / f"rank{rank}.log"

    def output(self, rank: int) -> str:
        try:
            return self.log_path(rank).read_text(errors="replace")
        except OSError:
            return ""

    def start(self) -> LocalRanks:
        for r in range(self.world.world_size):
            env = {**os.environ, **self.env, **self.world.with_rank(r).env(),
                   "OMP_NUM_THREADS": str(self.threads), "STRATA_RANK_THREADS": str(self.threads)}
            with open(self.log_path(r), "wb") as log:
                self.procs.append(subprocess.Popen(
                    [sys.executable, *self.argv], env=env, stdout=log, stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL, start_new_session=True))
        return self

    def wait(self, timeout_s: float, grace_s: float = 10.0) -> list[int]:
        """Wait for every rank; once one fails the others get `grace_s` to exit (report their
        own error) before they are killed. Raises RanksFailed on a failure or the timeout."""
        deadline = time.monotonic() + timeout_s
        failed_at = None
        while True:
            rcs = [p.poll() for p in self.procs]
            if all(rc is not None for rc in rcs):
                break
            now = time.monotonic()
            if failed_at is None and any(rc not in (None, 0) for rc in rcs):
                failed_at = now
            if now > deadline or (failed_at is not None and now - failed_at > grace_s):
                self.kill()
                rcs = [p.returncode for p in self.procs]
                self.returncodes = rcs
                raise RanksFailed(self._report("timed out" if now > deadline else "a rank failed", rcs))
            time.sleep(0.02)
        self.returncodes = rcs
        if any(rcs):
            raise RanksFailed(self._report("a rank failed", rcs))
        return rcs

    def _report(self, what: str, rcs: list[int | None]) -> str:
        lines = [f"{what}: {' '.join(self.argv)} (exit codes {rcs})"]
        for r in range(len(self.procs)):
            tail = self.output(r).strip().splitlines()[-15:]
            lines += [f"--- rank {r}:"] + tail
        return "\n".join(lines)

    def kill(self) -> None:
        """SIGKILL every rank's process group still running, then reap each rank."""
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)

    def __enter__(self) -> LocalRanks:
        return self.start()

    def __exit__(self, *exc) -> None:
        try:
            self.kill()
        finally:
            self._logdir.cleanup()

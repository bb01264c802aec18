"""Helpers of the comm tests: run comm_rank_prog.py as N local ranks (launch.LocalRanks: loopback,
every process reaped), the /dev/shm files a run left, a SIGALRM bound on a test."""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path

import pytest

from strata.comm.launch import LocalRanks, RanksFailed
from strata.comm.shm import PREFIX, SHM_DIR

PROG = str(Path(__file__).with_name("comm_rank_prog.py"))


def shm_files() -> set[str]:
    return {n for n in os.listdir(SHM_DIR) if n.startswith(PREFIX)}


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@contextlib.contextmanager
def bounded(seconds: int):
    """Fail the test (TimeoutError) if its body runs past `seconds`."""
    def boom(*_):
        raise TimeoutError(f"test ran past its {seconds} s bound")

    old = signal.signal(signal.SIGALRM, boom)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def ranks(n: int, mode: str, env: dict[str, str] | None = None) -> LocalRanks:
    return LocalRanks(n, [PROG, mode], env=env, threads_per_rank=1)


def run_ranks(n: int, mode: str, timeout_s: float, env: dict | None = None) -> list[str]:
    """Run `mode` on n ranks to completion; their outputs. Fails the test if a rank fails, one
    is left running or a shared-memory file is left behind."""
    before = shm_files()
    with ranks(n, mode, env) as rk:
        pids = [p.pid for p in rk.procs]
        try:
            rk.wait(timeout_s)
        except RanksFailed as e:
            pytest.fail(str(e))
        outs = [rk.output(r) for r in range(n)]
    assert all(gone(p) for p in pids)
    assert shm_files() - before == set(), "a shared-memory file was left behind"
    return outs

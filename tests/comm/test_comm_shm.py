"""The shared-memory all-reduce and all-to-all between real ranks (subprocesses on loopback, always
reaped): equal to gloo's (all-to-all: to a reference), the compressed variant's error, and a rank
that dies or stalls mid-collective."""

from __future__ import annotations

import json
import os
import re
import time

import pytest
from comm_ranks import bounded, gone, ranks, run_ranks, shm_files


def test_shm_equals_gloo_two_ranks() -> None:
    with bounded(240):
        outs = run_ranks(2, "equal", 200)
    for out in outs:
        assert "shm on" in out
        for what in ("torch.float32 16777216 == gloo", "torch.float32 65537 == gloo", "torch.float32 1 == gloo",
                     "torch.bfloat16 131075 == gloo", "torch.float16 2097153 == gloo", "torch.int32 65545",
                     "OK non-contiguous -> gloo", "OK cost model choice"):
            assert what in out, (what, out[-2000:])


def test_three_ranks_agree_and_match_exact_sum() -> None:
    with bounded(240):
        outs = run_ranks(3, "equal", 200)
    assert all("OK cost model choice" in o and "close to exact" in o for o in outs)
    assert "OK subgroup" not in outs[0] and all("OK subgroup" in o for o in outs[1:])


@pytest.mark.parametrize("n", [2, 3])
def test_all_to_all_shm_and_gloo_match_reference(n: int) -> None:
    with bounded(240):
        outs = run_ranks(n, "a2a", 200)
    for out in outs:
        assert out.count("OK a2a torch.") == 6, out[-2000:]
        assert "OK a2a equal split" in out and "OK a2a errors" in out, out[-2000:]


def test_compressed_all_reduce_error_is_bounded() -> None:
    with bounded(120):
        outs = run_ranks(2, "compress", 100)
    rows = [json.loads(line) for line in outs[0].splitlines() if line.startswith("{")]
    assert len(rows) == 2 * 2 * 3
    bound = {"float32": 1e-6, "bfloat16": 2**-7, "float16": 2**-10}  # ~ one input rounding each
    for r in rows:
        assert r["rel_max"] <= bound[r["comm_dtype"]], r
        assert r["rms_rel"] <= bound[r["comm_dtype"]] / 2, r
    by = {(r["transport"], r["comm_dtype"], r["numel"]): r for r in rows}
    # SHM sums the 16-bit slots in fp32 (no rounding of the sum): no worse than gloo's 16-bit sum
    for (tr, cd, numel), r in by.items():
        if tr == "shm" and cd != "float32":
            assert r["rms_rel"] <= by[("gloo", cd, numel)]["rms_rel"] * 1.01


@pytest.mark.parametrize("mode,victim,op", [
    ("die", 1, "all_reduce"), ("die", 0, "all_reduce"), ("stall", 1, "all_reduce"),
    ("die", 1, "all_to_all"), ("die", 0, "all_to_all"), ("stall", 0, "all_to_all"), ("die", 1, "all_to_all_gloo")])
def test_dead_or_stalled_rank_is_an_error_not_a_hang(mode: str, victim: int, op: str) -> None:
    timeout = 3.0
    survivor = 1 - victim
    before = shm_files()
    env = {"COMM_TEST_TIMEOUT": str(timeout), "COMM_TEST_VICTIM": str(victim), "COMM_TEST_OP": op}
    with bounded(90), ranks(2, mode, env) as rk:
        pids = [p.pid for p in rk.procs]
        t0 = time.monotonic()
        rc = rk.procs[survivor].wait(timeout=60)
        elapsed = time.monotonic() - t0
        out = rk.output(survivor)
        rk.kill()  # the stalled victim is still alive: reaped here (and by __exit__ in any case)
    assert rc == 0, out
    m = re.search(r"ERROR after ([0-9.]+) s: (.*)", out)
    assert m, out
    waited, msg = float(m.group(1)), m.group(2)
    if op == "all_to_all_gloo":  # gloo's own error (the peer's socket closed), within the timeout
        assert waited < timeout + 2, msg
    else:
        assert f"rank {victim}" in msg
        if op == "all_to_all":
            assert f"shared-memory all-to-all on rank {survivor}" in msg, msg
        if mode == "die":
            assert "died" in msg and waited < timeout  # the liveness check beats the timeout
        else:
            assert "timed out" in msg and timeout <= waited < timeout + 2
    assert elapsed < 45
    assert all(gone(p) for p in pids)
    assert shm_files() - before == set()
    assert not any(str(p) in f for f in os.listdir("/dev/shm") for p in pids)

"""The shared-memory region in one process: layout, attach checks, the sweep of regions a crashed
creator left, which tensors the SHM path takes, and the barrier's own timeout."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from strata.comm import shm


def test_create_attach_unlink_close() -> None:
    r = shm.ShmRegion.create(3, 4096)
    try:
        assert os.path.exists(r.path) and os.stat(r.path).st_size == shm.ShmRegion.size(3, 4096)
        assert oct(os.stat(r.path).st_mode & 0o777) == "0o600"
        other = shm.ShmRegion.attach(r.path, 3, 4096)
        other.write_pid(2)
        assert r.pids() == [0, 0, os.getpid()]  # the two mappings share the pages
        other.close()
        with pytest.raises(ValueError, match="does not match|bytes, expected"):
            shm.ShmRegion.attach(r.path, 2, 4096)
        with pytest.raises(ValueError, match="not a Strata region"):
            shm.ShmRegion.attach("/tmp/elsewhere", 3, 4096)
        with pytest.raises(ValueError, match="multiple of"):
            shm.ShmRegion.create(2, 100)
    finally:
        r.unlink()
        r.close()
    assert not os.path.exists(r.path)
    r.unlink()  # idempotent
    r.close()


def test_sweep_removes_only_old_regions_of_dead_creators() -> None:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    dead, live = p.pid, os.getpid()
    paths = {k: os.path.join(shm.SHM_DIR, f"{shm.PREFIX}{pid}-test{k}") for k, pid in
             (("dead_old", dead), ("dead_new", dead), ("live_old", live))}
    old = time.time() - 2 * shm.STALE_S
    try:
        for k, path in paths.items():
            open(path, "wb").close()
            if k.endswith("old"):
                os.utime(path, (old, old))
        removed = shm.sweep_stale()
        assert paths["dead_old"] in removed
        assert not os.path.exists(paths["dead_old"])
        assert os.path.exists(paths["dead_new"]) and os.path.exists(paths["live_old"])
    finally:
        for path in paths.values():
            if os.path.exists(path):
                os.unlink(path)


def test_supports() -> None:
    ok = shm.ShmAllReduce.supports
    assert ok(torch.zeros(4)) and ok(torch.zeros(4, dtype=torch.bfloat16)) and ok(torch.zeros(3, dtype=torch.int64))
    assert ok(torch.zeros(4), torch.bfloat16)
    assert not ok(torch.zeros(4, 4).t())  # non-contiguous: gloo
    assert not ok(torch.zeros(4, dtype=torch.bool)) and not ok(torch.zeros(2, dtype=torch.complex64))


def test_single_process_barrier_times_out_naming_the_missing_rank() -> None:
    """Rank 0 of a two-rank region whose rank 1 never attaches: a CommError after the timeout,
    and the all-reduce refuses to run again."""
    r = shm.ShmRegion.create(2, 4096)
    r.unlink()
    ar = shm.ShmAllReduce(r, 0, timeout_s=0.3, check_pids=False)
    t0 = time.monotonic()
    with pytest.raises(shm.CommError, match=r"timed out after 0.3 s waiting for rank\(s\) 1 at round 1"):
        ar.all_reduce(torch.ones(8))
    assert 0.3 <= time.monotonic() - t0 < 2.0
    with pytest.raises(shm.CommError, match="unusable after an earlier failure"):
        ar.all_reduce(torch.ones(8))
    ar.close()


@pytest.mark.parametrize("shape,dtype", [((0,), torch.float32), ((700, 5), torch.float32), ((3,), torch.bool),
                                         ((2000, 7), torch.bfloat16), ((0, 4), torch.int64), ((9, 0), torch.float32)])
def test_all_to_all_to_itself_over_many_rounds(shape, dtype) -> None:
    """One rank, 4 KiB slots: rows straddle the chunks of several rounds and come back whole."""
    r = shm.ShmRegion.create(1, 4096)
    r.unlink()
    ar = shm.ShmAllReduce(r, 0, timeout_s=1.0, check_pids=False)
    t = (torch.rand(shape) * 100).to(dtype)
    out, counts = ar.all_to_all(t, [shape[0]])
    assert counts == [shape[0]] and out.shape == t.shape and torch.equal(out, t)
    nbytes = t.numel() * t.element_size()
    assert ar._round == max(1, -(-nbytes // (4096 - ar.head_bytes)))
    ar.close()


def test_single_process_all_to_all_times_out_naming_the_missing_rank() -> None:
    r = shm.ShmRegion.create(2, 4096)
    r.unlink()
    ar = shm.ShmAllReduce(r, 0, timeout_s=0.3, check_pids=False)
    with pytest.raises(shm.CommError, match=r"all-to-all on rank 0: timed out after 0.3 s waiting for rank\(s\) 1"):
        ar.all_to_all(torch.ones(4, 2), [2, 2])
    with pytest.raises(shm.CommError, match="all-to-all unusable after an earlier failure"):
        ar.all_to_all(torch.ones(4, 2), [2, 2])
    ar.close()


def test_all_to_all_counts_are_checked_before_anything_moves() -> None:
    from strata.comm.collectives import _split_counts

    t = torch.zeros(6, 2)
    assert _split_counts(t, None, 3) == [2, 2, 2] and _split_counts(t, [0, 6, 0], 3) == [0, 6, 0]
    for bad in ([1, 2], [3, 4, -1], [1, 1, 1]):
        with pytest.raises(ValueError, match="send_counts"):
            _split_counts(t, bad, 3)
    with pytest.raises(ValueError, match="do not split equally"):
        _split_counts(t, None, 4)
    with pytest.raises(ValueError, match="rows"):
        _split_counts(torch.tensor(1.0), None, 2)
    r = shm.ShmRegion.create(2, 4096)
    r.unlink()
    ar = shm.ShmAllReduce(r, 0, timeout_s=0.3, check_pids=False)
    with pytest.raises(ValueError, match="send_counts"):
        ar.all_to_all(t, [5, 2])
    assert ar._round == 0  # refused before the round: the peers see nothing
    ar.close()
    with pytest.raises(shm.CommError, match="closed"):
        ar.all_to_all(t, [3, 3])

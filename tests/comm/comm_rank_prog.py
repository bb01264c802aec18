"""One rank of the comm tests (started by comm_ranks.run_ranks as `python comm_rank_prog.py MODE`).

Modes:
  equal     SHM all-reduce == gloo's, sizes 1 element .. 64 MiB (odd ones, > the slot), fp32,
            bf16, fp16, int32; every rank holds the same bits; non-contiguous -> gloo; the cost
            model's choice per size
  compress  the compressed all-reduce's error against the fp64 sum (printed as JSON lines)
  a2a       all_to_all over SHM and gloo == a reference every rank computes locally: uneven counts
            with zeros, several dtypes, more than one slot, nothing at all; the combine back;
            the equal split; rows of different bytes and wrong recv_counts are errors
  die       rank VICTIM SIGKILLs itself inside the collective COMM_TEST_OP (all_reduce, all_to_all
            over SHM, all_to_all_gloo: before the call); the other prints the error
  stall     rank VICTIM stops inside the SHM collective (alive); the other times out
Prints `OK <what>` lines; any failed check raises (non-zero exit).
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import time

import torch

from strata.comm import shm as shm_mod
from strata.comm.alpha_beta import CommModel, fit
from strata.comm.collectives import Communicator
from strata.comm.world import World, destroy_world

SLOT = 256 * 1024  # small slots: the larger sizes take many chunks


def _data(numel: int, rank: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    if not dtype.is_floating_point:
        return torch.randint(-1000, 1000, (numel,), generator=g, dtype=dtype)
    return torch.randn(numel, generator=g).to(dtype)


def _same_on_all_ranks(comm: Communicator, t: torch.Tensor) -> bool:
    raw = t.contiguous().view(-1).view(torch.uint8).clone()
    gathered = comm.all_gather(raw, 0).view(comm.world_size, -1)
    return all(torch.equal(gathered[0], gathered[r]) for r in range(1, comm.world_size))


def equal(comm: Communicator) -> None:
    n = comm.world_size
    cases = [(torch.float32, [1, 3, 1000, SLOT // 4 + 1, 1_000_003, 16 * 2**20]),  # 16 Mi fp32 = 64 MiB
             (torch.bfloat16, [1, 7, SLOT // 2 + 3, 2**21 + 1]),
             (torch.float16, [1, 7, SLOT // 2 + 3, 2**21 + 1]),
             (torch.int32, [5, SLOT // 4 + 9])]
    for dtype, sizes in cases:
        for numel in sizes:
            x = _data(numel, comm.rank, dtype, seed=numel % 97)
            a, b = x.clone(), x.clone()
            comm.all_reduce(a, transport="shm")
            assert comm.last_transport == "shm"
            comm.all_reduce(b, transport="gloo")
            exact = sum(_data(numel, r, dtype, seed=numel % 97).double() for r in range(n))
            assert _same_on_all_ranks(comm, a), f"{dtype} {numel}: ranks disagree"
            if n == 2 or not dtype.is_floating_point:
                assert torch.equal(a, b), f"{dtype} {numel}: shm != gloo, max diff {(a.double() - b.double()).abs().max()}"
            # summed in fp32 and rounded once: within half an ulp of the exact sum (fp32: n ulps
            # of the inputs); relative to max(|sum|, 1) so cancellation does not blow it up
            tol = {torch.float32: 1e-6 * n, torch.bfloat16: 2**-8, torch.float16: 2**-11}.get(dtype, 0)
            err = ((a.double() - exact).abs() / exact.abs().clamp_min(1.0)).max().item()
            assert err <= tol, f"{dtype} {numel}: relative error {err} > {tol}"
            print(f"OK {dtype} {numel} {'== gloo' if n == 2 else 'close to exact'}", flush=True)
    # non-contiguous: gloo, still right
    x = _data(64, comm.rank, torch.float32).view(8, 8).t()
    y = x.clone()
    comm.all_reduce(x)
    assert comm.last_transport == "gloo" and not x.is_contiguous()
    ref = sum(_data(64, r, torch.float32).view(8, 8).t() for r in range(n))
    assert torch.allclose(x, ref, rtol=1e-6, atol=1e-6) and not torch.equal(x, y)
    print("OK non-contiguous -> gloo", flush=True)
    # default: SHM; with a cost model in which gloo wins big messages, gloo there
    t = torch.ones(4096)
    comm.all_reduce(t)
    assert comm.last_transport == "shm" and float(t[0]) == n
    sizes = [2**k for k in range(4, 24, 2)]
    shm_fit = fit("all_reduce", "shm", n, sizes, [10e-6 + s / 1e9 for s in sizes])
    gloo_fit = fit("all_reduce", "gloo", n, sizes, [200e-6 + s / 50e9 for s in sizes])
    comm.cost = CommModel((shm_fit, gloo_fit))
    comm.all_reduce(torch.ones(16))
    assert comm.last_transport == "shm"
    comm.all_reduce(torch.ones(2**22))
    assert comm.last_transport == "gloo", comm.last_transport
    comm.cost = None
    print("OK cost model choice", flush=True)


def subgroup(world_rank: int) -> None:
    """Ranks 1 and 2 of three as their own group: its ranks are group ranks (src=0 is world
    rank 1), and it gets its own SHM region."""
    import torch.distributed as dist

    group = dist.new_group([1, 2])  # every rank of the world calls new_group
    if world_rank == 0:
        return
    sub = Communicator(group, timeout_s=20, shm_slot_bytes=SLOT)
    assert sub.rank == world_rank - 1 and sub.world_size == 2
    t = torch.full((1000,), float(world_rank))
    sub.all_reduce(t)
    assert sub.last_transport == "shm" and sub.shm_available and torch.all(t == 3.0)
    assert sub.broadcast_bytes(b"from group rank 0" if sub.rank == 0 else None, 0) == b"from group rank 0"
    x = sub.broadcast(torch.full((4,), float(world_rank)), 1)
    assert torch.all(x == 2.0), x
    assert sub.all_gather(torch.tensor([world_rank]), 0).tolist() == [1, 2]
    sub.close()
    print("OK subgroup", flush=True)


def compress(comm: Communicator) -> None:
    n = comm.world_size
    for numel in (1000, SLOT // 2 + 5):
        exact = sum(_data(numel, r, torch.float32).double() for r in range(n))
        for transport in ("shm", "gloo"):
            for cd in (None, "bfloat16", "float16"):
                comm.comm_dtype = getattr(torch, cd) if cd else None
                t = _data(numel, comm.rank, torch.float32)
                comm.all_reduce(t, transport=transport)
                assert t.dtype == torch.float32 and _same_on_all_ranks(comm, t)
                err = (t.double() - exact).abs()
                print(json.dumps({"transport": transport, "comm_dtype": cd or "float32", "numel": numel,
                                  "max_abs": err.max().item(),
                                  "rel_max": (err.max() / exact.abs().max()).item(),
                                  "rms_rel": (err.norm() / exact.norm()).item()}), flush=True)
    comm.comm_dtype = None
    print("OK compress", flush=True)


def _a2a_counts(n: int, seed: int, most: int) -> list[list[int]]:
    """counts[i][j]: rows rank i sends rank j, 0..most, with at least one zero."""
    g = torch.Generator().manual_seed(seed)
    c = torch.randint(0, most + 1, (n, n), generator=g)
    c[seed % n, (seed + 1) % n] = 0
    return c.tolist()


def _a2a_send(src: int, counts: list[list[int]], tail: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Rank src's send buffer (any rank can regenerate it)."""
    gen = dtype if dtype.is_floating_point else torch.int64  # uint8: int64 values, wrapped
    return _data(sum(counts[src]) * math.prod(tail), src, gen, seed).to(dtype).view(sum(counts[src]), *tail)


def _a2a_expected(me: int, counts: list[list[int]], tail, dtype, seed) -> torch.Tensor:
    parts = []
    for i, row in enumerate(counts):
        start = sum(row[:me])
        parts.append(_a2a_send(i, counts, tail, dtype, seed)[start:start + row[me]])
    return torch.cat(parts)


def a2a(comm: Communicator) -> None:
    n, me = comm.world_size, comm.rank
    cases = [(torch.float32, (16,), 5), (torch.bfloat16, (8,), 5), (torch.int64, (), 9), (torch.uint8, (3,), 4),
             (torch.float32, (256,), 700),  # up to 700 KiB to each rank: several 256 KiB slots
             (torch.float32, (4,), 0)]  # nothing at all
    for seed, (dtype, tail, most) in enumerate(cases):
        counts = _a2a_counts(n, seed, most)
        x = _a2a_send(me, counts, tail, dtype, seed)
        want = _a2a_expected(me, counts, tail, dtype, seed)
        got_counts = [counts[i][me] for i in range(n)]
        for tr in ("shm", "gloo"):
            out, rc = comm.all_to_all(x, counts[me], transport=tr)
            assert comm.last_transport == tr
            assert rc == got_counts and out.dtype == dtype and torch.equal(out, want), (tr, dtype, rc, got_counts)
            back, rc2 = comm.all_to_all(out, rc, counts[me], transport=tr)  # the combine
            assert rc2 == counts[me] and torch.equal(back, x), (tr, dtype)
        out, _ = comm.all_to_all(x, counts[me])
        assert comm.last_transport == "shm" and torch.equal(out, want)
        print(f"OK a2a {dtype} {tail} counts {counts}", flush=True)
    # the equal split: every rank 3 rows for every rank
    x = _data(n * 3 * 2, me, torch.float32).view(n * 3, 2)
    want = torch.cat([_data(n * 3 * 2, i, torch.float32).view(n * 3, 2)[3 * me:3 * me + 3] for i in range(n)])
    for tr in ("shm", "gloo"):
        out, rc = comm.all_to_all(x, transport=tr)
        assert rc == [3] * n and torch.equal(out, want), tr
    print("OK a2a equal split", flush=True)
    # rows of different bytes: an error on every rank, and the region still works
    x = torch.zeros(n, 4 if me == 0 else 5)
    try:
        comm.all_to_all(x, [1] * n, transport="shm")
        raise AssertionError("rows of different bytes were exchanged")
    except ValueError as e:
        assert "differ in bytes" in str(e), e
    # recv_counts that do not match what the ranks sent: an error on that rank only
    wrong = [2] * n if me == 0 else [1] * n
    try:
        comm.all_to_all(torch.zeros(n, 2), [1] * n, wrong, transport="shm")
        assert me != 0, "wrong recv_counts accepted"
    except ValueError as e:
        assert me == 0 and "recv_counts" in str(e), e
    out, rc = comm.all_to_all(torch.full((n, 1), float(me)), transport="shm")
    assert out.view(-1).tolist() == [float(i) for i in range(n)] and rc == [1] * n
    print("OK a2a errors", flush=True)


def die_or_stall(comm: Communicator, mode: str, victim: int, op: str = "all_reduce") -> None:
    orig = shm_mod.ShmAllReduce._wait

    def wait(self, r):  # the victim stops after posting round 3 of 8
        if self.rank == victim and r == 3:
            print(f"victim rank {victim} {mode}s at round {r}", flush=True)
            if mode == "die":
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(600)
        return orig(self, r)

    shm_mod.ShmAllReduce._wait = wait
    t = torch.ones(8 * SLOT // 4)  # 8 chunks (all_to_all: each rank sends 8 slots' worth)
    run = {"all_reduce": lambda: comm.all_reduce(t, transport="shm"),
           "all_to_all": lambda: comm.all_to_all(t, transport="shm"),
           "all_to_all_gloo": lambda: comm.all_to_all(t, transport="gloo")}[op]
    if op == "all_to_all_gloo" and comm.rank == victim:
        print(f"victim rank {victim} dies before the gloo all_to_all", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    t0 = time.monotonic()
    try:
        run()
    except (shm_mod.CommError, RuntimeError) as e:  # gloo's DistBackendError is a RuntimeError
        print(f"ERROR after {time.monotonic() - t0:.2f} s: {e}", flush=True)
        os._exit(0)  # the peer is gone: skip gloo's teardown
    raise AssertionError(f"the {op} completed without the victim")


def main() -> int:
    mode = sys.argv[1]
    torch.set_num_threads(1)
    world = World.from_env()
    timeout = float(os.environ.get("COMM_TEST_TIMEOUT", "20"))
    comm = Communicator.create(world, "cpu", timeout_s=timeout, shm_slot_bytes=SLOT)
    assert comm.shm_available, comm.shm_state
    print(f"rank {world.rank} pid {os.getpid()} shm {comm.shm_state}", flush=True)
    if mode == "equal":
        equal(comm)
        if world.world_size == 3:
            subgroup(world.rank)
    elif mode == "compress":
        compress(comm)
    elif mode == "a2a":
        a2a(comm)
    else:
        die_or_stall(comm, mode, int(os.environ["COMM_TEST_VICTIM"]), os.environ.get("COMM_TEST_OP", "all_reduce"))
    comm.close()
    destroy_world()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""One rank of `strata bench comm` (strata/bench/comm.py starts N of these with launch.LocalRanks):
times every (collective, transport, size) point (all-reduce and all-to-all on each transport) and
the compressed all-reduce's numeric error; rank 0 writes the raw figures as JSON for the parent
to tabulate and fit.

The points are timed in several passes over the whole list, and a point's figures are over the
repetitions of all its passes together (median, p10, p90), with each pass's median kept: on a
shared machine the cost of a point moves over seconds (a neighbour's burst, idle vCPUs that
are slow to wake), so one look is one moment. Pooling the passes gives the typical cost, which
is what a cost model should predict; the spread of the pass medians says how much the point
moved while it was measured.

Timing, per point: a few warm-up calls, one timed call sets the repetitions (rank 0 decides,
so every rank runs as many), then each repetition is timed on every rank; a repetition's time
is the slowest rank's (the collective is done when the last rank is), and the point keeps the
median and the spread. Timed tensors hold zeros, so repeated in-place sums stay finite; the
error figures use random data against an fp64 sum of every rank's input (each rank can
regenerate all inputs from their seeds).

    python -m strata.comm.bench_worker --out FILE --sizes 8,16,... [--transports shm,gloo]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import time

import torch
import torch.distributed as dist

from strata.comm.collectives import Communicator
from strata.comm.world import World, destroy_world
from strata.settings import SETTINGS

WARMUP = 3


def _inputs(numel: int, rank: int, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + rank)
    return torch.randn(numel, generator=g, dtype=torch.float32).to(dtype)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def split(numel: int, n: int) -> list[int]:
    """All-to-all counts: `numel` elements as evenly over n ranks as they go (the first get one
    more); every rank sends the same, so rank j receives n x split[j]."""
    return [numel // n + (j < numel % n) for j in range(n)]


def _op(comm: Communicator, collective: str, transport: str, t: torch.Tensor):
    if collective == "all_reduce":
        return lambda: comm.all_reduce(t, transport=transport)
    if collective == "all_to_all":  # the counts known (a combine): the data exchange alone
        n, sends = comm.world_size, split(t.numel(), comm.world_size)
        recvs = [sends[comm.rank]] * n
        return lambda: comm.all_to_all(t, sends, recvs, transport=transport)
    if collective == "all_gather":
        return lambda: comm.all_gather(t, 0)
    return lambda: comm.broadcast(t, 0)


def _numel(collective: str, nbytes: int, n: int, itemsize: int) -> int:
    """all_gather's size is the gathered output (nccl-tests' convention), all_to_all's what one
    rank sends (its whole buffer, as nccl-tests' alltoall); 0: size too small."""
    per = nbytes // (n if collective == "all_gather" else 1)
    return per // itemsize


def time_point(comm: Communicator, device: str, collective: str, transport: str, nbytes: int,
               budget_s: float, min_reps: int, max_reps: int, warmup: int = WARMUP) -> dict | None:
    n = comm.world_size
    comm_dtype = None
    if "+" in transport:  # compressed all-reduce: fp32 tensors, 16-bit on the wire
        transport, dname = transport.split("+")
        comm_dtype = getattr(torch, dname)
    numel = _numel(collective, nbytes, n, 4)  # fp32 elements; size = the tensor's bytes
    if numel < 1:
        return None
    t = torch.zeros(numel, dtype=torch.float32, device=device)
    saved, comm.comm_dtype = comm.comm_dtype, comm_dtype
    try:
        op = _op(comm, collective, transport, t)
        for _ in range(warmup):
            op()
        _sync(device)
        t0 = time.perf_counter()
        op()
        _sync(device)
        one = time.perf_counter() - t0
        reps = torch.tensor([min(max_reps, max(min_reps, int(budget_s / max(one, 1e-7))))], dtype=torch.int64)
        dist.broadcast(reps, group=comm.meta_group, group_src=0)
        times = torch.empty(int(reps.item()), dtype=torch.float64)
        for i in range(times.numel()):
            t0 = time.perf_counter()
            op()
            _sync(device)
            times[i] = time.perf_counter() - t0
    finally:
        comm.comm_dtype = saved
    dist.all_reduce(times, op=dist.ReduceOp.MAX, group=comm.meta_group)
    return {"collective": collective, "transport": transport + (f"+{str(comm_dtype)[6:]}" if comm_dtype else ""),
            "bytes": int(numel * 4 * (n if collective == "all_gather" else 1)), "times": times.tolist()}


def pooled(passes: list[dict]) -> dict:
    """One point's figures over the repetitions of all its passes (see the module docstring)."""
    ts = sorted(t for p in passes for t in p["times"])
    q = lambda p: ts[min(len(ts) - 1, int(p * len(ts)))]  # noqa: E731
    meds = [statistics.median(p["times"]) for p in passes]
    head = {k: v for k, v in passes[0].items() if k != "times"}
    return dict(head, reps=len(ts), median_s=statistics.median(ts), p10_s=q(0.1), p90_s=q(0.9),
                min_s=ts[0], max_s=ts[-1], pass_medians_s=meds)


def error_point(comm: Communicator, device: str, transport: str, comm_dtype: str | None, nbytes: int) -> dict:
    """One all-reduce of random fp32 data against the fp64 sum of every rank's input."""
    numel = max(1, nbytes // 4)
    t = _inputs(numel, comm.rank).to(device)
    exact = sum(_inputs(numel, r).double() for r in range(comm.world_size))
    saved, comm.comm_dtype = comm.comm_dtype, (getattr(torch, comm_dtype) if comm_dtype else None)
    try:
        comm.all_reduce(t, transport=transport)
    finally:
        comm.comm_dtype = saved
    err = (t.double().cpu() - exact).abs()
    ref = exact.abs()
    return {"transport": transport, "comm_dtype": comm_dtype or "float32", "bytes": numel * 4,
            "max_abs": float(err.max()), "rel_max": float(err.max() / ref.max().clamp_min(1e-30)),
            "rms_rel": float(err.norm() / exact.norm().clamp_min(1e-30))}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", required=True)
    p.add_argument("--sizes", required=True, help="comma-separated byte counts")
    p.add_argument("--transports", default="shm,gloo", help="all-reduce / all-to-all transports (shm, gloo, nccl)")
    p.add_argument("--collectives", default="all_reduce,all_gather,broadcast,all_to_all")
    p.add_argument("--compress", default="bfloat16,float16", help="comm dtypes of the compressed all-reduce")
    p.add_argument("--compress-sizes", default="65536,4194304")
    p.add_argument("--device", default="cpu")
    p.add_argument("--budget-s", type=float, default=0.2, help="time spent per point, all passes")
    p.add_argument("--passes", type=int, default=8)
    p.add_argument("--min-reps", type=int, default=3)
    p.add_argument("--max-reps", type=int, default=400)
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--shm-slot-bytes", type=int, default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(SETTINGS.rank_threads)
    world = World.from_env()
    device = args.device
    if device.startswith("cuda"):
        device = f"cuda:{world.local_rank}"
    kw = {} if args.shm_slot_bytes is None else {"shm_slot_bytes": args.shm_slot_bytes}
    comm = Communicator.create(world, device, timeout_s=args.timeout,
                               shm="shm" in args.transports.split(","), **kw)
    sizes = [int(s) for s in args.sizes.split(",") if s]
    transports = [t for t in args.transports.split(",") if t and (t != "shm" or comm.shm_available)]
    other = "nccl" if device.startswith("cuda") else "gloo"
    specs, errors, t0 = [], [], time.perf_counter()
    for collective in args.collectives.split(","):
        algos = transports if collective in ("all_reduce", "all_to_all") else [other]
        if collective == "all_reduce":
            algos = algos + [f"{t}+{c}" for c in args.compress.split(",") if c for t in transports]
        # every transport at every size: a compressed transport's cache-to-DRAM knee needs as
        # many points as the plain one's for the fit to find its size regimes
        specs += [(collective, tr, s) for tr in algos for s in sizes]
    seen: dict[tuple, list[dict]] = {}
    min_reps = max(1, -(-args.min_reps // args.passes))  # the pooled point has >= --min-reps
    for k in range(args.passes):  # pooled over the passes (see the module docstring)
        order = list(specs)
        random.Random(k).shuffle(order)  # every rank the same order; no point always after another
        for spec in order:
            pt = time_point(comm, device, *spec, args.budget_s / args.passes, min_reps,
                            max(1, args.max_reps // args.passes), WARMUP if k == 0 else 1)
            if pt is not None:
                seen.setdefault(spec, []).append(pt)
    points = [pooled(seen[s]) for s in specs if s in seen]
    for s in [int(x) for x in args.compress_sizes.split(",") if x]:
        for tr in transports:
            for cd in [None] + [c for c in args.compress.split(",") if c]:
                errors.append(error_point(comm, device, tr, cd, s))
    if world.rank == 0:
        out = {"world_size": world.world_size, "device": args.device, "host": socket.gethostname(),
               "threads_per_rank": torch.get_num_threads(), "shm_state": comm.shm_state,
               "shm_slot_bytes": comm.shm_slot_bytes, "wall_s": time.perf_counter() - t0,
               "points": points, "errors": errors}
        tmp = f"{args.out}.tmp"
        with open(tmp, "w") as f:
            json.dump(out, f)
        os.replace(tmp, args.out)
    comm.close()
    destroy_world()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

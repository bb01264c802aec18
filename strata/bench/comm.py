"""`strata bench comm`: the collectives between N local ranks, nccl-tests style, and the alpha-beta
model fitted to them.

Starts N ranks on this host (python -m strata.comm.bench_worker; loopback rendezvous; every rank
reaped whatever happens), times all-reduce (SHM and gloo on CPU, NCCL on CUDA; plus the
compressed all-reduce with bf16/fp16 on the wire), all-gather, broadcast and all-to-all (SHM and
gloo on CPU, NCCL on CUDA; size = the bytes each rank sends, split evenly, counts known) over the
sizes, and prints one table per algorithm: size, time (median over repetitions, with p10-p90),
algbw = size / time and busbw = algbw x 2(n-1)/n (all-reduce), x (n-1)/n (all-gather,
all-to-all), x 1 (broadcast), and the fitted model's time and error at that size. Then the fit per algorithm (alpha, beta; formulas in
strata/comm/alpha_beta.py), the compressed all-reduce's numeric error against an fp64 sum, and
where SHM and gloo cross. The fit is stored in this machine's cached hardware profile (unless
--no-profile), where `strata plan --hardware thisxN` prices the tensor-parallel all-reduce from it
(and CommModel.all_to_all_seconds the expert-parallel exchange) and
Communicator(cost=cached_comm_model()) picks SHM or gloo per message.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import socket
import tempfile
import time
from pathlib import Path

from strata.bench.common import write_json
from strata.comm.alpha_beta import FORMULA_TEXT, CommModel, bus_bandwidth, fit
from strata.comm.launch import LocalRanks, RanksFailed
from strata.config import parse_bytes
from strata.errors import ConfigError
from strata.hardware.probe import save_comm_model
from strata.text_table import fmt_bytes, print_table

NAME = "comm"
HELP = "collectives between local ranks (SHM, gloo, NCCL): nccl-tests table + fitted alpha-beta model"
DESCRIPTION = __doc__
DEFAULT_SIZES = "8B:16MiB"
FULL_SIZES = "8B:256MiB"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--world-size", type=int, default=2, help="ranks to start on this host (default 2)")
    p.add_argument("--backend", choices=("auto", "gloo", "nccl", "shm"), default="auto",
                   help="all-reduce and all-to-all transports: auto = NCCL with enough GPUs, else SHM and gloo")
    p.add_argument("--sizes", default=None,
                   help=f"LO:HI (geometric by --factor) or a comma list, e.g. 8B:1MiB (default {DEFAULT_SIZES})")
    p.add_argument("--full", action="store_true", help=f"sizes {FULL_SIZES}")
    p.add_argument("--factor", type=int, default=2, help="size step of LO:HI (default 2)")
    p.add_argument("--collectives", default="all_reduce,all_gather,broadcast,all_to_all",
                   help="comma-separated collectives to time")
    p.add_argument("--compress", default="bfloat16,float16",
                   help="comm dtypes of the compressed all-reduce ('none' to skip)")
    p.add_argument("--budget-s", type=float, default=0.15, help="time per point (default 0.15 s)")
    p.add_argument("--passes", type=int, default=8,
                   help="passes over the points in shuffled orders, pooled (default 8)")
    p.add_argument("--timeout", type=float, default=60.0, help="bound on one collective, seconds")
    p.add_argument("--run-timeout", type=float, default=1200.0, help="bound on the whole run, seconds")
    p.add_argument("--shm-slot-bytes", default=None, help="SHM slot per rank (chunk size), e.g. 4MiB")
    p.add_argument("--no-profile", action="store_true", help="do not store the fit in the hardware profile")
    p.add_argument("--json", default=None, help="write the figures, fits and errors to FILE")


def parse_sizes(text: str, factor: int = 2) -> list[int]:
    """'8B:1MiB' -> 8, 16, ..., 1 MiB (x factor); '4KiB,1MiB' -> those; '64KiB' -> one size."""
    if factor < 2:
        raise ConfigError(f"--factor: must be >= 2, got {factor}")
    if "," in text:
        return sorted({parse_bytes(s.strip(), "--sizes") for s in text.split(",") if s.strip()})
    parts = text.split(":")
    if len(parts) not in (1, 2):
        raise ConfigError(f"--sizes: expected LO:HI or a comma list, got {text!r}")
    lo, hi = parse_bytes(parts[0], "--sizes"), parse_bytes(parts[-1], "--sizes")
    if hi < lo:
        raise ConfigError(f"--sizes: HI < LO in {text!r}")
    out, s = [], lo
    while s <= hi:
        out.append(s)
        s *= factor
    return out


def _setup(args: argparse.Namespace) -> tuple[str, str]:
    """(device, all-reduce transports) from --backend."""
    import torch

    if args.world_size < 2:
        raise ConfigError(f"--world-size: needs at least 2 ranks, got {args.world_size}")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    backend = args.backend
    if backend == "auto":
        backend = "nccl" if gpus >= args.world_size else "cpu"
    if backend == "nccl":
        if gpus < args.world_size:
            raise ConfigError(f"--backend nccl: needs {args.world_size} CUDA devices, this host has {gpus}")
        return "cuda", "nccl"
    return "cpu", {"cpu": "shm,gloo", "gloo": "gloo", "shm": "shm"}[backend]


def run_ranks(args: argparse.Namespace, device: str, transports: str, sizes: list[int]) -> dict:
    """Start the ranks, wait (bounded), return rank 0's raw figures."""
    compress = "" if args.compress.lower() in ("none", "") else args.compress
    with tempfile.TemporaryDirectory(prefix="strata-bench-comm-") as tmp:
        out = Path(tmp) / "raw.json"
        argv = ["-m", "strata.comm.bench_worker", "--out", str(out), "--sizes", ",".join(map(str, sizes)),
                "--transports", transports, "--collectives", args.collectives, "--compress", compress,
                "--device", device, "--budget-s", str(args.budget_s), "--passes", str(args.passes), "--timeout", str(args.timeout)]
        if args.shm_slot_bytes:
            argv += ["--shm-slot-bytes", str(parse_bytes(args.shm_slot_bytes, "--shm-slot-bytes"))]
        threads = max(1, (os.cpu_count() or 1) // args.world_size)
        with LocalRanks(args.world_size, argv, threads_per_rank=threads) as ranks:
            try:
                ranks.wait(args.run_timeout)
            except RanksFailed as e:
                raise ConfigError(f"strata bench comm: {e}") from None
        return json.loads(out.read_text())


def fit_points(raw: dict) -> tuple[CommModel, dict[tuple[str, str], dict]]:
    """One fit per (collective, transport) over its median times; returns the model and, per
    key, the fit's relative error at each size."""
    n = int(raw["world_size"])
    groups: dict[tuple[str, str], list[dict]] = {}
    for pt in raw["points"]:
        groups.setdefault((pt["collective"], pt["transport"]), []).append(pt)
    fits, errs = [], {}
    for (coll, tr), pts in groups.items():
        f = fit(coll, tr, n, [p["bytes"] for p in pts], [p["median_s"] for p in pts])
        fits.append(f)
        errs[(coll, tr)] = {p["bytes"]: e for p, e in zip(pts, f.rel_errors())}
    model = CommModel(tuple(fits), source=f"strata bench comm --world-size {n}", host=raw.get("host", ""),
                      measured_at=datetime.date.today().isoformat(),
                      notes=(f"{raw.get('threads_per_rank', 1)} thread(s) per rank; SHM {raw.get('shm_state')}",))
    return model, errs


def _tables(raw: dict, model: CommModel, errs: dict) -> None:
    n = int(raw["world_size"])
    for f in model.fits:
        pts = [p for p in raw["points"] if (p["collective"], p["transport"]) == (f.collective, f.transport)]
        rows = []
        for p in pts:
            alg, bus = bus_bandwidth(f.collective, p["bytes"], p["median_s"], n)
            rows.append([fmt_bytes(p["bytes"]), p["median_s"] * 1e6,
                         f"{p['p10_s'] * 1e6:.1f}-{p['p90_s'] * 1e6:.1f}", f"{pass_spread(p):.0%}", alg / 1e9,
                         bus / 1e9, f.predict(p["bytes"]) * 1e6, f"{errs[(f.collective, f.transport)][p['bytes']]:+.0%}"])
        wire = " (fp32 tensor bytes)" if "+" in f.transport else ""
        print(f"\n{f.collective} via {f.transport}, {n} ranks{wire}")
        print_table(["size", "time us", "p10-p90 us", "pass spread", "algbw GB/s", "busbw GB/s", "model us",
                     "model err"], rows)


def pass_spread(p: dict) -> float:
    """How far the point moved between passes: (max - min) of the pass medians / the median."""
    meds = p.get("pass_medians_s") or [p["median_s"]]
    return (max(meds) - min(meds)) / p["median_s"]


def _fit_table(model: CommModel, errs: dict) -> None:
    rows = []
    for f in model.fits:
        e = errs[(f.collective, f.transport)]
        for k, seg in enumerate(f.segments):
            upto = f.segments[k + 1].from_bytes if k + 1 < len(f.segments) else math.inf
            mine = [x for size, x in e.items() if seg.from_bytes <= size < upto]
            span = (f"{fmt_bytes(min(s for s in e if seg.from_bytes <= s < upto))}.."
                    f"{fmt_bytes(max(s for s in e if seg.from_bytes <= s < upto))}")
            rows.append([f.collective if k == 0 else "", f.transport if k == 0 else "",
                         FORMULA_TEXT[f.algorithm] if k == 0 else "", span, seg.alpha_s * 1e6,
                         seg.beta_bps / 1e9, f"{max(abs(x) for x in mine):.0%}",
                         f"{math.sqrt(sum(x * x for x in mine) / len(mine)):.0%}"])
    print("\nFitted alpha-beta model (weighted least squares on relative error, in size regimes chosen by BIC;"
          " S = bytes, n = ranks)")
    print_table(["collective", "transport", "t(n, S)", "sizes", "alpha us", "beta GB/s", "max |err|", "rms err"],
                rows)
    every = [abs(x) for e in errs.values() for x in e.values()]
    if every:
        print(f"model vs measured over every point: max |err| {max(every):.0%}, "
              f"{sum(x <= 0.25 for x in every)}/{len(every)} within 25%")


def _error_table(raw: dict) -> None:
    if not raw.get("errors"):
        return
    rows = [[e["transport"], e["comm_dtype"], fmt_bytes(e["bytes"]), f"{e['max_abs']:.3g}",
             f"{e['rel_max']:.2e}", f"{e['rms_rel']:.2e}"] for e in raw["errors"]]
    print("\nAll-reduce numeric error vs the fp64 sum (random normal inputs; rel = max abs / max |sum|)")
    print_table(["transport", "comm dtype", "size", "max abs", "rel (max)", "rel (rms)"], rows)


def crossover(model: CommModel, n: int, a: str = "shm", b: str = "gloo") -> float | None:
    """Bytes above which `b`'s all-reduce is cheaper than `a`'s (None: never, in the model)."""
    fa, fb = model.get("all_reduce", a, n), model.get("all_reduce", b, n)
    if fa is None or fb is None:
        return None
    lo, hi = 1.0, float(2**40)
    if fb.predict(hi, n) >= fa.predict(hi, n):
        return None
    while hi / lo > 1.01:
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if fb.predict(mid, n) >= fa.predict(mid, n) else (lo, mid)
    return hi


def shm_vs_gloo_all_to_all(model: CommModel, n: int, sizes: tuple[int, ...] = (4096, 65536, 2**20)) -> str:
    """The two fits side by side at a few bytes-per-rank ('' unless both are fitted)."""
    if model.get("all_to_all", "shm") is None or model.get("all_to_all", "gloo") is None:
        return ""
    parts = []
    for s in sizes:
        shm, gloo = model.predict("all_to_all", "shm", s, n), model.predict("all_to_all", "gloo", s, n)
        parts.append(f"{fmt_bytes(s)} per rank {shm * 1e6:.1f} vs {gloo * 1e6:.1f} us ({gloo / shm:.1f}x)")
    return "; ".join(parts)


def run(args: argparse.Namespace) -> int:
    if args.passes < 1:
        raise ConfigError(f"--passes: must be >= 1, got {args.passes}")
    device, transports = _setup(args)
    sizes = parse_sizes(args.sizes or (FULL_SIZES if args.full else DEFAULT_SIZES), args.factor)
    t0 = time.perf_counter()
    print(f"strata bench comm: {args.world_size} ranks on {socket.gethostname()} (loopback), "
          f"{device}, all-reduce/all-to-all via {transports}, {len(sizes)} sizes {fmt_bytes(sizes[0])}..{fmt_bytes(sizes[-1])}")
    raw = run_ranks(args, device, transports, sizes)
    model, errs = fit_points(raw)
    print(f"{raw['threads_per_rank']} thread(s) per rank; SHM all-reduce {raw['shm_state']}")
    _tables(raw, model, errs)
    _fit_table(model, errs)
    _error_table(raw)
    cross = crossover(model, args.world_size)
    if model.get("all_reduce", "shm") and model.get("all_reduce", "gloo"):
        print("\nSHM vs gloo all-reduce: " + (f"gloo is cheaper above ~{fmt_bytes(cross)}" if cross
                                             else "SHM is cheaper at every size (in the fitted model)"))
    a2a = shm_vs_gloo_all_to_all(model, args.world_size)
    if a2a:
        print("\nSHM vs gloo all-to-all (fitted): " + a2a)
    profile_path = None
    if not args.no_profile:
        profile_path = str(save_comm_model("cuda:0" if device == "cuda" else "cpu", model))
        print(f"stored the fit in the hardware profile {profile_path} "
              "(strata plan --hardware thisxN prices tensor-parallel all-reduces from it)")
    wall = time.perf_counter() - t0
    print(f"done in {wall:.1f} s")
    if args.json:
        points = [dict(p, model_s=model.predict(p["collective"], p["transport"], p["bytes"], args.world_size),
                       model_err=errs[(p["collective"], p["transport"])][p["bytes"]],
                       algbw_gbs=bus_bandwidth(p["collective"], p["bytes"], p["median_s"], args.world_size)[0] / 1e9,
                       busbw_gbs=bus_bandwidth(p["collective"], p["bytes"], p["median_s"], args.world_size)[1] / 1e9)
                  for p in raw["points"]]
        write_json(args.json, {
            "world_size": args.world_size, "device": device, "transports": transports.split(","),
            "host": raw.get("host"), "threads_per_rank": raw.get("threads_per_rank"),
            "shm_state": raw.get("shm_state"), "points": points, "fits": [f.to_json() for f in model.fits],
            "errors": raw.get("errors", []), "shm_gloo_crossover_bytes": cross,
            "comm_model": model.to_json(), "profile": profile_path, "wall_s": wall})
    return 0

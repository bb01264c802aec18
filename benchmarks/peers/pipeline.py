"""One benchmark run in order: prepare, machine and versions, the parts, then the report."""

from __future__ import annotations

import argparse
import datetime as dt
import shlex
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from .build import prepare
from .machine import machine, versions
from .monitor import CpuMonitor
from .parts import part_depth, part_latency, part_serving, part_throughput
from .report import merge_previous, render_markdown, write_report
from .runner import Ctx, StepError, read_json, strata_cmd
from .settings import (
    ALL_SHAPES,
    DEFAULT_JSON,
    DEFAULT_MD,
    DEPTH_CAPABLE,
    FULL,
    PARTS,
    QUICK,
    SMALL_SHAPES,
    parse_depths,
    parse_shapes,
    rng_text,
)


def selection(args: argparse.Namespace) -> tuple[list[str], list[str], list[str], list[str]]:
    """(parts, latency shapes, depth shapes, load shapes) this run measures: --only's parts in
    PARTS order, and each part's shapes (empty when the part does not run)."""
    only = set(args.only.split(","))
    parts = [p for p in PARTS if p in only]
    lat = parse_shapes(args.shapes) if "latency" in parts else []
    depth = parse_shapes(args.depth_shapes, DEPTH_CAPABLE) if "depth" in parts else []
    load = parse_shapes(args.load_shapes, SMALL_SHAPES) if {"throughput", "serving"} & set(parts) else []
    return parts, lat, depth, load


def run_all(args: argparse.Namespace, argv: list[str] | None = None) -> int:
    """One run for the parsed command line (argv as given, shown in the report); returns the exit status."""
    from strata.config import cache_root

    cache = Path(args.cache).expanduser().resolve() if args.cache else cache_root() / "peers"
    out_md = Path(args.out_md) if args.out_md else (cache / "quick" / "benchmarks.md" if args.quick else DEFAULT_MD)
    out_json = Path(args.out_json) if args.out_json else (cache / "quick" / "results.json" if args.quick
                                                          else DEFAULT_JSON)
    if args.report_only:
        out_md.write_text(render_markdown(read_json(out_json)))
        print(f"wrote {out_md}")
        return 0

    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    run_dir = cache / "runs" / stamp
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    parts, lat_shapes, depth_shapes, load_shapes = selection(args)
    wl = QUICK if args.quick else FULL
    depths = parse_depths(args.depths) if args.depths is not None else list(wl.depths)
    shown_args = " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    results: dict[str, Any] = {
        "date": dt.datetime.now().astimezone().isoformat(timespec="seconds"), "args": shown_args,
        "quick": args.quick, "parts": parts, "workload": {
            "lat_in": wl.lat_in, "lat_out": wl.lat_out, "bench_reps": wl.bench_reps, "tp_prompts": wl.tp_prompts,
            "tp_in": rng_text(wl.tp_in), "tp_out": rng_text(wl.tp_out), "serve_target_s": wl.serve_target_s,
            "serve_min_prompts": wl.serve_min_prompts, "serve_max_prompts": wl.serve_max_prompts,
            "hf_batch": wl.hf_batch, "threads": args.threads, "strata_kv_cache_dtype": args.strata_kv_cache_dtype,
            "big_lat_out": wl.big_lat_out, "big_bench_reps": wl.big_bench_reps, "big_repeats": wl.big_repeats,
            "big_latency_rounds": args.big_latency_rounds, "depth_out": wl.depth_out, "depths": depths,
            "depth_rounds": args.depth_rounds, "depth_bracket": args.depth_bracket},
        "commands": [], "errors": [], "notes": [], "versions": {}, "machine": {},
        "wait_quiet_s": args.wait_quiet, "quiet_cpu": args.quiet_cpu,
        "latency": {}, "depth": {}, "throughput": {}, "serving": {},
    }
    ctx = Ctx(args=args, wl=wl, cache=cache, run_dir=run_dir, results=results)
    ctx.strata = strata_cmd(ctx.python)
    results["run_dir_display"] = ctx.display([str(run_dir)])
    t_start = time.perf_counter()
    print(f"peer cache {cache}\nthis run: {run_dir}\nparts: {', '.join(parts)}; latency shapes "
          f"{lat_shapes}; depth shapes {depth_shapes} at depths {depths}; load shapes {load_shapes}"
          f"{' (quick)' if args.quick else ''}", flush=True)

    ctx.monitor = CpuMonitor()
    results["versions"] = versions(ctx)
    t0 = time.perf_counter()
    ggufs = prepare(ctx, sorted(set(lat_shapes + depth_shapes + load_shapes), key=ALL_SHAPES.index))
    results["prepare_s"] = time.perf_counter() - t0
    print(f"prepare: {results['prepare_s']:.1f} s", flush=True)
    if args.prepare_only:
        ctx.monitor.stop()
        return 0
    results["machine"] = machine(ctx)
    results["machine"]["others_cpu_during_hw"] = ctx.last.get("others_cpu_mean")

    def attempt(part: str, fn, *a) -> Any:
        try:
            return fn(*a)
        except (StepError, subprocess.SubprocessError, OSError, KeyError, ValueError) as e:
            traceback.print_exc()
            results["errors"].append({"part": part, "error": str(e).splitlines()[0][:500]})
            return None

    for shape in lat_shapes:
        r = attempt(f"latency {shape}", part_latency, ctx, shape, ggufs[shape])
        if r:
            results["latency"][shape] = r
    for shape in depth_shapes:
        r = attempt(f"depth {shape}", part_depth, ctx, shape, ggufs[shape], depths)
        if r:
            results["depth"][shape] = r
    for shape in load_shapes:
        sat = None
        if "throughput" in parts:
            r = attempt(f"throughput {shape}", part_throughput, ctx, shape, ggufs[shape])
            if r:
                results["throughput"][shape] = r
                if (r.get("strata_http") or {}).get("rps"):
                    sat = (r["strata_http"]["rps"],
                           "Strata's `strata serve` at --request-rate inf, the throughput part's HTTP row")
        if "serving" in parts:
            r = attempt(f"serving {shape}", part_serving, ctx, shape, ggufs[shape], sat,
                        results["throughput"].get(shape))
            if r:
                results["serving"][shape] = r

    ctx.monitor.stop()
    results["waited_quiet_s"] = round(ctx.waited_total, 1)
    results["wall_s"] = time.perf_counter() - t_start
    if not args.no_merge:
        merge_previous(results, out_json, lat_shapes, load_shapes, depth_shapes)
    write_report(results, out_json, out_md, run_dir)
    for e in results["errors"]:
        print(f"ERROR in {e['part']}: {e['error']}")
    return 1 if results["errors"] else 0

"""The benchmark parts (latency, throughput, serving); a contended measurement is taken again."""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path
from typing import Any

from .figures import (
    derive_rates,
    others_cpu,
    parse_llama_bench,
    pick_bench,
    prompts_for_rate,
    serve_summary,
)
from .monitor import loadavg
from .runner import Ctx, Server, free_port, read_json
from .settings import RATE_FACTORS, STRATA_REPEATS, rng_text


def measure(ctx: Ctx, what: str, fn: Any) -> Any:
    """fn(attempt) runs one measurement (one or more commands) and returns its figures. When other
    processes used >= --quiet-cpu of a core during it and --retries remain, run it again (after
    waiting for quiet) and keep the least-contended attempt; the others' commands are marked
    discarded (kept in results.json, left out of the report's command list)."""
    attempts: list[tuple[float, Any, list[dict]]] = []
    for attempt in range(1 + max(0, ctx.args.retries)):
        n0 = len(ctx.results["commands"])
        out = fn(attempt)
        entries = ctx.results["commands"][n0:]
        busy = others_cpu(*entries) or 0.0
        attempts.append((busy, out, entries))
        if busy < ctx.args.quiet_cpu:
            break
        if attempt < ctx.args.retries:
            print(f"    {what}: other processes used {busy:.0f}% of a core meanwhile; measuring again", flush=True)
    best = min(range(len(attempts)), key=lambda i: attempts[i][0])
    for i, (_busy, _out, entries) in enumerate(attempts):
        for e in entries:
            e["attempt"] = i + 1
            if i != best:
                e["discarded"] = True
    if len(attempts) > 1:
        ctx.results["notes"].append(
            f"{what}: measured {len(attempts)} times because other processes were busy "
            f"({', '.join(f'{a[0]:.0f}%' for a in attempts)} of a core); the report keeps attempt {best + 1}.")
    return attempts[best][1]


# Strata's weight format, its `strata bench latency` flags, and the GGUF types compared with it.
# bf16: the same rounding as the bf16 GGUF (the random checkpoints are fp32); int4 groups of 64
# with fp32 scales = 4.5 bits a weight, as q4_0's blocks of 32 with fp16 scales.
LATENCY_PAIRS = (
    ("fp32", ["--compare", "hf"], ("f32",)),
    ("bf16", ["--quantization", "bf16"], ("bf16", "f16")),
    ("int8", ["--quantization", "int8"], ("q8_0",)),
    ("int4", ["--quantization", "int4", "--quantization-group-size", "64"], ("q4_0",)),
)


# a round's llama.cpp runs before and after Strata's may differ by this factor and still count
# as one bandwidth level (the dev VM switches between ~45 and ~75 GB/s within tens of seconds)
STEADY = 1.10


def bracketed(before: dict | None, after: dict | None, key: str) -> tuple[float | None, list[float]]:
    """(mean, [values]) of one llama-bench figure measured before and after Strata's run (either
    may be missing)."""
    values = [r[key] for r in (before, after) if r and r.get(key) is not None]
    return (sum(values) / len(values) if values else None), values


def steady(runs: list[float] | None) -> bool | None:
    """Whether llama.cpp's runs before and after Strata's agree within STEADY (the machine's
    bandwidth level held across the bracket); None when there were not two."""
    if not runs or len(runs) < 2 or min(runs) <= 0:
        return None
    return max(runs) / min(runs) <= STEADY


def _round_figures(e: dict) -> dict:
    got: dict[str, Any] = {f: e.get(f) for f in ("prefill_tps", "decode_tps")}
    for phase in ("prefill", "decode"):
        flag = steady(e.get(f"{phase}_tps_runs"))
        if flag is not None:
            got[f"{phase}_steady"] = flag
    return got


def median_rounds(per_round: list[dict[str, dict]]) -> dict[str, dict]:
    """One entry per row key: each figure the median over the rounds that measured it (others'
    CPU: the highest), and with more than one round the rounds' own figures as round_figures."""
    out: dict[str, dict] = {}
    for key in dict.fromkeys(k for got in per_round for k in got):
        entries = [got[key] for got in per_round if key in got]
        merged: dict[str, Any] = dict(entries[-1])
        for f in ("prefill_tps", "decode_tps", "prefill_stddev", "decode_stddev", "mbu", "achieved_gbs"):
            values = [e[f] for e in entries if e.get(f) is not None]
            if f in merged:
                merged[f] = statistics.median(values) if values else None
        busy = [e["others_cpu"] for e in entries if e.get("others_cpu") is not None]
        merged["others_cpu"] = max(busy) if busy else None
        if len(per_round) > 1:
            merged["round_figures"] = [_round_figures(e) for e in entries]
        out[key] = merged
    return out


def part_latency(ctx: Ctx, shape: str, ggufs: dict[str, Path]) -> dict:
    """Per precision: llama-bench on its GGUF(s), Strata's run, llama-bench again; llama.cpp's
    figure is the mean of the two. The dev VM's DRAM bandwidth drifts by up to 2x within minutes,
    so measuring each engine's rows minutes apart made the ratios move +-25% between runs;
    bracketing puts both engines under the same drift (to first order). With --latency-rounds N
    every precision is measured N times, round-robin (so a precision's rounds are minutes
    apart), and each figure is the median of its rounds (round_figures keeps each round)."""
    wl, args = ctx.wl, ctx.args
    res: dict[str, Any] = {"loadavg_before": loadavg(), "llama_bracketed": True}
    out_dir = ctx.run_dir / "latency"
    out_dir.mkdir(exist_ok=True)
    common = ["-t", str(args.threads), "-r", str(wl.bench_reps), "-o", "json"]
    all_rows: list[dict] = []

    def llama(types: tuple[str, ...], when: str) -> tuple[list[dict], float | None]:
        margs = [a for t in types for a in ("-m", ggufs[t])]
        tag = "-".join(types)

        def run(attempt: int) -> tuple[list[dict], float | None]:
            pp = ctx.run("latency", f"llama-bench-pp-{shape}-{tag}-{when}",
                         [ctx.bin_dir / "llama-bench", *margs, "-p", str(wl.lat_in), "-n", "0", *common],
                         capture=True, timeout=3600)
            e_pp = ctx.last
            tg = ctx.run("latency", f"llama-bench-tg-{shape}-{tag}-{when}",
                         [ctx.bin_dir / "llama-bench", *margs, "-p", "0", "-n", str(wl.lat_out), "-d", str(wl.lat_in),
                          *common], capture=True, timeout=3600)
            return parse_llama_bench(pp) + parse_llama_bench(tg), others_cpu(e_pp, ctx.last)

        return measure(ctx, f"{shape} llama-bench {tag} ({when} Strata)", run)

    base = [*ctx.strata, "bench", "latency", "--random-model", shape, "--dtype", "float32",
            "--kv-cache-dtype", args.strata_kv_cache_dtype, "--input-len", str(wl.lat_in), "--output-len", str(wl.lat_out), "--threads", str(args.threads), "--repeats", str(STRATA_REPEATS)]

    def strata(extra: list[str], tag: str) -> Any:
        def run(attempt: int) -> tuple[dict, float | None]:
            f = out_dir / f"strata-{shape}-{tag}{f'-a{attempt + 1}' if attempt else ''}.json"
            ctx.run("latency", f"strata-latency-{shape}-{tag}", [*base, *extra, "--json", f], timeout=3600)
            return read_json(f), others_cpu(ctx.last)
        return measure(ctx, f"{shape} strata bench latency {tag}", run)

    rounds = args.latency_rounds
    per_round: list[dict[str, dict]] = []
    for r in range(rounds):
        got: dict[str, dict] = {}
        for tag, extra, types in LATENCY_PAIRS:
            when = "" if rounds == 1 else f"-r{r + 1}"
            rows_before, busy_before = llama(types, "before" + when)
            d, busy = strata(extra, tag + when)
            rows_after, busy_after = llama(types, "after" + when)
            all_rows += rows_before + rows_after
            for t in types:
                name = ggufs[t].name
                entry: dict[str, Any] = {"others_cpu": max((b for b in (busy_before, busy_after) if b is not None), default=None)}
                for phase, p, n, depth in (("prefill", wl.lat_in, 0, 0), ("decode", 0, wl.lat_out, wl.lat_in)):
                    before, after = pick_bench(rows_before, name, p, n, depth), pick_bench(rows_after, name, p, n, depth)
                    entry[f"{phase}_tps"], entry[f"{phase}_tps_runs"] = bracketed(before, after, "avg_ts")
                    entry[f"{phase}_stddev"] = bracketed(before, after, "stddev_ts")[0]
                    entry.setdefault("model_type", (before or after or {}).get("model_type"))
                got[f"llama_{t}"] = entry
            if tag == "fp32":
                for key, src in (("strata_fp32", "strata"), ("hf_fp32", "hf")):
                    if d.get(src):
                        got[key] = {"prefill_tps": d[src]["prefill_tokens_per_s"], "decode_tps": d[src]["decode_tokens_per_s"],
                                    "mbu": d[src].get("mbu"), "achieved_gbs": d[src].get("achieved_gbs"), "others_cpu": busy}
                res["mem_bandwidth_gbs_fp32_run"] = d.get("mem_bandwidth_gbs")
            else:
                got[f"strata_{tag}"] = {"prefill_tps": d["strata"]["prefill_tokens_per_s"],
                                        "decode_tps": d["strata"]["decode_tokens_per_s"], "mbu": d["strata"].get("mbu"),
                                        "others_cpu": busy}
        per_round.append(got)
    res.update(median_rounds(per_round))
    res["rounds"] = rounds
    (out_dir / f"llama-bench-{shape}.json").write_text(json.dumps(all_rows, indent=2) + "\n")
    if all_rows:
        ctx.results["versions"]["llama_cpp"].setdefault("build_number", all_rows[0].get("build_number"))
        ctx.results["versions"]["llama_cpp"].setdefault("build_commit", all_rows[0].get("build_commit"))
        ctx.results["machine"].setdefault("llama_cpu_info", all_rows[0].get("cpu_info"))
    res["loadavg_after"] = loadavg()
    return res


def bench_serve(ctx: Ctx, part: str, name: str, url: str, model_dir: Path, num_prompts: int, rate: str,
                out: Path) -> dict:
    """`strata bench serve` against url (through measure(): repeated when contended)."""
    wl = ctx.wl

    def run(attempt: int) -> dict:
        f = out.with_name(f"{out.stem}-a{attempt + 1}{out.suffix}") if attempt else out
        cmd = [*ctx.strata, "bench", "serve", "--url", url, "--num-prompts", str(num_prompts),
               "--request-rate", rate, "--input-len", rng_text(wl.tp_in), "--output-len", rng_text(wl.tp_out),
               "--tokenizer", model_dir, "--slo", ctx.args.slo, "--seed", "0", "--no-progress", "--json", f]
        ctx.run(part, name, cmd, timeout=3600)
        s = serve_summary(read_json(f))
        s["loadavg_after"] = loadavg()
        s["others_cpu"] = others_cpu(ctx.last)
        return s

    return measure(ctx, name, run)


def strata_server(ctx: Ctx, part: str, shape: str, max_num_seqs: int | None = None) -> Server:
    port = free_port(ctx.args.port)
    cmd = [*ctx.strata, "serve", "--random-model", shape, "--dtype", "float32", "--kv-cache-dtype",
           ctx.args.strata_kv_cache_dtype, "--kv-cache-memory", ctx.args.kv_cache_memory, "--threads", str(ctx.args.threads), "--port", str(port)]
    if max_num_seqs is not None:
        cmd += ["--max-num-seqs", str(max_num_seqs)]
    return Server(ctx, part, f"strata-serve-{shape}", cmd, port, "/ready")


def llama_server(ctx: Ctx, part: str, shape: str, gguf: Path, slots: int) -> Server:
    port = free_port(ctx.args.port + 1)
    per_slot = 1 << max(8, math.ceil(math.log2(ctx.wl.tp_in[1] + ctx.wl.tp_out[1] + 64)))
    cmd = [ctx.bin_dir / "llama-server", "-m", gguf, "--host", "127.0.0.1", "--port", str(port),
           "-t", str(ctx.args.threads), "-tb", str(ctx.args.threads), "-np", str(slots), "-cb",
           "-c", str(slots * per_slot), "--no-webui"]
    return Server(ctx, part, f"llama-server-{shape}", cmd, port, "/health")


def part_throughput(ctx: Ctx, shape: str, ggufs: dict[str, Path]) -> dict:
    from strata.demo.random_models import random_model_path

    wl, args = ctx.wl, ctx.args
    res: dict[str, Any] = {"loadavg_before": loadavg(), "notes": []}
    out_dir = ctx.run_dir / "throughput"
    out_dir.mkdir(exist_ok=True)

    def offline(attempt: int) -> tuple[dict, float | None]:
        f = out_dir / f"strata-{shape}{f'-a{attempt + 1}' if attempt else ''}.json"
        ctx.run("throughput", f"strata-throughput-{shape}",
                [*ctx.strata, "bench", "throughput", "--random-model", shape, "--dtype", "float32",
                 "--kv-cache-dtype", args.strata_kv_cache_dtype, "--num-prompts", str(wl.tp_prompts), "--input-len", rng_text(wl.tp_in), "--output-len",
                 rng_text(wl.tp_out), "--threads", str(args.threads), "--compare", "hf", "--hf-batch-size",
                 str(wl.hf_batch), "--json", f], timeout=7200)
        return read_json(f), others_cpu(ctx.last)

    d, busy = measure(ctx, f"{shape} strata bench throughput --compare hf", offline)
    for key, src in (("strata_offline", "strata"), ("hf_static", "hf")):
        if d.get(src):
            s = d[src]
            res[key] = {"requests": s["requests"], "elapsed_s": s["elapsed_s"], "rps": s["requests_per_s"],
                        "output_tps": s["output_tokens_per_s"], "total_tps": s["total_tokens_per_s"],
                        "batch_size": s.get("batch_size"), "others_cpu": busy}
    model_dir = random_model_path(shape)
    with strata_server(ctx, "throughput", shape) as srv:
        s = bench_serve(ctx, "throughput", f"bench-serve-strata-{shape}-inf", srv.url, model_dir, wl.tp_prompts,
                        "inf", out_dir / f"serve-strata-{shape}-inf.json")
    res["strata_http"] = dict(s, requests=s["completed"], elapsed_s=s["duration_s"])
    runs = []
    for slots in llama_slot_list(args):
        with llama_server(ctx, "throughput", shape, ggufs["f32"], slots) as srv:
            s = bench_serve(ctx, "throughput", f"bench-serve-llama-{shape}-np{slots}-inf", srv.url, model_dir,
                            wl.tp_prompts, "inf", out_dir / f"serve-llama-{shape}-np{slots}-inf.json")
        runs.append(dict(s, requests=s["completed"], elapsed_s=s["duration_s"], slots=slots))
    res["llama_http_runs"] = runs
    res["llama_http"] = max(runs, key=lambda r: r.get("output_tps") or 0.0)
    for label, r in [("strata serve", res["strata_http"])] + [(f"llama-server -np {r['slots']}", r) for r in runs]:
        if r.get("failed"):
            res["notes"].append(f"{label}: {r['failed']} requests failed: {list(r['errors'])[:2]}")
        if r.get("short_outputs"):
            res["notes"].append(f"{label}: {r['short_outputs']} requests returned fewer tokens than max_tokens")
    if not any(r.get("short_outputs") or r.get("failed") for r in runs):
        res["notes"].append("llama-server honoured `ignore_eos` (no short outputs) and streamed "
                            "/v1/completions with a usage chunk to `strata bench serve`.")
    res["loadavg_after"] = loadavg()
    return res


def llama_slot_list(args: argparse.Namespace) -> list[int]:
    return [int(x) for x in str(args.llama_slots).split(",") if x.strip()]


def part_serving(ctx: Ctx, shape: str, ggufs: dict[str, Path], saturation: tuple[float, str] | None,
                 tp_res: dict | None = None) -> dict:
    from strata.demo.random_models import random_model_path

    wl, args = ctx.wl, ctx.args
    out_dir = ctx.run_dir / "serving"
    out_dir.mkdir(exist_ok=True)
    model_dir = random_model_path(shape)
    res: dict[str, Any] = {"loadavg_before": loadavg(), "slo": args.slo}
    if args.rates:
        rates = dict(zip(RATE_FACTORS, (float(x) for x in args.rates.split(","))))
        res["saturation_rps"], res["saturation_source"] = None, "--rates given"
    else:
        if saturation is None:  # no throughput part in this run: measure Strata's saturation here
            with strata_server(ctx, "serving", shape) as srv:
                s = bench_serve(ctx, "serving", f"bench-serve-strata-{shape}-saturation", srv.url, model_dir,
                                wl.tp_prompts, "inf", out_dir / f"serve-strata-{shape}-inf.json")
            saturation = (s["rps"], "Strata's `strata serve` at --request-rate inf, measured in this part")
        res["saturation_rps"], res["saturation_source"] = saturation
        rates = derive_rates(saturation[0])
    points = [{"name": name, "rate": rate,
               "num_prompts": prompts_for_rate(rate, wl.serve_target_s, wl.serve_min_prompts, wl.serve_max_prompts)}
              for name, rate in rates.items()]
    res["points"] = points
    # the same batch ceiling for both: llama-server runs at most `slots` sequences at once
    slots = (tp_res or {}).get("llama_http", {}).get("slots") or llama_slot_list(args)[0]
    res["llama_slots"] = slots
    with strata_server(ctx, "serving", shape, max_num_seqs=slots) as srv:
        res["strata_cmd"] = ctx.display(srv.cmd).replace(f"--port {srv.port}", "--port P")
        for p in points:
            p["strata"] = bench_serve(ctx, "serving", f"bench-serve-strata-{shape}-{p['name']}", srv.url, model_dir,
                                      p["num_prompts"], f"{p['rate']:g}",
                                      out_dir / f"serve-strata-{shape}-{p['name']}.json")
    with llama_server(ctx, "serving", shape, ggufs["f32"], slots) as srv:
        res["llama_cmd"] = ctx.display(srv.cmd).replace(f"--port {srv.port}", "--port P")
        for p in points:
            p["llama"] = bench_serve(ctx, "serving", f"bench-serve-llama-{shape}-{p['name']}", srv.url, model_dir,
                                     p["num_prompts"], f"{p['rate']:g}",
                                     out_dir / f"serve-llama-{shape}-{p['name']}.json")
    res["loadavg_after"] = loadavg()
    return res

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
from .settings import (
    BIG_SHAPES,
    DEPTH_CONTEXT,
    RATE_FACTORS,
    STRATA_REPEATS,
    Workload,
    precisions,
    rng_text,
)


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
        peaks = [e["peak_rss_bytes"] for e in entries if e.get("peak_rss_bytes")]
        if peaks:  # the highest of the rounds: a peak, not a rate
            merged["peak_rss_bytes"] = max(peaks)
        if len(per_round) > 1:
            merged["round_figures"] = [_round_figures(e) for e in entries]
        out[key] = merged
    return out


def latency_pairs(shape: str, have: set[str] | dict) -> list[tuple[str, list[str], tuple[str, ...]]]:
    """LATENCY_PAIRS for one shape: its Strata formats (settings.precisions; all for the small
    shapes), each with the GGUF types of `have` (those the shape prepares), pairs left without one
    dropped."""
    wanted = precisions(shape)
    out = []
    for tag, extra, types in LATENCY_PAIRS:
        if wanted is not None and tag not in wanted:
            continue
        kept = tuple(t for t in types if t in have)
        if kept:
            out.append((tag, extra, kept))
    return out


def latency_plan(shape: str, wl: Workload, args: argparse.Namespace) -> dict[str, int]:
    """Tokens, repetitions and rounds of one shape's latency rows: the big shapes' own (Workload.big_*,
    --big-latency-rounds), else the workload's and --latency-rounds."""
    if shape in BIG_SHAPES:
        return {"lat_in": wl.lat_in, "lat_out": wl.big_lat_out, "bench_reps": wl.big_bench_reps,
                "repeats": wl.big_repeats, "rounds": args.big_latency_rounds}
    return {"lat_in": wl.lat_in, "lat_out": wl.lat_out, "bench_reps": wl.bench_reps, "repeats": STRATA_REPEATS,
            "rounds": args.latency_rounds}


def peak_of(*entries: dict | None) -> int | None:
    """The highest peak RSS (bytes) of these commands' records, or None."""
    xs = [e.get("peak_rss_bytes") for e in entries if e]
    xs = [x for x in xs if x]
    return max(xs) if xs else None


def part_latency(ctx: Ctx, shape: str, ggufs: dict[str, Path]) -> dict:
    """Per precision: llama-bench on its GGUF(s), Strata's run, llama-bench again; llama.cpp's
    figure is the mean of the two. The dev VM's DRAM bandwidth drifts by up to 2x within minutes,
    so measuring each engine's rows minutes apart made the ratios move +-25% between runs;
    bracketing puts both engines under the same drift (to first order). With --latency-rounds N
    every precision is measured N times, round-robin (so a precision's rounds are minutes
    apart), and each figure is the median of its rounds (round_figures keeps each round)."""
    wl, args = ctx.wl, ctx.args
    plan = latency_plan(shape, wl, args)
    lat_in, lat_out = plan["lat_in"], plan["lat_out"]
    res: dict[str, Any] = {"loadavg_before": loadavg(), "llama_bracketed": True}
    if shape in BIG_SHAPES:  # its own workload: the report says so beside its table
        res["workload"] = plan
    out_dir = ctx.run_dir / "latency"
    out_dir.mkdir(exist_ok=True)
    common = ["-t", str(args.threads), "-r", str(plan["bench_reps"]), "-o", "json"]
    all_rows: list[dict] = []

    def llama(types: tuple[str, ...], when: str) -> tuple[list[dict], float | None, int | None]:
        margs = [a for t in types for a in ("-m", ggufs[t])]
        tag = "-".join(types)

        def run(attempt: int) -> tuple[list[dict], float | None, int | None]:
            pp = ctx.run("latency", f"llama-bench-pp-{shape}-{tag}-{when}",
                         [ctx.bin_dir / "llama-bench", *margs, "-p", str(lat_in), "-n", "0", *common],
                         capture=True, timeout=3600)
            e_pp = ctx.last
            tg = ctx.run("latency", f"llama-bench-tg-{shape}-{tag}-{when}",
                         [ctx.bin_dir / "llama-bench", *margs, "-p", "0", "-n", str(lat_out), "-d", str(lat_in),
                          *common], capture=True, timeout=3600)
            # one model per invocation: its peak RSS is that model's (two would give the larger one's)
            peak = peak_of(e_pp, ctx.last) if len(types) == 1 else None
            return parse_llama_bench(pp) + parse_llama_bench(tg), others_cpu(e_pp, ctx.last), peak

        return measure(ctx, f"{shape} llama-bench {tag} ({when} Strata)", run)

    base = [*ctx.strata, "bench", "latency", "--random-model", shape, "--dtype", "float32",
            "--kv-cache-dtype", args.strata_kv_cache_dtype, "--input-len", str(lat_in), "--output-len", str(lat_out),
            "--threads", str(args.threads), "--repeats", str(plan["repeats"])]

    def strata(extra: list[str], tag: str) -> Any:
        def run(attempt: int) -> tuple[dict, float | None, int | None]:
            f = out_dir / f"strata-{shape}-{tag}{f'-a{attempt + 1}' if attempt else ''}.json"
            ctx.run("latency", f"strata-latency-{shape}-{tag}", [*base, *extra, "--json", f], timeout=3600)
            return read_json(f), others_cpu(ctx.last), peak_of(ctx.last)
        return measure(ctx, f"{shape} strata bench latency {tag}", run)

    rounds = plan["rounds"]
    per_round: list[dict[str, dict]] = []
    for r in range(rounds):
        got: dict[str, dict] = {}
        for tag, extra, types in latency_pairs(shape, ggufs):
            when = "" if rounds == 1 else f"-r{r + 1}"
            rows_before, busy_before, peak_before = llama(types, "before" + when)
            d, busy, peak = strata(extra, tag + when)
            rows_after, busy_after, peak_after = llama(types, "after" + when)
            all_rows += rows_before + rows_after
            for t in types:
                name = ggufs[t].name
                entry: dict[str, Any] = {"others_cpu": max((b for b in (busy_before, busy_after) if b is not None), default=None)}
                if peak_before or peak_after:
                    entry["peak_rss_bytes"] = max(x for x in (peak_before, peak_after) if x)
                for phase, p, n, depth in (("prefill", lat_in, 0, 0), ("decode", 0, lat_out, lat_in)):
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
                if peak:  # the fp32 row's process runs transformers too: no peak of Strata's own there
                    got[f"strata_{tag}"]["peak_rss_bytes"] = peak
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


# The depth part's KV formats: (row tag, Strata --kv-cache-dtype, llama-bench -ctk/-ctv). Both engines
# read bf16 weights (Strata --quantization bf16, the bf16 GGUF) so the KV bytes weigh more at depth.
DEPTH_KV = (
    ("bf16", "bfloat16", "f16"),
    ("int8", "int8", "q8_0"),
)
# llama.cpp keeps a quantised V cache only with flash attention on; every depth row runs with it,
# f16 too, so the two KV formats differ in nothing else
LLAMA_DEPTH_FLAGS = ("-fa", "on")  # llama-bench --help: -fa, --flash-attn <on|off|auto>


def depth_key(depth: int) -> str:
    """results.json key of one depth ('0', '4096', ...: JSON keys are strings)."""
    return str(depth)


def part_depth(ctx: Ctx, shape: str, ggufs: dict[str, Path], depths: list[int]) -> dict:
    """Batch-1 decode after a context of each depth: Strata's bf16 and int8 KV vs llama.cpp's f16
    and q8_0 KV, bf16 weights on both. Per round, per KV format, per depth: llama-bench (-p 0 -n N
    -d D: N tokens generated after a D-token context, which it prefills untimed), then Strata's run
    (`strata bench latency --input-len D --output-len N`: its decode figure covers the N - 1 steps
    after the prompt; one warm-up run, which prefills a context of D again, then one timed run:
    without the warm-up a new process's first decode steps ran 1.6x slower). With --depth-bracket
    llama-bench runs again after Strata and its figure is the mean of the two, as in the latency
    part; by default it runs once, before (a 16k context takes each engine minutes to prefill on 2
    cores). --depth-rounds rounds, each figure the median of its rounds (round_figures keeps each)."""
    from .convert import long_context_model

    wl, args = ctx.wl, ctx.args
    n_out = wl.depth_out
    model = long_context_model(ctx, shape, max(DEPTH_CONTEXT, max(depths) + n_out))
    gguf = ggufs["bf16"]
    rounds, bracket = args.depth_rounds, args.depth_bracket
    res: dict[str, Any] = {"loadavg_before": loadavg(), "depths": depths, "output_len": n_out, "rounds": rounds,
                           "llama_bracketed": bracket,
                           "weights": {"strata": "--quantization bf16", "llama": gguf.name},
                           "kv": [{"tag": t, "strata": s, "llama": ll} for t, s, ll in DEPTH_KV],
                           "model_dir": ctx.display([str(model)]), "llama_flags": list(LLAMA_DEPTH_FLAGS)}
    out_dir = ctx.run_dir / "depth"
    out_dir.mkdir(exist_ok=True)
    all_rows: list[dict] = []

    def llama(kv: str, depth: int, when: str) -> tuple[dict | None, float | None, int | None]:
        def run(attempt: int) -> tuple[dict | None, float | None, int | None]:
            out = ctx.run("depth", f"llama-bench-depth-{shape}-{kv}-d{depth}-{when}",
                          [ctx.bin_dir / "llama-bench", "-m", gguf, "-p", "0", "-n", str(n_out), "-d", str(depth),
                           "-ctk", kv, "-ctv", kv, *LLAMA_DEPTH_FLAGS, "-t", str(args.threads),
                           "-r", str(wl.depth_bench_reps), "-o", "json"], capture=True, timeout=3600)
            rows = parse_llama_bench(out)
            all_rows.extend(rows)
            return pick_bench(rows, gguf.name, 0, n_out, depth), others_cpu(ctx.last), peak_of(ctx.last)

        return measure(ctx, f"{shape} llama-bench depth {depth} {kv} KV ({when} Strata)", run)

    def strata(kv_dtype: str, depth: int, tag: str) -> tuple[dict, float | None, int | None]:
        def run(attempt: int) -> tuple[dict, float | None, int | None]:
            f = out_dir / f"strata-{shape}-{tag}{f'-a{attempt + 1}' if attempt else ''}.json"
            ctx.run("depth", f"strata-depth-{shape}-{tag}",
                    [*ctx.strata, "bench", "latency", "--model", model, "--dtype", "float32", "--quantization", "bf16",
                     "--kv-cache-dtype", kv_dtype, "--input-len", str(max(1, depth)), "--output-len", str(n_out),
                     "--warmup", "1", "--repeats", "1", "--threads", str(args.threads), "--json", f], timeout=3600)
            return read_json(f), others_cpu(ctx.last), peak_of(ctx.last)

        return measure(ctx, f"{shape} strata bench latency depth {depth} {kv_dtype} KV", run)

    per_round: list[dict[str, dict[str, dict]]] = []
    for r in range(rounds):
        got: dict[str, dict[str, dict]] = {depth_key(d): {} for d in depths}
        when = "" if rounds == 1 else f"-r{r + 1}"
        for tag, kv_dtype, kv in DEPTH_KV:
            for depth in depths:
                before, busy_b, peak_b = llama(kv, depth, "before" + when)
                d, busy, peak = strata(kv_dtype, depth, f"{tag}kv-d{depth}{when}")
                after, busy_a, peak_a = llama(kv, depth, "after" + when) if bracket else (None, None, None)
                mean, runs = bracketed(before, after, "avg_ts")
                entry: dict[str, Any] = {"decode_tps": mean, "decode_tps_runs": runs,
                                         "decode_stddev": bracketed(before, after, "stddev_ts")[0],
                                         "others_cpu": others_cpu({"others_cpu_mean": busy_b},
                                                                  {"others_cpu_mean": busy_a}),
                                         "type_k": (before or after or {}).get("type_k"),
                                         "flash_attn": (before or after or {}).get("flash_attn")}
                if peak_b or peak_a:
                    entry["peak_rss_bytes"] = max(x for x in (peak_b, peak_a) if x)
                got[depth_key(depth)][f"llama_{kv}"] = entry
                s = d["strata"]
                got[depth_key(depth)][f"strata_{tag}"] = {
                    "decode_tps": s["decode_tokens_per_s"], "context_prefill_s": s.get("prefill_s"),
                    "mbu": s.get("mbu"), "others_cpu": busy, "kv_bytes_per_token": d.get("kv_bytes_per_token"),
                    **({"peak_rss_bytes": peak} if peak else {})}
        per_round.append(got)
    res["by_depth"] = {depth_key(d): median_rounds([g[depth_key(d)] for g in per_round]) for d in depths}
    (out_dir / f"llama-bench-depth-{shape}.json").write_text(json.dumps(all_rows, indent=2) + "\n")
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

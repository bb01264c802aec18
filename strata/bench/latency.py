"""Latency of one batch: prefill time, decode speed, and how close decode gets to the memory roofline.

Runs --batch random-token prompts of --input-len tokens together, greedy (or sampled with
--temperature / --top-p / --top-k), ignoring EOS, for --output-len tokens each. Prefill time is the
batch's time to first token; the remaining output-len - 1 tokens are decode steps. Decode streams
every weight and each sequence's KV once per step, so achieved bandwidth = (weight bytes + mean KV
bytes read per step) / step time, and MBU = that / this machine's memory bandwidth, measured
in-process just before the runs. With --quantization the weight bytes are the quantised ones (the
engine's memory plan). Prefill FLOP/s is 2 x params x prompt tokens / prefill time (attention FLOPs
not counted).

With --compare hf, transformers runs the same prompts on the same weights, dtype and threads:
one forward over the prompts for prefill, then a plain greedy loop over a DynamicCache.

examples:
  strata bench latency                                      # demo model, batch 1, 128 in / 128 out
  strata bench latency --random-model smol-135m --dtype float32 --compare hf
  strata bench latency --random-model qwen-0.5b --dtype float32 --quantization int4
  strata bench latency --model ./Qwen2.5-0.5B --batch 8 --input-len 512 --output-len 64 --json lat.json
  strata bench latency --random-model smol-135m --dtype float32 --compile     # torch.compile'd decode
  strata bench latency --random-model smol-135m --dtype float32 --profile --trace decode.json

--profile runs the batch once more after the timed run with the decode steps under torch.profiler
and prints the top-5 operators/kernels by self time, their share of step time, and the share of
step time spent outside any operator (host overhead); see strata/kernels/profile.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc

import numpy as np
import torch

from strata.bench.common import (
    CompetingLoad,
    add_model_args,
    add_repeat_args,
    add_sampling_args,
    bench_engine_kwargs,
    capture_stats,
    check_sampling_args,
    load_average,
    median_of_runs,
    random_prompts,
    ratio,
    resolve_model,
    sampling_note,
    sampling_params,
    special_ids,
    stability_notes,
    warm_capture,
    write_json,
)
from strata.bench.hf_peer import hf_latency, load_hf_model
from strata.engine.llm import LLM
from strata.errors import ConfigError, StrataError
from strata.hardware.probe import measure_mem_bandwidth
from strata.kernels.profile import profile_decode
from strata.memory import planner as memory_planner
from strata.protocol.sampling_params import RequestOutputKind
from strata.text_table import print_table

NAME = "latency"
HELP = "prefill time, decode tok/s and memory-bandwidth utilisation of one batch (optionally vs transformers)"
DESCRIPTION = __doc__

_RATES = ("prefill_tokens_per_s", "prefill_gflops", "decode_tokens_per_s_per_seq",
          "decode_tokens_per_s", "achieved_gbs", "mbu")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    g = p.add_argument_group("workload")
    g.add_argument("--batch", type=int, default=1, help="sequences run together (default 1)")
    g.add_argument("--input-len", type=int, default=128, help="prompt tokens per sequence (default 128)")
    g.add_argument("--output-len", type=int, default=128, help="output tokens per sequence, >= 2 (default 128)")
    g.add_argument("--warmup", type=int, default=1, help="untimed warm-up runs (short outputs) before timing")
    g.add_argument("--seed", type=int, default=0, help="seed for the token ids")
    add_repeat_args(g)
    add_sampling_args(g)
    g.add_argument("--competing-load", type=int, default=0, metavar="N",
                   help="run N busy-looping processes during the timed runs of every engine (contention: "
                   "another job sharing the cores); default 0")
    g.add_argument("--profile", action="store_true",
                   help="after the timed run, profile the decode loop: top-5 operators/kernels by self time "
                   "and the host-overhead share of step time")
    g.add_argument("--trace", default=None, metavar="FILE",
                   help="write the profiled decode loop as a Chrome trace (implies --profile)")


def figures(
    prefill_s: float, decode_s: float, args: argparse.Namespace, params: int, weight_bytes: int,
    kv_bytes_per_token: int, bandwidth_gbs: float, steps: int | None = None,
) -> dict:
    """Rates and roofline figures from the two phase times (same formulas for every engine);
    `steps`: the decode steps decode_s covers (default output_len - 1)."""
    b, n_in, n_out = args.batch, args.input_len, args.output_len
    steps = n_out - 1 if steps is None else steps
    step_s = decode_s / steps
    # decode step j (1..steps) attends over n_in + j positions: mean n_in + n_out / 2 per sequence
    kv_read = b * (n_in + n_out / 2) * kv_bytes_per_token
    achieved = (weight_bytes + kv_read) / step_s / 1e9
    return {
        "prefill_s": prefill_s,
        "prefill_tokens_per_s": b * n_in / prefill_s,
        "prefill_gflops": 2 * params * b * n_in / prefill_s / 1e9,
        "decode_s": decode_s,
        "decode_steps": steps,
        "ms_per_step": step_s * 1e3,
        "decode_tokens_per_s_per_seq": steps / decode_s,
        "decode_tokens_per_s": b * steps / decode_s,
        "bytes_per_step": weight_bytes + kv_read,
        "achieved_gbs": achieved,
        "mbu": achieved / bandwidth_gbs,
    }


_SPREAD = ("prefill_tokens_per_s", "decode_tokens_per_s")


def _row(name: str, f: dict) -> list:
    s = f["spread"]
    return [name, f["prefill_s"] * 1e3, f["prefill_tokens_per_s"], f"{s['prefill_tokens_per_s']:.0%}",
            f["prefill_gflops"], f["ms_per_step"], f["decode_tokens_per_s_per_seq"], f["decode_tokens_per_s"],
            f"{s['decode_tokens_per_s']:.0%}", f["achieved_gbs"], f"{f['mbu']:.1%}"]


def _repeat_prompts(args: argparse.Namespace, vocab: int, avoid: set[int], first: list[list[int]]) -> list:
    """Fresh prompts for every repeat after the first (the same ones again would hit the prefix cache)."""
    return [first] + [
        random_prompts(np.random.default_rng(args.seed + 2000 + i), vocab, [args.input_len] * args.batch, avoid)
        for i in range(1, args.repeats)
    ]


def _strata_run(llm, prompts: list[list[int]], output_len: int, args) -> tuple[float, float, int]:
    """(prefill_s, decode_s, decode steps) from the requests' own timeline stamps.

    Decode is the window in which every sequence decodes every step: from the last prompt's first
    token to the first request's end. They coincide with the batch's whole decode when all
    prompts prefill in one step; when the prompts exceed the step's token budget, prefill is
    chunked, the early sequences start decoding (in steps shared with prefill chunks) and finish
    early, and counting their tokens would credit the batch with steps it never ran."""
    outs = llm.generate(prompts, sampling_params(args, output_len), use_tqdm=False)
    if any(len(o.outputs[0].token_ids) != output_len for o in outs):
        raise StrataError(f"a request stopped before its {output_len} tokens")
    start = min(o.arrival_time for o in outs)
    last = max(outs, key=lambda o: o.first_token_time)
    first = last.first_token_time
    end = min(o.finished_time for o in outs)
    steps = sum(1 for t in last.token_times if first < t <= end)
    if steps == 0:
        raise ConfigError(
            f"no step decoded all {len(prompts)} sequences at once (prefill was chunked over more steps "
            f"than --output-len {output_len} leaves): raise --max-num-batched-tokens to at least "
            f"{sum(len(p) for p in prompts)} or --output-len")
    return first - start, end - first, steps


def run(args: argparse.Namespace) -> int:
    for flag, v, lo in (("--batch", args.batch, 1), ("--input-len", args.input_len, 1),
                        ("--output-len", args.output_len, 2), ("--warmup", args.warmup, 0),
                        ("--repeats", args.repeats, 1), ("--competing-load", args.competing_load, 0)):
        if v < lo:
            raise ConfigError(f"{flag}: must be >= {lo}, got {v}")
    check_sampling_args(args)
    need = args.input_len + args.output_len
    profile = args.profile or args.trace is not None
    if profile and args.compile:
        import torch._inductor.config as inductor_config

        inductor_config.cpp.enable_kernel_profile = True  # compiled C++ kernels as named profiler events
    llm = LLM(resolve_model(args), **bench_engine_kwargs(args, need, args.batch))
    eng = llm.engine
    cfg, vocab, avoid = eng.model_config, eng.model_config.vocab_size, special_ids(eng)
    rng = np.random.default_rng(args.seed)
    prompts = random_prompts(rng, vocab, [args.input_len] * args.batch, avoid)
    warm = [random_prompts(np.random.default_rng(args.seed + 1 + i), vocab, [args.input_len] * args.batch, avoid)
            for i in range(args.warmup)]
    warm_len = min(args.output_len, 8)
    params, held, kvtok = cfg.num_params(), eng.plan.weight_bytes, eng.plan.kv_bytes_per_token
    # what a decode step reads: an untied input embedding is looked up, not streamed; an MoE
    # model's step, the experts its batch picks (expected under uniform routing: memory/planner.py)
    wbytes = memory_planner.streamed_weight_bytes(cfg, eng.dtype, eng.config.quantization,
                                                  eng.config.quantization_group_size, tokens=args.batch)
    info = {
        "benchmark": NAME, "model": str(eng.model_path), "architecture": cfg.architecture, "params": params,
        "dtype": str(eng.dtype).replace("torch.", ""), "device": args.device, "threads": eng.threads,
        "batch": args.batch, "input_len": args.input_len, "output_len": args.output_len,
        "warmup": args.warmup, "repeats": args.repeats, "competing_load": args.competing_load, "seed": args.seed,
        "temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k,
        "weight_bytes": held, "streamed_weight_bytes": wbytes, "kv_bytes_per_token": kvtok,
        "quantization": eng.config.quantization,
        "quantization_group_size": eng.config.quantization_group_size if eng.config.quantization == "int4" else None,
        "fuse": eng.config.fuse, "compile": eng.config.compile, "cuda_graphs": eng.config.cuda_graphs,
    }
    quant = ""
    if eng.config.quantization is not None:
        quant = f", {eng.config.quantization} weights"
        if eng.config.quantization == "int4":
            quant += f" (group {eng.config.quantization_group_size})"
    print(
        f"model {info['model']} ({cfg.architecture}, {params / 1e6:.0f}M params), {info['dtype']}{quant}, "
        f"{args.device}, {eng.threads} threads\n"
        f"batch {args.batch} x input {args.input_len}, output {args.output_len} "
        f"({args.output_len - 1} decode steps), {sampling_note(args)}, warmup {args.warmup}, "
        f"{args.repeats} timed runs per engine "
        "(medians; spread = (max - min) / median)"
        + (f"; {args.competing_load} competing busy process(es) during the timed runs" if args.competing_load else "")
    )
    if args.batch * args.input_len > args.max_num_batched_tokens:
        print(f"note: {args.batch * args.input_len} prompt tokens exceed --max-num-batched-tokens "
              f"{args.max_num_batched_tokens}; Strata's prefill is chunked over several steps, and its decode "
              "figures cover only the steps that decode every sequence")

    bw = measure_mem_bandwidth(args.device)
    info["mem_bandwidth_gbs"] = info["mem_bandwidth_before_gbs"] = bw
    kv_mean = args.batch * (args.input_len + args.output_len / 2) * kvtok
    print(f"memory bandwidth (measured now): {bw:.1f} GB/s; decode reads {wbytes / 1e6:.1f} MB weights "
          f"+ {kv_mean / 1e6:.1f} MB KV (mean) per step")

    batches = _repeat_prompts(args, vocab, avoid, prompts)
    load_before = load_average()
    warm_capture(eng)
    for w in warm:
        _strata_run(llm, w, warm_len, args)
    with CompetingLoad(args.competing_load):
        strata_runs = [_strata_run(llm, b, args.output_len, args) for b in batches]
    info["capture"] = capture_stats(eng)
    # DRAM bandwidth on a shared VM moves within seconds: measure again after the run and take
    # the higher figure, so MBU is against the best the machine showed around the run
    after = measure_mem_bandwidth(args.device)
    print(f"memory bandwidth after the run: {after:.1f} GB/s; MBU uses {max(bw, after):.1f} GB/s (the higher)")
    bw = info["mem_bandwidth_gbs"] = max(bw, after)
    fig = dict(params=params, weight_bytes=wbytes, kv_bytes_per_token=kvtok, bandwidth_gbs=bw)
    results = {"strata": median_of_runs([figures(p, d, args, **fig, steps=n) for p, d, n in strata_runs], _SPREAD)}
    rows = [_row("strata", results["strata"])]
    report = None
    if profile:
        again = random_prompts(np.random.default_rng(args.seed + 1000), vocab, [args.input_len] * args.batch, avoid)
        # the engine's steps as the timed runs' LLM.generate drives them: final outputs only
        params = dataclasses.replace(sampling_params(args, args.output_len), output_kind=RequestOutputKind.FINAL_ONLY)
        report = profile_decode(eng, again, params, top=5, trace=args.trace)
        report.unprofiled_step_ms = results["strata"]["ms_per_step"]
        results["strata"]["profile"] = report.to_dict()

    if args.compare == "hf":
        path, dtype, threads = eng.model_path, eng.dtype, eng.threads
        hf_fig = dict(fig, weight_bytes=memory_planner.streamed_weight_bytes(cfg, dtype, tokens=args.batch))  # transformers reads float weights
        del llm, eng
        gc.collect()  # free Strata's KV cache before loading the peer
        torch.set_num_threads(threads)
        model = load_hf_model(str(path), dtype, args.device)
        for w in warm:
            hf_latency(model, w, warm_len, args.device, progress=False)
        with CompetingLoad(args.competing_load):
            hf_runs = [hf_latency(model, b, args.output_len, args.device) for b in batches]
        results["hf"] = hf = median_of_runs(
            [figures(r.prefill_s, r.decode_s, args, **hf_fig) for r in hf_runs], _SPREAD)
        results["ratio"] = r = {k: ratio(results["strata"][k], hf[k]) for k in _RATES}
        rows.append(_row("hf", hf))
        rows.append(["strata/hf", "", f"{r[_RATES[0]]:.2f}x", "", f"{r[_RATES[1]]:.2f}x", "",
                     f"{r[_RATES[2]]:.2f}x", f"{r[_RATES[3]]:.2f}x", "", f"{r[_RATES[4]]:.2f}x",
                     f"{r[_RATES[5]]:.2f}x"])

    spreads = {name: results[name]["spread"] for name in ("strata", "hf") if name in results}
    info["unstable"] = stability_notes(info["mem_bandwidth_before_gbs"], after, load_before, load_average(),
                                       info["threads"] + args.competing_load, spreads)
    print()
    print_table(["engine", "prefill ms", "prefill tok/s", "±", "prefill GFLOP/s", "ms/step",
                 "tok/s/seq", "tok/s total", "±", "decode GB/s", "MBU"], rows)
    for note in info["unstable"]:
        print(f"warning: unstable measurement: {note}; re-run on a quiet machine or with more --repeats")
    if info["capture"] is not None:
        c = info["capture"]
        print(f"captured decode: {c['compiles']} torch.compile compilations, {c['graphs']} CUDA graphs; "
              f"batch buckets used {c['bucket_hits']}")
    if report is not None:
        print()
        print(report.format())
    write_json(args.json, {**info, **results})
    return 0

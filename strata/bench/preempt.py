"""Oversubscribed KV cache: more concurrent long sequences than the KV pool holds.

Runs the same greedy, ignore-EOS workload three ways in one invocation: with a KV cache big
enough for everything (the reference, no preemption), then with a cache that holds only
--kv-fraction of the workload's peak KV, once per preemption mode (recompute: preempted
sequences drop their KV and re-prefill later; swap: their blocks park in host memory and come
back ahead of use). Reports each run's throughput, preemptions and swapped blocks, and whether
every output is identical to the reference (nothing lost or changed). Exits 1 on any mismatch.

examples:
  strata bench preempt --random-model smol-135m --dtype float32
  strata bench preempt --num-prompts 8 --input-len 128:256 --output-len 64 --kv-fraction 0.3 --json p.json
"""

from __future__ import annotations

import argparse
import gc
import time

import numpy as np

from strata.bench.common import (
    add_model_args,
    bench_engine_kwargs,
    parse_range,
    random_prompts,
    resolve_model,
    special_ids,
    write_json,
)
from strata.engine.llm import LLM
from strata.errors import ConfigError
from strata.protocol.sampling_params import SamplingParams
from strata.text_table import print_table

NAME = "preempt"
HELP = "oversubscribed KV cache: recompute vs swap preemption, outputs checked against a reference"
DESCRIPTION = __doc__


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    g = p.add_argument_group("workload")
    g.add_argument("--num-prompts", type=int, default=16, help="requests in the workload")
    g.add_argument("--input-len", default="256:512", help="prompt tokens, N or LO:HI (default 256:512)")
    g.add_argument("--output-len", default="128", help="output tokens, N or LO:HI (default 128)")
    g.add_argument("--kv-fraction", type=float, default=0.25,
                   help="KV cache size as a fraction of the workload's peak KV (default 0.25)")
    g.add_argument("--modes", default="recompute,swap", help="comma-separated preemption modes to run")
    g.add_argument("--seed", type=int, default=0, help="seed for lengths and token ids")


def _run(model, kwargs: dict, prompts, params) -> tuple[dict, list[list[int]], object]:
    llm = LLM(model, **kwargs)
    # untimed warm-up with a few full prompts, so the first large step's one-off costs (fresh
    # activation memory) are not charged to whichever mode runs first
    llm.generate(prompts[:4], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=False)
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    engine = llm.engine
    tokens = [o.outputs[0].token_ids for o in outs]
    swapper = getattr(engine.runner, "swapper", None)
    fig = {
        "elapsed_s": elapsed,
        "output_tokens_per_s": sum(map(len, tokens)) / elapsed,
        "preemptions": engine.scheduler.num_preemptions,
        "blocks_swapped_out": swapper.blocks_out if swapper else 0,
        "blocks_swapped_in": swapper.blocks_in if swapper else 0,
        "kv_blocks": engine.plan.num_blocks,
    }
    return fig, tokens, engine


def run(args: argparse.Namespace) -> int:
    if not 0 < args.kv_fraction < 1:
        raise ConfigError(f"--kv-fraction must be in (0, 1), got {args.kv_fraction}")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for m in modes:
        if m not in ("recompute", "swap", "auto"):
            raise ConfigError(f"--modes: unknown mode {m!r}; choose from recompute, swap, auto")
    in_lo, in_hi = parse_range(args.input_len, "--input-len")
    out_lo, out_hi = parse_range(args.output_len, "--output-len")
    rng = np.random.default_rng(args.seed)
    in_lens = rng.integers(in_lo, in_hi + 1, size=args.num_prompts).tolist()
    out_lens = rng.integers(out_lo, out_hi + 1, size=args.num_prompts).tolist()
    model = resolve_model(args)
    need_len = max(i + o for i, o in zip(in_lens, out_lens))
    base = bench_engine_kwargs(args, need_len, args.num_prompts)
    probe_llm = LLM(model, **{**base, "kv_cache_memory": "64MiB" if base["kv_cache_memory"] is None else base["kv_cache_memory"]})
    engine = probe_llm.engine
    prompts = random_prompts(rng, engine.model_config.vocab_size, in_lens, special_ids(engine))
    per_token, block = engine.plan.kv_bytes_per_token, engine.plan.block_size
    peak = sum(-(-(i + o) // block) for i, o in zip(in_lens, out_lens)) * block * per_token
    one_seq = -(-need_len // block) * block * per_token
    small = max(int(peak * args.kv_fraction), one_seq)
    del probe_llm, engine
    gc.collect()
    params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for o in out_lens]
    print(f"{args.num_prompts} requests, input {args.input_len}, output {args.output_len}; peak KV "
          f"{peak / 2**20:.1f} MiB, oversubscribed cache {small / 2**20:.1f} MiB ({small / peak:.0%})")
    results, rows, ok = {}, [], True
    ref_fig, ref_tokens, _ = _run(model, {**base, "kv_cache_memory": peak + one_seq}, prompts, params)
    results["reference"] = ref_fig
    rows.append(["reference (fits)", ref_fig["elapsed_s"], ref_fig["output_tokens_per_s"],
                 ref_fig["preemptions"], 0, "-"])
    gc.collect()
    for mode in modes:
        kw = {**base, "kv_cache_memory": small, "preemption_mode": mode, "swap_space": peak + one_seq}
        fig, tokens, _ = _run(model, kw, prompts, params)
        same = tokens == ref_tokens
        ok &= same
        fig["identical_to_reference"] = same
        results[mode] = fig
        rows.append([mode, fig["elapsed_s"], fig["output_tokens_per_s"], fig["preemptions"],
                     fig["blocks_swapped_out"], "yes" if same else "NO"])
        gc.collect()
    print()
    print_table(["mode", "elapsed s", "output tok/s", "preemptions", "blocks swapped out", "outputs identical"], rows)
    write_json(args.json, {"benchmark": "preempt", "kv_fraction": args.kv_fraction, "peak_kv_bytes": peak,
                           "cache_bytes": small, "results": results})
    return 0 if ok else 1

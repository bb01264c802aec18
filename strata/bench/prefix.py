"""Prefix caching: many requests sharing one long system prompt, with the cache and without.

--num-prompts requests share a system prompt of --prefix-len random tokens, each followed by its
own random suffix of --suffix-len tokens (N or LO:HI uniform), and generate --output-len tokens
(greedy, ignoring EOS). All of them arrive at once through LLM.generate (offline). The same
requests run twice in one invocation, on two engines that differ only in enable_prefix_caching:
first with prefix caching, then without.

Before each timed run, an untimed warm-up runs on that engine (2 output tokens each): first
unrelated random prompts that fill one step's token budget (a process's first large step pays
first-touch costs for its activations, several times the steady state on the dev VM), then the
system prompt plus a suffix of its own. With caching the warm-up leaves the system prompt's
blocks in the cache, as on a server that has already served the prompt once; both engines get
the same warm-up.

TTFT per request = first_token_time - arrival_time from its RequestOutput; every request arrives
at the start, so TTFT includes queueing behind other prefills. Reported: mean, p50 and p90 TTFT,
total time, prompt tokens actually computed, the cache's hit rate, and the no-cache / cache ratios.

examples:
  strata bench prefix --random-model smol-135m --dtype float32
  strata bench prefix --num-prompts 16 --prefix-len 256 --suffix-len 16:64 --json prefix.json
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
    ratio,
    resolve_model,
    special_ids,
    write_json,
)
from strata.engine.llm import LLM
from strata.errors import ConfigError
from strata.protocol.sampling_params import SamplingParams
from strata.text_table import print_table

NAME = "prefix"
HELP = "TTFT of requests sharing a long system prompt, with and without prefix caching"
DESCRIPTION = __doc__

_RATIOS = ("ttft_mean_s", "ttft_p50_s", "ttft_p90_s", "elapsed_s")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    g = p.add_argument_group("workload")
    g.add_argument("--num-prompts", type=int, default=64, help="requests sharing the prefix")
    g.add_argument("--prefix-len", type=int, default=1024, help="shared system-prompt tokens (default 1024)")
    g.add_argument("--suffix-len", default="32:128",
                   help="per-request suffix tokens, N or LO:HI uniform (default 32:128)")
    g.add_argument("--output-len", type=int, default=16, help="output tokens per request (default 16)")
    g.add_argument("--seed", type=int, default=0, help="seed for lengths and token ids")


def _run(llm, prompts: list[list[int]], fill: list[list[int]], warm: list[int], output_len: int) -> dict:
    """Warm-up (`fill`, then `warm`: the system prompt stays most recently used), then every prompt
    at once; figures from the requests' timelines."""
    short = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    llm.generate(fill, short, use_tqdm=False)
    llm.generate([warm], short, use_tqdm=False)
    stats = llm.engine.block_manager.stats
    queries, hits = stats.queries, stats.hits
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=True)
    elapsed = time.perf_counter() - t0
    ttft = np.array([o.first_token_time - o.arrival_time for o in outs])
    prompt_tokens = sum(len(p) for p in prompts)
    hit_blocks, queried = stats.hits - hits, stats.queries - queries
    return {
        "prefix_caching": llm.engine.config.enable_prefix_caching, "requests": len(prompts),
        "elapsed_s": elapsed,
        "ttft_mean_s": float(ttft.mean()), "ttft_p50_s": float(np.percentile(ttft, 50)),
        "ttft_p90_s": float(np.percentile(ttft, 90)), "ttft_max_s": float(ttft.max()),
        "output_tokens_per_s": sum(len(o.outputs[0].token_ids) for o in outs) / elapsed,
        "prompt_tokens": prompt_tokens,
        "prompt_tokens_computed": prompt_tokens - hit_blocks * llm.engine.block_manager.block_size,
        "blocks_queried": queried, "blocks_hit": hit_blocks,
        "hit_rate": hit_blocks / queried if queried else 0.0,
    }


def _row(name: str, f: dict) -> list:
    return [name, f["requests"], f["ttft_mean_s"] * 1e3, f["ttft_p50_s"] * 1e3, f["ttft_p90_s"] * 1e3,
            f["elapsed_s"], f["output_tokens_per_s"], f["prompt_tokens_computed"], f"{f['hit_rate']:.1%}"]


def run(args: argparse.Namespace) -> int:
    if args.compare is not None:
        raise ConfigError("--compare: bench prefix compares Strata with and without prefix caching only")
    if not args.enable_prefix_caching:
        raise ConfigError("--no-prefix-caching: bench prefix runs both with and without the cache itself")
    for flag, v, lo in (("--num-prompts", args.num_prompts, 1), ("--prefix-len", args.prefix_len, 1),
                        ("--output-len", args.output_len, 1)):
        if v < lo:
            raise ConfigError(f"{flag}: must be >= {lo}, got {v}")
    suf_lo, suf_hi = parse_range(args.suffix_len, "--suffix-len")
    rng = np.random.default_rng(args.seed)
    suffix_lens = rng.integers(suf_lo, suf_hi + 1, size=args.num_prompts + 1).tolist()
    need = args.prefix_len + max(suffix_lens) + args.output_len
    model = resolve_model(args)
    kw = bench_engine_kwargs(args, need, args.num_prompts)

    results: dict = {}
    info: dict = {}
    for key, caching in (("cache", True), ("no_cache", False)):
        llm = LLM(model, **{**kw, "enable_prefix_caching": caching})
        eng = llm.engine
        if not info:
            vocab = eng.model_config.vocab_size
            system = random_prompts(rng, vocab, [args.prefix_len], special_ids(eng))[0]
            suffixes = random_prompts(rng, vocab, suffix_lens, special_ids(eng))
            prompts = [system + s for s in suffixes[1:]]
            budget = kw["max_num_batched_tokens"]
            piece = max(1, min(budget, need - 2))
            n_fill = min(kw["max_num_seqs"], -(-budget // piece))
            fill = random_prompts(np.random.default_rng(args.seed + 1), vocab, [piece] * n_fill, special_ids(eng))
            info = {
                "benchmark": NAME, "model": str(eng.model_path), "architecture": eng.model_config.architecture,
                "params": eng.model_config.num_params(), "dtype": str(eng.dtype).replace("torch.", ""),
                "device": args.device, "threads": eng.threads, "num_prompts": args.num_prompts,
                "prefix_len": args.prefix_len, "suffix_len": [suf_lo, suf_hi], "output_len": args.output_len,
                "seed": args.seed, "prompt_tokens": sum(len(p) for p in prompts),
                "block_size": eng.block_manager.block_size,
                "warmup": f"untimed, on each engine before its timed run: {len(fill)} unrelated random "
                          f"prompt(s) filling a {budget}-token step, then the system prompt + a suffix of its "
                          "own (2 output tokens each); with caching this leaves the system prompt cached",
            }
            print(
                f"model {info['model']} ({info['architecture']}, {info['params'] / 1e6:.0f}M params), "
                f"{info['dtype']}, {args.device}, {eng.threads} threads\n"
                f"{args.num_prompts} requests at once: shared prefix {args.prefix_len} + suffix "
                f"{suf_lo}:{suf_hi} tokens ({info['prompt_tokens']} prompt tokens), output {args.output_len}, "
                f"seed {args.seed}\nwarm-up: {info['warmup']}"
            )
        results[key] = _run(llm, prompts, fill, system + suffixes[0], args.output_len)
        del llm, eng
        gc.collect()  # free this engine's KV cache and weights before the next one
    on, off = results["cache"], results["no_cache"]
    results["ratio"] = {k: ratio(off[k], on[k]) for k in _RATIOS}  # > 1: caching is faster
    results["ratio"]["output_tokens_per_s"] = ratio(on["output_tokens_per_s"], off["output_tokens_per_s"])
    r = results["ratio"]
    rows = [_row("prefix cache on", on), _row("prefix cache off", off),
            ["speed-up (off/on)", "", f"{r['ttft_mean_s']:.2f}x", f"{r['ttft_p50_s']:.2f}x",
             f"{r['ttft_p90_s']:.2f}x", f"{r['elapsed_s']:.2f}x", f"{r['output_tokens_per_s']:.2f}x", "", ""]]
    print()
    print_table(["run", "requests", "TTFT mean ms", "TTFT p50 ms", "TTFT p90 ms", "total s",
                 "output tok/s", "prompt tok computed", "hit rate"], rows)
    write_json(args.json, {**info, **results})
    return 0

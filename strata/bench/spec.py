"""Speculative decoding (prompt lookup, or --speculative-model DIR for a draft model): batch-1 decode speed with and without, on a repetitive
workload (where the output copies its context: summaries, edits, extraction) and on random prompts.

repetitive: the prompt is a passage of --input-len tokens (text from data/shakespeare when the
model has a tokenizer, else random ids) followed by its first --echo-len tokens again, so the
natural continuation repeats the passage, as when a model edits or quotes a given text.
random: random token ids, where prompt lookup rarely finds anything and must cost ~nothing.

Each workload runs greedy, one request at a time, --repeats times with speculation off and on,
alternating, on the same engine (the speculator is switched, nothing else). Reported: decode
tokens/s (output tokens after the first / time after the first token), median of the repeats,
the speedup, acceptance rate, tokens per verifying step, and whether the tokens were identical.

examples:
  strata bench spec                                    # the demo model
  strata bench spec --random-model smol-135m --dtype float32 --num-speculative-tokens 4
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from strata.bench.common import (
    add_model_args,
    bench_engine_kwargs,
    random_prompts,
    resolve_model,
    special_ids,
    write_json,
)
from strata.engine.llm import LLM
from strata.errors import ConfigError
from strata.protocol.sampling_params import SamplingParams
from strata.text_table import print_table

NAME = "spec"
HELP = "speculative decoding (prompt lookup): batch-1 decode speedup and acceptance, repetitive vs random prompts"
DESCRIPTION = __doc__

TEXT_DIR = Path(__file__).resolve().parents[2] / "data" / "shakespeare" / "train"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    g = p.add_argument_group("workload")
    g.add_argument("--input-len", type=int, default=256, help="passage / prompt tokens (default 256)")
    g.add_argument("--echo-len", type=int, default=16, help="repetitive: passage tokens repeated at the end")
    g.add_argument("--output-len", type=int, default=128, help="output tokens (default 128)")
    g.add_argument("--prompts", type=int, default=3, help="different prompts per workload (default 3)")
    g.add_argument("--repeats", type=int, default=3, help="timed runs of each (default 3)")
    g.add_argument("--seed", type=int, default=0, help="seed for the prompts and sampling")


def _passages(eng, n: int, length: int, rng) -> list[list[int]]:
    files = sorted(TEXT_DIR.glob("*.txt")) if TEXT_DIR.is_dir() else []
    if eng.tokenizer is None or not files:
        return random_prompts(rng, eng.model_config.vocab_size, [length] * n, special_ids(eng))
    ids = eng.tokenizer.encode(files[0].read_text(encoding="utf-8")[:400_000], add_special_tokens=False)
    starts = rng.integers(0, max(1, len(ids) - length), size=n)
    return [ids[s:s + length] for s in starts]


def _decode_rate(out) -> float:
    n = len(out.outputs[0].token_ids)
    return (n - 1) / (out.finished_time - out.first_token_time)


def _run(llm, prompts, speculator, args) -> dict:
    eng = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    rates = {"off": [], "on": []}
    tokens = {"off": [], "on": []}
    before = (speculator.stats.drafted, speculator.stats.accepted, speculator.stats.steps, speculator.stats.emitted)
    for prompt in prompts:
        for mode in ("off", "on"):  # warm-up of this prompt length
            eng.scheduler.speculator = speculator if mode == "on" else None
            llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    before = (speculator.stats.drafted, speculator.stats.accepted, speculator.stats.steps, speculator.stats.emitted)
    for _ in range(args.repeats):
        for mode in ("off", "on"):
            eng.scheduler.speculator = speculator if mode == "on" else None
            per = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
            rates[mode].append(float(np.mean([_decode_rate(o) for o in per])))
            tokens[mode].append([o.outputs[0].token_ids for o in per])
    eng.scheduler.speculator = speculator
    st = speculator.stats
    drafted, accepted, steps, emitted = (st.drafted - before[0], st.accepted - before[1], st.steps - before[2],
                                         st.emitted - before[3])
    off, on = float(np.median(rates["off"])), float(np.median(rates["on"]))
    return {"decode_tok_s_off": off, "decode_tok_s_on": on, "speedup": on / off,
            "acceptance_rate": accepted / drafted if drafted else 0.0,
            "tokens_per_step": emitted / steps if steps else 1.0, "drafted": drafted,
            "identical_tokens": all(a == b for a, b in zip(tokens["off"], tokens["on"])),
            "runs_tok_s": rates}


def run(args: argparse.Namespace) -> int:
    for flag, v in (("--input-len", args.input_len), ("--output-len", args.output_len), ("--prompts", args.prompts),
                    ("--repeats", args.repeats)):
        if v < 1:
            raise ConfigError(f"{flag}: must be >= 1, got {v}")
    if not 1 <= args.echo_len <= args.input_len:
        raise ConfigError(f"--echo-len: must be in [1, --input-len], got {args.echo_len}")
    kw = bench_engine_kwargs(args, args.input_len + args.echo_len + args.output_len, 1)
    kw["speculative_model"] = kw.get("speculative_model") or "ngram"  # or --speculative-model DIR: a draft model
    llm = LLM(resolve_model(args), **kw)
    eng = llm.engine
    cfg = eng.config
    speculator = eng.scheduler.speculator
    rng = np.random.default_rng(args.seed)
    passages = _passages(eng, args.prompts, args.input_len, rng)
    workloads = {
        "repetitive": [p + p[:args.echo_len] for p in passages],
        "random": random_prompts(rng, eng.model_config.vocab_size, [args.input_len] * args.prompts, special_ids(eng)),
    }
    print(f"model {eng.model_path}, {str(eng.dtype).replace('torch.', '')}, {eng.threads} threads; batch 1, greedy, "
          f"{args.input_len} in / {args.output_len} out, K = {cfg.num_speculative_tokens}, n-gram "
          f"{cfg.prompt_lookup_min}..{cfg.prompt_lookup_max} (drafts: {cfg.speculative_model}); {args.prompts} prompts x {args.repeats} repeats")
    results = {name: _run(llm, prompts, speculator, args) for name, prompts in workloads.items()}
    print_table(["workload", "decode tok/s off", "decode tok/s on", "speedup", "acceptance", "tokens/step",
                 "same tokens"],
                [[name, r["decode_tok_s_off"], r["decode_tok_s_on"], f"{r['speedup']:.2f}x",
                  f"{r['acceptance_rate']:.1%}", r["tokens_per_step"], "yes" if r["identical_tokens"] else "NO"]
                 for name, r in results.items()])
    write_json(args.json, {"benchmark": NAME, "model": str(eng.model_path), "threads": eng.threads,
                           "num_speculative_tokens": cfg.num_speculative_tokens, "input_len": args.input_len,
                           "output_len": args.output_len, "workloads": results})
    llm.close()
    return 0

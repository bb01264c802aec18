"""Structured output: what a JSON-schema constraint costs per token and per schema, and the grammar engines side by side.

1. Per-token overhead: --batch-sizes requests (random prompts of --input-len tokens, --output-len
   tokens each, temperature 1.0) run unconstrained and under a JSON schema that cannot complete
   within --output-len tokens (so both runs produce the same number of tokens), on the same
   engine, --repeats times each, alternating. Reported: median TPOT of each, the overhead, and
   where the constrained step's extra time goes: mask computation (in a worker thread, beside the
   forward pass), the time the step waited for it after the forward, and applying the masks.
2. Compile time: --schemas distinct schemas compiled against the model's tokenizer (cache misses),
   and the one-off build of the grammar engine's view of the tokenizer.
3. Engines: llguidance (what Strata uses) and xgrammar, if installed, on the same tokenizer and
   schemas: compile time and the time to compute one token mask along a random valid path.

examples:
  strata bench structured --random-model smol-135m --dtype float32
  strata bench structured --batch-sizes 1,16 --output-len 64 --json structured.json
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from strata.bench.common import (
    add_model_args,
    bench_engine_kwargs,
    random_prompts,
    resolve_model,
    special_ids,
    write_json,
)
from strata.engine.grammar import GrammarCompiler
from strata.engine.llm import LLM
from strata.errors import ConfigError
from strata.protocol.sampling_params import SamplingParams, StructuredOutput
from strata.protocol.structured import JSON_OPTIONS, close_objects
from strata.text_table import print_table

NAME = "structured"
HELP = "per-token and per-schema cost of structured output (JSON schema); llguidance vs xgrammar"
DESCRIPTION = __doc__

# an array of bounded records: every step is inside JSON (strings, numbers, enums), never complete early
LONG_SCHEMA = {"type": "array", "minItems": 10_000, "items": {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "role": {"enum": ["king", "queen", "fool", "soldier"]}, "alive": {"type": "boolean"}},
    "required": ["name", "age", "role", "alive"]}}


def _schema(i: int) -> dict:
    """A distinct, realistic schema per i (a compile is a cache miss)."""
    return {"type": "object", "properties": {
        f"field_{i}": {"type": "string", "maxLength": 40},
        "count": {"type": "integer", "minimum": -i, "maximum": 1000 + i},
        "tags": {"type": "array", "items": {"enum": ["a", "b", f"c{i}"]}, "maxItems": 5},
        "nested": {"type": "object", "properties": {"x": {"type": "number"}, "ok": {"type": "boolean"}},
                   "required": ["x"]}},
        "required": [f"field_{i}", "count"]}


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    g = p.add_argument_group("workload")
    g.add_argument("--batch-sizes", default="1,16", help="concurrent requests per run (default 1,16)")
    g.add_argument("--input-len", type=int, default=32, help="prompt tokens (default 32)")
    g.add_argument("--output-len", type=int, default=64, help="output tokens per request (default 64)")
    g.add_argument("--repeats", type=int, default=3, help="timed runs of each kind (default 3)")
    g.add_argument("--schemas", type=int, default=20, help="schemas compiled for the compile time (default 20)")
    g.add_argument("--engines", default="llguidance,xgrammar", help="grammar engines to compare")
    g.add_argument("--seed", type=int, default=0, help="seed for the prompts and sampling")


def _tpot(outs) -> float:
    per = [(o.finished_time - o.first_token_time) / (len(o.outputs[0].token_ids) - 1) for o in outs]
    return float(np.median(per))


def _overhead(llm, prompts, args) -> dict:
    masks = llm.engine.grammar_masks
    plain = [SamplingParams(temperature=1.0, seed=i, max_tokens=args.output_len, ignore_eos=True)
             for i in range(len(prompts))]
    constrained = [SamplingParams(temperature=1.0, seed=i, max_tokens=args.output_len,
                                  structured=StructuredOutput(json=LONG_SCHEMA)) for i in range(len(prompts))]
    llm.generate(prompts, plain, use_tqdm=False)  # warm-up, both kinds
    llm.generate(prompts, constrained, use_tqdm=False)
    runs = {"plain": [], "constrained": []}
    before = (masks.masks, masks.compute_seconds, masks.wait_seconds, masks.apply_seconds, llm.engine.num_steps)
    steps = 0
    for _ in range(args.repeats):
        runs["plain"].append(_tpot(llm.generate(prompts, plain, use_tqdm=False)))
        s0 = llm.engine.num_steps
        outs = llm.generate(prompts, constrained, use_tqdm=False)
        steps += llm.engine.num_steps - s0
        runs["constrained"].append(_tpot(outs))
        if any(len(o.outputs[0].token_ids) != args.output_len for o in outs):
            raise RuntimeError("a constrained request ended early; the overhead would compare unequal work")
    n = masks.masks - before[0]
    tp, tc = float(np.median(runs["plain"])), float(np.median(runs["constrained"]))
    return {"batch": len(prompts), "tpot_plain_ms": tp * 1e3, "tpot_constrained_ms": tc * 1e3,
            "overhead": tc / tp - 1, "mask_compute_us_per_token": (masks.compute_seconds - before[1]) / n * 1e6,
            "mask_wait_ms_per_step": (masks.wait_seconds - before[2]) / steps * 1e3,
            "mask_apply_ms_per_step": (masks.apply_seconds - before[3]) / steps * 1e3,
            "runs_ms": {k: [v * 1e3 for v in vs] for k, vs in runs.items()}}


def _compile_times(engine, n: int) -> dict:
    compiler = GrammarCompiler(engine.tokenizer.to_json(), engine.model_config.vocab_size, engine.eos_token_ids)
    t0 = time.perf_counter()
    compiler.tokenizer  # noqa: B018 - the one-off build being timed
    build = time.perf_counter() - t0
    times = []
    for i in range(n):
        t0 = time.perf_counter()
        compiler.matcher(StructuredOutput(json=_schema(i)))
        times.append(time.perf_counter() - t0)
    return {"tokenizer_build_ms": build * 1e3, "compile_ms_median": float(np.median(times)) * 1e3,
            "compile_ms_max": max(times) * 1e3, "schemas": n}


def _walk_llguidance(tok_json: str, vocab: int, eos: list[int], schemas: list[dict], steps: int, rng):
    import llguidance
    import torch

    t0 = time.perf_counter()
    tok = llguidance.LLTokenizer(tok_json, n_vocab=vocab, eos_token=eos[0] if eos else None)
    build = time.perf_counter() - t0
    compile_s, mask_s, masks = [], 0.0, 0
    bitmask = torch.empty((vocab + 31) // 32, dtype=torch.int32)
    for schema in schemas:
        t0 = time.perf_counter()
        m = llguidance.LLMatcher(tok, llguidance.LLMatcher.grammar_from_json_schema(close_objects(schema),
                                                                                   defaults=JSON_OPTIONS))
        compile_s.append(time.perf_counter() - t0)
        for _ in range(steps):
            t0 = time.perf_counter()
            m.unsafe_compute_mask_ptr(bitmask.data_ptr(), bitmask.numel() * 4)
            mask_s += time.perf_counter() - t0
            masks += 1
            allowed = _allowed(bitmask.numpy(), vocab)
            if m.is_stopped() or not allowed.size:
                break
            m.consume_token(int(rng.choice(allowed)))
    return build, compile_s, mask_s / masks


def _allowed(words: np.ndarray, vocab: int) -> np.ndarray:
    bits = np.unpackbits(words.view(np.uint8), bitorder="little")[:vocab]
    return np.flatnonzero(bits)


def _walk_xgrammar(tok_json: str, vocab: int, eos: list[int], schemas: list[dict], steps: int, rng):
    import tokenizers
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerFast

    t0 = time.perf_counter()
    hf = PreTrainedTokenizerFast(tokenizer_object=tokenizers.Tokenizer.from_str(tok_json))
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=eos or None)
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    build = time.perf_counter() - t0
    compile_s, mask_s, masks = [], 0.0, 0
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    for schema in schemas:
        t0 = time.perf_counter()
        compiled = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=True,
                                                separators=(", ", ": "))
        matcher = xgr.GrammarMatcher(compiled)
        compile_s.append(time.perf_counter() - t0)
        for _ in range(steps):
            if matcher.is_terminated():
                break
            t0 = time.perf_counter()
            matcher.fill_next_token_bitmask(bitmask)
            mask_s += time.perf_counter() - t0
            masks += 1
            allowed = _allowed(bitmask[0].numpy(), vocab)
            if not allowed.size:
                break
            matcher.accept_token(int(rng.choice(allowed)))
    return build, compile_s, mask_s / masks


def _engines(engine, names: list[str], n: int, seed: int) -> list[dict]:
    tok_json, vocab, eos = engine.tokenizer.to_json(), engine.model_config.vocab_size, engine.eos_token_ids
    schemas = [_schema(i) for i in range(n)]
    rows = []
    for name in names:
        walk = {"llguidance": _walk_llguidance, "xgrammar": _walk_xgrammar}.get(name)
        if walk is None:
            raise ConfigError(f"--engines: unknown {name!r}; choose llguidance, xgrammar")
        try:
            build, compile_s, mask = walk(tok_json, vocab, eos, schemas, 64, np.random.default_rng(seed))
        except ImportError as e:
            rows.append({"engine": name, "skipped": f"not installed ({e})"})
            continue
        rows.append({"engine": name, "tokenizer_build_ms": build * 1e3,
                     "compile_ms_median": float(np.median(compile_s)) * 1e3, "mask_us_mean": mask * 1e6})
    return rows


def run(args: argparse.Namespace) -> int:
    sizes = [int(x) for x in args.batch_sizes.split(",") if x]
    if not sizes or min(sizes) < 1 or args.output_len < 2 or args.input_len < 1 or args.repeats < 1:
        raise ConfigError("--batch-sizes >= 1, --input-len >= 1, --output-len >= 2 and --repeats >= 1")
    kw = bench_engine_kwargs(args, args.input_len + args.output_len, max(sizes))
    llm = LLM(resolve_model(args), **kw)
    eng = llm.engine
    if eng.tokenizer is None:
        raise ConfigError(f"{eng.model_path} has no tokenizer.json: structured output needs one")
    rng = np.random.default_rng(args.seed)
    info = {"benchmark": NAME, "model": str(eng.model_path), "dtype": str(eng.dtype).replace("torch.", ""),
            "threads": eng.threads, "vocab": eng.model_config.vocab_size, "input_len": args.input_len,
            "output_len": args.output_len, "repeats": args.repeats}
    print(f"model {info['model']}, {info['dtype']}, {eng.threads} threads, vocabulary {info['vocab']}; "
          f"{args.input_len} in / {args.output_len} out, temperature 1.0, {args.repeats} repeats (medians)")
    overhead = []
    for b in sizes:
        prompts = random_prompts(rng, eng.model_config.vocab_size, [args.input_len] * b, special_ids(eng))
        overhead.append(_overhead(llm, prompts, args))
    print_table(["batch", "TPOT plain ms", "TPOT JSON ms", "overhead", "mask us/token (thread)",
                 "wait ms/step", "apply ms/step"],
                [[r["batch"], r["tpot_plain_ms"], r["tpot_constrained_ms"], f"{r['overhead']:+.1%}",
                  r["mask_compute_us_per_token"], r["mask_wait_ms_per_step"], r["mask_apply_ms_per_step"]]
                 for r in overhead])
    compile_times = _compile_times(eng, args.schemas)
    print(f"\ncompile: {compile_times['schemas']} distinct schemas, median {compile_times['compile_ms_median']:.2f} ms "
          f"(max {compile_times['compile_ms_max']:.2f}); tokenizer view built once in "
          f"{compile_times['tokenizer_build_ms']:.1f} ms")
    engines = _engines(eng, [x for x in args.engines.split(",") if x], args.schemas, args.seed)
    print()
    print_table(["engine", "tokenizer build ms", "compile ms (median)", "mask us (mean, random valid path)"],
                [[r["engine"], "-", r["skipped"], "-"] if "skipped" in r else
                 [r["engine"], r["tokenizer_build_ms"], r["compile_ms_median"], r["mask_us_mean"]] for r in engines])
    write_json(args.json, {**info, "overhead": overhead, "compile": compile_times, "engines": engines})
    llm.close()
    return 0

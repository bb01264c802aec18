"""Offline throughput: many random-token requests through LLM.generate (continuous batching).

Prompt and output lengths are drawn uniformly from the given ranges (deterministic in --seed);
every request ignores EOS and runs to its own output length, greedy (or sampled with --temperature /
--top-p / --top-k). With --compare hf the same requests
run through transformers `generate` in static, left-padded batches in the same process, on the
same weights, dtype and thread count, and the table shows the Strata/HF ratio. Only each
request's own output tokens are counted for both (HF's batch padding is not credited).

examples:
  strata bench throughput                                   # demo model
  strata bench throughput --random-model smol-135m --dtype float32 --compare hf
  strata bench throughput --model ./Qwen2.5-0.5B --num-prompts 256 --input-len 128:1024 \\
      --output-len 64:512 --json throughput.json
"""

from __future__ import annotations

import argparse
import gc
import time

import numpy as np
import torch

from strata.bench.common import (
    add_model_args,
    add_sampling_args,
    bench_engine_kwargs,
    capture_stats,
    check_sampling_args,
    parse_range,
    random_prompts,
    ratio,
    resolve_model,
    sampling_note,
    sampling_params,
    special_ids,
    warm_capture,
    write_json,
)
from strata.bench.hf_peer import hf_throughput, load_hf_model
from strata.bench.lora import write_adapters
from strata.engine.llm import LLM
from strata.errors import ConfigError
from strata.protocol.sampling_params import SamplingParams
from strata.text_table import print_table

NAME = "throughput"
HELP = "offline throughput on random-token requests (optionally vs transformers)"
DESCRIPTION = __doc__


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    g = p.add_argument_group("workload")
    g.add_argument("--num-prompts", type=int, default=64, help="requests in the workload")
    g.add_argument("--input-len", default="32:512", help="prompt tokens, N or LO:HI uniform (default 32:512)")
    g.add_argument("--output-len", default="32:256", help="output tokens, N or LO:HI uniform (default 32:256)")
    g.add_argument("--seed", type=int, default=0, help="seed for lengths and token ids")
    g.add_argument("--lora-adapters", type=int, default=0, metavar="N",
                   help="requests take N random LoRA adapters round robin (rank --max-lora-rank on every linear; "
                   "implies --enable-lora and --max-loras >= N). `strata bench lora` compares 0/1/4/16 in one run")
    add_sampling_args(g)
    g.add_argument("--hf-batch-size", type=int, default=16, help="static batch size for --compare hf")


def _figures(n: int, elapsed: float, prompt_tokens: int, output_tokens: int) -> dict:
    return {
        "requests": n, "elapsed_s": elapsed, "requests_per_s": n / elapsed,
        "output_tokens_per_s": output_tokens / elapsed,
        "total_tokens_per_s": (prompt_tokens + output_tokens) / elapsed,
    }


def _row(name: str, f: dict) -> list:
    return [name, f["requests"], f["elapsed_s"], f["requests_per_s"], f["output_tokens_per_s"],
            f["total_tokens_per_s"]]


def run(args: argparse.Namespace) -> int:
    if args.num_prompts < 1:
        raise ConfigError(f"--num-prompts: must be >= 1, got {args.num_prompts}")
    if args.hf_batch_size < 1:
        raise ConfigError(f"--hf-batch-size: must be >= 1, got {args.hf_batch_size}")
    check_sampling_args(args)
    in_lo, in_hi = parse_range(args.input_len, "--input-len")
    out_lo, out_hi = parse_range(args.output_len, "--output-len")
    rng = np.random.default_rng(args.seed)
    in_lens = rng.integers(in_lo, in_hi + 1, size=args.num_prompts).tolist()
    out_lens = rng.integers(out_lo, out_hi + 1, size=args.num_prompts).tolist()
    need = max(i + o for i, o in zip(in_lens, out_lens))
    kw = bench_engine_kwargs(args, need, args.num_prompts)
    if args.lora_adapters < 0:
        raise ConfigError(f"--lora-adapters: must be >= 0, got {args.lora_adapters}")
    if args.lora_adapters and args.compare:
        raise ConfigError("--lora-adapters with --compare hf: the peer runs the base model only; drop one")
    if args.lora_adapters:
        kw.update(enable_lora=True, max_loras=max(kw.get("max_loras") or 1, args.lora_adapters))

    llm = LLM(resolve_model(args), **kw)
    eng = llm.engine
    loras = write_adapters(eng, args.lora_adapters, eng.config.max_lora_rank, "all", args.seed) if args.lora_adapters \
        else []
    lora_requests = [loras[i % len(loras)] for i in range(args.num_prompts)] if loras else None
    avoid = special_ids(eng)
    prompts = random_prompts(rng, eng.model_config.vocab_size, in_lens, avoid)
    params = [sampling_params(args, o) for o in out_lens]
    prompt_tokens = sum(in_lens)
    info = {
        "benchmark": NAME, "model": str(eng.model_path), "architecture": eng.model_config.architecture,
        "params": eng.model_config.num_params(), "dtype": str(eng.dtype).replace("torch.", ""),
        "device": args.device, "threads": eng.threads, "num_prompts": args.num_prompts,
        "input_len": [in_lo, in_hi], "output_len": [out_lo, out_hi], "seed": args.seed,
        "temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k,
        "prompt_tokens": prompt_tokens, "output_tokens": sum(out_lens),
        "fuse": eng.config.fuse, "compile": eng.config.compile, "cuda_graphs": eng.config.cuda_graphs,
        "lora_adapters": args.lora_adapters,
    }
    print(
        f"model {info['model']} ({info['architecture']}, {info['params'] / 1e6:.0f}M params), "
        f"{info['dtype']}, {args.device}, {eng.threads} threads\n"
        f"{args.num_prompts} requests: input {in_lo}:{in_hi} (mean {prompt_tokens / args.num_prompts:.0f}), "
        f"output {out_lo}:{out_hi} (mean {sum(out_lens) / args.num_prompts:.0f}), seed {args.seed}, "
        f"{sampling_note(args)}"
        + (f"; {args.lora_adapters} LoRA adapters rank {eng.config.max_lora_rank} round robin" if loras else "")
    )

    warm_capture(eng)
    warm = [prompts[0][:8]]
    llm.generate(warm, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True), use_tqdm=False)
    kv_samples: list[tuple[float, float]] = []  # per step: (waste, live-token bytes) / reserved

    def sample_kv(engine) -> None:
        if engine.scheduler.running:
            u = engine.kv_usage()
            kv_samples.append((u.waste_bytes / u.reserved_bytes, u.token_bytes / u.reserved_bytes))

    llm.engine.step_observers.append(sample_kv)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=True, lora_request=lora_requests)
    elapsed = time.perf_counter() - t0
    llm.engine.step_observers.remove(sample_kv)
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    results = {"strata": _figures(len(outs), elapsed, prompt_tokens, produced)}
    if kv_samples:
        waste = [w for w, _ in kv_samples]
        results["strata"]["kv_waste_mean_of_reserved"] = sum(waste) / len(waste)
        results["strata"]["kv_waste_max_of_reserved"] = max(waste)
        results["strata"]["kv_live_mean_of_reserved"] = sum(t for _, t in kv_samples) / len(kv_samples)
    rows = [_row("strata", results["strata"])]
    info["capture"] = capture_stats(eng)

    if args.compare == "hf":
        path, dtype, threads = eng.model_path, eng.dtype, eng.threads
        pad = eng.eos_token_ids[0] if eng.eos_token_ids else 0
        del llm, eng, outs
        gc.collect()  # free Strata's KV cache before loading the peer
        torch.set_num_threads(threads)
        model = load_hf_model(str(path), dtype, args.device)
        hf_throughput(model, [p[:8] for p in prompts[:1]], [2], 1, pad, args.device, progress=False)
        run = hf_throughput(model, prompts, out_lens, args.hf_batch_size, pad, args.device)
        hf = _figures(len(prompts), run.elapsed_s, prompt_tokens, sum(out_lens))
        hf.update(batch_size=args.hf_batch_size, batches=run.num_batches,
                  padded_output_tokens=run.padded_output_tokens)
        results["hf"] = hf
        results["ratio"] = {
            k: ratio(results["strata"][k], hf[k])
            for k in ("requests_per_s", "output_tokens_per_s", "total_tokens_per_s")
        }
        rows.append(_row(f"hf (batch {args.hf_batch_size})", hf))
        r = results["ratio"]
        rows.append(["strata/hf", "", "", f"{r['requests_per_s']:.2f}x",
                     f"{r['output_tokens_per_s']:.2f}x", f"{r['total_tokens_per_s']:.2f}x"])

    print()
    print_table(["engine", "requests", "elapsed s", "requests/s", "output tok/s", "total tok/s"], rows)
    if kv_samples:
        st = results["strata"]
        print(f"strata KV cache over the run: live tokens {st['kv_live_mean_of_reserved']:.1%} of reserved "
              f"bytes on average; waste in partially filled blocks {st['kv_waste_mean_of_reserved']:.2%} "
              f"mean, {st['kv_waste_max_of_reserved']:.2%} max")
    if info["capture"] is not None:
        c = info["capture"]
        print(f"captured decode: {c['compiles']} torch.compile compilations, {c['graphs']} CUDA graphs; "
              f"batch buckets used {c['bucket_hits']}")
    write_json(args.json, {**info, **results})
    return 0

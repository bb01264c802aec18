"""LoRA serving cost: offline throughput with 0, 1, 4, 16 distinct adapters in one workload, and
batch-1 decode with and without an adapter, all in one engine, rounds alternated.

The adapters are random PEFT directories written for the model's own projections (rank --rank,
every linear or --targets attention), under $STRATA_CACHE/lora-bench; requests take them round
robin. The engine holds max(--adapters) slots, so every round runs the same engine and weights and
the ratios compare like with like.

examples:
  strata bench lora --random-model smol-135m --dtype float32
  strata bench lora --random-model smol-135m --quantization int4 --adapters 0,1,16 --rounds 3 --json lora.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from strata.bench.common import (
    add_model_args,
    bench_engine_kwargs,
    random_prompts,
    resolve_model,
    special_ids,
    write_json,
)
from strata.config import cache_root
from strata.cpuinfo import cpu_model_and_flags
from strata.engine.llm import LLM
from strata.errors import ConfigError
from strata.protocol.lora import LoRARequest
from strata.protocol.sampling_params import SamplingParams
from strata.text_table import print_table

NAME = "lora"
HELP = "LoRA serving cost: throughput with 0/1/4/16 adapters and batch-1 decode overhead"
DESCRIPTION = __doc__


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    g = p.add_argument_group("workload")
    g.add_argument("--adapters", default="0,1,4,16", help="distinct adapters per throughput run (comma list)")
    g.add_argument("--rank", type=int, default=16, help="the adapters' rank")
    g.add_argument("--targets", choices=("all", "attention"), default="all", help="projections adapted")
    g.add_argument("--num-prompts", type=int, default=32, help="requests per throughput run")
    g.add_argument("--input-len", type=int, default=64, help="prompt tokens per request")
    g.add_argument("--output-len", type=int, default=64, help="output tokens per request (EOS ignored)")
    g.add_argument("--rounds", type=int, default=2, help="rounds, each running every case once")
    g.add_argument("--seed", type=int, default=0, help="seed for token ids and the adapters' weights")


def write_adapters(engine, n: int, rank: int, targets: str, seed: int) -> list[LoRARequest]:
    """n random PEFT adapters for `engine`'s model (its LoRA sites), reused when already written."""
    sites = engine.lora.sites
    names = [h for h in sites if targets == "all" or ".self_attn." in h]
    root = cache_root() / "lora-bench" / f"{Path(str(engine.model_path)).name}-r{rank}-{targets}"
    out = []
    for i in range(n):
        d = root / f"adapter-{i}"
        if not (d / "adapter_model.safetensors").is_file():
            g = torch.Generator().manual_seed(seed + i)
            tensors = {}
            for hf in names:
                s = sites[hf]
                tensors[f"base_model.model.{hf}.lora_A.weight"] = torch.randn(rank, s.in_features, generator=g) * 0.02
                tensors[f"base_model.model.{hf}.lora_B.weight"] = torch.randn(s.out_features, rank, generator=g) * 0.02
            d.mkdir(parents=True, exist_ok=True)
            save_file(tensors, str(d / "adapter_model.safetensors"))
            cfg = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules":
                   sorted({h.rsplit(".", 1)[-1] for h in names}), "bias": "none", "task_type": "CAUSAL_LM"}
            (d / "adapter_config.json").write_text(json.dumps(cfg))
        out.append(LoRARequest(f"bench-{i}", i + 1, str(d)))
    return out


def run(args: argparse.Namespace) -> int:
    counts = sorted({int(c) for c in args.adapters.split(",")})
    if not counts or counts[0] < 0:
        raise ConfigError(f"--adapters: a comma list of counts >= 0, got {args.adapters!r}")
    need = args.input_len + args.output_len
    kw = bench_engine_kwargs(args, need, args.num_prompts)
    kw.update(enable_lora=True, max_loras=max(1, counts[-1]), max_lora_rank=max(16, args.rank),
              max_cpu_loras=max(1, counts[-1]))
    llm = LLM(resolve_model(args), **kw)
    eng = llm.engine
    loras = write_adapters(eng, max(1, counts[-1]), args.rank, args.targets, args.seed)
    rng = np.random.default_rng(args.seed)
    prompts = random_prompts(rng, eng.model_config.vocab_size, [args.input_len] * args.num_prompts, special_ids(eng))
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    lora_dtype = str(eng.lora.banks[0].lora_a.dtype).removeprefix("torch.")
    print(f"model {eng.model_path} ({eng.model_config.architecture}), {str(eng.dtype).replace('torch.', '')}, "
          f"weights {eng.config.quantization or 'as loaded'}, {eng.threads} threads; adapters rank {args.rank} "
          f"({lora_dtype}) on "
          f"{args.targets} projections; {args.num_prompts} requests x {args.input_len} in / {args.output_len} out")
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False, lora_request=loras[0])

    def throughput(n: int) -> float:
        reqs = [None if n == 0 else loras[i % n] for i in range(len(prompts))]
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False, lora_request=reqs)
        return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0)

    def decode(lora) -> float:
        p = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
        t0 = time.perf_counter()
        out = llm.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
                           use_tqdm=False, lora_request=lora)
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = llm.generate([prompts[0]], p, use_tqdm=False, lora_request=lora)
        total = time.perf_counter() - t0
        return (len(out[0].outputs[0].token_ids) - 1) / max(total - first, 1e-9)

    rounds = {f"throughput {n}": [] for n in counts} | {"decode base": [], "decode 1 adapter": []}
    for r in range(args.rounds):
        order = counts if r % 2 == 0 else counts[::-1]  # alternate, so drift hits both ends alike
        for n in order:
            rounds[f"throughput {n}"].append(throughput(n))
        cases = [("decode base", None), ("decode 1 adapter", loras[0])]
        for name, lora in cases if r % 2 == 0 else cases[::-1]:
            rounds[name].append(decode(lora))
    base_tp = statistics.median(rounds[f"throughput {counts[0]}"])
    base_dec = statistics.median(rounds["decode base"])
    rows = []
    for name, vals in rounds.items():
        ref = base_dec if name.startswith("decode") else base_tp
        rows.append([name, statistics.median(vals), " ".join(f"{v:.1f}" for v in vals),
                     statistics.median(vals) / ref])
    print_table(["case", "tok/s (median)", "every round", f"vs {'0 adapters / base'}"], rows)
    llm.close()
    write_json(args.json, {"benchmark": NAME, "model": str(eng.model_path), "rank": args.rank,
                           "targets": args.targets, "lora_dtype": lora_dtype, "cpu": cpu_model_and_flags()[0],
                           "rounds": rounds})
    return 0

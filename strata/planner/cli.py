"""`strata plan`: the serving plan (plan.py, plan_report.py), or with --train a training run's (train_plan.py)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from strata.config import engine_default, parse_bytes
from strata.engine.args import FLAGS
from strata.planner import plan as plan_mod
from strata.planner.plan import PlanRequest, build_plan
from strata.planner.plan_report import format_html, format_text
from strata.planner.train_plan import TrainPlanRequest, build_train_plan, format_train_plan, measure
from strata.train.config import ACTIVATION_CHECKPOINTING, DISTRIBUTED, PRECISIONS, TrainConfig

NAME = "plan"
HELP = "memory, roofline, parallelism and cost of a model on named or this hardware"
DESCRIPTION = plan_mod.__doc__

EPILOG = """examples:
  strata plan --model smol-135m --hardware this --dtype float32
  strata plan --model ./Llama-3-8B --hardware H100x8 --max-model-len 8192 --batch 256 --price-per-hour 24
  strata plan --model ./qwen/config.json --hardware L4 --quantization int4 --html plan.html
  strata plan --model llama-3.2-3b --hardware this --quantization bf16 --kv-cache-dtype bfloat16
  strata plan --model qwen-0.5b --hardware this --dtype float32 --input-len 512 --context 192 --batch 16
  strata plan --model smol-135m --hardware this --dtype float32 --batch 32 --max-loras 16 --max-lora-rank 16
  strata plan --train --model smol-135m --seq-len 1024 --micro-batch-size 8 --activation-checkpointing full
  strata plan --train --model demo --seq-len 128 --micro-batch-size 4 --measure   # predicted vs a real run
  strata plan --train --model ./Llama-3-8B --hardware H100x8 --distributed fsdp --precision bfloat16
  strata plan --train --lora --model ./Llama-3-8B --quantization int4 --lora-rank 16 --hardware L4
"""


def cmd_train_plan(args: argparse.Namespace) -> int:
    req = TrainPlanRequest(
        model=args.model, seq_len=args.seq_len, micro_batch_size=args.micro_batch_size,
        precision=args.precision, activation_checkpointing=args.activation_checkpointing,
        ac_every=args.ac_every, world_size=args.world_size, distributed=args.distributed,
        device=args.device, hardware=args.hardware, ddp_bucket_mb=args.ddp_bucket_mb,
        loss_chunk_tokens=args.loss_chunk_tokens, fused_loss=args.fused_loss, lora=args.lora,
        lora_rank=args.lora_rank, lora_target_modules=tuple(args.lora_target_modules),
        lora_dropout=args.lora_dropout, quantization=args.quantization,
        quantization_group_size=args.quantization_group_size,
    )
    plan = build_train_plan(req)
    if args.measure:
        if args.hardware.lower() != "this":
            print("error: --measure runs on this machine; drop --hardware", file=sys.stderr)
            return 2
        plan = measure(plan, args.threads)
    if args.json:
        print(json.dumps(plan.to_json(), indent=2, default=str))
    else:
        print(format_train_plan(plan))
    return 0


def run(args: argparse.Namespace) -> int:
    if args.train:
        return cmd_train_plan(args)
    req = PlanRequest(
        model=args.model, hardware=args.hardware, dtype=args.dtype, quantization=args.quantization,
        group_size=args.quantization_group_size, kv_cache_dtype=args.kv_cache_dtype,
        max_model_len=args.max_model_len, batch=args.batch,
        input_len=args.input_len, context=args.context,
        kv_cache_memory=parse_bytes(args.kv_cache_memory, "--kv-cache-memory") if args.kv_cache_memory else None,
        memory_fraction=args.memory_fraction, max_num_seqs=args.max_num_seqs, block_size=args.block_size,
        max_num_batched_tokens=args.max_num_batched_tokens, price_per_hour=args.price_per_hour,
        alpha_us=args.alpha_us, refresh=args.refresh, lora_adapters=args.lora_adapters,
        lora_rank=args.max_lora_rank, lora_dtype=args.lora_dtype,
    )
    plan = build_plan(req)
    if args.html:
        Path(args.html).write_text(format_html(plan))
        print(f"wrote {args.html}", file=sys.stderr)
    if args.json:
        print(json.dumps(plan.to_json(), indent=2, default=str))
    else:
        print(format_text(plan))
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="HF directory, config.json, or a random shape (smol-135m, "
                   "qwen-0.5b, tiny)")
    p.add_argument("--hardware", default="this", help="NAME, NAMExN (e.g. H100x8) or 'this' (default)")
    p.add_argument("--dtype", default=engine_default("dtype"),
                   help="auto | float32 | bfloat16 | float16 (default auto: what the engine would pick here)")
    p.add_argument("--quantization", default=None, choices=["int8", "int4", "bf16"],
                   help="weight-only int8 / int4, or bf16 weights with fp32 compute (CPU)")
    p.add_argument("--quantization-group-size", type=int, default=engine_default("quantization_group_size"),
                   choices=[32, 64, 128], help="int4: input columns sharing one scale")
    kv = next(f for f in FLAGS if f.field == "kv_cache_dtype")  # the engine's flag, its choices and help
    p.add_argument(kv.option, dest=kv.field, default=engine_default(kv.field), choices=kv.choices,
                   help=kv.help_text())
    p.add_argument("--max-model-len", type=int, default=None, help="L (default: the model's max positions)")
    p.add_argument("--batch", type=int, default=64, help="largest decode batch B (default 64)")
    p.add_argument("--input-len", type=int, default=None, help="prefill prompt tokens (default L)")
    p.add_argument("--context", type=int, default=None, help="decode context per sequence (default L)")
    p.add_argument("--kv-cache-memory", default=None, help="KV cache size as the engine flag, e.g. 2GiB")
    p.add_argument("--memory-fraction", type=float, default=engine_default("memory_fraction"),
                   help="this: share of free memory for KV when --kv-cache-memory is unset "
                   f"(engine default {engine_default('memory_fraction'):g})")
    p.add_argument("--max-num-seqs", type=int, default=engine_default("max_num_seqs"), help="as the engine flag")
    p.add_argument("--block-size", type=int, default=engine_default("block_size"), help="as the engine flag")
    p.add_argument("--max-num-batched-tokens", type=int, default=engine_default("max_num_batched_tokens"),
                   help="as the engine flag")
    p.add_argument("--price-per-hour", type=float, default=None, help="for all N devices, e.g. 24.0")
    p.add_argument("--alpha-us", type=float, default=None,
                   help="all-reduce per-message latency (default 5 us NVLink/IF, 10 us PCIe: an assumption)")
    p.add_argument("--refresh", action="store_true", help="this: re-measure the hardware and step overhead")
    p.add_argument("--html", default=None, metavar="FILE", help="also write a self-contained HTML page")
    g = p.add_argument_group("serving LoRA adapters (the engine's --enable-lora; planner/lora_cost.py)")
    g.add_argument("--max-loras", dest="lora_adapters", type=int, default=0, metavar="N",
                   help="adapter slots resident (as the engine flag): their memory, bytes and FLOPs, and on "
                   "'this' a decode step of --batch rows over N adapters timed with and without (default 0: none)")
    g.add_argument("--max-lora-rank", type=int, default=engine_default("max_lora_rank"),
                   help="as the engine flag: every slot is padded to it")
    g.add_argument("--lora-dtype", default=engine_default("lora_dtype"), choices=("auto", "float32", "bfloat16"),
                   help="as the engine flag")
    p.add_argument("--json", action="store_true", help="print JSON instead of the text report")
    _add_train_flags(p)


def _add_train_flags(p: argparse.ArgumentParser) -> None:
    """`strata plan --train`: the training run's memory per rank (flags as `strata train`'s)."""
    d = TrainConfig()
    g = p.add_argument_group("training memory (--train; see strata/train/memory_plan.py)")
    g.add_argument("--train", action="store_true",
                   help="plan a training run's memory per rank instead of serving")
    g.add_argument("--seq-len", type=int, default=d.seq_len, help=f"training sequence length (default {d.seq_len})")
    g.add_argument("--micro-batch-size", type=int, default=d.micro_batch_size,
                   help=f"sequences per forward per rank (default {d.micro_batch_size})")
    g.add_argument("--precision", default=d.precision, choices=PRECISIONS,
                   help="autocast dtype, as strata train (default auto)")
    g.add_argument("--activation-checkpointing", default=d.activation_checkpointing,
                   choices=ACTIVATION_CHECKPOINTING, help="as strata train (default none)")
    g.add_argument("--ac-every", type=int, default=d.ac_every, help=f"selective: every k-th layer (default {d.ac_every})")
    g.add_argument("--world-size", type=int, default=None, help="data-parallel ranks (default: the --hardware count)")
    g.add_argument("--distributed", default=d.distributed, choices=DISTRIBUTED, help="ddp or fsdp (default ddp)")
    g.add_argument("--ddp-bucket-mb", type=float, default=d.ddp_bucket_mb, help="DDP gradient bucket size")
    g.add_argument("--loss-chunk-tokens", type=int, default=d.loss_chunk_tokens,
                   help="as strata train: LM head + loss over this many tokens at a time (default 0 = off)")
    g.add_argument("--fused-loss", action=argparse.BooleanOptionalAction, default=d.fused_loss,
                   help="as strata train: LM head + loss fused by chunks (default on)")
    g.add_argument("--lora", action="store_true",
                   help="as strata train --lora: an adapter on the frozen base (with --quantization int8|int4: "
                        "the base held quantized, QLoRA-style)")
    g.add_argument("--lora-rank", type=int, default=d.lora_rank, help=f"LoRA rank (default {d.lora_rank})")
    g.add_argument("--lora-target-modules", nargs="+", default=list(d.lora_target_modules), metavar="NAME",
                   help="PEFT module names or all-linear (default: the seven projections)")
    g.add_argument("--lora-dropout", type=float, default=d.lora_dropout, help="as strata train (default 0)")
    g.add_argument("--device", default=d.device, help="this machine's training device (default cpu)")
    g.add_argument("--measure", action="store_true",
                   help="also run strata train for 3 steps with these settings and compare its peak")
    g.add_argument("--threads", type=int, default=None, help="--measure: torch threads of the training run")

"""`strata analyze`: flags, and the offline / serve workloads."""

from __future__ import annotations

import argparse
import logging
import sys

import torch

from strata.analyze import analyze as analyze_mod
from strata.analyze.analyze import Workload, analyze_engine
from strata.analyze.analyze_report import format_html
from strata.analyze.analyze_report import format_text as analysis_text
from strata.analyze.analyze_serve import analyze_serve
from strata.analyze.analyze_serve import format_text as serve_text
from strata.bench.common import parse_range, resolve_model, write_json
from strata.bench.serve import ServeBenchConfig, parse_rate
from strata.config import engine_default
from strata.engine.args import EngineArgs
from strata.engine.llm_engine import LLMEngine
from strata.errors import StrataError
from strata.hardware import probe as hw_probe
from strata.planner import plan

logger = logging.getLogger(__name__)

NAME = "analyze"
HELP = "run a workload instrumented; attribute its time; name the bottleneck"
DESCRIPTION = analyze_mod.__doc__
EPILOG = """examples:
  strata analyze --random-model smol-135m --dtype float32 --num-prompts 1 --input-len 16 --output-len 64
  strata analyze --random-model smol-135m --dtype float32 --num-prompts 1 --input-len 512 --output-len 1
  strata analyze --model ./qwen --num-prompts 32 --max-num-seqs 4 --html report.html
  strata analyze --random-model smol-135m --dtype float32 --num-prompts 32 --lora-adapters 16
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    EngineArgs.add_cli_args(p)
    p.add_argument("--json", default=None, metavar="FILE", help="write the analysis to FILE as JSON")
    g = p.add_argument_group("workload")
    g.add_argument("--workload", default="offline", choices=["offline", "serve"],
                   help="offline: all requests at once through the engine in this process; serve: start "
                   "`strata serve` with these flags and drive it with `strata bench serve` (default offline)")
    g.add_argument("--request-rate", default="inf", help="serve: requests/s or inf (default inf)")
    g.add_argument("--tokenizer-workers", type=int, default=None, help="serve: passed to strata serve")
    g.add_argument("--num-prompts", type=int, default=16, help="requests in the workload")
    g.add_argument("--input-len", default="128", help="prompt tokens, N or A:B (default 128)")
    g.add_argument("--output-len", default="64", help="output tokens, N or A:B (default 64)")
    g.add_argument("--seed", type=int, default=0, help="seed for lengths and token ids")
    g.add_argument("--lora-adapters", type=int, default=0, metavar="N",
                   help="offline: requests take N random LoRA adapters round robin (rank --max-lora-rank, every "
                   "linear; implies --enable-lora and --max-loras >= N); the report gives LoRA's share (default 0)")
    p.add_argument("--html", default=None, help="also write a self-contained HTML report here")


def _serve_args(args: argparse.Namespace) -> list[str]:
    """The engine flags given on this command line, forwarded to `strata serve`."""
    out = EngineArgs.from_cli_args(args).to_cli()
    if args.tokenizer_workers is not None:
        out += ["--tokenizer-workers", str(args.tokenizer_workers)]
    return out


def _decode_crossover(model: str | None, dtype: str, quantization: str | None, context: int,
                      group_size: int = engine_default("quantization_group_size")) -> float | None:
    """The planner's compute crossover batch for this model on this machine (cached `strata hw`);
    None when it cannot be had (no model directory, or no measured profile for the dtype)."""
    if model is None:
        return None
    try:
        cfg, _ = plan.resolve_model(model)
        profile = hw_probe.probe("cuda:0" if torch.cuda.is_available() else "cpu")
        req = plan.PlanRequest(model=model, dtype=dtype, quantization=quantization, group_size=group_size)
        f = plan.engine_formats(req, cfg, profile.device, 1, profile)  # as the engine resolves them
        dev = plan.this_device(profile, f.dtype, f.quantization)
        return plan.crossover_batch(plan.ModelShape.of(cfg, f.dtype, f.quantization, group_size, f.kv_dtype), dev,
                                    context)
    except (StrataError, ValueError, OSError) as e:  # the verdict still stands without it
        logger.info("no decode crossover for the serve verdict: %s", e)
        return None


def cmd_analyze_serve(args: argparse.Namespace) -> int:
    model = resolve_model(args)
    cfg = ServeBenchConfig(url="", num_prompts=args.num_prompts, request_rate=parse_rate(args.request_rate),
                           input_len=parse_range(args.input_len, "--input-len"),
                           output_len=parse_range(args.output_len, "--output-len"), seed=args.seed,
                           tokenizer=model, progress=True)
    context = (cfg.input_len[0] + cfg.input_len[1]) / 2 + (cfg.output_len[0] + cfg.output_len[1]) / 4
    a = analyze_serve(_serve_args(args), model or "demo", cfg, args.max_num_seqs,
                      _decode_crossover(model, args.dtype, args.quantization, int(context),
                                        args.quantization_group_size))
    print(serve_text(a))
    if args.json:
        write_json(args.json, a.to_json())
    return 0


def run(args: argparse.Namespace) -> int:
    if args.workload == "serve":
        return cmd_analyze_serve(args)
    w = Workload(args.num_prompts, parse_range(args.input_len, "--input-len"),
                 parse_range(args.output_len, "--output-len"), args.seed, args.lora_adapters)
    if args.lora_adapters < 0:
        raise StrataError(f"--lora-adapters: must be >= 0, got {args.lora_adapters}")
    if args.lora_adapters:  # the engine flags the workload needs
        args.enable_lora = True
        args.max_loras = max(args.max_loras or 1, args.lora_adapters)
    def say(msg: str) -> None:
        print(f"strata analyze: {msg} ...", file=sys.stderr, flush=True)

    say("loading the model")
    engine = LLMEngine(EngineArgs.from_cli_args(args).create_engine_config())
    analysis = analyze_engine(engine, w, progress=say)
    print(analysis_text(analysis))
    if args.html:
        say("drawing the HTML report")
        with open(args.html, "w", encoding="utf-8") as f:
            f.write(format_html(analysis))
        print(f"wrote {args.html}", file=sys.stderr)
    if args.json:
        write_json(args.json, analysis.to_json())
    return 0


"""Online serving: a load generator for any OpenAI-compatible server (Strata, vLLM, llama-server).

Sends --num-prompts streaming requests to --url, arriving as a Poisson process at --request-rate
req/s (or gamma-distributed gaps with shape --burstiness and the same mean, as vLLM's
benchmark_serving does; burstiness < 1 is burstier, > 1 more regular; `inf` sends every request
at once), with at most --max-concurrency in flight. Each prompt is --input-len random token ids
(N or LO:HI uniform) decoded to text with --tokenizer (default: the demo model's tokenizer; give
the served model's tokenizer directory for exact prompt lengths), avoiding special tokens. Each
request asks for --output-len tokens (N or LO:HI uniform) with temperature 0, "ignore_eos": true
and "stream_options": {"include_usage": true}. Everything is seeded by --seed.

Per request: TTFT (send -> first chunk with text), the gaps between successive text chunks (ITL),
end-to-end latency, and TPOT = (e2e - TTFT) / (output tokens - 1). Output and prompt tokens come
from the server's usage chunk when it sends one (else: text chunks counted, planned prompt
length). A non-200 status, an error chunk or an exception marks the request failed; the run goes
on and the first distinct errors are printed. Goodput counts the requests per second meeting every
--slo bound. Connections go straight to --url (proxy variables are ignored).

examples:
  strata serve &                                            # then, in another shell:
  strata bench serve --url http://127.0.0.1:8000 --num-prompts 200 --request-rate 4
  strata bench serve --url http://127.0.0.1:8000/v1 --request-rate inf --max-concurrency 8 \\
      --input-len 128:512 --output-len 64:256 --slo ttft=500,tpot=50 --json serve.json
  strata bench serve --url http://127.0.0.1:8080 --endpoint chat --tokenizer ./Qwen2.5-0.5B
"""

# This file is the command (flags -> ServeBenchConfig, main); the docstring above is its --help.

from __future__ import annotations

import argparse
import asyncio
import math

from strata.bench.common import parse_range, write_json
from strata.bench.serve_client import benchmark, run_benchmark
from strata.bench.serve_metrics import (
    BENCHMARK,
    RequestRecord,
    ServeBenchResult,
    print_result,
    summarize,
)
from strata.bench.serve_workload import (
    API_KEY_ENV,
    ENDPOINTS,
    PlannedRequest,
    ServeBenchConfig,
    load_tokenizer,
    parse_rate,
    parse_slo,
    plan_requests,
    resolve_api_key,
    server_root,
)

# the workload (serve_workload.py), the client loop (serve_client.py) and the metrics
# (serve_metrics.py) are reached from here too, as they were before the split
__all__ = [
    "DESCRIPTION", "HELP", "NAME", "PlannedRequest", "RequestRecord", "ServeBenchConfig", "ServeBenchResult", "add_arguments",
    "benchmark", "config_from_args", "load_tokenizer", "parse_rate", "parse_slo", "plan_requests",
    "print_result", "resolve_api_key", "run", "run_benchmark", "server_root", "summarize",
]

NAME = BENCHMARK
HELP = "load-test any OpenAI-compatible server: TTFT, TPOT, ITL, throughput, goodput"
DESCRIPTION = __doc__


def _range_text(r: tuple[int, int]) -> str:
    return str(r[0]) if r[0] == r[1] else f"{r[0]}:{r[1]}"


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000 (a trailing /v1 is fine)")
    g.add_argument("--model", default=None, help="model name to send (default: the first id from GET /v1/models)")
    g.add_argument("--endpoint", choices=list(ENDPOINTS), default="completions",
                   help="/v1/completions (default) or /v1/chat/completions")
    g.add_argument("--api-key", default=None,
                   help=f"sent as 'Authorization: Bearer KEY' (default: ${' or $'.join(API_KEY_ENV)})")
    g.add_argument("--timeout", type=float, default=3600.0, help="seconds one request may take (default 3600)")
    g = p.add_argument_group("workload")
    g.add_argument("--num-prompts", type=int, default=100, help="requests to send (default 100)")
    g.add_argument("--request-rate", default="inf", help="mean arrivals per second, or inf: all at once (default)")
    g.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the arrival gaps: 1 = Poisson (default), < 1 burstier, > 1 steadier")
    g.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight (default: no cap)")
    g.add_argument("--input-len", default="128", help="prompt tokens, N or LO:HI uniform (default 128)")
    g.add_argument("--output-len", default="128", help="max_tokens, N or LO:HI uniform (default 128)")
    g.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="HF directory with tokenizer.json to build prompts (default: the demo tokenizer)")
    g.add_argument("--seed", type=int, default=0, help="seed for lengths, token ids and arrival times")
    g = p.add_argument_group("report")
    g.add_argument("--slo", default=None, metavar="ttft=MS,tpot=MS",
                   help="goodput counts requests within these bounds (either key may be left out)")
    g.add_argument("--json", default=None, metavar="FILE", help="write figures, config and every request to FILE")
    g.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def config_from_args(args: argparse.Namespace) -> ServeBenchConfig:
    slo_ttft, slo_tpot = parse_slo(args.slo)
    cfg = ServeBenchConfig(
        url=server_root(args.url), model=args.model, num_prompts=args.num_prompts,
        request_rate=parse_rate(args.request_rate), burstiness=args.burstiness,
        max_concurrency=args.max_concurrency,
        input_len=parse_range(args.input_len, "--input-len"),
        output_len=parse_range(args.output_len, "--output-len"),
        endpoint=args.endpoint, api_key=args.api_key, slo_ttft_ms=slo_ttft, slo_tpot_ms=slo_tpot,
        tokenizer=args.tokenizer, seed=args.seed, timeout_s=args.timeout, progress=not args.no_progress,
    )
    cfg.validate()
    return cfg


def run(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    rate = "inf" if math.isinf(cfg.request_rate) else f"{cfg.request_rate:g}"
    cap = cfg.max_concurrency if cfg.max_concurrency is not None else "no cap"
    print(f"server {cfg.url}, {ENDPOINTS[cfg.endpoint]}\n"
          f"{cfg.num_prompts} requests at {rate} req/s (burstiness {cfg.burstiness:g}), max concurrency {cap}, "
          f"input {_range_text(cfg.input_len)} / output {_range_text(cfg.output_len)} tokens, seed {cfg.seed}")
    res = asyncio.run(run_benchmark(cfg))
    print(f"model {res.model}\n")
    print_result(res)
    write_json(args.json, res.to_dict())
    return 0

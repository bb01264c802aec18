"""Peer benchmarks in one run: Strata vs llama.cpp vs transformers, same weights, same machine.

`benchmarks/peers/run.sh` calls this file. In order:

1. prepare (cached under $STRATA_CACHE/peers, else ~/.cache/strata/peers; never inside the repo):
   - the llama-cpp-python sdist from PyPI (`pip download`), whose vendor/llama.cpp tree is the
     llama.cpp source used for everything below;
   - llama.cpp built with cmake (Release, GGML_NATIVE=ON, no OpenSSL/CURL, no web UI download),
     only llama-bench and llama-server; a stamp file keyed by the sdist version, the cmake flags
     and this CPU makes a second run skip the build;
   - Strata's random-weight checkpoints (strata.demo.random_models) converted to GGUF f32, f16,
     bf16 and q8_0 by the tree's own convert_hf_to_gguf.py (through convert_gguf.py, which overrides
     the one method that cannot know our tokenizer), q4_0 by llama-quantize; the big shapes'
     bf16 checkpoints to a bf16 GGUF and llama-quantize's q8_0 / q4_0 from it (llama-3.1-8b: q4_0
     only, its bf16 GGUF deleted afterwards); each file checked by a short llama-bench run.
2. latency: batch 1, 128-token prompt, 128 output tokens (llama-bench; strata bench latency,
   with --compare hf for transformers; fp32, bf16, 8-bit and 4-bit weights); the big shapes
   (llama-3.2-3b: bf16 / int8 / int4; llama-3.1-8b: int4) 64 output tokens, fewer rounds; peak
   RSS of every Strata and llama.cpp process beside its row.
   depth: batch-1 decode after a context of 0 / 4k / 16k tokens (qwen-0.5b, bf16 weights):
   Strata's bf16 and int8 KV vs llama.cpp's f16 and q8_0 KV.
3. throughput: 64 requests, input 32:512, output 32:256, EOS ignored (strata bench throughput
   --compare hf; strata serve and llama-server -np N, each driven by strata bench serve at rate inf).
4. serving: strata bench serve at three request rates derived from the measured saturation
   throughput, against strata serve and llama-server.
5. report: docs/benchmarks.md and benchmarks/peers/results.json (raw per-run JSON and logs stay
   under the cache, in runs/<timestamp>/).

Everything is a subprocess whose exact command line goes into the report. Nothing here runs
under `make test`; tests/bench/test_peers.py covers only the pure functions (parsing, tables,
rates).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

if not __package__:  # run as a file (run.sh): make this directory importable as benchmarks.peers
    sys.path.append(str(Path(__file__).resolve().parents[2]))

from benchmarks.peers.pipeline import run_all
from benchmarks.peers.settings import (
    ALL_SHAPES,
    BIG_SHAPES,
    DEFAULT_JSON,
    DEFAULT_MD,
    DEFAULT_SHAPES,
    DEPTH_CAPABLE,
    DEPTH_SHAPES,
    FULL,
    LCP_VERSION,
    PARTS,
    QUICK,
    REPO,
    SMALL_SHAPES,
    parse_depths,
    parse_shapes,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="benchmarks/peers/run.sh", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default=",".join(PARTS), help=f"parts to run, comma-separated ({', '.join(PARTS)})")
    p.add_argument("--shapes", default=",".join(DEFAULT_SHAPES),
                   help=f"shapes for the latency part, from {', '.join(ALL_SHAPES)} (default %(default)s; "
                   "the big ones run their own formats, tokens and rounds: see --big-latency-rounds; "
                   "llama-3.1-8b, int4 only, is opt-in: ~4.5 more minutes)")
    p.add_argument("--latency-rounds", type=int, default=3,
                   help="measure every small shape's latency row this many times, round-robin over the "
                   "precisions; figures are the rounds' medians; a ratio is the median of every round's "
                   "own ratio, shown with each round's (and, where some rounds' llama.cpp runs before and "
                   "after Strata's disagreed by > 10%%, the steady rounds' median beside it) "
                   "(default %(default)s)")
    p.add_argument("--big-latency-rounds", type=int, default=2,
                   help=f"rounds of the big shapes' latency rows ({', '.join(BIG_SHAPES)}; their rows also "
                   f"decode {FULL.big_lat_out} tokens, {FULL.big_bench_reps} llama-bench repetitions and "
                   f"{FULL.big_repeats} Strata runs; default %(default)s)")
    p.add_argument("--depth-shapes", default=",".join(DEPTH_SHAPES),
                   help="shapes for the depth part: batch-1 decode after a long context (default %(default)s)")
    p.add_argument("--depths", default=None,
                   help="context depths of the depth part, comma-separated, 'k' = 1024 (default "
                   f"{','.join(map(str, FULL.depths))}; --quick: {','.join(map(str, QUICK.depths))})")
    p.add_argument("--depth-rounds", type=int, default=1,
                   help="rounds of the depth rows, each figure the median of its rounds (default %(default)s)")
    p.add_argument("--depth-bracket", action="store_true",
                   help="in the depth part, run llama-bench before and after each Strata run (the mean of the "
                   "two, as the latency part does) instead of once before it: +1 llama.cpp prefill of each "
                   "depth per row (4-10 min at 16k on 2 cores)")
    p.add_argument("--load-shapes", default="smol-135m", help="shapes for the throughput and serving parts")
    p.add_argument("--quick", action="store_true",
                   help="tiny workloads, a smoke test; writes the report under the cache, not docs/")
    p.add_argument("--prepare-only", action="store_true", help="download, build, convert and verify; no benchmarks")
    p.add_argument("--report-only", action="store_true", help="re-render the markdown from --out-json; run nothing")
    p.add_argument("--cache", default=None, help="peer cache (default: $STRATA_CACHE/peers or ~/.cache/strata/peers)")
    p.add_argument("--llama-cpp-python", default=LCP_VERSION, metavar="VERSION", help="sdist version (default %(default)s)")
    p.add_argument("--sdist", default=None, help="use this llama-cpp-python sdist file instead of downloading")
    p.add_argument("--no-build", action="store_true", help="fail instead of building when no cached build exists")
    p.add_argument("--jobs", type=int, default=None, help="build jobs (default: nproc)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="compute threads for every engine")
    p.add_argument("--llama-slots", default="16,64",
                   help="llama-server parallel slots (-np) to try in the throughput part, comma-separated; "
                   "serving uses the one with the best output tok/s (default %(default)s)")
    p.add_argument("--kv-cache-memory", default="2GiB", help="strata serve --kv-cache-memory (default 2GiB)")
    p.add_argument("--strata-kv-cache-dtype", default="bfloat16", choices=("auto", "bfloat16"),
                   help="Strata's --kv-cache-dtype in every part: llama.cpp stores K/V in f16 by default "
                   "(-ctk/-ctv f16), so bfloat16 compares like with like (default %(default)s)")
    p.add_argument("--slo", default="ttft=2000,tpot=150", help="goodput SLO in ms (default %(default)s)")
    p.add_argument("--rates", default=None, help="low,near,over request rates instead of derived ones")
    p.add_argument("--wait-quiet", type=float, default=300,
                   help="before each measurement, wait up to this many seconds for other processes to "
                   "go quiet (0: never wait; default %(default)s)")
    p.add_argument("--wait-quiet-total", type=float, default=1200,
                   help="stop waiting for quiet once this many seconds were spent waiting (default %(default)s)")
    p.add_argument("--retries", type=int, default=1,
                   help="measure again (keeping the least-contended attempt) when other processes used "
                   ">= --quiet-cpu during a measurement, this many times at most (default %(default)s)")
    p.add_argument("--quiet-cpu", type=float, default=40,
                   help="'quiet' = other processes use less than this %% of one core (default %(default)s)")
    p.add_argument("--port", type=int, default=8190, help="first port tried for the servers")
    p.add_argument("--no-merge", action="store_true",
                   help="do not carry parts/shapes this run skipped over from the previous results file")
    p.add_argument("--out-md", default=None, help=f"markdown report (default {DEFAULT_MD.relative_to(REPO)})")
    p.add_argument("--out-json", default=None, help=f"results JSON (default {DEFAULT_JSON.relative_to(REPO)})")
    args = p.parse_args(argv)
    for flag in ("latency_rounds", "big_latency_rounds", "depth_rounds"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')}: must be >= 1, got {getattr(args, flag)}")
    bad = set(args.only.split(",")) - set(PARTS)
    if bad:
        p.error(f"--only: unknown part(s) {', '.join(sorted(bad))}; choose from {', '.join(PARTS)}")
    for flag, known in (("shapes", ALL_SHAPES), ("depth_shapes", DEPTH_CAPABLE), ("load_shapes", SMALL_SHAPES)):
        try:
            parse_shapes(getattr(args, flag), known)
        except ValueError as e:
            p.error(f"--{flag.replace('_', '-')}: {e}")
    if args.depths is not None:
        try:
            parse_depths(args.depths)
        except ValueError as e:
            p.error(f"--depths: {e}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return run_all(args, argv)


if __name__ == "__main__":
    sys.exit(main())

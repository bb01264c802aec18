#!/usr/bin/env bash
# Peer benchmarks in one run: Strata vs llama.cpp vs transformers (entry point peers.py, next to this;
# the logic in the modules beside it: pipeline, build, convert, parts, report, ...).
#
#   benchmarks/peers/run.sh                      # prepare (cached) + all parts, ~60 min on 2 cores
#   benchmarks/peers/run.sh --only latency --shapes llama-3.1-8b   # the 8B int4 row (opt-in)
#   benchmarks/peers/run.sh --only depth         # decode at 0 / 4k / 16k context, bf16 vs int8 KV
#   benchmarks/peers/run.sh --quick              # smoke run; report under the cache, not docs/
#   benchmarks/peers/run.sh --only latency --shapes qwen-0.5b
#   benchmarks/peers/run.sh --prepare-only       # download, build llama.cpp, convert to GGUF
#   benchmarks/peers/run.sh --help
#
# Writes docs/benchmarks.md and benchmarks/peers/results.json. The llama.cpp source, build and
# GGUF files live under $STRATA_CACHE/peers (default ~/.cache/strata/peers), never in the repo.
# Not part of `make test`.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
py="${PYTHON:-$root/.venv/bin/python}"
if [ ! -x "$py" ]; then
    echo "run.sh: no virtualenv at $root/.venv; creating it with 'make install'" >&2
    make -C "$root" install >&2
fi
exec "$py" "$here/peers.py" "$@"

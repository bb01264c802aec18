#!/usr/bin/env bash
# One prepared GPU check for Strata, within ~10 minutes:
#   1. refuses clearly (exit 2) unless an NVIDIA GPU is visible (nvidia-smi) and torch sees it;
#   2. uses the venv as the Makefile does (.venv; torch, then `pip install -e .[dev,triton]`);
#   3. runs the GPU tests (pytest -m gpu: each Triton kernel on CUDA vs its torch twin, greedy
#      generation with the triton attention backend vs sdpa), then the interpreter/twin tests;
#   4. runs `strata bench latency` and `strata bench throughput` on --random-model qwen-0.5b and
#      smol-135m, --device cuda --dtype bfloat16: eager, then with --compile and --cuda-graphs
#      where `strata bench latency --help` lists those flags (skipped where it does not);
#   5. writes a summary (and every log) to $GPU_CHECK_OUT, printed at the end.
#
# usage: scripts/gpu_check.sh            (from anywhere; it works in the repository root)
# env:   GPU_CHECK_OUT  output folder (default: /tmp/strata-gpu-check-<time>)
#        VENV           virtualenv folder (default: .venv, as the Makefile)
#        BUDGET_S       total seconds for everything (default: 570)
#        STRATA_PYTHON  use this python instead of a venv (e.g. an image's python with CUDA torch)
# exit:  0 all passed, 1 something failed (see the summary), 2 no usable GPU, 3 setup failed.
set -u -o pipefail

cd "$(dirname "$0")/.." || exit 3
REPO=$(pwd)
BUDGET_S=${BUDGET_S:-570}
OUT_DIR=${GPU_CHECK_OUT:-${TMPDIR:-/tmp}/strata-gpu-check-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$OUT_DIR" || exit 3
SUMMARY="$OUT_DIR/summary.txt"
: >"$SUMMARY"
START=$SECONDS
FAILED=0

say() { echo "$*" | tee -a "$SUMMARY"; }
left() { echo $((BUDGET_S - (SECONDS - START))); }
no_gpu() {
    say "NO USABLE NVIDIA GPU: $*"
    say "This script needs a machine with an NVIDIA GPU and a CUDA build of torch; nothing was run."
    say "summary: $SUMMARY"
    exit 2
}

say "strata gpu_check  $(date -u +%Y-%m-%dT%H:%M:%SZ)  repo $REPO  ($(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo no-git))"

# --- 1. is there a GPU at all? (before any install) ---------------------------------------------
if ! command -v nvidia-smi >/dev/null 2>&1; then
    no_gpu "nvidia-smi not found (no NVIDIA driver on this machine)"
fi
if ! GPUS=$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1) || [ -z "$GPUS" ]; then
    no_gpu "nvidia-smi found no GPU: $GPUS"
fi
say "gpu: $GPUS"

# --- 2. python environment, as the Makefile makes it ---------------------------------------------
cuda_torch() { "$1" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" >/dev/null 2>&1; }
if [ -n "${STRATA_PYTHON:-}" ]; then
    PY=$STRATA_PYTHON
else
    VENV=${VENV:-.venv}
    if [ ! -x "$VENV/bin/python" ]; then
        # an image whose python3 already has a CUDA torch (possibly offline): build on top of it
        if cuda_torch python3; then
            say "setup: creating $VENV on top of python3's site-packages (it has a CUDA torch)"
            python3 -m venv --system-site-packages "$VENV" || exit 3
        else
            say "setup: creating $VENV"
            python3 -m venv "$VENV" || exit 3
        fi
    fi
    PY=$VENV/bin/python
    # torch first, as the Makefile (on Linux x86-64, PyPI's torch wheel is a CUDA build)
    "$PY" -c "import torch" 2>/dev/null || "$PY" -m pip install -q torch==2.13.0 >>"$OUT_DIR/setup.log" 2>&1
    if ! "$PY" -m pip install -q -e ".[dev,triton]" >>"$OUT_DIR/setup.log" 2>&1; then
        # offline: install strata alone and use what is already there
        say "setup: pip install -e .[dev,triton] failed (offline?); installing strata without dependencies"
        "$PY" -m pip install -q --no-deps --no-build-isolation -e . >>"$OUT_DIR/setup.log" 2>&1 \
            || say "setup: could not install strata either; falling back to PYTHONPATH=$REPO"
    fi
fi
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
    say "setup failed: $PY cannot import torch (log: $OUT_DIR/setup.log)"
    exit 3
fi
if ! cuda_torch "$PY"; then
    no_gpu "$("$PY" -c 'import torch; print(f"torch {torch.__version__} (CUDA build: {torch.version.cuda}) sees no GPU: torch.cuda.is_available() is False")' 2>&1).
 A CPU-only torch build needs replacing, e.g.: $PY -m pip install --force-reinstall torch==2.13.0"
fi
say "python: $("$PY" -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "device", torch.cuda.get_device_name(0))')"
if ! TRITON_V=$("$PY" -c "import triton; print(triton.__version__)" 2>/dev/null); then
    say "triton: NOT importable: the triton tests will be skipped and the engine will use sdpa"
    FAILED=1
else
    say "triton: $TRITON_V"
fi
"$PY" -c "import strata.cli" 2>/dev/null || { say "setup failed: strata does not import"; exit 3; }
STRATA=("$PY" -m strata.cli)  # works with or without the console script installed

# run NAME TIMEOUT CMD...: log to $OUT_DIR/NAME.log, tail into the summary, within the budget
run() {
    local name=$1 cap=$2
    shift 2
    local t=$(($(left) - 5))
    [ "$t" -gt "$cap" ] && t=$cap
    if [ "$t" -lt 20 ]; then
        say "== $name: SKIPPED (time budget spent)"
        return 0
    fi
    local t0=$SECONDS rc
    PYTHONUNBUFFERED=1 timeout -k 10 "$t" "$@" </dev/null >"$OUT_DIR/$name.log" 2>&1
    rc=$?
    local status=ok
    [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ] && status="TIMED OUT after ${t}s"
    [ "$rc" -eq 5 ] && [[ $name == pytest* ]] && status="FAILED (rc 5: pytest ran no tests)"
    [ "$rc" -ne 0 ] && [ "$status" = ok ] && status="FAILED (rc $rc)"
    [ "$rc" -ne 0 ] && FAILED=1
    say "== $name: $status in $((SECONDS - t0))s  (log: $OUT_DIR/$name.log)"
    tail -n "${TAIL:-25}" "$OUT_DIR/$name.log" | sed 's/^/   /' >>"$SUMMARY"
}

# --- 3. tests -----------------------------------------------------------------------------------
TAIL=15 run pytest-gpu 240 "$PY" -m pytest -m gpu tests/kernels/triton_kernels -p no:cacheprovider -q -rs
TAIL=6 run pytest-interpreter 90 "$PY" -m pytest -m "not gpu" tests/kernels/triton_kernels -p no:cacheprovider -q

# --- 4. benchmarks ------------------------------------------------------------------------------
# --compile / --cuda-graphs only where the subcommand's --help lists them (they are being added)
HELP_latency=$("${STRATA[@]}" bench latency --help 2>/dev/null)
HELP_throughput=$("${STRATA[@]}" bench throughput --help 2>/dev/null)
has_flag() { local help="HELP_$1"; grep -q -- "$2\b" <<<"${!help}"; }
for flag in --compile --cuda-graphs; do
    for bench in latency throughput; do
        has_flag "$bench" "$flag" || say "bench: $flag is not a flag of 'strata bench $bench' yet: skipped"
    done
done
COMMON=(--device cuda --dtype bfloat16 --kv-cache-memory 8GiB)
# eager runs of both models first, so the optional variants are what a short budget drops
for variant in eager --compile --cuda-graphs; do
    tag=${variant#--}
    for model in qwen-0.5b smol-135m; do
        for bench in latency throughput; do
            extra=()
            if [ "$variant" != eager ]; then
                has_flag "$bench" "$variant" || continue
                extra=("$variant")
            fi
            if [ "$bench" = latency ]; then
                work=(--batch 1 --input-len 128 --output-len 128)
            else
                work=(--num-prompts 64 --input-len 32:256 --output-len 32:128)
            fi
            run "$bench-$model-$tag" 150 "${STRATA[@]}" bench "$bench" --random-model "$model" "${COMMON[@]}" \
                "${work[@]}" --json "$OUT_DIR/$bench-$model-$tag.json" "${extra[@]}"
        done
    done
done

# --- 4b. tensor parallelism (NCCL) -------------------------------------------------------------------
NGPU=$("$PY" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
if [ "$NGPU" -ge 2 ]; then
    run "comm-nccl" 300 "${STRATA[@]}" bench comm --world-size "$NGPU" --backend nccl --json "$OUT_DIR/comm-nccl.json"
    for tp in 1 2; do
        run "latency-qwen-tp$tp" 300 "${STRATA[@]}" bench latency --random-model qwen-0.5b "${COMMON[@]}" \
            --batch 1 --input-len 128 --output-len 128 --tensor-parallel-size "$tp" --json "$OUT_DIR/latency-qwen-tp$tp.json"
    done
else
    say "tensor parallelism: needs two GPUs, this machine has $NGPU (NCCL ranks need a GPU each); running the host's comm bench (shm/gloo) instead"
    run "comm-host" 180 "${STRATA[@]}" bench comm --world-size 2 --backend auto --json "$OUT_DIR/comm-host.json"
fi

# --- 5. summary ---------------------------------------------------------------------------------
say "total: $((SECONDS - START))s; $([ "$FAILED" -eq 0 ] && echo 'everything passed' || echo 'SOMETHING FAILED: see above')"
say "summary: $SUMMARY"
exit "$FAILED"

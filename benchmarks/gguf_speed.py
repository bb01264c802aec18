"""Strata and llama.cpp on the same GGUF files: batch-1 decode and prefill, bracketed.

usage: python benchmarks/gguf_speed.py FILE.gguf [FILE.gguf ...] --llama-bench PATH
       [--input-len 128] [--output-len 64] [--repeats 3] [--rounds 1] [--json OUT]

For each file and round: llama-bench (-p INPUT -n OUTPUT, 2 threads), then `strata bench latency
--model FILE` with the same lengths, then llama-bench again; llama.cpp's figure is the mean of the
two runs around Strata's, so both engines see the same DRAM-bandwidth drift (the dev VM's moves
up to 2x within minutes). Prints every round, then the medians and the ratios; --json writes them.
The files are llama.cpp's own (benchmarks/peers makes F32 / Q8_0 / Q4_0 GGUFs of the random
shapes; `llama-quantize F32.gguf OUT.gguf Q4_K_M` makes a Q4_K_M one).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def llama_bench(bench: str, model: str, n_in: int, n_out: int, reps: int) -> tuple[float, float]:
    """(prefill tok/s, decode tok/s) from llama-bench's JSON."""
    out = subprocess.run([bench, "-m", model, "-t", "2", "-p", str(n_in), "-n", str(n_out), "-r", str(reps),
                          "-o", "json"], capture_output=True, text=True, check=True, timeout=3600).stdout
    rows = json.loads(out)
    pp = next(r["avg_ts"] for r in rows if r["n_prompt"] == n_in and r["n_gen"] == 0)
    tg = next(r["avg_ts"] for r in rows if r["n_gen"] == n_out and r["n_prompt"] == 0)
    return pp, tg


def strata_bench(model: str, n_in: int, n_out: int, reps: int) -> tuple[float, float]:
    with tempfile.TemporaryDirectory() as d:
        f = Path(d) / "lat.json"
        subprocess.run([sys.executable, "-m", "strata", "bench", "latency", "--model", model, "--input-len", str(n_in),
                        "--output-len", str(n_out), "--repeats", str(reps), "--max-model-len", str(n_in + n_out + 64),
                        "--json", str(f)], check=True, capture_output=True, timeout=3600)
        s = json.loads(f.read_text())["strata"]
    return s["prefill_tokens_per_s"], s["decode_tokens_per_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--llama-bench", required=True)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rounds: dict[str, list[dict]] = {f: [] for f in args.files}
    print(f"{'file':<28} {'round':>5} {'strata dec':>10} {'llama dec':>10} {'strata pre':>10} {'llama pre':>10}")
    for r in range(args.rounds):
        for f in args.files:
            before = llama_bench(args.llama_bench, f, args.input_len, args.output_len, args.repeats)
            ours = strata_bench(f, args.input_len, args.output_len, args.repeats)
            after = llama_bench(args.llama_bench, f, args.input_len, args.output_len, args.repeats)
            row = {"strata_prefill": ours[0], "strata_decode": ours[1],
                   "llama_prefill": (before[0] + after[0]) / 2, "llama_decode": (before[1] + after[1]) / 2,
                   "llama_runs": [before, after]}
            rounds[f].append(row)
            print(f"{Path(f).name:<28} {r + 1:>5} {row['strata_decode']:>10.1f} {row['llama_decode']:>10.1f} "
                  f"{row['strata_prefill']:>10.1f} {row['llama_prefill']:>10.1f}")
    print(f"\n{'file (median of rounds)':<28} {'decode':>16} {'prefill':>16}")
    summary = {}
    for f, rows in rounds.items():
        med = {k: statistics.median(x[k] for x in rows) for k in rows[0] if k != "llama_runs"}
        summary[f] = {"median": med, "rounds": rows}
        print(f"{Path(f).name:<28} {med['strata_decode'] / med['llama_decode']:>15.2f}x "
              f"{med['strata_prefill'] / med['llama_prefill']:>15.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()

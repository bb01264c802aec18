"""Peer benchmarks in one run: Strata vs llama.cpp vs transformers, same weights, same machine.

`benchmarks/peers/run.sh` calls this file. In order:

1. prepare (cached under $STRATA_CACHE/peers, else ~/.cache/strata/peers; never inside the repo):
   - the llama-cpp-python sdist from PyPI (`pip download`), whose vendor/llama.cpp tree is the
     llama.cpp source used for everything below;
   - llama.cpp built with cmake (Release, GGML_NATIVE=ON, no OpenSSL/CURL, no web UI download),
     only llama-bench and llama-server; a stamp file keyed by the sdist version, the cmake flags
     and this CPU makes a second run skip the build;
   - Strata's random-weight checkpoints (strata.demo.random_models) converted to GGUF f32, f16
     and q8_0 by the tree's own convert_hf_to_gguf.py (through convert_gguf.py, which overrides
     the one method that cannot know our tokenizer), each checked by a short llama-bench run.
2. latency: batch 1, 128-token prompt, 128 output tokens (llama-bench; strata bench latency,
   with --compare hf for transformers; fp32 and 8-bit weights).
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
import datetime as dt
import hashlib
import json
import math
import os
import platform
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import traceback
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
DEFAULT_MD = REPO / "docs" / "benchmarks.md"
DEFAULT_JSON = HERE / "results.json"

LCP_VERSION = "0.3.36"  # llama-cpp-python sdist on PyPI; its vendor/llama.cpp is the peer
BUILD_TARGETS = ("llama-bench", "llama-server")
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",  # -march=native: this CPU's AVX-512 / VNNI / BF16
    "-DBUILD_SHARED_LIBS=OFF",  # self-contained binaries in the cache
    "-DLLAMA_OPENSSL=OFF",  # no HTTPS client: nothing is downloaded at run time
    "-DLLAMA_USE_PREBUILT_UI=OFF",  # the server's web UI would be fetched from Hugging Face
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
)
OUTTYPES = ("f32", "f16", "q8_0")
ALL_SHAPES = ("smol-135m", "qwen-0.5b")
PARTS = ("latency", "throughput", "serving")
RATE_FACTORS = {"low": 0.3, "near": 0.9, "over": 1.5}  # x the saturation request rate


# ----------------------------------------------------------------------------------------------
# workloads


@dataclass(frozen=True)
class Workload:
    lat_in: int = 128
    lat_out: int = 128
    bench_reps: int = 3  # llama-bench repetitions
    tp_prompts: int = 64
    tp_in: tuple[int, int] = (32, 512)
    tp_out: tuple[int, int] = (32, 256)
    serve_target_s: float = 80.0  # arrivals span about this long at each serving point
    serve_min_prompts: int = 12
    serve_max_prompts: int = 64
    hf_batch: int = 16


FULL = Workload()
QUICK = Workload(lat_in=32, lat_out=16, bench_reps=1, tp_prompts=8, tp_in=(16, 64), tp_out=(8, 32),
                 serve_target_s=8.0, serve_min_prompts=4, serve_max_prompts=8)


def rng_text(r: tuple[int, int]) -> str:
    return str(r[0]) if r[0] == r[1] else f"{r[0]}:{r[1]}"


# ----------------------------------------------------------------------------------------------
# pure logic (unit-tested in tests/bench/test_peers.py)


def parse_llama_bench(text: str) -> list[dict[str, Any]]:
    """llama-bench `-o json` stdout -> one dict per test with the fields the report uses."""
    start = text.find("[")
    if start < 0:
        raise ValueError("no JSON array in llama-bench output")
    rows = json.loads(text[start:])
    out = []
    for r in rows:
        out.append({
            "model": Path(str(r.get("model_filename", ""))).name,
            "model_type": r.get("model_type"),
            "n_prompt": int(r.get("n_prompt", 0)),
            "n_gen": int(r.get("n_gen", 0)),
            "n_depth": int(r.get("n_depth", 0)),
            "n_threads": r.get("n_threads"),
            "avg_ts": float(r["avg_ts"]),
            "stddev_ts": float(r.get("stddev_ts", 0.0)),
            "samples_ts": [float(x) for x in r.get("samples_ts", [])],
            "build_commit": r.get("build_commit"),
            "build_number": r.get("build_number"),
            "cpu_info": r.get("cpu_info"),
            "type_k": r.get("type_k"),
            "flash_attn": r.get("flash_attn"),
        })
    return out


def pick_bench(rows: list[dict], model: str, n_prompt: int, n_gen: int, n_depth: int = 0) -> dict | None:
    """The llama-bench test of `model` (file name) with these token counts, or None."""
    for r in rows:
        if (r["model"] == model and r["n_prompt"] == n_prompt and r["n_gen"] == n_gen
                and r["n_depth"] == n_depth):
            return r
    return None


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, or None when either is missing, non-finite or b is not positive."""
    if a is None or b is None or not (math.isfinite(a) and math.isfinite(b)) or b <= 0:
        return None
    return a / b


def derive_rates(saturation_rps: float, factors: dict[str, float] = RATE_FACTORS) -> dict[str, float]:
    """Offered request rates (req/s) for the serving points, from the saturation request rate."""
    if not (saturation_rps > 0 and math.isfinite(saturation_rps)):
        raise ValueError(f"saturation rate must be a positive number, got {saturation_rps!r}")
    return {name: round(f * saturation_rps, 3) for name, f in factors.items()}


def prompts_for_rate(rate: float, target_s: float, lo: int, hi: int) -> int:
    """Requests at one serving point so that arrivals span about target_s seconds, in [lo, hi]."""
    return int(min(hi, max(lo, round(rate * target_s))))


def fmt_num(v: Any, digits: int = 3) -> str:
    """Numbers for tables: '-' for missing, 3 significant digits below 100, else whole numbers."""
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        if abs(v) >= 100:
            return f"{v:,.0f}"
        return f"{v:.{digits}g}"
    return str(v)


def others_cpu(*entries: dict | None) -> float | None:
    """Largest mean CPU (% of one core) other processes used during these commands."""
    xs = [e.get("others_cpu_mean") for e in entries if e]
    xs = [x for x in xs if x is not None]
    return max(xs) if xs else None


def fmt_cpu(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}%"


def fmt_ratio(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def md_table(headers: list[str], rows: list[list[Any]], left: int = 1) -> str:
    """A GitHub markdown table; the first `left` columns left-aligned, the rest right-aligned."""
    cells = [[c if isinstance(c, str) else fmt_num(c) for c in r] for r in rows]
    align = [":--"] * left + ["--:"] * (len(headers) - left)
    lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join(align) + " |"]
    lines += ["| " + " | ".join(r) + " |" for r in cells]
    return "\n".join(lines)


# one row per engine/weights; "vs" names the Strata row a peer row is compared with
LATENCY_ROWS = (
    ("strata_fp32", "**Strata**", "fp32", None),
    ("llama_f32", "llama.cpp", "f32 GGUF", "strata_fp32"),
    ("hf_fp32", "transformers", "fp32", "strata_fp32"),
    ("strata_int8", "**Strata**", "int8 (per row, fp32 activations)", None),
    ("llama_q8_0", "llama.cpp", "q8_0 GGUF (blocks of 32)", "strata_int8"),
    ("llama_f16", "llama.cpp", "f16 GGUF (vs Strata fp32)", "strata_fp32"),
)


def latency_table(shape_res: dict[str, dict]) -> str:
    """Markdown table of one shape's batch-1 figures: rows from LATENCY_ROWS that were measured."""
    rows = []
    for key, engine, weights, vs in LATENCY_ROWS:
        r = shape_res.get(key)
        if not r:
            continue
        base = shape_res.get(vs) if vs else None
        pre, dec = r.get("prefill_tps"), r.get("decode_tps")
        rp = ratio(base.get("prefill_tps"), pre) if base else None
        rd = ratio(base.get("decode_tps"), dec) if base else None
        ms = 1e3 / dec if dec else None
        rows.append([engine, weights, pre, dec, ms,
                     fmt_ratio(rp) if vs else "", fmt_ratio(rd) if vs else "", fmt_cpu(r.get("others_cpu"))])
    return md_table(["engine", "weights", "prefill tok/s", "decode tok/s", "decode ms/token",
                     "Strata ÷ this, prefill", "Strata ÷ this, decode", "others' CPU"], rows)


THROUGHPUT_ROWS = (
    ("strata_offline", "**Strata**", "LLM.generate, continuous batching (`strata bench throughput`)", None),
    ("hf_static", "transformers", "generate, static batches (`--compare hf`)", "strata_offline"),
    ("strata_http", "**Strata**", "`strata serve` + `strata bench serve --request-rate inf`", None),
)
LLAMA_HTTP_HOW = "`llama-server -np N -cb` + `strata bench serve --request-rate inf`"


def throughput_rows(tp: dict[str, Any]) -> list[tuple[str, str, str, str | None, dict]]:
    """(key, engine, how, compared-with key, figures) for every measured throughput row:
    THROUGHPUT_ROWS, then one llama-server row per slot count tried."""
    out = [(k, e, h, vs, tp[k]) for k, e, h, vs in THROUGHPUT_ROWS if tp.get(k)]
    best = (tp.get("llama_http") or {}).get("slots")
    for r in tp.get("llama_http_runs") or ([tp["llama_http"]] if tp.get("llama_http") else []):
        how = LLAMA_HTTP_HOW.replace("-np N", f"-np {r.get('slots', 'N')}")
        if best is not None and r.get("slots") == best and len(tp.get("llama_http_runs") or []) > 1:
            how += " (best slot count; used for serving)"
        out.append((f"llama_http_np{r.get('slots')}", "llama.cpp", how, "strata_http", r))
    return out


def throughput_table(tp: dict[str, Any]) -> str:
    rows = []
    for key, engine, how, vs, r in throughput_rows(tp):
        if key == "hf_static" and r.get("batch_size"):
            how = how.replace("static batches", f"static batches of {r['batch_size']}")
        base = tp.get(vs) if vs else None
        rr = ratio(base.get("output_tps"), r.get("output_tps")) if base else None
        rows.append([engine, how, r.get("requests"), r.get("elapsed_s"), r.get("rps"), r.get("output_tps"),
                     r.get("total_tps"), r.get("short_outputs", "-"), fmt_ratio(rr) if vs else "",
                     fmt_cpu(r.get("others_cpu"))])
    return md_table(["engine", "how", "requests", "elapsed s", "req/s", "output tok/s", "total tok/s",
                     "short outputs", "Strata ÷ this, output tok/s", "others' CPU"], rows)


def serve_summary(d: dict) -> dict:
    """The figures of one `strata bench serve --json` file that the report keeps."""
    return {
        "completed": d.get("completed"), "failed": d.get("failed"), "duration_s": d.get("duration_s"),
        "rps": d.get("request_throughput"), "output_tps": d.get("output_throughput"),
        "total_tps": d.get("total_token_throughput"),
        "ttft_ms": d.get("ttft_ms"), "tpot_ms": d.get("tpot_ms"), "itl_ms": d.get("itl_ms"),
        "e2e_ms": d.get("e2e_ms"), "goodput": d.get("goodput"), "good_requests": d.get("good_requests"),
        "short_outputs": d.get("short_outputs"), "max_concurrency": d.get("max_concurrency_observed"),
        "input_tokens": d.get("total_input_tokens"), "output_tokens": d.get("total_output_tokens"),
        "errors": d.get("errors") or {},
    }


def serving_table(points: list[dict]) -> str:
    """One row per (rate, engine), plus a Strata ÷ llama.cpp row per rate."""
    rows = []
    for p in points:
        by = {}
        for eng, label in (("strata", "**Strata**"), ("llama", "llama.cpp")):
            r = p.get(eng)
            if not r:
                continue
            by[eng] = r
            good = r.get("goodput")
            rows.append([f"{p['name']} ({p['rate']:g} req/s, {p['num_prompts']} req)", label,
                         f"{r.get('completed')}/{p['num_prompts']}", r.get("rps"), r.get("output_tps"),
                         (r.get("ttft_ms") or {}).get("p50"), (r.get("ttft_ms") or {}).get("p99"),
                         (r.get("tpot_ms") or {}).get("p50"), (r.get("tpot_ms") or {}).get("p99"),
                         good, f"{r.get('good_requests')}/{r.get('completed')}", fmt_cpu(r.get("others_cpu"))])
        if len(by) == 2:
            s, ll = by["strata"], by["llama"]

            def rp(k: str, sub: str | None = None, s: dict = s, ll: dict = ll) -> str:
                a = (s.get(k) or {}).get(sub) if sub else s.get(k)
                b = (ll.get(k) or {}).get(sub) if sub else ll.get(k)
                return fmt_ratio(ratio(a, b))

            rows.append(["", "Strata ÷ llama.cpp", "", rp("rps"), rp("output_tps"), rp("ttft_ms", "p50"),
                         rp("ttft_ms", "p99"), rp("tpot_ms", "p50"), rp("tpot_ms", "p99"), rp("goodput"), "", ""])
    return md_table(["offered load", "engine", "done", "req/s", "output tok/s", "TTFT p50 ms",
                     "TTFT p99 ms", "TPOT p50 ms", "TPOT p99 ms", "goodput req/s", "within SLO",
                     "others' CPU"], rows)


def findings(res: dict) -> list[str]:
    """Plain sentences: every comparison, Strata's losses first (rates: < 1x; latencies: > 1x)."""
    losses, wins = [], []

    def add(text: str, r: float | None, higher_better: bool = True) -> None:
        if r is None:
            return
        bad = r < 1 if higher_better else r > 1
        (losses if bad else wins).append(f"{text}: Strata ÷ peer = {r:.2f}x")

    for shape, sr in (res.get("latency") or {}).items():
        for key, engine, weights, vs in LATENCY_ROWS:
            if vs and sr.get(key) and sr.get(vs):
                for k, what in (("prefill_tps", "prefill tok/s"), ("decode_tps", "decode tok/s")):
                    add(f"{shape} batch-1 {what}, {engine} {weights.split(' (')[0]}",
                        ratio(sr[vs].get(k), sr[key].get(k)))
    for shape, tp in (res.get("throughput") or {}).items():
        for key, engine, _how, vs, r in throughput_rows(tp):
            if vs and tp.get(vs):
                what = f"llama-server -np {r.get('slots')}, HTTP" if key.startswith("llama") else engine
                add(f"{shape} throughput (output tok/s) vs {what}", ratio(tp[vs].get("output_tps"), r.get("output_tps")))
    for shape, sv in (res.get("serving") or {}).items():
        for p in sv.get("points", []):
            s, ll = p.get("strata"), p.get("llama")
            if not (s and ll):
                continue
            tag = f"{shape} serving at {p['rate']:g} req/s ({p['name']})"
            add(f"{tag}, TTFT p50 vs llama.cpp", ratio(s["ttft_ms"].get("p50"), ll["ttft_ms"].get("p50")),
                higher_better=False)
            add(f"{tag}, TPOT p50 vs llama.cpp", ratio(s["tpot_ms"].get("p50"), ll["tpot_ms"].get("p50")),
                higher_better=False)
            add(f"{tag}, goodput vs llama.cpp", ratio(s.get("goodput"), ll.get("goodput")))
    return [f"Strata behind: {t}" for t in losses] + [f"Strata ahead or even: {t}" for t in wins]


# ----------------------------------------------------------------------------------------------
# report


def _mib(n: int | None) -> str:
    return "-" if not n else f"{n / 2**30:.1f} GiB"


def render_markdown(res: dict) -> str:
    """docs/benchmarks.md from the results dict (everything it shows is in results.json)."""
    m, v, wl = res.get("machine", {}), res.get("versions", {}), res.get("workload", {})
    out: list[str] = []
    w = out.append
    w("# Peer benchmarks: Strata vs llama.cpp vs transformers\n")
    w(f"Generated by `benchmarks/peers/run.sh{(' ' + res['args']) if res.get('args') else ''}` "
      f"on {res.get('date', '?')} (run took {fmt_num(res.get('wall_s', 0) / 60)} min). "
      "Re-running the script regenerates this page and `benchmarks/peers/results.json`; "
      "per-run JSON and logs stay under the cache directory "
      f"(`{res.get('run_dir_display', '$PEERS/runs/...')}`).\n")
    if res.get("quick"):
        w("**Quick smoke run: tiny workloads, the figures mean nothing.**\n")
    if res.get("kept_from_previous"):
        w("Carried over from an earlier run (this run skipped them): "
          + "; ".join(res["kept_from_previous"]) + ".\n")
    w("All engines run the same random-weight checkpoints (`strata.demo.random_models`: smol-135m is "
      "SmolLM2-135M's shape, Llama architecture, 30 layers, tied embeddings; qwen-0.5b is Qwen2.5-0.5B's "
      "shape), one after another in one invocation, so figures are ratios on one machine. "
      "llama.cpp reads them as GGUF converted by its own `convert_hf_to_gguf.py`; transformers and "
      "Strata read the safetensors directory. Every request is greedy and ignores EOS.\n")
    w("**The dev machine is a shared VM** (2 cores; other jobs may run beside this one, and its DRAM "
      "bandwidth drifts by up to 2x within an hour), so absolute figures move between runs. Before each measurement the script waits "
      f"(up to {fmt_num(res.get('wait_quiet_s'))} s) for other processes to use less than "
      f"{fmt_num(res.get('quiet_cpu'))}% of a core, and the \"others' CPU\" column gives the mean CPU "
      "(in % of one core) that processes outside this run used while the figure was measured: "
      "a row with a high figure there was measured on less than two free cores. llama.cpp suffers "
      "most from that (its threads spin-wait at barriers, so one preempted thread stalls every "
      "step). Compare within a table, not across runs."
      + (f" This run waited {fmt_num(res['waited_quiet_s'])} s in total for quiet." if res.get("waited_quiet_s")
         else "") + "\n")

    w("## How to run\n")
    w("```bash\n"
      "benchmarks/peers/run.sh                    # prepare (cached) + every part; rewrites this page\n"
      "benchmarks/peers/run.sh --quick            # smoke run, tiny workloads; report under the cache\n"
      "benchmarks/peers/run.sh --only latency --shapes qwen-0.5b\n"
      "benchmarks/peers/run.sh --prepare-only     # download, build, convert, verify; no benchmarks\n"
      "benchmarks/peers/run.sh --report-only      # re-render this page from benchmarks/peers/results.json\n"
      "benchmarks/peers/run.sh --help             # shapes, slots, SLO, rates, quiet-machine waiting, retries\n"
      "```\n")
    w("A run with `--only` or fewer shapes keeps the other tables from the previous results.json (dated).\n")
    w("The first run downloads the llama-cpp-python sdist with pip (the only network access), unpacks it, "
      "builds llama.cpp from its `vendor/llama.cpp` with cmake and converts the checkpoints; all of it lands "
      "under `$STRATA_CACHE/peers` (default `~/.cache/strata/peers`). A stamp file keyed by the sdist "
      "version, the cmake flags and the CPU makes later runs skip the build. Nothing here is part of "
      "`make test`.\n")
    w("## Machine\n")
    hw = m.get("strata_hw") or {}
    host, meas = hw.get("host") or {}, hw.get("cpu_measured") or {}
    rows = [
        ["CPU", f"{m.get('cpu_model', '?')} ({m.get('cpu_note', '')})".replace(" ()", "")],
        ["cores", f"{host.get('cores_physical', m.get('cores'))} physical, "
                  f"{host.get('cores_logical', m.get('cpus'))} logical"],
        ["memory", _mib(host.get("memory_total_bytes") or m.get("memory_bytes"))],
        ["ISA", ", ".join(k for k, on in (host.get("isa") or {}).items() if on) or "-"],
        ["memory bandwidth (torch read, measured)", f"{fmt_num(meas.get('mem_bandwidth_gbs'))} GB/s"],
        ["memory bandwidth (numpy read, measured)", f"{fmt_num(meas.get('numpy_read_gbs'))} GB/s"],
        ["fp32 GEMM (512 rows, measured)", f"{fmt_num((meas.get('gemm_gflops') or {}).get('float32'))} GFLOP/s"],
        ["fp32 batch-16 linear (measured)", f"{fmt_num((meas.get('matmul_gflops') or {}).get('float32'))} GFLOP/s"],
        ["fp32 batch-1 linear weight stream", f"{fmt_num((meas.get('linear_gbs') or {}).get('float32'))} GB/s"],
        ["measured by", f"`{m.get('hw_source', 'strata hw --json --refresh')}` at the start of the run"
                        f" (others' CPU meanwhile: {fmt_cpu(m.get('others_cpu_during_hw'))})"],
        ["kernel", m.get("kernel", "-")],
    ]
    w(md_table(["", ""], rows, left=2) + "\n")

    w("## Versions\n")
    lc = v.get("llama_cpp") or {}
    rows = [
        ["Strata", f"git {v.get('strata_commit', '?')}{' (uncommitted changes)' if v.get('strata_dirty') else ''}"],
        ["llama.cpp", f"commit {lc.get('commit', '?')} ({lc.get('commit_date', '?')}), build "
                      f"{lc.get('build_number', '?')}, vendored in llama-cpp-python {lc.get('sdist_version', '?')} "
                      "(PyPI sdist)"],
        ["llama.cpp build", f"{v.get('cmake_version', 'cmake ?')}, {v.get('compiler', '?')}; "
                            f"`{' '.join(lc.get('cmake_flags', []))}`; targets {', '.join(lc.get('targets', []))}"],
        ["llama.cpp converter", f"convert_hf_to_gguf.py + gguf-py {lc.get('gguf_py_version', '?')} from the same tree, "
                                "run through benchmarks/peers/convert_gguf.py (BPE pre-tokenizer = gpt-2)"],
        ["transformers", v.get("transformers", "?")],
        ["torch", v.get("torch", "?")],
        ["numpy / numba", f"{v.get('numpy', '?')} / {v.get('numba', '?')}"],
        ["Python", v.get("python", "?")],
    ]
    w(md_table(["", ""], rows, left=2) + "\n")
    bi = res.get("build") or {}
    if bi:
        w(f"llama.cpp build: {bi.get('status', '?')}" +
          (f" (built in {fmt_num(bi.get('build_s'))} s on this machine, -j{bi.get('jobs')})"
           if bi.get("build_s") else "") + ".\n")

    w("## Batch-1 latency\n")
    w(f"One sequence, {wl.get('lat_in')}-token prompt of random token ids, {wl.get('lat_out')} output tokens, "
      "2 threads for every engine. Prefill tok/s = prompt tokens / time to the first token. Decode tok/s "
      "= decode steps / decode time with the prompt in the KV cache (llama-bench: "
      f"`-p 0 -n {wl.get('lat_out')} -d {wl.get('lat_in')}`, i.e. generation at depth {wl.get('lat_in')}; "
      f"prefill is `-p {wl.get('lat_in')} -n 0`; mean of {wl.get('bench_reps')} repetitions). Strata and "
      "transformers are one timed run after a warm-up (`strata bench latency`, transformers via "
      "`--compare hf`: one prefill forward, then a greedy loop over a DynamicCache). "
      "\"Strata ÷ this\" > 1 means Strata is faster.\n")
    w("8-bit rows are not the same format: Strata's int8 is symmetric per output row with fp32 "
      "activations (dequantised in the kernel); llama.cpp's q8_0 stores blocks of 32 weights with an "
      "fp16 scale and quantises the activations to 8 bits too, so it runs integer dot products (VNNI).\n")
    for shape, sr in (res.get("latency") or {}).items():
        w(f"### {shape}\n")
        w(latency_table(sr) + "\n")

    tps = res.get("throughput") or {}
    if tps:
        w("## Offline throughput\n")
        w(f"{wl.get('tp_prompts')} requests, prompt lengths uniform in {wl.get('tp_in')} tokens, output "
          f"lengths uniform in {wl.get('tp_out')}, EOS ignored, seed 0 (the same lengths for every engine; "
          "the HTTP runs draw the same lengths, prompts are random token ids decoded to text and re-encoded). "
          "All requests are submitted at once. Output tok/s counts each request's own output tokens. "
          "The HTTP rows put the same client (`strata bench serve`, streaming /v1/completions) in front "
          "of both servers, so they compare like with like; the offline rows have no HTTP at all. "
          "\"short outputs\" = requests that returned fewer tokens than asked (a server ignoring "
          "`ignore_eos`).\n")
        for shape, tp in tps.items():
            w(f"### {shape}\n")
            w(throughput_table(tp) + "\n")
            notes = tp.get("notes") or []
            for n in notes:
                w(f"- {n}")
            if notes:
                w("")

    svs = res.get("serving") or {}
    if svs:
        w("## Online serving\n")
        for shape, sv in svs.items():
            w(f"### {shape}\n")
            w(f"Poisson arrivals at three offered rates derived from the saturation request rate "
              f"{fmt_num(sv.get('saturation_rps'))} req/s ({sv.get('saturation_source', '?')}): "
              + ", ".join(f"{k} = {f:g}x" for k, f in RATE_FACTORS.items())
              + f". Same workload as the throughput runs (input {wl.get('tp_in')}, output {wl.get('tp_out')}); "
              f"each point sends enough requests for its arrivals to span about {fmt_num(wl.get('serve_target_s'))} s "
              f"({wl.get('serve_min_prompts')}-{wl.get('serve_max_prompts')} requests), so a point takes 1-2 "
              f"minutes. Goodput = requests per second meeting the SLO {sv.get('slo', '?')} "
              "(TTFT and TPOT in ms). Servers: "
              f"`{sv.get('strata_cmd', 'strata serve')}` and `{sv.get('llama_cmd', 'llama-server')}`. "
              "TTFT and TPOT ratios > 1 mean Strata is slower.\n")
            w(serving_table(sv.get("points", [])) + "\n")

    f = findings(res)
    if f:
        w("## Where Strata stands\n")
        w("Generated from the tables above.\n")
        w("\n".join(f"- {x}" for x in f) + "\n")

    notes = res.get("notes") or []
    if notes:
        w("## Notes\n")
        w("\n".join(f"- {n}" for n in notes) + "\n")
    errs = res.get("errors") or []
    if errs:
        w("## Errors in this run\n")
        w("\n".join(f"- {e['part']}: {e['error']}" for e in errs) + "\n")

    w("## Commands\n")
    w("`$PEERS` is the peer cache (`$STRATA_CACHE/peers`, default `~/.cache/strata/peers`); `$RUN` is "
      "this run's directory under it. In order:\n")
    w("```bash")
    part = None
    for c in res.get("commands", []):
        if c.get("discarded"):
            continue
        if c["part"] != part:
            part = c["part"]
            w(f"# --- {part}")
        w(c["cmd"])
    w("```\n")
    return "\n".join(out)


# ----------------------------------------------------------------------------------------------
# running things


class StepError(RuntimeError):
    pass


@dataclass
class Ctx:
    args: argparse.Namespace
    wl: Workload
    cache: Path
    run_dir: Path
    results: dict[str, Any]
    python: str = sys.executable
    strata: list[str] = field(default_factory=list)
    llama_dir: Path | None = None
    bin_dir: Path | None = None
    env: dict[str, str] = field(default_factory=dict)
    n_cmd: int = 0
    monitor: CpuMonitor | None = None
    last: dict = field(default_factory=dict)  # the record of the latest command run
    waited_total: float = 0.0  # seconds spent in quiet() so far

    def quiet(self, what: str) -> dict:
        """Before a measurement: wait for the other processes to go quiet (bounded); returns the wait."""
        budget = min(self.args.wait_quiet, self.args.wait_quiet_total - self.waited_total)
        if self.monitor is None or budget <= 0:
            return {}
        waited = self.monitor.wait_quiet(self.args.quiet_cpu, budget)
        self.waited_total += waited
        if waited >= 1:
            print(f"    waited {waited:.0f} s for other processes to go quiet before {what}", flush=True)
        return {"waited_quiet_s": round(waited, 1)}

    def display(self, cmd: list[str]) -> str:
        """The command as the report shows it: cache paths as $PEERS/$RUN, the venv's strata as strata."""
        text = shlex.join([str(c) for c in cmd])
        reps = [(str(self.run_dir), "$RUN"), (str(self.cache), "$PEERS")]
        if self.strata:
            reps.insert(0, (shlex.join(self.strata), "strata"))
        reps += [(self.python, "python"), (str(REPO) + "/", ""), (str(Path.home()), "~")]
        for a, b in reps:
            text = text.replace(a, b)
        return text

    def log_path(self, name: str) -> Path:
        self.n_cmd += 1
        return self.run_dir / "logs" / f"{self.n_cmd:02d}-{name}.log"

    def run(self, part: str, name: str, cmd: list[str], timeout: float = 3600, record: bool = True,
            capture: bool = False, cwd: Path | None = None, env: dict | None = None) -> str:
        """Run cmd (stdout+stderr to a log); return stdout when capture (stderr still logged)."""
        log = self.log_path(name)
        shown = self.display(cmd)
        entry: dict[str, Any] = {"part": part, "cmd": shown}
        self.last = entry
        if record:
            self.results["commands"].append(entry)
            if part not in ("prepare", "machine"):
                entry.update(self.quiet(name))
        print(f"[{time.strftime('%H:%M:%S')}] $ {shown}\n    log: {log}", flush=True)
        full_env = {**os.environ, **self.env, **(env or {})}
        wall0 = time.time()
        t0 = time.perf_counter()
        with open(log, "w") as f:
            f.write(f"$ {shlex.join([str(c) for c in cmd])}\n\n")
            f.flush()
            p = subprocess.run([str(c) for c in cmd], stdout=subprocess.PIPE if capture else f,
                               stderr=f, timeout=timeout, cwd=cwd, env=full_env, text=True)
        dt_s = time.perf_counter() - t0
        entry["seconds"] = round(dt_s, 1)
        if self.monitor is not None:
            entry.update(self.monitor.window(wall0, time.time()))
            busy = entry.get("others_cpu_mean")
            if busy is not None and busy >= self.args.quiet_cpu:
                print(f"    note: other processes used {busy:.0f}% of a core on average meanwhile "
                      f"({'; '.join(entry['busiest'][:2])})", flush=True)
        if capture:
            with open(log, "a") as f:
                f.write("\n--- stdout ---\n" + p.stdout)
        status = "ok" if p.returncode == 0 else f"FAILED rc={p.returncode}"
        print(f"    {status} in {dt_s:.1f} s", flush=True)
        if p.returncode != 0:
            raise StepError(f"`{shown}` failed (rc {p.returncode}); last lines of {log}:\n{tail(log)}")
        return p.stdout if capture else ""


def tail(path: Path, n: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def read_json(path: Path) -> dict:
    return json.loads(path.read_text())


def free_port(start: int) -> int:
    for port in range(start, start + 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise StepError(f"no free TCP port in {start}..{start + 199}")


class Server:
    """A server process started by us (own session), ready when GET ready_path answers 200."""

    def __init__(self, ctx: Ctx, part: str, name: str, cmd: list[str], port: int, ready_path: str,
                 timeout_s: float = 600):
        self.ctx, self.part, self.name, self.cmd = ctx, part, name, cmd
        self.port, self.ready_path, self.timeout_s = port, ready_path, timeout_s
        self.proc: subprocess.Popen | None = None
        self.log = ctx.log_path(name)
        self.url = f"http://127.0.0.1:{port}"

    def __enter__(self) -> Server:
        shown = self.ctx.display(self.cmd)
        self.ctx.results["commands"].append({"part": self.part, "cmd": shown + " &"})
        print(f"[{time.strftime('%H:%M:%S')}] $ {shown} &\n    log: {self.log}", flush=True)
        self._f = open(self.log, "w")
        self.proc = subprocess.Popen([str(c) for c in self.cmd], stdout=self._f, stderr=subprocess.STDOUT,
                                     start_new_session=True, env={**os.environ, **self.ctx.env})
        t0 = time.perf_counter()
        while True:
            if self.proc.poll() is not None:
                self._f.close()
                raise StepError(f"{self.name} exited (rc {self.proc.returncode}) before it was ready:\n"
                                f"{tail(self.log)}")
            try:
                with urllib.request.urlopen(self.url + self.ready_path, timeout=2) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            if time.perf_counter() - t0 > self.timeout_s:
                self.__exit__(None, None, None)
                raise StepError(f"{self.name} not ready after {self.timeout_s:.0f} s:\n{tail(self.log)}")
            time.sleep(0.5)
        print(f"    ready in {time.perf_counter() - t0:.1f} s at {self.url}", flush=True)
        return self

    def __exit__(self, *exc) -> None:
        p = self.proc
        if p is None or p.poll() is not None:
            self._f.close()
            return
        try:
            os.killpg(p.pid, signal.SIGTERM)  # the session we started: the server and its children
            p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=30)
        except ProcessLookupError:
            pass
        self._f.close()
        time.sleep(1.0)


def loadavg() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


class CpuMonitor:
    """Samples, every `period` s, the CPU used by processes outside this run's process tree.

    The machine is shared: figures taken while someone else's job held a core are not comparable,
    so every measured command records the mean/max CPU of the others during it (in % of one core),
    and `wait_quiet` holds a measurement back (up to a limit) until the others go quiet.
    """

    def __init__(self, period: float = 2.0):
        import threading

        import psutil

        self.psutil, self.period = psutil, period
        self.samples: list[tuple[float, float, list[str]]] = []  # (time, others' CPU %, busiest)
        self._procs: dict[int, Any] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _mine(self) -> set[int]:
        me = self.psutil.Process()
        try:
            return {me.pid} | {c.pid for c in me.children(recursive=True)}
        except self.psutil.Error:
            return {me.pid}

    def _sample(self) -> None:
        mine, total, busy = self._mine(), 0.0, []
        seen = set()
        for p in self.psutil.process_iter(["pid"]):
            pid = p.pid
            seen.add(pid)
            proc = self._procs.setdefault(pid, p)
            try:
                pct = proc.cpu_percent(None)  # since this object's previous call (0.0 the first time)
                if pid in mine or pct < 1.0:
                    continue
                total += pct
                if pct >= 10:
                    busy.append((pct, " ".join(proc.cmdline())[:80] or proc.name()))
            except self.psutil.Error:
                continue
        for pid in set(self._procs) - seen:
            del self._procs[pid]
        busy.sort(reverse=True)
        self.samples.append((time.time(), total, [f"{c:.0f}% {n}" for c, n in busy[:3]]))

    def _loop(self) -> None:
        while not self._stop.wait(self.period):
            try:
                self._sample()
            except Exception:  # never let the monitor kill the run
                pass

    def window(self, t0: float, t1: float) -> dict:
        """Others' CPU (% of one core) between two time.time() stamps."""
        xs = [s for s in self.samples if t0 <= s[0] <= t1]
        if not xs:
            return {"others_cpu_mean": None, "others_cpu_max": None, "busiest": []}
        top = max(xs, key=lambda s: s[1])
        return {"others_cpu_mean": round(sum(s[1] for s in xs) / len(xs), 1),
                "others_cpu_max": round(top[1], 1), "busiest": top[2]}

    def wait_quiet(self, threshold: float, max_wait: float) -> float:
        """Wait until the others' CPU over the last ~6 s is below threshold, at most max_wait s."""
        t0 = time.time()
        while time.time() - t0 < max_wait:
            recent = [s[1] for s in self.samples if s[0] >= time.time() - 3 * self.period - 0.5]
            if len(recent) >= 3 and sum(recent) / len(recent) < threshold:
                break
            time.sleep(self.period)
        return time.time() - t0

    def stop(self) -> None:
        self._stop.set()


# ----------------------------------------------------------------------------------------------
# prepare: sdist, build, conversion


def sdist_path(ctx: Ctx) -> Path:
    """The llama-cpp-python sdist in $PEERS/src, downloaded from PyPI with pip when absent."""
    ver = ctx.args.llama_cpp_python
    src = ctx.cache / "src"
    src.mkdir(parents=True, exist_ok=True)
    dst = src / f"llama_cpp_python-{ver}.tar.gz"
    if dst.is_file():
        print(f"sdist: {dst} (cached)")
        return dst
    if ctx.args.sdist:
        shutil.copyfile(ctx.args.sdist, dst)
        print(f"sdist: copied {ctx.args.sdist}")
        return dst
    with tempfile.TemporaryDirectory(dir=src) as tmp:
        ctx.run("prepare", "pip-download", [ctx.python, "-m", "pip", "download", f"llama-cpp-python=={ver}",
                                            "--no-deps", "--no-binary", ":all:", "-d", tmp], timeout=1800)
        got = sorted(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        if not got:
            raise StepError(f"pip download left no llama_cpp_python-*.tar.gz in {tmp}")
        got[0].rename(dst)
    return dst


def extract(ctx: Ctx, sdist: Path) -> Path:
    """Unpack the sdist once; returns its vendor/llama.cpp directory."""
    ver = ctx.args.llama_cpp_python
    root = ctx.cache / "src" / f"llama_cpp_python-{ver}"
    stamp = ctx.cache / "src" / f".extracted-{ver}"
    if not stamp.is_file():
        shutil.rmtree(root, ignore_errors=True)
        print(f"extracting {sdist.name} ...", flush=True)
        with tarfile.open(sdist) as tf:
            kw = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
            tf.extractall(ctx.cache / "src", **kw)
        stamp.write_text(ver + "\n")
    llama = root / "vendor" / "llama.cpp"
    if not (llama / "CMakeLists.txt").is_file():
        raise StepError(f"{llama} has no CMakeLists.txt: not the expected sdist layout")
    return llama


def llama_commit(llama: Path) -> dict:
    """Commit of the vendored llama.cpp: from git when it works, else the submodule's HEAD file."""
    info: dict[str, Any] = {}
    try:
        out = subprocess.run(["git", "-C", str(llama), "log", "-1", "--format=%H%n%cI%n%s"],
                             capture_output=True, text=True, timeout=30)
        if out.returncode == 0:
            h, date, subj = (out.stdout.splitlines() + ["", "", ""])[:3]
            info = {"commit": h, "commit_date": date, "commit_subject": subj}
    except (OSError, subprocess.SubprocessError):
        pass
    if not info.get("commit"):
        head = llama.parents[1] / ".git" / "modules" / "vendor" / "llama.cpp" / "HEAD"
        if head.is_file():
            info["commit"] = head.read_text().strip()
    return info


def cpu_key() -> str:
    """CPU model + flags: GGML_NATIVE binaries are only valid on a CPU like the one that built them."""
    try:
        text = Path("/proc/cpuinfo").read_text()
        lines = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags"))][:2]
    except OSError:
        lines = [platform.processor()]
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:12]


def build_llama(ctx: Ctx, llama: Path) -> Path:
    """cmake configure + build of BUILD_TARGETS, skipped when the stamp matches; returns bin/."""
    ver = ctx.args.llama_cpp_python
    key = {"sdist_version": ver, "cmake_flags": list(CMAKE_FLAGS), "targets": list(BUILD_TARGETS),
           "cpu": cpu_key()}
    key_hash = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:10]
    bdir = ctx.cache / "build" / f"llama.cpp-{ver}-{key_hash}"
    stamp = bdir / "strata-peers.stamp.json"
    bins = bdir / "bin"
    if stamp.is_file() and all((bins / t).is_file() for t in BUILD_TARGETS):
        st = read_json(stamp)
        if st.get("key") == key:
            print(f"llama.cpp build: cached in {bdir} (built {st.get('built_at')}, "
                  f"{st.get('build_s', 0):.0f} s); skipping the build", flush=True)
            ctx.results["build"] = {"status": "reused from cache", "dir": ctx.display([str(bdir)]),
                                    "built_at": st.get("built_at"), "build_s": st.get("build_s"),
                                    "jobs": st.get("jobs")}
            return bins
    if ctx.args.no_build:
        raise StepError(f"no cached llama.cpp build in {bdir} and --no-build was given")
    jobs = ctx.args.jobs or os.cpu_count() or 2
    bdir.mkdir(parents=True, exist_ok=True)
    stamp.unlink(missing_ok=True)
    t0 = time.perf_counter()
    ctx.run("prepare", "cmake-configure", ["cmake", "-S", llama, "-B", bdir, *CMAKE_FLAGS], timeout=1800)
    ctx.run("prepare", "cmake-build", ["cmake", "--build", bdir, "--config", "Release", "-j", str(jobs),
                                       "--target", *BUILD_TARGETS], timeout=7200)
    build_s = time.perf_counter() - t0
    stamp.write_text(json.dumps({"key": key, "built_at": dt.datetime.now().isoformat(timespec="seconds"),
                                 "build_s": build_s, "jobs": jobs}, indent=2) + "\n")
    ctx.results["build"] = {"status": "built in this run", "dir": ctx.display([str(bdir)]), "build_s": build_s,
                            "jobs": jobs}
    print(f"llama.cpp build: {build_s:.0f} s", flush=True)
    return bins


def converter_env(ctx: Ctx) -> dict[str, str]:
    """PYTHONPATH for the converter: sentencepiece in $PEERS/pydeps when this Python lacks it.

    The Llama converter imports sentencepiece before it looks for tokenizer.model (and only an
    absent file, not an absent module, sends it to the tokenizer.json path); the other imports
    (numpy, torch, transformers, pyyaml, tqdm) come from Strata's venv, gguf from the tree.
    """
    probe = subprocess.run([ctx.python, "-c", "import sentencepiece"], capture_output=True)
    if probe.returncode == 0:
        return {}
    deps = ctx.cache / "pydeps"
    if not (deps / "sentencepiece").is_dir():
        ctx.run("prepare", "pip-sentencepiece", [ctx.python, "-m", "pip", "install", "--no-deps", "--target",
                                                 deps, "sentencepiece"], timeout=1800)
    return {"PYTHONPATH": str(deps)}


def convert(ctx: Ctx, llama: Path, shapes: list[str]) -> dict[str, dict[str, Path]]:
    """GGUF files per shape and outtype under $PEERS/gguf/<sdist version>/, converted once."""
    from strata.demo.random_models import random_model_path

    env = None
    out: dict[str, dict[str, Path]] = {}
    gdir = ctx.cache / "gguf" / ctx.args.llama_cpp_python
    gdir.mkdir(parents=True, exist_ok=True)
    for shape in shapes:
        model = random_model_path(shape)
        out[shape] = {}
        for t in OUTTYPES:
            dst = gdir / f"{shape}-{t}.gguf"
            if not dst.is_file():
                if env is None:
                    env = converter_env(ctx)
                tmp = dst.with_suffix(".tmp.gguf")
                ctx.run("prepare", f"convert-{shape}-{t}",
                        [ctx.python, HERE / "convert_gguf.py", llama, model, "--outtype", t, "--outfile", tmp],
                        timeout=3600, env=env)
                tmp.rename(dst)
            out[shape][t] = dst
    return out


def verify_gguf(ctx: Ctx, ggufs: dict[str, dict[str, Path]]) -> None:
    """A tiny llama-bench run per file: the GGUF loads and runs (once per file; stamped)."""
    for shape, files in ggufs.items():
        for t, path in files.items():
            ok = path.with_suffix(".verified")
            if ok.is_file():
                continue
            out = ctx.run("prepare", f"verify-{shape}-{t}",
                          [ctx.bin_dir / "llama-bench", "-m", path, "-p", "16", "-n", "4", "-r", "1", "-t",
                           str(ctx.args.threads), "-o", "json"], timeout=900, capture=True)
            rows = parse_llama_bench(out)
            if not rows or any(not r["avg_ts"] > 0 for r in rows):
                raise StepError(f"llama-bench on {path} gave no rates")
            ok.write_text(json.dumps(rows) + "\n")


def prepare(ctx: Ctx, shapes: list[str]) -> dict[str, dict[str, Path]]:
    sdist = sdist_path(ctx)
    llama = extract(ctx, sdist)
    ctx.llama_dir = llama
    info = llama_commit(llama)
    info["sdist_version"] = ctx.args.llama_cpp_python
    info["cmake_flags"] = list(CMAKE_FLAGS)
    info["targets"] = list(BUILD_TARGETS)
    gp = llama / "gguf-py" / "pyproject.toml"
    if gp.is_file():
        for line in gp.read_text().splitlines():
            if line.startswith("version"):
                info["gguf_py_version"] = line.split("=", 1)[1].strip().strip('"')
                break
    ctx.results["versions"]["llama_cpp"] = info
    ctx.bin_dir = build_llama(ctx, llama)
    ggufs = convert(ctx, llama, shapes)
    verify_gguf(ctx, ggufs)
    try:
        v = subprocess.run([ctx.bin_dir / "llama-server", "--version"], capture_output=True, text=True,
                           timeout=60)
        info["server_version"] = (v.stdout + v.stderr).strip().splitlines()[-2:]
    except (OSError, subprocess.SubprocessError):
        pass
    return ggufs


# ----------------------------------------------------------------------------------------------
# parts


def measure(ctx: Ctx, what: str, fn: Any) -> Any:
    """fn(attempt) runs one measurement (one or more commands) and returns its figures. When other
    processes used >= --quiet-cpu of a core during it and --retries remain, run it again (after
    waiting for quiet) and keep the least-contended attempt; the others' commands are marked
    discarded (kept in results.json, left out of the report's command list)."""
    attempts: list[tuple[float, Any, list[dict]]] = []
    for attempt in range(1 + max(0, ctx.args.retries)):
        n0 = len(ctx.results["commands"])
        out = fn(attempt)
        entries = ctx.results["commands"][n0:]
        busy = others_cpu(*entries) or 0.0
        attempts.append((busy, out, entries))
        if busy < ctx.args.quiet_cpu:
            break
        if attempt < ctx.args.retries:
            print(f"    {what}: other processes used {busy:.0f}% of a core meanwhile; measuring again", flush=True)
    best = min(range(len(attempts)), key=lambda i: attempts[i][0])
    for i, (_busy, _out, entries) in enumerate(attempts):
        for e in entries:
            e["attempt"] = i + 1
            if i != best:
                e["discarded"] = True
    if len(attempts) > 1:
        ctx.results["notes"].append(
            f"{what}: measured {len(attempts)} times because other processes were busy "
            f"({', '.join(f'{a[0]:.0f}%' for a in attempts)} of a core); the report keeps attempt {best + 1}.")
    return attempts[best][1]


def part_latency(ctx: Ctx, shape: str, ggufs: dict[str, Path]) -> dict:
    wl, args = ctx.wl, ctx.args
    res: dict[str, Any] = {"loadavg_before": loadavg()}
    out_dir = ctx.run_dir / "latency"
    out_dir.mkdir(exist_ok=True)
    files = [ggufs[t] for t in ("f32", "q8_0", "f16")]
    margs = [a for f in files for a in ("-m", f)]
    common = ["-t", str(args.threads), "-r", str(wl.bench_reps), "-o", "json"]

    def llama(attempt: int) -> tuple[list[dict], float | None]:
        pp = ctx.run("latency", f"llama-bench-pp-{shape}",
                     [ctx.bin_dir / "llama-bench", *margs, "-p", str(wl.lat_in), "-n", "0", *common],
                     capture=True, timeout=3600)
        e_pp = ctx.last
        tg = ctx.run("latency", f"llama-bench-tg-{shape}",
                     [ctx.bin_dir / "llama-bench", *margs, "-p", "0", "-n", str(wl.lat_out), "-d", str(wl.lat_in),
                      *common], capture=True, timeout=3600)
        return parse_llama_bench(pp) + parse_llama_bench(tg), others_cpu(e_pp, ctx.last)

    rows, busy = measure(ctx, f"{shape} llama-bench", llama)
    (out_dir / f"llama-bench-{shape}.json").write_text(json.dumps(rows, indent=2) + "\n")
    for t in ("f32", "q8_0", "f16"):
        name = ggufs[t].name
        p = pick_bench(rows, name, wl.lat_in, 0, 0)
        g = pick_bench(rows, name, 0, wl.lat_out, wl.lat_in)
        res[f"llama_{t}"] = {"prefill_tps": p and p["avg_ts"], "decode_tps": g and g["avg_ts"],
                             "prefill_stddev": p and p["stddev_ts"], "decode_stddev": g and g["stddev_ts"],
                             "model_type": (p or g or {}).get("model_type"), "others_cpu": busy}
    if rows:
        ctx.results["versions"]["llama_cpp"].setdefault("build_number", rows[0].get("build_number"))
        ctx.results["versions"]["llama_cpp"].setdefault("build_commit", rows[0].get("build_commit"))
        ctx.results["machine"].setdefault("llama_cpu_info", rows[0].get("cpu_info"))

    base = [*ctx.strata, "bench", "latency", "--random-model", shape, "--dtype", "float32",
            "--input-len", str(wl.lat_in), "--output-len", str(wl.lat_out), "--threads", str(args.threads)]

    def strata(extra: list[str], tag: str) -> Any:
        def run(attempt: int) -> tuple[dict, float | None]:
            f = out_dir / f"strata-{shape}-{tag}{f'-a{attempt + 1}' if attempt else ''}.json"
            ctx.run("latency", f"strata-latency-{shape}-{tag}", [*base, *extra, "--json", f], timeout=3600)
            return read_json(f), others_cpu(ctx.last)
        return measure(ctx, f"{shape} strata bench latency {tag}", run)

    d, busy = strata(["--compare", "hf"], "fp32")
    for key, src in (("strata_fp32", "strata"), ("hf_fp32", "hf")):
        if d.get(src):
            res[key] = {"prefill_tps": d[src]["prefill_tokens_per_s"], "decode_tps": d[src]["decode_tokens_per_s"],
                        "mbu": d[src].get("mbu"), "achieved_gbs": d[src].get("achieved_gbs"), "others_cpu": busy}
    res["mem_bandwidth_gbs_fp32_run"] = d.get("mem_bandwidth_gbs")
    d, busy = strata(["--quantization", "int8"], "int8")
    res["strata_int8"] = {"prefill_tps": d["strata"]["prefill_tokens_per_s"],
                          "decode_tps": d["strata"]["decode_tokens_per_s"], "mbu": d["strata"].get("mbu"),
                          "others_cpu": busy}
    res["loadavg_after"] = loadavg()
    return res


def bench_serve(ctx: Ctx, part: str, name: str, url: str, model_dir: Path, num_prompts: int, rate: str,
                out: Path) -> dict:
    """`strata bench serve` against url (through measure(): repeated when contended)."""
    wl = ctx.wl

    def run(attempt: int) -> dict:
        f = out.with_name(f"{out.stem}-a{attempt + 1}{out.suffix}") if attempt else out
        cmd = [*ctx.strata, "bench", "serve", "--url", url, "--num-prompts", str(num_prompts),
               "--request-rate", rate, "--input-len", rng_text(wl.tp_in), "--output-len", rng_text(wl.tp_out),
               "--tokenizer", model_dir, "--slo", ctx.args.slo, "--seed", "0", "--no-progress", "--json", f]
        ctx.run(part, name, cmd, timeout=3600)
        s = serve_summary(read_json(f))
        s["loadavg_after"] = loadavg()
        s["others_cpu"] = others_cpu(ctx.last)
        return s

    return measure(ctx, name, run)


def strata_server(ctx: Ctx, part: str, shape: str) -> Server:
    port = free_port(ctx.args.port)
    cmd = [*ctx.strata, "serve", "--random-model", shape, "--dtype", "float32", "--kv-cache-memory",
           ctx.args.kv_cache_memory, "--threads", str(ctx.args.threads), "--port", str(port)]
    return Server(ctx, part, f"strata-serve-{shape}", cmd, port, "/ready")


def llama_server(ctx: Ctx, part: str, shape: str, gguf: Path, slots: int) -> Server:
    port = free_port(ctx.args.port + 1)
    per_slot = 1 << max(8, math.ceil(math.log2(ctx.wl.tp_in[1] + ctx.wl.tp_out[1] + 64)))
    cmd = [ctx.bin_dir / "llama-server", "-m", gguf, "--host", "127.0.0.1", "--port", str(port),
           "-t", str(ctx.args.threads), "-tb", str(ctx.args.threads), "-np", str(slots), "-cb",
           "-c", str(slots * per_slot), "--no-webui"]
    return Server(ctx, part, f"llama-server-{shape}", cmd, port, "/health")


def part_throughput(ctx: Ctx, shape: str, ggufs: dict[str, Path]) -> dict:
    from strata.demo.random_models import random_model_path

    wl, args = ctx.wl, ctx.args
    res: dict[str, Any] = {"loadavg_before": loadavg(), "notes": []}
    out_dir = ctx.run_dir / "throughput"
    out_dir.mkdir(exist_ok=True)

    def offline(attempt: int) -> tuple[dict, float | None]:
        f = out_dir / f"strata-{shape}{f'-a{attempt + 1}' if attempt else ''}.json"
        ctx.run("throughput", f"strata-throughput-{shape}",
                [*ctx.strata, "bench", "throughput", "--random-model", shape, "--dtype", "float32",
                 "--num-prompts", str(wl.tp_prompts), "--input-len", rng_text(wl.tp_in), "--output-len",
                 rng_text(wl.tp_out), "--threads", str(args.threads), "--compare", "hf", "--hf-batch-size",
                 str(wl.hf_batch), "--json", f], timeout=7200)
        return read_json(f), others_cpu(ctx.last)

    d, busy = measure(ctx, f"{shape} strata bench throughput --compare hf", offline)
    for key, src in (("strata_offline", "strata"), ("hf_static", "hf")):
        if d.get(src):
            s = d[src]
            res[key] = {"requests": s["requests"], "elapsed_s": s["elapsed_s"], "rps": s["requests_per_s"],
                        "output_tps": s["output_tokens_per_s"], "total_tps": s["total_tokens_per_s"],
                        "batch_size": s.get("batch_size"), "others_cpu": busy}
    model_dir = random_model_path(shape)
    with strata_server(ctx, "throughput", shape) as srv:
        s = bench_serve(ctx, "throughput", f"bench-serve-strata-{shape}-inf", srv.url, model_dir, wl.tp_prompts,
                        "inf", out_dir / f"serve-strata-{shape}-inf.json")
    res["strata_http"] = dict(s, requests=s["completed"], elapsed_s=s["duration_s"])
    runs = []
    for slots in llama_slot_list(args):
        with llama_server(ctx, "throughput", shape, ggufs["f32"], slots) as srv:
            s = bench_serve(ctx, "throughput", f"bench-serve-llama-{shape}-np{slots}-inf", srv.url, model_dir,
                            wl.tp_prompts, "inf", out_dir / f"serve-llama-{shape}-np{slots}-inf.json")
        runs.append(dict(s, requests=s["completed"], elapsed_s=s["duration_s"], slots=slots))
    res["llama_http_runs"] = runs
    res["llama_http"] = max(runs, key=lambda r: r.get("output_tps") or 0.0)
    for label, r in [("strata serve", res["strata_http"])] + [(f"llama-server -np {r['slots']}", r) for r in runs]:
        if r.get("failed"):
            res["notes"].append(f"{label}: {r['failed']} requests failed: {list(r['errors'])[:2]}")
        if r.get("short_outputs"):
            res["notes"].append(f"{label}: {r['short_outputs']} requests returned fewer tokens than max_tokens")
    if not any(r.get("short_outputs") or r.get("failed") for r in runs):
        res["notes"].append("llama-server honoured `ignore_eos` (no short outputs) and streamed "
                            "/v1/completions with a usage chunk to `strata bench serve`.")
    res["loadavg_after"] = loadavg()
    return res


def llama_slot_list(args: argparse.Namespace) -> list[int]:
    return [int(x) for x in str(args.llama_slots).split(",") if x.strip()]


def part_serving(ctx: Ctx, shape: str, ggufs: dict[str, Path], saturation: tuple[float, str] | None,
                 tp_res: dict | None = None) -> dict:
    from strata.demo.random_models import random_model_path

    wl, args = ctx.wl, ctx.args
    out_dir = ctx.run_dir / "serving"
    out_dir.mkdir(exist_ok=True)
    model_dir = random_model_path(shape)
    res: dict[str, Any] = {"loadavg_before": loadavg(), "slo": args.slo}
    if args.rates:
        rates = dict(zip(RATE_FACTORS, (float(x) for x in args.rates.split(","))))
        res["saturation_rps"], res["saturation_source"] = None, "--rates given"
    else:
        if saturation is None:  # no throughput part in this run: measure Strata's saturation here
            with strata_server(ctx, "serving", shape) as srv:
                s = bench_serve(ctx, "serving", f"bench-serve-strata-{shape}-saturation", srv.url, model_dir,
                                wl.tp_prompts, "inf", out_dir / f"serve-strata-{shape}-inf.json")
            saturation = (s["rps"], "Strata's `strata serve` at --request-rate inf, measured in this part")
        res["saturation_rps"], res["saturation_source"] = saturation
        rates = derive_rates(saturation[0])
    points = [{"name": name, "rate": rate,
               "num_prompts": prompts_for_rate(rate, wl.serve_target_s, wl.serve_min_prompts, wl.serve_max_prompts)}
              for name, rate in rates.items()]
    res["points"] = points
    with strata_server(ctx, "serving", shape) as srv:
        res["strata_cmd"] = ctx.display(srv.cmd).replace(f"--port {srv.port}", "--port P")
        for p in points:
            p["strata"] = bench_serve(ctx, "serving", f"bench-serve-strata-{shape}-{p['name']}", srv.url, model_dir,
                                      p["num_prompts"], f"{p['rate']:g}",
                                      out_dir / f"serve-strata-{shape}-{p['name']}.json")
    slots = (tp_res or {}).get("llama_http", {}).get("slots") or llama_slot_list(args)[0]
    res["llama_slots"] = slots
    with llama_server(ctx, "serving", shape, ggufs["f32"], slots) as srv:
        res["llama_cmd"] = ctx.display(srv.cmd).replace(f"--port {srv.port}", "--port P")
        for p in points:
            p["llama"] = bench_serve(ctx, "serving", f"bench-serve-llama-{shape}-{p['name']}", srv.url, model_dir,
                                     p["num_prompts"], f"{p['rate']:g}",
                                     out_dir / f"serve-llama-{shape}-{p['name']}.json")
    res["loadavg_after"] = loadavg()
    return res


# ----------------------------------------------------------------------------------------------
# machine and versions


def machine(ctx: Ctx) -> dict:
    m: dict[str, Any] = {"kernel": f"{platform.system()} {platform.release()}", "cpus": os.cpu_count()}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                m["cpu_model"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        out = ctx.run("machine", "strata-hw", [*ctx.strata, "hw", "--json", "--refresh"], capture=True,
                      timeout=900)
        m["strata_hw"] = json.loads(out[out.find("{"):])
        m["hw_source"] = "strata hw --json --refresh"
    except (StepError, ValueError, subprocess.SubprocessError) as e:
        print(f"strata hw failed ({e}); falling back to strata.hardware.probe.probe()")
        from strata.hardware.probe import probe

        m["strata_hw"] = {"cpu_measured": probe(refresh=True).to_json(), "host": {}}
        m["hw_source"] = "strata.hardware.probe.probe(refresh=True)"
    if m.get("cpu_model") == "AMD EPYC":
        m["cpu_note"] = "KVM guest; family 25 model 17 = Zen 4 Genoa"
    return m


def versions(ctx: Ctx) -> dict:
    v: dict[str, Any] = {"python": platform.python_version()}
    for mod in ("torch", "transformers", "numpy", "numba"):
        try:
            out = subprocess.run([ctx.python, "-c", f"import {mod}; print({mod}.__version__)"],
                                 capture_output=True, text=True, timeout=120)
            v[mod] = out.stdout.strip() or "not installed"
        except (OSError, subprocess.SubprocessError):
            v[mod] = "?"
    try:
        v["strata_commit"] = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                                            capture_output=True, text=True).stdout.strip()
        st = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                            capture_output=True, text=True).stdout
        v["strata_dirty"] = bool(st.strip())
    except OSError:
        v["strata_commit"] = "?"
    for tool, key in (("cmake", "cmake_version"), ("cc", "compiler")):
        try:
            out = subprocess.run([tool, "--version"], capture_output=True, text=True, timeout=30).stdout
            v[key] = out.splitlines()[0].strip()
        except (OSError, subprocess.SubprocessError, IndexError):
            v[key] = "?"
    return v


# ----------------------------------------------------------------------------------------------
# main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="benchmarks/peers/run.sh", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default=",".join(PARTS), help=f"parts to run, comma-separated ({', '.join(PARTS)})")
    p.add_argument("--shapes", default="smol-135m,qwen-0.5b", help="shapes for the latency part")
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
    bad = set(args.only.split(",")) - set(PARTS)
    if bad:
        p.error(f"--only: unknown part(s) {', '.join(sorted(bad))}; choose from {', '.join(PARTS)}")
    for flag in ("shapes", "load_shapes"):
        bad = set(filter(None, getattr(args, flag).split(","))) - set(ALL_SHAPES)
        if bad:
            p.error(f"--{flag.replace('_', '-')}: unknown shape(s) {', '.join(sorted(bad))}")
    return args


def merge_previous(results: dict, path: Path, lat_shapes: list[str], load_shapes: list[str]) -> None:
    """Keep what this run did not measure (other parts or shapes) from the previous results file,
    with its commands, marked with the date it was measured, so `--only latency` updates one table."""
    try:
        prev = read_json(path)
    except (OSError, ValueError):
        return
    if prev.get("quick") != results.get("quick"):
        return
    ran = {"latency": set(lat_shapes), "throughput": set(load_shapes) if "throughput" in results["parts"] else set(),
           "serving": set(load_shapes) if "serving" in results["parts"] else set()}
    kept = results.setdefault("kept_from_previous", [])
    for part in PARTS:
        for shape, r in (prev.get(part) or {}).items():
            if shape in ran[part] or shape in results[part]:
                continue
            date = r.get("measured_on") or prev.get("date")
            results[part][shape] = dict(r, measured_on=date)
            kept.append(f"{part} {shape} (measured {date})")
            results["commands"] += [dict(c, part=f"{c['part']} (from the run of {date})")
                                    for c in prev.get("commands", [])
                                    if c["part"].split(" ")[0] == part and shape in c["cmd"]]
    for part in PARTS:
        for r in results[part].values():
            r.setdefault("measured_on", results["date"])


def strata_cmd(python: str) -> list[str]:
    exe = Path(python).parent / "strata"
    return [str(exe)] if exe.is_file() else [python, "-c", "import sys; from strata.cli import main; sys.exit(main())"]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from strata.config import cache_root

    cache = Path(args.cache).expanduser().resolve() if args.cache else cache_root() / "peers"
    out_md = Path(args.out_md) if args.out_md else (cache / "quick" / "benchmarks.md" if args.quick else DEFAULT_MD)
    out_json = Path(args.out_json) if args.out_json else (cache / "quick" / "results.json" if args.quick
                                                          else DEFAULT_JSON)
    if args.report_only:
        out_md.write_text(render_markdown(read_json(out_json)))
        print(f"wrote {out_md}")
        return 0

    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    run_dir = cache / "runs" / stamp
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    parts = [p for p in PARTS if p in args.only.split(",")]
    lat_shapes = [s for s in args.shapes.split(",") if s] if "latency" in parts else []
    load_shapes = [s for s in args.load_shapes.split(",") if s] if {"throughput", "serving"} & set(parts) else []
    wl = QUICK if args.quick else FULL
    shown_args = " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    results: dict[str, Any] = {
        "date": dt.datetime.now().astimezone().isoformat(timespec="seconds"), "args": shown_args,
        "quick": args.quick, "parts": parts, "workload": {
            "lat_in": wl.lat_in, "lat_out": wl.lat_out, "bench_reps": wl.bench_reps, "tp_prompts": wl.tp_prompts,
            "tp_in": rng_text(wl.tp_in), "tp_out": rng_text(wl.tp_out), "serve_target_s": wl.serve_target_s,
            "serve_min_prompts": wl.serve_min_prompts, "serve_max_prompts": wl.serve_max_prompts,
            "hf_batch": wl.hf_batch, "threads": args.threads},
        "commands": [], "errors": [], "notes": [], "versions": {}, "machine": {},
        "wait_quiet_s": args.wait_quiet, "quiet_cpu": args.quiet_cpu,
        "latency": {}, "throughput": {}, "serving": {},
    }
    ctx = Ctx(args=args, wl=wl, cache=cache, run_dir=run_dir, results=results)
    ctx.strata = strata_cmd(ctx.python)
    results["run_dir_display"] = ctx.display([str(run_dir)])
    t_start = time.perf_counter()
    print(f"peer cache {cache}\nthis run: {run_dir}\nparts: {', '.join(parts)}; latency shapes "
          f"{lat_shapes}; load shapes {load_shapes}{' (quick)' if args.quick else ''}", flush=True)

    ctx.monitor = CpuMonitor()
    results["versions"] = versions(ctx)
    t0 = time.perf_counter()
    ggufs = prepare(ctx, sorted(set(lat_shapes + load_shapes), key=ALL_SHAPES.index))
    results["prepare_s"] = time.perf_counter() - t0
    print(f"prepare: {results['prepare_s']:.1f} s", flush=True)
    if args.prepare_only:
        ctx.monitor.stop()
        return 0
    results["machine"] = machine(ctx)
    results["machine"]["others_cpu_during_hw"] = ctx.last.get("others_cpu_mean")

    def attempt(part: str, fn, *a) -> Any:
        try:
            return fn(*a)
        except (StepError, subprocess.SubprocessError, OSError, KeyError, ValueError) as e:
            traceback.print_exc()
            results["errors"].append({"part": part, "error": str(e).splitlines()[0][:500]})
            return None

    for shape in lat_shapes:
        r = attempt(f"latency {shape}", part_latency, ctx, shape, ggufs[shape])
        if r:
            results["latency"][shape] = r
    for shape in load_shapes:
        sat = None
        if "throughput" in parts:
            r = attempt(f"throughput {shape}", part_throughput, ctx, shape, ggufs[shape])
            if r:
                results["throughput"][shape] = r
                if (r.get("strata_http") or {}).get("rps"):
                    sat = (r["strata_http"]["rps"],
                           "Strata's `strata serve` at --request-rate inf, the throughput part's HTTP row")
        if "serving" in parts:
            r = attempt(f"serving {shape}", part_serving, ctx, shape, ggufs[shape], sat,
                        results["throughput"].get(shape))
            if r:
                results["serving"][shape] = r

    ctx.monitor.stop()
    results["waited_quiet_s"] = round(ctx.waited_total, 1)
    results["wall_s"] = time.perf_counter() - t_start
    if not args.no_merge:
        merge_previous(results, out_json, lat_shapes, load_shapes)
    out_json.parent.mkdir(parents=True, exist_ok=True)
    out_json.write_text(json.dumps(results, indent=2, default=str) + "\n")
    (run_dir / "results.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    out_md.parent.mkdir(parents=True, exist_ok=True)
    out_md.write_text(render_markdown(results))
    print(f"\nwrote {out_md} and {out_json} ({results['wall_s'] / 60:.1f} min)")
    for e in results["errors"]:
        print(f"ERROR in {e['part']}: {e['error']}")
    return 1 if results["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())

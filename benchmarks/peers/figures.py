"""Pure logic on measured figures: llama-bench output, ratios, serving rates, serve summaries.

Unit-tested in tests/bench/test_peers.py.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from .settings import RATE_FACTORS


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


def others_cpu(*entries: dict | None) -> float | None:
    """Largest mean CPU (% of one core) other processes used during these commands."""
    xs = [e.get("others_cpu_mean") for e in entries if e]
    xs = [x for x in xs if x is not None]
    return max(xs) if xs else None


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

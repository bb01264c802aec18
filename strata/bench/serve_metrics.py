"""`strata bench serve`'s metrics: per-request records, the run's figures, and their report.

RequestRecord is what happened to one request (TTFT, ITL gaps, end-to-end latency, tokens);
summarize() turns a run's records into a ServeBenchResult (throughputs, latency percentiles,
goodput within the SLOs, distinct errors) and print_result() prints it as two tables.
"""

from __future__ import annotations

import math
import sys
from collections import Counter
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import numpy as np

from strata.bench.serve_workload import ServeBenchConfig
from strata.text_table import print_table

BENCHMARK = "serve"  # the JSON's "benchmark" field; also the subcommand's name (serve.NAME)
STATS = ("mean", "p50", "p90", "p99")
MAX_ERRORS_SHOWN = 5


@dataclass
class RequestRecord:
    """What happened to one request. Times are in seconds; start_s is relative to the run start."""

    index: int
    prompt_len: int  # planned
    output_len: int  # requested (max_tokens)
    arrival_s: float  # scheduled
    start_s: float = math.nan  # actually sent (after waiting for a --max-concurrency slot)
    success: bool = False
    error: str | None = None
    ttft_s: float = math.nan
    latency_s: float = math.nan  # end to end
    itl_s: list[float] = field(default_factory=list)  # gaps between successive text chunks
    output_tokens: int = 0  # usage.completion_tokens, else text chunks
    prompt_tokens: int = 0  # usage.prompt_tokens, else prompt_len
    text_chunks: int = 0
    usage_reported: bool = False

    @property
    def tpot_s(self) -> float:
        if not self.success or self.output_tokens < 2:
            return math.nan
        return (self.latency_s - self.ttft_s) / (self.output_tokens - 1)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "tpot_s": self.tpot_s}


@dataclass
class ServeBenchResult:
    """Figures of one run. Latency stats are dicts of mean/p50/p90/p99 in ms (NaN when empty)."""

    config: ServeBenchConfig
    url: str  # server root, without /v1
    model: str
    records: list[RequestRecord]
    duration_s: float
    completed: int
    failed: int
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float  # completed requests / s
    output_throughput: float  # output tok/s
    total_token_throughput: float  # (input + output) tok/s
    ttft_ms: dict[str, float]
    tpot_ms: dict[str, float]
    itl_ms: dict[str, float]
    e2e_ms: dict[str, float]
    good_requests: int | None  # None without an SLO
    goodput: float | None  # good requests / s
    max_concurrency_observed: int
    short_outputs: int  # completed requests with fewer output tokens than max_tokens
    errors: dict[str, int]  # distinct error message -> count, in order of first occurrence

    def to_dict(self, with_records: bool = True) -> dict[str, Any]:
        d: dict[str, Any] = {"benchmark": BENCHMARK, "config": self.config.to_dict()}
        d |= {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("config", "records")}
        d["slo"] = {"ttft_ms": self.config.slo_ttft_ms, "tpot_ms": self.config.slo_tpot_ms}
        if with_records:
            d["requests"] = [r.to_dict() for r in self.records]
        return d


def _stats_ms(values_s: list[float]) -> dict[str, float]:
    if not values_s:
        return {k: math.nan for k in STATS}
    a = np.asarray(values_s, dtype=np.float64) * 1e3
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return {"mean": float(a.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99)}


def _meets_slo(rec: RequestRecord, cfg: ServeBenchConfig) -> bool:
    if cfg.slo_ttft_ms is not None and not rec.ttft_s * 1e3 <= cfg.slo_ttft_ms:
        return False
    tpot = rec.tpot_s  # NaN for a single output token: no decode step to hold to the bound
    return cfg.slo_tpot_ms is None or math.isnan(tpot) or tpot * 1e3 <= cfg.slo_tpot_ms


def summarize(cfg: ServeBenchConfig, root: str, model: str, records: list[RequestRecord],
              duration_s: float, max_in_flight: int) -> ServeBenchResult:
    ok = [r for r in records if r.success]
    inp = sum(r.prompt_tokens for r in ok)
    out = sum(r.output_tokens for r in ok)
    dur = duration_s if duration_s > 0 else math.nan
    good: int | None = None
    if cfg.slo_ttft_ms is not None or cfg.slo_tpot_ms is not None:
        good = sum(_meets_slo(r, cfg) for r in ok)
    errors = Counter(r.error for r in records if not r.success and r.error is not None)
    return ServeBenchResult(
        config=cfg, url=root, model=model, records=records, duration_s=duration_s,
        completed=len(ok), failed=len(records) - len(ok), total_input_tokens=inp, total_output_tokens=out,
        request_throughput=len(ok) / dur, output_throughput=out / dur, total_token_throughput=(inp + out) / dur,
        ttft_ms=_stats_ms([r.ttft_s for r in ok]),
        tpot_ms=_stats_ms([r.tpot_s for r in ok if r.output_tokens > 1]),
        itl_ms=_stats_ms([x for r in ok for x in r.itl_s]),
        e2e_ms=_stats_ms([r.latency_s for r in ok]),
        good_requests=good, goodput=None if good is None else good / dur,
        max_concurrency_observed=max_in_flight,
        short_outputs=sum(r.output_tokens < r.output_len for r in ok),
        errors=dict(errors),
    )


def _slo_text(cfg: ServeBenchConfig) -> str:
    parts = [f"{k} <= {v:g} ms" for k, v in (("TTFT", cfg.slo_ttft_ms), ("TPOT", cfg.slo_tpot_ms))
             if v is not None]
    return ", ".join(parts)


def print_result(res: ServeBenchResult, file=None) -> None:
    """The two tables (summary; latency percentiles) plus the first distinct errors."""
    file = file or sys.stdout
    cfg = res.config
    rows: list[list[Any]] = [
        ["completed requests", res.completed],
        ["failed requests", res.failed],
        ["duration s", res.duration_s],
        ["request throughput req/s", res.request_throughput],
        ["output token throughput tok/s", res.output_throughput],
        ["total token throughput tok/s", res.total_token_throughput],
        ["input tokens", res.total_input_tokens],
        ["output tokens", res.total_output_tokens],
        ["max concurrent requests", res.max_concurrency_observed],
    ]
    if res.goodput is not None:
        rows.append([f"goodput req/s ({_slo_text(cfg)})", res.goodput])
        rows.append(["requests within SLO", f"{res.good_requests}/{res.completed}"])
    print_table(["metric", "value"], rows, file=file)
    print(file=file)
    lat = [[name] + [d[k] for k in STATS] for name, d in
           (("TTFT", res.ttft_ms), ("TPOT", res.tpot_ms), ("ITL", res.itl_ms), ("e2e", res.e2e_ms))]
    print_table(["latency ms"] + list(STATS), lat, file=file)
    if res.short_outputs:
        print(f"note: {res.short_outputs} completed requests returned fewer tokens than max_tokens "
              "(does the server honour ignore_eos?)", file=file)
    if res.errors:
        print(f"\n{res.failed} requests failed; first distinct errors:", file=file)
        for msg, count in list(res.errors.items())[:MAX_ERRORS_SHOWN]:
            print(f"  [{count}x] {msg}", file=file)
        if len(res.errors) > MAX_ERRORS_SHOWN:
            print(f"  ... and {len(res.errors) - MAX_ERRORS_SHOWN} more (all in --json)", file=file)

"""`strata analyze --workload serve`: a served workload, attributed from the server's own metrics.

Starts `strata serve` with the same model and engine flags on a free loopback port, drives it with
`strata bench serve` (streaming requests at --request-rate), and reads the server's Prometheus
counters before and after: per-request stage time (tokenize, queue, prefill, decode, detokenize,
stream, summed over requests) and the engine loop's wall time per step phase (schedule, forward,
sample). The engine's idle time is the run's duration minus its busy time.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from strata.analyze.analyze_moe import ExpertLoad, expert_load
from strata.analyze.analyze_moe import format_lines as expert_lines
from strata.analyze.analyze_verdict import QUEUE_SHARE, TOKENIZE_SHARE, Action, Verdict
from strata.bench.serve_client import run_benchmark

STAGES = ("tokenize", "queue", "prefill", "decode", "detokenize", "stream")
PHASES = ("schedule", "forward", "sample")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(url: str) -> dict[str, float]:
    """The server's stage and step-phase counters."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for sample in family.samples:  # labels in any order (model_name rides along on every series)
            if sample.name == "strata_request_stage_seconds_total" and "stage" in sample.labels:
                out["stage:" + sample.labels["stage"]] = sample.value
            elif sample.name == "strata_engine_step_seconds_total" and "phase" in sample.labels:
                out["phase:" + sample.labels["phase"]] = sample.value
            elif sample.name == "strata_moe_expert_tokens_total" and "expert" in sample.labels:
                out[f"expert:{sample.labels['layer']}:{sample.labels['expert']}"] = sample.value
    return out


@dataclass
class ServeAnalysis:
    model: str
    duration_s: float
    completed: int
    stage_s: dict[str, float]  # summed over requests
    engine_s: dict[str, float]  # engine loop wall time per phase, plus idle
    bench: dict[str, Any]
    verdict: Verdict
    notes: list[str] = field(default_factory=list)
    experts: ExpertLoad | None = None  # MoE models: hot experts and load imbalance under this load

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def serve_verdict(stage: dict[str, float], engine: dict[str, float], n: int, max_num_seqs: int,
                  max_concurrency: int, crossover: float | None = None) -> Verdict:
    """The limiting layer from the stage counters. `crossover`: the planner's batch at which decode
    turns compute-bound on this machine; the mean decode batch is the requests' summed decode
    time over the engine's busy time (Little's law), so a busy server past the crossover is named
    compute-bound, not bandwidth-bound."""
    total = sum(stage.values()) or 1e-9
    busy = sum(v for k, v in engine.items() if k != "idle")
    if stage["tokenize"] / total >= TOKENIZE_SHARE:
        return Verdict("CPU pipeline: tokenization",
                       f"tokenisation is {stage['tokenize'] / total:.0%} of the requests' summed latency",
                       [Action("--tokenizer-workers N", "more tokenizer processes (on spare cores)",
                               f"up to {1 / (1 - stage['tokenize'] / total):.2f}x lower latency")])
    if stage["queue"] / total >= QUEUE_SHARE and max_concurrency > max_num_seqs:
        return Verdict("scheduling / queueing",
                       f"requests waited {stage['queue'] / total:.0%} of their latency for admission with "
                       f"max_num_seqs={max_num_seqs} and up to {max_concurrency} requests in flight",
                       [Action(f"--max-num-seqs {max_concurrency}", "admit every in-flight request",
                               "queue time goes to ~0 while the KV cache holds them")])
    if engine.get("idle", 0.0) > busy:
        return Verdict("load (the engine waits for requests)",
                       f"the engine was idle {engine['idle']:.1f} s of the run vs {busy:.1f} s busy",
                       [Action("--request-rate higher", "the server has headroom at this load", "more throughput")])
    host = engine.get("schedule", 0.0) + engine.get("sample", 0.0)
    batch = stage["decode"] / busy if busy > 0 else 0.0
    evidence = (f"engine busy {busy:.1f} s: forward {engine.get('forward', 0):.1f} s, schedule+sample {host:.1f} s; "
                f"requests spent {stage['prefill'] / total:.0%} in prefill and {stage['decode'] / total:.0%} in "
                f"decode, ~{batch:.1f} sequences decoding at a time")
    offline = Action("strata analyze --workload offline", "the per-phase roofline comparison for this model",
                     "names the kernel-level limit")
    if stage["prefill"] > stage["decode"]:
        return Verdict("compute (prefill)", evidence, [offline])
    if crossover is not None and batch >= crossover:
        return Verdict("compute (decode batches)", evidence + f", past the planner's compute crossover (batch "
                       f"~{crossover:.1f})",
                       [Action(f"--max-num-seqs {max(1, int(crossover))}", "smaller decode batches: lower TPOT, "
                               "requests queue instead (higher TTFT)", "TPOT toward the batch-1 step time"),
                        Action("--dtype bfloat16", "where strata hw measures a faster bf16 GEMM than fp32",
                               "decode steps at the bf16/fp32 GEMM rate ratio"), offline])
    return Verdict("memory bandwidth (decode)", evidence + (f", below the compute crossover (~{crossover:.1f})"
                                                            if crossover is not None else ""),
                   [Action("--quantization int8", "fewer weight bytes streamed per decode step",
                           "up to ~4x fewer bytes than fp32"), offline])


def analyze_serve(server_args: list[str], model_label: str, bench_cfg, max_num_seqs: int,
                  crossover: float | None = None) -> ServeAnalysis:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    # warnings only: the server's info lines (one access line per request) would bury the progress bar
    proc = subprocess.Popen([sys.executable, "-m", "strata.cli", "serve", "--port", str(port), "--log-level",
                             "warning", *server_args])
    try:
        deadline = time.monotonic() + 600
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"strata serve exited with code {proc.returncode} during start-up")
            try:
                if httpx.get(url + "/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("strata serve not ready after 600 s")
            time.sleep(0.3)
        bench_cfg.url = url
        before = scrape(url)
        import asyncio

        result = asyncio.run(run_benchmark(bench_cfg))
        time.sleep(1.2)  # the engine reports its counters at least once a second
        after = scrape(url)
    finally:
        proc.terminate()
        proc.wait(60)
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    stage = {s: delta.get("stage:" + s, 0.0) for s in STAGES}
    engine = {p: delta.get("phase:" + p, 0.0) for p in PHASES}
    engine["idle"] = max(0.0, result.duration_s - sum(engine.values()))
    v = serve_verdict(stage, engine, result.completed, max_num_seqs, result.max_concurrency_observed, crossover)
    bench = {k: getattr(result, k) for k in ("completed", "failed", "duration_s", "request_throughput",
                                              "output_throughput", "ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")}
    return ServeAnalysis(model_label, result.duration_s, result.completed, stage, engine, bench, v,
                         experts=expert_load(expert_counts(delta)))


def expert_counts(scraped: dict[str, float]) -> dict[str, list[int]]:
    """{layer: [tokens per expert]} from scrape()'s "expert:LAYER:E" entries."""
    out: dict[str, dict[int, int]] = {}
    for key, value in scraped.items():
        if key.startswith("expert:"):
            _, layer, e = key.split(":")
            out.setdefault(layer, {})[int(e)] = int(value)
    return {layer: [by_e.get(e, 0) for e in range(max(by_e) + 1)] for layer, by_e in out.items()}


def format_text(a: ServeAnalysis) -> str:
    total = sum(a.stage_s.values()) or 1e-9
    out = [f"strata analyze --workload serve: {a.model}",
           f"{a.completed} requests in {a.duration_s:.1f} s; output {a.bench['output_throughput']:.1f} tok/s; "
           f"TTFT p50 {a.bench['ttft_ms']['p50']:.0f} ms p99 {a.bench['ttft_ms']['p99']:.0f} ms; "
           f"TPOT p50 {a.bench['tpot_ms']['p50']:.1f} ms p99 {a.bench['tpot_ms']['p99']:.1f} ms", "",
           "request time by stage (summed over requests)"]
    for s in STAGES:
        out.append(f"  {s:12s} {a.stage_s[s]:9.3f} s  {a.stage_s[s] / total:6.1%}")
    out.append("engine loop: " + ", ".join(f"{k} {v:.2f} s" for k, v in a.engine_s.items()))
    out += expert_lines(a.experts)
    out += ["", f"verdict: limited by {a.verdict.layer}", f"  {a.verdict.evidence}"]
    out += [f"  {i}. {x.flag}: {x.why} (predicted: {x.predicted_gain})" for i, x in enumerate(a.verdict.actions, 1)]
    return "\n".join(out)

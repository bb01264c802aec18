"""`strata analyze` output: a text report, and a self-contained HTML page with inline SVG charts
(planner/charts.py: matplotlib)."""

from __future__ import annotations

import html
import math

from strata.analyze.analyze import CATEGORY_LABELS, Analysis
from strata.analyze.analyze_lora import format_text as lora_lines
from strata.analyze.analyze_moe import format_lines as expert_lines
from strata.planner import charts


def _ms(s: float) -> str:
    return f"{s * 1000:.1f} ms" if math.isfinite(s) else "-"


def format_text(a: Analysis) -> str:
    w = a.wall_s or 1e-9
    out = [f"strata analyze: {a.model}", f"workload {a.workload}; wall time {a.wall_s:.2f} s", "",
           "where the wall time went (engine loop)"]
    for cat, secs in sorted(a.categories.items(), key=lambda kv: -kv[1]):
        if secs > 0:
            out.append(f"  {CATEGORY_LABELS[cat]:32s} {secs:8.3f} s  {secs / w:6.1%}")
    out.append("by layer: " + ", ".join(f"{k} {v / w:.0%}" for k, v in sorted(a.layers.items(), key=lambda kv: -kv[1])))
    out += ["", "phases: measured vs the planner's kernel prediction (strata hw rates)",
            f"  {'phase':8s} {'steps':>6s} {'measured':>10s} {'predicted':>10s} {'explained':>9s} {'bound':>8s} "
            f"{'batch':>6s} {'GB/s':>7s} {'MBU':>6s} {'GFLOP/s':>8s} {'MFU':>6s} {'in kernels':>10s}"]
    for p in a.phases:
        out.append(f"  {p.name:8s} {p.steps:6d} {p.seconds:9.3f}s {p.predicted_s:9.3f}s {p.efficiency:9.0%} "
                   f"{p.bound:>8s} {p.mean_batch:6.1f} {p.bytes / p.seconds / 1e9:7.1f} {p.mbu:6.0%} "
                   f"{p.flops / p.seconds / 1e9:8.1f} {p.mfu:6.0%} {p.kernel_share:10.0%}")
    out += ["", "top-5 operators by self time (profiled steps)"]
    total_ops = sum(s for _, s in a.top_ops) or 1e-9
    for name, secs in a.top_ops:
        out.append(f"  {name:40s} {secs * 1000:9.2f} ms  {secs / total_ops:6.1%} of the top 5")
    r = a.requests
    out += ["", f"requests: {r['count']}, mean tokenize {_ms(r['mean_tokenize_s'])}, queue {_ms(r['mean_queue_s'])}, "
            f"prefill {_ms(r['mean_prefill_s'])}, decode {_ms(r['mean_decode_s'])}; "
            f"TTFT p50 {_ms(r['ttft_p50_s'])} p99 {_ms(r['ttft_p99_s'])}; "
            f"TPOT p50 {_ms(r['tpot_p50_s'])} p99 {_ms(r['tpot_p99_s'])}"]
    out += expert_lines(a.experts)
    out += lora_lines(a.lora, a.wall_s)
    v = a.verdict
    out += ["", f"verdict: limited by {v.layer}", f"  {v.evidence}"]
    for i, act in enumerate(v.actions, 1):
        out.append(f"  {i}. {act.flag}: {act.why} (predicted: {act.predicted_gain})")
    return "\n".join(out)


def format_html(a: Analysis) -> str:
    dev = a.device
    ceilings = [(f"GEMM {dev['gemm_gflops']:.0f} GFLOP/s", dev["gemm_gflops"] * 1e9),
                (f"{dev['few_rows']}-row {dev['few_rows_gflops']:.0f} GFLOP/s", dev["few_rows_gflops"] * 1e9)]
    bands = [(f"DRAM {dev['mem_gbs']:.0f} GB/s", dev["mem_gbs"] * 1e9),
             (f"GEMV stream {dev['stream_gbs']:.0f} GB/s", dev["stream_gbs"] * 1e9)]
    points = [(p.name, p.intensity, p.flops / p.seconds) for p in a.phases if p.seconds > 0 and p.intensity > 0]
    roof = charts.roofline(ceilings, bands, points, title="Roofline: measured phases on this machine") if points else ""
    cats = [(CATEGORY_LABELS[c], s) for c, s in a.categories.items() if s > 0]
    bar = charts.stacked_bar(cats, title="Wall time by category", fmt=lambda v: f"{v:.2f}s")
    r = a.requests
    req_bar = charts.stacked_bar([("tokenize", r["mean_tokenize_s"]), ("queue", r["mean_queue_s"]),
                               ("prefill", r["mean_prefill_s"]), ("decode", r["mean_decode_s"])],
                              title="Mean request latency by stage", fmt=lambda v: f"{v * 1000:.0f}ms")
    text = html.escape(format_text(a))
    return ("<!doctype html><html><head><meta charset='utf-8'><title>strata analyze</title>"
            "<style>body{font-family:sans-serif;max-width:760px;margin:2em auto}pre{font-size:12px;"
            "background:#f6f6f6;padding:1em;overflow-x:auto}</style></head><body>"
            f"<h1>strata analyze</h1><p><b>Verdict:</b> limited by {html.escape(a.verdict.layer)}. "
            f"{html.escape(a.verdict.evidence)}</p>"
            + "<ol>" + "".join(f"<li><code>{html.escape(x.flag)}</code>: {html.escape(x.why)} "
                               f"(predicted: {html.escape(x.predicted_gain)})</li>" for x in a.verdict.actions) + "</ol>"
            + roof + bar + req_bar + charts.distribution([v * 1000 for v in a.ttft_s], "TTFT")
            + charts.distribution([v * 1000 for v in a.tpot_s], "TPOT")
            + f"<h2>Report</h2><pre>{text}</pre></body></html>")

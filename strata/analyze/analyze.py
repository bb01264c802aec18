"""`strata analyze`: run a workload with instrumentation, attribute its time, name the bottleneck.

The offline workload runs through LLMEngine in this process. Wall time of the run is split into:
  CPU pipeline   tokenize, schedule, sample (+ stop checks), batch preparation and Python/dispatch
                 overhead (forward time not inside any operator, from torch.profiler)
  compute        GEMM, attention, norm and elementwise operators (profiler self time)
  memory         KV writes, gathers and copies, swap
  communication  (tensor parallel; 0 on one device)
  idle           the rest of the loop
Operator shares come from torch.profiler on a sample of steps (one step in PROFILE_EVERY, so the
profiler's own cost stays out of most steps) and are applied to the measured forward time of each
phase. Each phase (prefill, decode) is compared with the planner's kernel prediction for the same
batches (planner/plan.py, from `strata hw`'s measured rates): predicted / measured is how much of
the time the hardware roofline explains. The verdict names the layer that limits the workload and
one to three actions, each with the flag and the gain the planner predicts.
"""

from __future__ import annotations

import logging
import statistics
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from strata.analyze.analyze_lora import lora_summary
from strata.analyze.analyze_moe import ExpertLoad, expert_load
from strata.analyze.analyze_run import (
    PROFILE_EVERY,
    Measurement,
    RequestRecord,
    StepRecord,
    Workload,
    classify,
    run_offline,
)
from strata.analyze.analyze_verdict import (
    CATEGORY_LABELS,
    LAYER_OF,
    QUEUE_SHARE,
    TOKENIZE_SHARE,
    Action,
    Phase,
    Verdict,
    attribute,
    phases,
    verdict,
)
from strata.hardware.probe import probe
from strata.planner import cost_model

# the run (analyze_run.py) and its attribution and verdict (analyze_verdict.py) are reached from
# here too: analyze_report.py, analyze_serve.py and the tests import them as strata.analyze.analyze
__all__ = [
    "CATEGORY_LABELS", "LAYER_OF", "PROFILE_EVERY", "QUEUE_SHARE", "TOKENIZE_SHARE", "Action", "Analysis",
    "Measurement", "Phase", "RequestRecord", "StepRecord", "Verdict", "Workload", "analyze_engine",
    "attribute", "classify", "phases", "run_offline", "verdict",
]

logger = logging.getLogger(__name__)


# ------------------------------------------------------------------ the whole analysis


@dataclass
class Analysis:
    model: str
    workload: dict
    wall_s: float
    categories: dict[str, float]
    layers: dict[str, float]
    phases: list[Phase]
    top_ops: list[tuple[str, float]]
    requests: dict[str, Any]
    verdict: Verdict
    device: dict[str, Any]
    ttft_s: list[float]
    tpot_s: list[float]
    experts: ExpertLoad | None = None  # MoE models: hot experts and load imbalance of the run
    lora: dict[str, Any] | None = None  # --lora-adapters: analyze_lora.lora_summary

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["phases"] = [{**asdict(p), "efficiency": p.efficiency, "intensity": p.intensity,
                        "roofline_bound": p.roofline_bound} for p in self.phases]
        return d


def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) if xs else float("nan")


def analyze_engine(engine, w: Workload, profile=None, progress=None) -> Analysis:
    """Run `w` on `engine` and analyse it against this machine's measured roofline.
    progress: called with a line as each phase starts (`strata analyze` prints them), and turns on
    the run's progress bar."""
    say = progress or (lambda _msg: None)
    if profile is None:
        say("reading this machine's measured rates (strata hw; measured once, then cached)")
        profile = probe(engine.config.device)
    quant = engine.config.quantization
    group = engine.config.quantization_group_size
    shape = cost_model.ModelShape.of(engine.model_config, engine.dtype, quant, group)
    dev = cost_model.this_device(profile, engine.dtype, quant)
    ctx: dict[str, Any] = {"shape": shape, "dev": dev, "profile": profile, "quantization": quant,
                           "dtype": str(engine.dtype).removeprefix("torch."),
                           "enable_prefix_caching": engine.config.enable_prefix_caching}
    if quant is None and engine.config.device == "cpu":
        try:
            ctx["int8_dev"] = cost_model.this_device(profile, engine.dtype, "int8")
            ctx["int8_shape"] = cost_model.ModelShape.of(engine.model_config, engine.dtype, "int8", group)
        except Exception:  # a profile without quantised rates: no int8 action
            ctx["int8_dev"] = None
    say("warming up the engine")
    engine.warm_up()
    say(f"running {w.num_prompts} requests (one step in {PROFILE_EVERY} under the profiler)")
    m = run_offline(engine, w, progress=progress is not None)
    say("attributing the time and comparing each phase with the planner")
    cats = attribute(m)
    if w.lora_adapters:
        say("timing the adapters on the decode probe's model (their share inside the fused layers)")
    lora = lora_summary(engine, m, cats, w.lora_adapters)
    ph = phases(m, shape, dev)
    layers: dict[str, float] = {}
    for cat, secs in cats.items():
        layers[LAYER_OF[cat]] = layers.get(LAYER_OF[cat], 0.0) + secs
    ttft = [r.ttft_s for r in m.requests]
    tpot = [r.tpot_s for r in m.requests if r.tpot_s is not None]
    reqs = {
        "count": len(m.requests),
        "mean_tokenize_s": statistics.mean(r.tokenize_s for r in m.requests),
        "mean_queue_s": statistics.mean(r.queue_s for r in m.requests),
        "mean_prefill_s": statistics.mean(r.prefill_s for r in m.requests),
        "mean_decode_s": statistics.mean(r.decode_s for r in m.requests),
        "ttft_p50_s": _pct(ttft, 50), "ttft_p99_s": _pct(ttft, 99),
        "tpot_p50_s": _pct(tpot, 50), "tpot_p99_s": _pct(tpot, 99),
        "output_tokens": sum(r.output_tokens for r in m.requests),
    }
    return Analysis(
        model=str(engine.model_path), workload=asdict(w), wall_s=m.wall_s, categories=cats, layers=layers,
        phases=ph, top_ops=m.top_ops, requests=reqs, verdict=verdict(m, cats, ph, ctx),
        device={"name": dev.name, "mem_gbs": dev.mem_gbs, "stream_gbs": dev.stream_gbs,
                "few_rows_gflops": dev.few_rows_gflops, "gemm_gflops": dev.gemm_gflops, "few_rows": dev.few_rows},
        ttft_s=ttft, tpot_s=tpot, experts=expert_load(engine.expert_token_counts()), lora=lora,
    )

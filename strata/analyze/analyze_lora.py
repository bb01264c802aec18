"""LoRA's share of an analysed run (`strata analyze --lora-adapters N`).

Two parts, kept apart because they are known differently:
- measured: the adapters' work on the eager path (graph/lora.LoRABank.add: prefill chunks, decode
  steps too wide for the fused layer) runs inside `strata::lora` profiler ranges, so the profiled
  steps give its self time, the "lora" category of the attribution;
- estimated: inside the fused CPU decode layer (kernels/cpu_decode_layer.lora_layer) the adapters
  run in the same compiled call as the base's GEMVs, which no profiler splits. The decode probe's
  model (planner/decode_probe.py) is timed at the run's mean decode batch with and without the
  adapters (planner/lora_cost.py), and that overhead is applied to the fused layers' seconds.
"""

from __future__ import annotations

import statistics
from typing import Any

from strata.planner.decode_probe import PROBE_BATCHES, decode_probe
from strata.planner.lora_cost import format_lines, lora_cost, measure


def lora_summary(engine, m, cats: dict[str, float], adapters: int) -> dict[str, Any] | None:
    """The run's LoRA figures (None without adapters): cost (lora_cost.LoRACost), measured and
    estimated seconds."""
    if not adapters or engine.lora is None:
        return None
    dtype = str(engine.lora.banks[0].lora_a.dtype).removeprefix("torch.")
    cost = lora_cost(engine.model_config, engine.config.max_loras, engine.config.max_lora_rank, dtype)
    decodes = [s for s in m.steps if s.kind == "decode" and s.decode_seqs]
    fused_s = cats.get("decoder_layer", 0.0)
    estimated = None
    if decodes and engine.config.device == "cpu":  # the step's cost with adapters, measured on the probe
        batch = max(1, min(max(PROBE_BATCHES), round(statistics.fmean(s.decode_seqs for s in decodes))))
        active = min(adapters, engine.config.max_loras)
        probe = decode_probe(engine.model_config, engine.dtype, engine.config.quantization,
                             engine.config.quantization_group_size, "cpu")
        cost = measure(probe, cost, batch, spread=active)
        over = max(cost.step_overhead or 0.0, 0.0)
        if fused_s > 0:  # some decode steps ran the fused layers: their adapters' share, estimated
            estimated = fused_s * over / (1 + over)
    return {"cost": cost, "measured_s": cats.get("lora", 0.0), "fused_estimated_s": estimated,
            "resident_slots": engine.config.max_loras}


def format_text(lora: dict[str, Any] | None, wall_s: float) -> list[str]:
    if lora is None:
        return []
    w = wall_s or 1e-9
    out = [""] + format_lines(lora["cost"])
    out.append(f"  this run: {lora['measured_s']:.3f} s ({lora['measured_s'] / w:.1%} of the wall time) in the "
               "adapters' own operators (profiled eager steps: prefill chunks, wide decode steps)")
    est = lora["fused_estimated_s"]
    if est is not None:
        out.append(f"  + ~{est:.3f} s ({est / w:.1%}) inside the fused decode layers, estimated from the measured "
                   "step overhead above (the compiled layer cannot be split by the profiler)")
    return out

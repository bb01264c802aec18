"""`strata analyze --lora-adapters N`: the adapters' operators attributed to their own category (the
eager path's strata::lora ranges), the fused decode layers' share estimated from the decode probe,
and the report's LoRA lines. Nothing here depends on this machine's speed."""

from __future__ import annotations

import pytest
from conftest import make_llm

from strata.analyze.analyze import Workload, analyze_engine
from strata.analyze.analyze_report import format_text
from strata.analyze.analyze_run import lora_inside
from strata.errors import ConfigError


def test_lora_share_is_attributed(tiny_models, cpu_profile):
    with make_llm(tiny_models["llama"], enable_lora=True, max_loras=2, max_lora_rank=8, num_threads=2,
                  kv_cache_memory="4MiB") as llm:
        a = analyze_engine(llm.engine, Workload(num_prompts=4, input_len=(20, 20), output_len=(6, 6),
                                                lora_adapters=2), cpu_profile)
    cats = a.categories
    assert cats["lora"] > 0 and all(v >= 0 for v in cats.values())
    assert abs(sum(cats.values()) - a.wall_s) < 1e-6 * max(1.0, a.wall_s) + 1e-9  # still the whole wall time
    lora = a.lora
    assert lora["measured_s"] == cats["lora"] and lora["resident_slots"] == 2
    cost = lora["cost"]
    assert cost.adapters == 2 and cost.rank == 8 and cost.dtype == "float32" and cost.spread == 2
    assert cost.base_layer_s > 0 and cost.lora_layer_s > 0
    fused = cats["decoder_layer"] > 0  # a profiled decode step ran the fused layers
    assert (lora["fused_estimated_s"] is not None) == fused and (lora["fused_estimated_s"] or 0) >= 0
    text = format_text(a)
    assert "LoRA: 2 adapter slot(s) of rank 8 (float32)" in text and "measured: a decode step of" in text
    assert ("inside the fused decode layers" in text) == fused
    assert "LoRA adapters (shrink + expand)" in text
    assert a.to_json()["lora"]["cost"]["rank"] == 8


def test_lora_workload_needs_an_engine_with_lora(tiny_models, cpu_profile):
    with make_llm(tiny_models["llama"]) as llm, pytest.raises(ConfigError, match="--enable-lora"):
        analyze_engine(llm.engine, Workload(num_prompts=1, input_len=(8, 8), output_len=(2, 2), lora_adapters=1),
                       cpu_profile)


class _Event:
    def __init__(self, name, self_us, children=(), total_us=None):
        self.name, self.self_cpu_time_total, self.cpu_children = name, self_us, list(children)
        self.cpu_time_total = total_us if total_us is not None else self_us + sum(c.cpu_time_total for c in children)


def test_ops_inside_a_lora_range_are_lora_time():
    mm, cat = _Event("aten::mm", 30.0), _Event("aten::cat", 5.0)
    ranged = _Event("strata::lora", 2.0, [_Event("aten::index_select", 3.0, [mm]), cat])
    outside = _Event("aten::mm", 100.0)
    total, inside = lora_inside([ranged, outside])
    assert total == pytest.approx(40e-6)
    assert inside == pytest.approx({"gemm": 30e-6, "memory": 8e-6})  # index_select and cat: copies

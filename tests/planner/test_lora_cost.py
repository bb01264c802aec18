"""`strata plan --max-loras N --max-lora-rank R`: the adapters' memory equals the engine's banks, the
KV plan leaves room for them as the engine does, and the decode probe times a step with adapters."""

from __future__ import annotations

import torch

from strata.config import EngineConfig
from strata.engine.llm_engine import LLMEngine
from strata.graph.loader import load_model
from strata.graph.lora_adapter import attach_banks
from strata.planner.calibrate import StepOverhead
from strata.planner.decode_probe import DecodeProbe
from strata.planner.lora_cost import lora_cost, measure, plan_lora_dtype
from strata.planner.plan import PlanRequest, build_plan
from strata.planner.plan_report import format_text


def _bank_bytes(model) -> int:
    banks = {id(m): m for m in model.modules() if m._modules.get("lora") is not None}
    return sum(t.numel() * t.element_size() for m in banks.values() for t in (m.lora.lora_a, m.lora.lora_b,
                                                                              m.lora.scale))


def test_resident_bytes_equal_the_engine_banks(tiny_models):
    for family in ("llama", "qwen2", "qwen3moe"):  # MoE: attention only
        model = load_model(tiny_models[family].path, torch.float32)
        for dtype in (torch.float32, torch.bfloat16):
            attach_banks(model, slots=3, rank=8, dtype=dtype)
            name = str(dtype).removeprefix("torch.")
            cost = lora_cost(model.config, 3, 8, name)
            scales = 3 * 4 * sum(m.lora.scale.shape[1] for m in model.modules() if m._modules.get("lora") is not None)
            assert cost.resident_bytes == _bank_bytes(model) == 3 * cost.adapter_bytes + scales, (family, name)
            assert cost.flops_per_token == 2 * cost.adapter_bytes // (4 if name == "float32" else 2)


def test_lora_dtype_follows_the_engine_rule():
    assert plan_lora_dtype("auto", torch.float32, None) == "float32"
    assert plan_lora_dtype("auto", torch.float32, "int4") == "bfloat16"
    assert plan_lora_dtype("auto", torch.bfloat16, None) == "bfloat16"
    assert plan_lora_dtype("float32", torch.float32, "int8") == "float32"


def test_plan_leaves_the_engine_room_for_the_banks(tiny_ckpt, cpu_profile):
    budget = 2**20
    engine = LLMEngine(EngineConfig(model=str(tiny_ckpt), dtype="float32", max_model_len=128, kv_cache_memory=budget,
                                    enable_lora=True, max_loras=3, max_lora_rank=8))
    req = PlanRequest(model=str(tiny_ckpt), hardware="this", dtype="float32", max_model_len=128,
                      kv_cache_memory=budget, batch=4, lora_adapters=3, lora_rank=8)
    plan = build_plan(req, profile=cpu_profile, overhead=StepOverhead.zero())
    assert plan.memory.weight_bytes == engine.plan.weight_bytes
    plain = build_plan(PlanRequest(model=str(tiny_ckpt), hardware="this", dtype="float32", max_model_len=128,
                                   kv_cache_memory=budget, batch=4), profile=cpu_profile, overhead=StepOverhead.zero())
    assert plan.memory.weight_bytes - plain.memory.weight_bytes == plan.lora.resident_bytes > 0
    assert plain.lora is None and "LoRA:" not in format_text(plain)
    text = format_text(plan)
    assert "LoRA: 3 adapter slot(s) of rank 8 (float32)" in text
    if plan.decode_probe is not None:  # measured on the probe's model
        assert plan.lora.batch == 4 and plan.lora.spread == 3 and "measured: a decode step of 4 rows" in text
    del engine


def test_measure_times_both_and_leaves_the_probe_clean(tiny_ckpt):
    from strata.model_config import ModelConfig

    cfg = ModelConfig.from_file(tiny_ckpt / "config.json")
    probe = DecodeProbe(cfg, torch.float32, None, 32)
    cost = measure(probe, lora_cost(cfg, 4, 8), batch=6)
    assert cost.batch == 6 and cost.spread == 4 and cost.base_layer_s > 0 and cost.lora_layer_s > 0
    assert not any(m._modules.get("lora") is not None for m in probe.model.modules())
    assert probe.retime(batches=(2,)).layer_s[0] > 0  # the probe still runs without banks

"""The planner's layer probe: one decoder layer timed at the model's shapes, composed into a
prefill prediction for `this` device (projections x tokens, attention x causal FLOPs)."""

from __future__ import annotations

import json

import pytest
import torch

from strata.planner.calibrate import StepOverhead
from strata.planner.layer_probe import LayerTimes, measure_prefill_layer
from strata.planner.plan import (
    ModelShape,
    PlanRequest,
    build_plan,
    prefill,
    resolve_model,
    this_device,
)


def test_measure_prefill_layer_times_a_tiny_layer() -> None:
    cfg, _ = resolve_model("tiny")
    times = measure_prefill_layer(cfg, torch.float32, 64)
    assert times.tokens == 64
    assert times.gemm_s > 0 and times.attention_s > 0 and times.elementwise_s >= 0
    assert times.layer_s == pytest.approx(times.gemm_s + times.attention_s + times.elementwise_s)
    assert measure_prefill_layer(cfg, torch.float32, 64) is times  # cached per shape
    with pytest.raises(ValueError, match="tokens"):
        measure_prefill_layer(cfg, torch.float32, 0)


def test_prefill_composes_layer_times(cpu_profile) -> None:
    cfg, _ = resolve_model("smol-135m")
    shape = ModelShape.of(cfg, torch.float32, None, 64)
    dev = this_device(cpu_profile, torch.float32, None)
    layer = LayerTimes(tokens=256, gemm_s=0.010, attention_s=0.002, elementwise_s=0.001)
    same = prefill(shape, dev, 256, 2048, layer=layer)
    n = cfg.num_layers
    assert same.source == "layer probe"
    assert same.compute_s == pytest.approx(n * (0.010 + 0.002))
    assert same.attention_s == pytest.approx(n * 0.002)
    assert same.elementwise_s == pytest.approx(n * 0.001)
    lm_head = cfg.vocab_size * cfg.hidden_size * 4 / (dev.stream_gbs * 1e9)
    assert same.weight_read_s == pytest.approx(lm_head)
    assert same.total_s == pytest.approx(n * 0.013 + lm_head)
    # twice the tokens: projections and elementwise work double, attention grows with T(T+1)
    double = prefill(shape, dev, 512, 2048, layer=layer)
    assert double.elementwise_s == pytest.approx(2 * same.elementwise_s)
    assert double.attention_s == pytest.approx(same.attention_s * 512 * 513 / (256 * 257))
    assert double.compute_s - double.attention_s == pytest.approx(2 * (same.compute_s - same.attention_s))
    # without a probe: the roofline rates, no elementwise term
    rates = prefill(shape, dev, 256, 2048)
    assert rates.source == "roofline" and rates.elementwise_s == 0.0


LLAMA_2_7B = dict(architectures=["LlamaForCausalLM"], hidden_size=4096, intermediate_size=11008,
                  num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32, vocab_size=32000,
                  rms_norm_eps=1e-5, max_position_embeddings=4096, torch_dtype="float16")


def test_this_plan_uses_the_probe_and_big_models_fall_back(tiny_ckpt, cpu_profile, tmp_path) -> None:
    small = build_plan(PlanRequest(model=str(tiny_ckpt), hardware="this", dtype="float32", max_model_len=128,
                                   input_len=96, batch=2), profile=cpu_profile, overhead=StepOverhead.zero())
    assert small.prefill.source == "layer probe" and small.prefill.elementwise_s >= 0
    # a 7B layer at 512 tokens would take seconds per call on this profile: rates, with a note saying so
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_2_7B))
    big = build_plan(PlanRequest(model=str(tmp_path), hardware="this", dtype="float32", max_model_len=4096,
                                 input_len=4096, batch=2, kv_cache_memory=2**30),
                     profile=cpu_profile, overhead=StepOverhead.zero())
    assert big.prefill.source == "roofline"
    assert any("layer probe budget" in n for n in big.notes)

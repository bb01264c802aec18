"""The planner's decode probe: the model's own layers, in the engine's weight format, timed for
decode steps and composed into the decode price of `this` device."""

from __future__ import annotations

import json

import pytest
import torch

from strata.graph.layers import Linear
from strata.kernels import cpu_decode_layer
from strata.memory.quant import QuantLinear
from strata.planner.calibrate import StepOverhead
from strata.planner.decode_probe import (
    PROBE_BATCHES,
    PROBE_CONTEXT,
    DecodeProbe,
    DecodeTimes,
    decode_probe,
    estimate_layer_bytes,
    forget,
    layers_to_build,
)
from strata.planner.plan import (
    ModelShape,
    PlanRequest,
    build_plan,
    decode_step,
    resolve_model,
    this_device,
)

TIMES = DecodeTimes(batches=(1, 16, 64), layer_s=(0.001, 0.004, 0.010), head_s=(0.002, 0.003, 0.007),
                    context=128, layers=4)


def test_times_interpolate_in_batch_and_extend_past_the_last() -> None:
    assert TIMES.at(1) == (0.001, 0.002)
    assert TIMES.at(16) == pytest.approx((0.004, 0.003))
    assert TIMES.at(8.5) == pytest.approx((0.0025, 0.0025))  # halfway between 1 and 16
    assert TIMES.at(40) == pytest.approx((0.007, 0.005))
    assert TIMES.at(112) == pytest.approx((0.016, 0.011))  # the 16..64 segment continued


def test_decode_step_composes_the_probe(cpu_profile) -> None:
    cfg, _ = resolve_model("smol-135m")
    shape = ModelShape.of(cfg, torch.float32, None, 64)
    dev = this_device(cpu_profile, torch.float32, None)
    at_probe = decode_step(shape, dev, 16, TIMES.context, probe=TIMES)
    assert at_probe.kernel_s == pytest.approx(cfg.num_layers * 0.004 + 0.003)
    # KV beyond the probe's context is read at the measured memory bandwidth
    longer = decode_step(shape, dev, 16, TIMES.context + 1000, probe=TIMES)
    extra = 16 * 1000 * shape.kv_per_token / (dev.mem_gbs * 1e9)
    assert longer.kernel_s - at_probe.kernel_s == pytest.approx(extra)


@pytest.mark.parametrize("quantization", [None, "bf16", "int8", "int4"])
def test_probe_builds_the_engines_weight_format_and_times_every_batch(quantization, monkeypatch) -> None:
    cfg, _ = resolve_model("tiny")
    probe = DecodeProbe(cfg, torch.float32, quantization, 32)
    assert probe.layers == cfg.num_layers  # a tiny model: all of it (what the cache holds is as in a run)
    qkv = probe.model.layers[0].self_attn.qkv_proj
    if quantization in ("int8", "int4"):
        assert isinstance(qkv, QuantLinear) and qkv.method == quantization
    else:
        assert type(qkv) is Linear
        assert qkv.weight.dtype == (torch.bfloat16 if quantization == "bf16" else torch.float32)
    fused_heads = []
    monkeypatch.setattr(cpu_decode_layer, "final_norm_head", lambda *a: fused_heads.append(a))
    times = probe.retime()
    assert times.batches == PROBE_BATCHES and times.context == PROBE_CONTEXT
    assert all(t > 0 for t in times.layer_s + times.head_s)
    # the layers' forward leaves the head out (the engine's fused decode step runs it beside the
    # final norm, and layer_s would count it too); the head is timed on its own
    assert fused_heads == []


def test_layers_built_span_the_cache_but_never_exceed_the_model() -> None:
    cfg, _ = resolve_model("qwen-0.5b")
    fp32 = estimate_layer_bytes(cfg, torch.float32, None, 64)
    int8 = estimate_layer_bytes(cfg, torch.float32, "int8", 64)
    assert fp32 > 3 * int8  # int8 weights (+ scales) are ~1/4 of fp32
    assert layers_to_build(cfg, fp32) < layers_to_build(cfg, int8) <= cfg.num_layers
    assert layers_to_build(cfg, 10**12) == 1


def test_probes_are_built_once_per_shape_and_format() -> None:
    cfg, _ = resolve_model("tiny")
    forget()
    a = decode_probe(cfg, torch.float32, "int8", 32)
    assert decode_probe(cfg, torch.float32, "int8", 32) is a
    assert decode_probe(cfg, torch.float32, None, 32) is not a
    forget()
    assert decode_probe(cfg, torch.float32, "int8", 32) is not a
    forget()


LLAMA_2_7B = dict(architectures=["LlamaForCausalLM"], hidden_size=4096, intermediate_size=11008,
                  num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32, vocab_size=32000,
                  rms_norm_eps=1e-5, max_position_embeddings=4096, torch_dtype="float16")


def test_this_plan_prices_decode_from_the_probe_and_falls_back_past_the_budget(tiny_ckpt, cpu_profile,
                                                                              tmp_path, monkeypatch) -> None:
    import strata.planner.decode_probe as probe_module

    plan = build_plan(PlanRequest(model=str(tiny_ckpt), hardware="this", dtype="float32", max_model_len=128,
                                  input_len=64, context=128, batch=4, quantization="int8"),
                      profile=cpu_profile, overhead=StepOverhead.zero())
    probe = plan.decode_probe
    assert isinstance(probe, DecodeTimes)
    assert any("decode priced from the model's own layers" in n for n in plan.notes)
    cfg = resolve_model(str(tiny_ckpt))[0]
    layer_s, head_s = probe.at(4)
    assert plan.steps[-1].batch == 4
    assert plan.steps[-1].kernel_s == pytest.approx(cfg.num_layers * layer_s + head_s)
    assert plan.prefill.source == "layer probe"  # quantised prefill is probed too, in its format
    # past the time budget (a 7B model's layers, with the budget cut): the rates, and a note saying why
    monkeypatch.setattr(probe_module, "DECODE_PROBE_BUDGET_S", 1.0)
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_2_7B))
    big = build_plan(PlanRequest(model=str(tmp_path), hardware="this", dtype="float32", max_model_len=4096,
                                 input_len=4096, batch=2, kv_cache_memory=2**30),
                     profile=cpu_profile, overhead=StepOverhead.zero())
    assert big.decode_probe is None
    assert any("decode from the measured rates" in n for n in big.notes)


def test_probe_times_a_whole_prompt_and_the_plan_scales_the_layer_probe_to_it(tiny_ckpt, cpu_profile) -> None:
    cfg, _ = resolve_model("tiny")
    probe = DecodeProbe(cfg, torch.float32, None, 32)
    assert probe.prefill_layer_s(64) > 0
    with pytest.raises(ValueError, match="tokens"):
        probe.prefill_layer_s(10**6)
    plan = build_plan(PlanRequest(model=str(tiny_ckpt), hardware="this", dtype="float32", max_model_len=128,
                                  input_len=96, batch=2), profile=cpu_profile, overhead=StepOverhead.zero())
    assert plan.prefill.source == "layer probe"
    assert any("prefill layer times scaled to the model's" in n for n in plan.notes)

"""`strata plan` on mixture-of-experts models: memory from every expert, decode from the active ones
(the distinct experts a batch reads), routing, and expert parallelism's all-to-alls."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from strata.comm.alpha_beta import CommModel, Fit, fit, model_seconds
from strata.hardware.specs import lookup
from strata.memory.planner import (
    expected_experts,
    expert_weight_bytes,
    streamed_weight_bytes,
    weight_bytes,
)
from strata.model_config import ModelConfig
from strata.planner import decode_probe as decode_probe_mod
from strata.planner import plan as plan_mod
from strata.planner.calibrate import StepOverhead
from strata.planner.cost_model import (
    GPU_ROUTING,
    ModelShape,
    Routing,
    all_to_all_seconds,
    decode_step,
    ep_all_to_all_bytes,
    prefill,
    spec_device,
    this_device,
)
from strata.planner.moe_probe import fit_routing, measure_routing
from strata.planner.plan import PlanRequest, build_plan
from strata.planner.plan_report import format_html, format_text

QWEN3_30B = Path(__file__).parent / "data" / "Qwen3-30B-A3B" / "config.json"  # as published on the Hub


def _cfg() -> ModelConfig:
    return ModelConfig.from_file(QWEN3_30B)


def test_expected_experts_formula():
    assert expected_experts(128, 8, 1) == pytest.approx(8)  # one token reads its top_k
    assert expected_experts(128, 8, 2) == pytest.approx(128 * (1 - (120 / 128) ** 2))  # 15.5
    assert expected_experts(128, 8, 0) == 0.0
    seq = [expected_experts(128, 8, b) for b in (1, 4, 16, 64, 256, 4096)]
    assert seq == sorted(seq) and seq[-1] == pytest.approx(128) and all(x <= 128 for x in seq)
    assert expected_experts(8, 8, 3) == pytest.approx(8)  # every expert picked by every token


def test_qwen3_30b_total_vs_active_bytes():
    cfg = _cfg()
    assert round(cfg.num_params() / 1e9, 2) == 30.53 and round(cfg.num_params(active=True) / 1e9, 2) == 3.35
    held = weight_bytes(cfg, torch.bfloat16)
    assert held == 2 * cfg.num_params()  # bf16, every expert stored
    experts = expert_weight_bytes(cfg, torch.bfloat16)
    assert experts == 48 * 128 * 3 * 2048 * 768 * 2
    # int4: the experts shrink like dense projections; the fp32-free rest (norms, router) does not
    assert expert_weight_bytes(cfg, torch.bfloat16, "int4") < experts / 3
    # a decode step of one token reads the active bytes: the non-expert weights + 8 of 128 experts
    one = streamed_weight_bytes(cfg, torch.bfloat16, tokens=1)
    untied_embed = cfg.vocab_size * cfg.hidden_size * 2
    assert one == pytest.approx(held - experts * (1 - 8 / 128) - untied_embed, rel=1e-9)
    assert one == pytest.approx(2 * cfg.num_params(active=True) - untied_embed, rel=1e-6)
    # more tokens read more experts, never more than all
    reads = [streamed_weight_bytes(cfg, torch.bfloat16, tokens=b) for b in (1, 4, 16, 64, 1024)]
    assert reads == sorted(reads) and reads[-1] <= streamed_weight_bytes(cfg, torch.bfloat16)


@pytest.mark.parametrize("family", ["mixtral", "qwen2moe", "qwen3moe", "olmoe"])
@pytest.mark.parametrize(("dtype", "storage"), [(torch.float32, None), (torch.float32, "bf16"),
                                                (torch.float32, "int8"), (torch.float32, "int4"),
                                                (torch.bfloat16, None)])
def test_weight_bytes_equal_the_loaded_moe_model(tiny_models, family, dtype, storage):
    """memory/planner.weight_bytes is the loaded model's own tensor bytes for every MoE family and
    weight format: experts counted like dense projections, the router (and Qwen2-MoE's shared
    expert gate) a float parameter never narrowed nor quantised."""
    from strata.graph.loader import load_model
    from strata.memory.quant import model_weight_bytes

    path = tiny_models[family].path
    cfg = ModelConfig.from_file(path / "config.json")
    model = load_model(path, dtype, storage=storage, group_size=32)
    assert weight_bytes(cfg, dtype, storage, 32) == model_weight_bytes(model)


def test_h100x2_plan_memory_total_decode_active_and_ep_rows():
    plan = build_plan(PlanRequest(model=str(QWEN3_30B), hardware="H100x2", max_model_len=8192, batch=64))
    cfg = _cfg()
    assert plan.params == cfg.num_params() and plan.active_params == cfg.num_params(active=True)
    assert plan.dtype == "bfloat16" and plan.memory.weight_bytes == weight_bytes(cfg, torch.bfloat16)
    b1 = plan.steps[0]
    assert b1.experts == pytest.approx(8) and b1.total_s > 0
    weights_read = [s.bytes - s.kv_bytes for s in plan.steps]
    assert weights_read == sorted(weights_read)  # a bigger batch reads more distinct experts
    assert weights_read[0] < 0.12 * plan.memory.weight_bytes  # batch 1: ~active (3.35B of 30.5B)
    assert weights_read[-1] < plan.memory.weight_bytes  # batch 64 reads ~126 of 128
    assert b1.routing_s == pytest.approx(GPU_ROUTING.seconds(48, 8))
    # EP rows: 1 and 2 devices, experts and weights split, the all-to-all priced by the link
    assert [o.tp for o in plan.tp_options] == [1, 2]
    one, two = plan.tp_options
    assert (one.experts_per_device, two.experts_per_device) == (128, 64)
    assert two.memory.weight_bytes == -(-plan.memory.weight_bytes // 2)
    assert two.a2a_bytes_per_rank == 8 * 2048 * 2 and two.ep_comm_s > 0 and one.ep_comm_s == 0
    assert "pairwise" in two.ep_comm_source and "NVLink" in two.ep_comm_source
    text = format_text(plan)
    assert "30.53B params stored, 3.35B active per token" in text
    assert "Expert parallel over 2 devices" in text and "E x (1 - (1 - k/E)^b)" in text
    assert "Best throughput: EP=" in text
    assert "Mixture of experts" in format_html(plan)


def test_this_plan_of_qwen3_30b(cpu_profile, monkeypatch):
    """On `this` (a synthetic 24 GiB CPU): a TPOT, a memory plan that says it does not fit, and the
    routing the probe measured priced into decode (probes too big for the test: the rates path)."""
    monkeypatch.setattr(decode_probe_mod, "DECODE_PROBE_BUDGET_S", 0.0)
    monkeypatch.setattr(plan_mod, "LAYER_PROBE_BUDGET_S", 0.0)
    routing = Routing(50e-6, 20e-6, "measured (test)")
    monkeypatch.setattr(plan_mod, "measure_routing", lambda *a, **k: routing)
    plan = build_plan(PlanRequest(model=str(QWEN3_30B), hardware="this", max_model_len=4096, batch=16),
                      profile=cpu_profile, overhead=StepOverhead.zero())
    assert plan.decode_probe is None and plan.routing == routing
    assert not plan.memory.fits and "DOES NOT FIT" in format_text(plan)
    b1 = plan.steps[0]
    assert 0 < b1.total_s < float("inf") and plan.tp_options[0].tpot_s == b1.total_s
    assert b1.routing_s == pytest.approx(routing.seconds(48, 8))
    b16 = next(s for s in plan.steps if s.batch == 16)
    assert b16.routing_s == pytest.approx(routing.seconds(48, expected_experts(128, 8, 16)))
    text = format_text(plan)
    assert "3.35B active per token" in text and "Expert parallel: one device here" in text
    assert "measured (test)" in text
    assert plan.prefill.routing_s > 0 and plan.prefill.total_s > plan.prefill.compute_s


def _all_gather_model(with_a2a: bool) -> CommModel:
    sizes = [8 * 4**k for k in range(10)]
    gather = fit("all_gather", "gloo", 2, sizes, [model_seconds("ring_gather", s, 2, 100e-6, 2e9) for s in sizes])
    ring = fit("all_reduce", "gloo", 2, sizes, [model_seconds("ring", s, 2, 112e-6, 2.5e9) for s in sizes])
    fits = (gather, ring)
    if with_a2a:  # the all-to-all's pairwise formula is the all-gather's: (n-1) a + (n-1)/n S/b
        fits += (Fit.line("all_to_all", "shm", "ring_gather", 2, 10e-6, 8e9),)
    return CommModel(fits, source="strata bench comm --world-size 2", measured_at="2026-01-01")


def test_all_to_all_from_the_fit_or_the_labelled_stand_in(cpu_profile):
    shape = ModelShape.of(_cfg(), torch.bfloat16, None, 64)
    nbytes = ep_all_to_all_bytes(shape, 16, 2)
    assert nbytes == 8 * 8 * 2048 * 2  # 8 of 16 tokens a rank, top 8, hidden 2048, bf16
    profile = dataclasses.replace(cpu_profile, comm_model=_all_gather_model(False).to_json())
    dev = this_device(profile, torch.float32, None, 2)
    seconds, source = all_to_all_seconds(dev, nbytes, 2)
    assert source.startswith("STAND-IN") and "all-gather" in source
    assert seconds == pytest.approx(dev.comm.get("all_gather", "gloo").predict(nbytes, 2))
    measured = dataclasses.replace(dev, comm=_all_gather_model(True))
    seconds, source = all_to_all_seconds(measured, nbytes, 2)
    assert "measured all-to-all" in source and seconds == pytest.approx(10e-6 + nbytes / 2 / 8e9)
    assert all_to_all_seconds(dev, nbytes, 1) == (0.0, "one rank: no all-to-all")


def test_thisx2_ep_rows_say_the_stand_in(cpu_profile):
    profile = dataclasses.replace(cpu_profile, comm_model=_all_gather_model(False).to_json())
    plan = build_plan(PlanRequest(model="tiny-moe", hardware="thisx2", dtype="float32", max_model_len=256, batch=4,
                                  kv_cache_memory=2**22), profile=profile, overhead=StepOverhead.zero())
    assert [o.tp for o in plan.tp_options] == [1, 2]
    assert plan.tp_options[1].experts_per_device == 4 and plan.tp_options[1].ep_comm_s > 0
    text = format_text(plan)
    assert "Expert parallel over 2 devices" in text and "STAND-IN" in text


def test_decode_counts_active_flops_and_distinct_expert_reads():
    cfg = _cfg()
    shape = ModelShape.of(cfg, torch.bfloat16, None, 64)
    dev = spec_device(lookup("H100"), 1, torch.bfloat16, None)
    assert shape.p_lin < 0.12 * cfg.num_params()  # active projections, not every expert
    for b in (1, 8, 64):
        step = decode_step(shape, dev, b, 0)
        assert step.flops == pytest.approx(2 * b * shape.p_lin)
        assert step.bytes == pytest.approx(shape.stream_at(b))
        assert step.experts == pytest.approx(expected_experts(128, 8, b))
    pre = prefill(shape, dev, 512, 2048)
    assert pre.flops == pytest.approx(2 * shape.p_layers * 512 + 2 * cfg.vocab_size * cfg.hidden_size
                                      + 2 * 48 * 32 * 128 * 512 * 513)
    assert pre.routing_s == pytest.approx(GPU_ROUTING.seconds(48, expected_experts(128, 8, 512)))


def test_dense_plans_have_no_moe_part(cpu_profile):
    plan = build_plan(PlanRequest(model="tiny", hardware="this", dtype="float32", max_model_len=128, batch=4),
                      profile=cpu_profile, overhead=StepOverhead.zero())
    assert plan.moe is None and plan.routing is None and plan.active_params == plan.params
    assert "Mixture of experts" not in format_text(plan) and all(s.routing_s == 0 for s in plan.steps)


def test_tiny_moe_this_plan_with_every_probe(cpu_profile):
    """tiny-moe on `this`: the decode probe times its MoE layers (routing inside: not added), the
    layer probe times an MoE layer, the routing probe measures the dispatch."""
    plan = build_plan(PlanRequest(model="tiny-moe", hardware="this", dtype="float32", max_model_len=256, batch=16),
                      profile=cpu_profile, overhead=StepOverhead.zero())
    assert plan.decode_probe is not None and plan.prefill_layer is not None
    assert all(s.routing_s == 0 for s in plan.steps) and plan.moe["routing_in_probe"]
    assert plan.routing.source.startswith("measured here")
    assert plan.prefill_layer.gemm_s > 0 and plan.steps[0].total_s > 0


def test_routing_probe_and_fit():
    r = fit_routing([8, 28, 48, 108], [1e-3, 3e-3, 5e-3, 11e-3], "x")
    assert r.per_expert_s == pytest.approx(1e-4) and r.fixed_s == pytest.approx(2e-4)
    spiked = fit_routing([8, 28, 48, 108], [1e-3, 3e-3, 5e-3, 90e-3], "x")  # one slowed point
    assert spiked.per_expert_s == pytest.approx(1e-4)
    assert fit_routing([4, 4], [1e-3, 2e-3], "x") == Routing(1e-3, 0.0, "x")
    assert fit_routing([4, 20], [5e-3, 1e-3], "x").per_expert_s == 0.0  # kept >= 0
    from strata.demo.shapes import SHAPES

    cfg = ModelConfig.from_dict({"torch_dtype": "float32", **SHAPES["tiny-moe"]})
    measured = measure_routing(cfg, torch.float32)
    assert measured.fixed_s >= 0 and measured.per_expert_s >= 0
    assert measure_routing(cfg, torch.float32) is measured  # cached per process


def test_probes_seed_the_routers():
    """The decode probe's and layer probe's MoE routers are N(0, 0.02), not the loader's empty
    tensor: a batch of random rows then picks about expected_experts distinct experts."""
    from strata.demo.shapes import SHAPES
    from strata.graph.moe import Router

    cfg = ModelConfig.from_dict({"torch_dtype": "float32", **SHAPES["tiny-moe"]})
    probe = decode_probe_mod.DecodeProbe(cfg, torch.float32, None, 64)
    routers = [m for m in probe.model.modules() if isinstance(m, Router)]
    assert len(routers) == cfg.num_layers
    w = routers[0].weight
    assert abs(w.std().item() - 0.02) < 0.005
    with torch.inference_mode():
        ids = routers[0](torch.randn(16, cfg.hidden_size))[2]
    assert ids.unique().numel() > cfg.moe.top_k  # varied, not one set for every row

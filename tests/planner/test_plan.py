"""`strata plan` math: known answers (KV bytes, parameter counts), the engine's block count,
the alpha-beta formulas, roofline/crossover consistency and the CPU kernel line."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from strata.errors import ConfigError
from strata.hardware.specs import lookup
from strata.memory.planner import kv_bytes_per_token, weight_bytes
from strata.model_config import ModelConfig
from strata.planner.calibrate import StepOverhead
from strata.planner.plan import (
    ModelShape,
    PlanRequest,
    allreduce_seconds,
    build_plan,
    crossover_batch,
    decode_step,
    resolve_model,
    spec_device,
    this_device,
)
from strata.planner.plan_report import format_text
from strata.text_table import fmt_bytes


def _llama(name, hidden, inter, layers, heads, kv, vocab, tied=False, arch="LlamaForCausalLM", **kw):
    return {
        "architectures": [arch], "hidden_size": hidden, "intermediate_size": inter,
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv,
        "vocab_size": vocab, "tie_word_embeddings": tied, "max_position_embeddings": 4096,
        "torch_dtype": "bfloat16", "_name": name, **kw,
    }


LLAMA2_7B = _llama("Llama-2-7B", 4096, 11008, 32, 32, 32, 32000, torch_dtype="float16")
# published parameter counts (model cards)
PUBLIC = [
    (LLAMA2_7B, 6.74e9),
    (_llama("Llama-3-8B", 4096, 14336, 32, 32, 8, 128256, max_position_embeddings=8192), 8.03e9),
    (_llama("Qwen2-0.5B", 896, 4864, 24, 14, 2, 151936, tied=True, arch="Qwen2ForCausalLM"), 0.494e9),
    (_llama("Mistral-7B", 4096, 14336, 32, 32, 8, 32000, arch="MistralForCausalLM"), 7.24e9),
]


def _cfg(d: dict) -> ModelConfig:
    return ModelConfig.from_dict({k: v for k, v in d.items() if not k.startswith("_")})


def _write(tmp_path, d: dict):
    path = tmp_path / f"{d['_name']}.json"
    path.write_text(json.dumps({k: v for k, v in d.items() if not k.startswith("_")}))
    return path


def test_llama2_7b_kv_known_answer(tmp_path) -> None:
    cfg = _cfg(LLAMA2_7B)
    assert kv_bytes_per_token(cfg, torch.float16) == 512 * 2**10
    assert 2048 * kv_bytes_per_token(cfg, torch.float16) == 2**30
    plan = build_plan(PlanRequest(model=str(_write(tmp_path, LLAMA2_7B)), hardware="A100-80GB",
                                  dtype="float16", max_model_len=2048, batch=8))
    assert plan.memory.kv_per_token == 512 * 2**10
    assert plan.memory.kv_per_sequence == 2**30


@pytest.mark.parametrize("d,published", PUBLIC, ids=[d["_name"] for d, _ in PUBLIC])
def test_weights_match_published_counts(d: dict, published: float) -> None:
    cfg = _cfg(d)
    assert abs(cfg.num_params() / published - 1) < 0.01
    assert abs(weight_bytes(cfg, torch.bfloat16) / 2 / published - 1) < 0.01
    assert ModelShape.of(cfg, torch.bfloat16, None, 64).params == cfg.num_params()


def test_resolve_model_forms(tmp_path) -> None:
    cfg, name = resolve_model("smol-135m")
    assert name == "smol-135m" and cfg.num_layers == 30 and cfg.tie_word_embeddings
    path = _write(tmp_path, LLAMA2_7B)
    assert resolve_model(str(path))[0].hidden_size == 4096
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "config.json").write_text(path.read_text())
    assert resolve_model(str(tmp_path / "dir"))[0].num_layers == 32
    with pytest.raises(ConfigError, match="qwen-0.5b"):
        resolve_model(str(tmp_path / "missing"))


def test_allreduce_ring_and_tree_known_input() -> None:
    t = allreduce_seconds(1e6, 8, 100.0, 5e-6)  # 1 MB, 8 devices, 100 GB/s, 5 us
    assert t["ring"] == pytest.approx(2 * 7 / 8 * 1e6 / 100e9 + 2 * 7 * 5e-6)  # 87.5 us
    assert t["ring"] == pytest.approx(87.5e-6)
    assert t["tree"] == pytest.approx(2 * 3 * (5e-6 + 1e6 / 100e9))  # 90 us
    assert allreduce_seconds(1e6, 1, 100.0, 5e-6) == {"ring": 0.0, "tree": 0.0}
    big = allreduce_seconds(1e9, 8, 100.0, 5e-6)  # bandwidth-bound: ring moves less
    assert big["ring"] < big["tree"]


def test_plan_capacity_equals_engine_blocks(tiny_ckpt, cpu_profile) -> None:
    from strata.config import EngineConfig
    from strata.engine.llm_engine import LLMEngine

    for budget, quant in ((2**20, None), (3 * 2**20 + 12345, "int8")):
        engine = LLMEngine(EngineConfig(model=str(tiny_ckpt), dtype="float32", max_model_len=128,
                                        kv_cache_memory=budget, quantization=quant))
        plan = build_plan(
            PlanRequest(model=str(tiny_ckpt), hardware="this", dtype="float32", max_model_len=128,
                        kv_cache_memory=budget, quantization=quant, batch=4),
            profile=cpu_profile, overhead=StepOverhead.zero(),
        )
        assert plan.memory.num_blocks == engine.plan.num_blocks > 0
        assert plan.memory.kv_tokens == engine.plan.tokens
        assert plan.memory.kv_cache_bytes == engine.plan.kv_cache_bytes
        assert plan.memory.weight_bytes == engine.plan.weight_bytes
        del engine


def test_spec_plan_tensor_parallel_and_cost(tmp_path) -> None:
    d = PUBLIC[1][0]  # Llama-3-8B
    plan = build_plan(PlanRequest(model=str(_write(tmp_path, d)), hardware="h100x8", dtype="bfloat16",
                                  max_model_len=8192, batch=256, price_per_hour=8 * 3.0))
    assert plan.device.name == "H100-SXM" and plan.device.count == 8
    assert [o.tp for o in plan.tp_options] == [1, 2, 4, 8]
    b1 = plan.steps[0]
    # batch-1 decode on a datasheet device is the roofline: weights (+ KV) / HBM bandwidth
    assert b1.total_s == pytest.approx(b1.roofline_s)
    assert b1.roofline_s == pytest.approx(b1.bytes / 3.35e12, rel=1e-6)
    tp1, tp8 = plan.tp_options[0], plan.tp_options[-1]
    assert tp8.memory.weight_bytes == pytest.approx(tp1.memory.weight_bytes / 8, rel=1e-6)
    assert tp8.tpot_s < tp1.tpot_s
    # comm: 2 all-reduces per layer of hidden x 2 bytes per token
    assert tp8.comm_bytes_per_token == 2 * 32 * 4096 * 2
    assert tp1.comm_ring_s == 0.0 and tp8.comm_ring_s > 0
    one = allreduce_seconds(4096 * 2, 8, 450.0, 5e-6)  # NVLink 4: 900 GB/s both ways = 450 each
    assert tp8.comm_tree_s == pytest.approx(2 * 32 * one["tree"])
    assert tp8.tpot_s == pytest.approx(plan.steps[0].total_s / 8 + 2 * 32 * min(one.values()), rel=0.02)
    assert plan.best is not None and plan.best["cost_per_mtok"] > 0
    assert plan.best["cost_per_mtok"] == pytest.approx(24 / 3600 / plan.best["tokens_per_s"] * 1e6)
    assert json.loads(json.dumps(plan.to_json()))["device"]["name"] == "H100-SXM"


def test_crossover_is_where_roofline_terms_meet() -> None:
    shape = ModelShape.of(_cfg(PUBLIC[1][0]), torch.bfloat16, None, 64)  # Llama-3-8B, GQA
    dev = spec_device(lookup("A100-80GB"), 1, torch.bfloat16, None)
    b = crossover_batch(shape, dev, context=256)
    assert b is not None and 100 < b < 400
    lo, hi = decode_step(shape, dev, math.floor(b), 256), decode_step(shape, dev, math.ceil(b), 256)
    assert lo.bound == "memory" and hi.bound == "compute"
    # Llama-2-7B (full MHA) at 512 tokens: a sequence's KV takes longer to read than its FLOPs
    mha = ModelShape.of(_cfg(LLAMA2_7B), torch.float16, None, 64)
    assert crossover_batch(mha, dev, context=512) is None


def test_cpu_kernel_line_between_measured_points(cpu_profile) -> None:
    cfg, _ = resolve_model("smol-135m")
    shape = ModelShape.of(cfg, torch.float32, None, 64)
    dev = this_device(cpu_profile, torch.float32, None)
    ctx = 192
    s1, s16 = decode_step(shape, dev, 1, ctx), decode_step(shape, dev, 16, ctx)
    w_s = shape.stream_bytes / 32e9
    kv1 = ctx * shape.kv_per_token / 40e9
    att1 = ctx * shape.attn_flops_per_pos / 64e9
    assert s1.kernel_s == pytest.approx(w_s + max(kv1, att1))
    assert s16.kernel_s == pytest.approx(16 * 2 * shape.p_lin / 64e9 + max(16 * kv1, 16 * att1))
    s8 = decode_step(shape, dev, 8, ctx)
    lin = lambda s: s.kernel_s - max(s.batch * kv1, s.batch * att1)  # noqa: E731
    assert lin(s8) == pytest.approx(lin(s1) + 7 / 15 * (lin(s16) - lin(s1)))
    # tied embedding: the lm_head is streamed once and the embedding is not counted twice
    assert shape.stream_bytes == weight_bytes(cfg, torch.float32)
    untied = ModelShape.of(_cfg(LLAMA2_7B), torch.float16, None, 64)
    assert untied.stream_bytes == weight_bytes(_cfg(LLAMA2_7B), torch.float16) - 32000 * 4096 * 2
    over = StepOverhead([1, 16], [1e-3, 2e-3], [1e-4, 3e-4], {}, "cpu", "float32", None)
    s = decode_step(shape, dev, 1, ctx, overhead=over)
    assert s.overhead_s == pytest.approx(1e-3 + 30 * 1e-4)
    assert s.total_s == pytest.approx(s.kernel_s + s.overhead_s)


def test_quantised_cpu_uses_quant_kernel_rates(cpu_profile) -> None:
    dev = this_device(cpu_profile, torch.float32, "int4")
    # prefill: dequantised tiles through the bf16 GEMM, which the profile measures 2.3x fp32's
    assert dev.stream_gbs == 14.0 and dev.few_rows_gflops == 48.0 and dev.gemm_gflops == 420.0
    slow_bf16 = dataclasses.replace(cpu_profile, gemm_gflops={**cpu_profile.gemm_gflops, "bfloat16": 190.0})
    assert this_device(slow_bf16, torch.float32, "int4").gemm_gflops == 180.0  # under 1.1x: fp32 tiles
    cfg, _ = resolve_model("qwen-0.5b")
    q = ModelShape.of(cfg, torch.float32, "int4", 64)
    f = ModelShape.of(cfg, torch.float32, None, 64)
    assert q.stream_bytes < f.stream_bytes / 5


def test_prefill_formula(cpu_profile) -> None:
    cfg, _ = resolve_model("smol-135m")
    shape = ModelShape.of(cfg, torch.float32, None, 64)
    dev = this_device(cpu_profile, torch.float32, None)
    from strata.planner.plan import prefill

    p = prefill(shape, dev, 512, 2048)
    attn = 2 * 30 * 9 * 64 * 512 * 513
    flops = 2 * shape.p_layers * 512 + 2 * cfg.vocab_size * cfg.hidden_size + attn
    assert p.flops == flops and p.chunks == 1
    assert p.total_s == pytest.approx((flops - attn) / 180e9 + attn / 70e9 + shape.stream_bytes / 32e9)
    assert p.attention_s == pytest.approx(attn / 70e9)
    assert prefill(shape, dev, 5000, 2048).chunks == 3


def test_bad_requests(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("STRATA_CACHE", str(tmp_path))  # no cached profile, so no comm model
    with pytest.raises(ConfigError, match="H100-SXM"):
        build_plan(PlanRequest(model="tiny", hardware="B9000"))
    with pytest.raises(ConfigError, match="one device.*strata bench comm --world-size 2"):
        build_plan(PlanRequest(model="tiny", hardware="thisx2"))
    assert not list(tmp_path.iterdir())  # refused before probing anything
    with pytest.raises(ConfigError, match="max_position_embeddings"):
        build_plan(PlanRequest(model="tiny", hardware="L4", max_model_len=10**6))
    with pytest.raises(ConfigError, match="no bfloat16 figure"):
        build_plan(PlanRequest(model="tiny", hardware="T4", dtype="bfloat16"))


def test_does_not_fit_is_reported(tmp_path) -> None:
    plan = build_plan(PlanRequest(model=str(_write(tmp_path, PUBLIC[1][0])), hardware="T4",
                                  dtype="float16", max_model_len=8192, batch=4))
    assert not plan.memory.fits and plan.memory.error
    assert plan.best is None


def _comm_model():
    from strata.comm.alpha_beta import CommModel, fit, model_seconds

    sizes = [8 * 4**k for k in range(10)]
    shm = fit("all_reduce", "shm", 2, sizes, [model_seconds("shm", s, 2, 9e-6, 23e9) for s in sizes])
    gloo = fit("all_reduce", "gloo", 2, sizes, [model_seconds("ring", s, 2, 112e-6, 2.5e9) for s in sizes])
    return CommModel((shm, gloo), source="strata bench comm --world-size 2", measured_at="2026-01-01")


def test_this_tp_priced_from_the_fitted_comm_model(cpu_profile) -> None:
    """thisx2 with a measured comm model in the profile: TP all-reduces priced from the fit
    (SHM and gloo; the cheaper taken), the CPU host's rates shared by the ranks, and said so."""
    import dataclasses

    model = _comm_model()
    profile = dataclasses.replace(cpu_profile, comm_model=model.to_json())
    req = PlanRequest(model="tiny", hardware="thisx2", dtype="float32", max_model_len=256, batch=4,
                      kv_cache_memory=2**22)
    plan = build_plan(req, profile=profile, overhead=StepOverhead.zero())
    dev = plan.device
    assert dev.count == 2 and dev.comm == model and dev.link == "measured gloo/shm"
    one = this_device(cpu_profile, torch.float32, None)
    assert dev.stream_gbs == pytest.approx(one.stream_gbs / 2)
    assert dev.memory_bytes == cpu_profile.memory_bytes // 2
    assert [o.tp for o in plan.tp_options] == [1, 2]
    tp2 = plan.tp_options[1]
    nbytes, layers = 128 * 4, 2  # tiny: hidden 128, fp32; 2 layers
    shm, gloo = model.get("all_reduce", "shm"), model.get("all_reduce", "gloo")
    assert tp2.comm_tree_s == pytest.approx(2 * layers * shm.predict(nbytes, 2))  # ~9 us each
    assert tp2.comm_ring_s == pytest.approx(2 * layers * gloo.predict(nbytes, 2))  # ~224 us each
    step = decode_step(ModelShape.of(resolve_model("tiny")[0], torch.float32, None, 64), dev, 1, 256, 2)
    assert step.comm_s == pytest.approx(tp2.comm_tree_s)  # the cheaper: SHM
    assert any("fitted on this machine" in n and "not a datasheet" in n for n in plan.notes)
    assert any("'comm tree' column = the shared-memory" in n for n in plan.notes)
    # the datasheet formula is not what priced it
    datasheet = allreduce_seconds(nbytes, 2, dev.link_gbs, dev.alpha_s)
    assert tp2.comm_ring_s != pytest.approx(2 * layers * datasheet["ring"])
    # one device of this machine: no TP rows, and a note that the model exists
    solo = build_plan(dataclasses.replace(req, hardware="this"), profile=profile, overhead=StepOverhead.zero())
    assert [o.tp for o in solo.tp_options] == [1] and any("thisxN" in n for n in solo.notes)
    # the comm model extrapolates to n=4 with the formulas (and says so)
    four = build_plan(dataclasses.replace(req, hardware="thisx4"), profile=profile, overhead=StepOverhead.zero())
    assert [o.tp for o in four.tp_options] == [1, 2, 4]
    assert any("extrapolated to n=4" in n for n in four.notes)
    assert four.tp_options[2].comm_ring_s == pytest.approx(2 * layers * gloo.predict(nbytes, 4))


def test_datasheet_targets_ignore_this_machines_comm_model(tmp_path) -> None:
    plan = build_plan(PlanRequest(model=str(_write(tmp_path, PUBLIC[1][0])), hardware="h100x8",
                                  dtype="bfloat16", max_model_len=8192, batch=8))
    assert plan.device.comm is None
    assert not any("strata bench comm" in n for n in plan.notes)


# ---------------------------------------------------------------- the depth curve and the formats (issue 43)

LONG = _llama("long-tiny", 128, 352, 2, 4, 2, 1024, tied=True, max_position_embeddings=32768,
              torch_dtype="float32")


def _kv_term(cfg: ModelConfig, depth: int, nbytes: int) -> int:
    return cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * depth * nbytes


def test_depth_curve_is_monotone_and_reads_the_kv_at_each_depth(tmp_path) -> None:
    """Datasheet: batch-1 decode at 0, 4k, 16k and L; bytes = weights + the KV term, the KV term
    = layers x 2 x kv_heads x head_dim x depth x bytes; tok/s falls with the depth."""
    d = PUBLIC[1][0]  # Llama-3-8B, GQA 32:8, L = 8192 here
    cfg = _cfg(d)
    plan = build_plan(PlanRequest(model=str(_write(tmp_path, d)), hardware="A100-80GB", dtype="bfloat16",
                                  max_model_len=8192, batch=4))
    curve = plan.depth_curve
    assert [s.context for s in curve] == [0, 4096, 8192]  # 16k is beyond L
    assert all(s.batch == 1 for s in curve)
    rates = [s.tokens_per_s for s in curve]
    assert rates == sorted(rates, reverse=True) and len(set(rates)) == len(rates)
    weights = ModelShape.of(cfg, torch.bfloat16, None, 64).stream_bytes
    for s in curve:
        assert s.kv_bytes == _kv_term(cfg, s.context, 2)
        assert s.bytes == weights + s.kv_bytes
        assert s.total_s == pytest.approx(s.bytes / 2.039e12, rel=1e-6)  # memory-bound roofline
    assert curve[-1].total_s == plan.steps[0].total_s  # depth L, batch 1 = the decode table's first row
    text = format_text(plan)
    assert "Decode by context depth" in text and "   4,096" in text
    assert json.loads(json.dumps(plan.to_json()))["depth_curve"][1]["kv_bytes"] == curve[1].kv_bytes


def test_depth_curve_on_this_machine_follows_the_kv_cache_dtype(tmp_path, cpu_profile) -> None:
    """`this` (the decode probe prices the layers at its own context; the KV beyond it is added):
    the curve falls with the depth, its KV term is the formula's in the cache's dtype, and a bf16
    cache halves it."""
    path = _write(tmp_path, LONG)
    cfg = _cfg(LONG)
    plans = {kv: build_plan(PlanRequest(model=str(path), hardware="this", dtype="float32", kv_cache_dtype=kv,
                                        max_model_len=20000, input_len=64, context=256, batch=2,
                                        kv_cache_memory=2**26),
                            profile=cpu_profile, overhead=StepOverhead.zero())
             for kv in ("auto", "bfloat16")}
    for kv, nbytes in (("auto", 4), ("bfloat16", 2)):
        plan = plans[kv]
        assert plan.decode_probe is not None and plan.kv_cache_dtype == ("float32" if kv == "auto" else kv)
        assert plan.memory.kv_per_token == _kv_term(cfg, 1, nbytes)
        curve = plan.depth_curve
        assert [s.context for s in curve] == [0, 4096, 16384, 20000]
        assert [s.kv_bytes for s in curve] == [_kv_term(cfg, s.context, nbytes) for s in curve]
        rates = [s.tokens_per_s for s in curve]
        assert rates == sorted(rates, reverse=True) and len(set(rates)) == len(rates)
    # 12k more tokens of depth: the fp32 cache's read is the slower (memory-bound); the bf16 cache
    # reads half the bytes, and the attention FLOPs at the decode attention rate are then slower
    grow = {kv: p.depth_curve[2].kernel_s - p.depth_curve[1].kernel_s for kv, p in plans.items()}
    dev = plans["auto"].device
    flops_s = (16384 - 4096) * 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim / (dev.decode_attn_gflops * 1e9)
    assert dev.decode_attn_gflops == cpu_profile.matmul_gflops["float32"]
    read_s = _kv_term(cfg, 16384 - 4096, 4) / (dev.mem_gbs * 1e9)
    assert read_s > flops_s > read_s / 2
    assert grow["auto"] == pytest.approx(read_s) and grow["bfloat16"] == pytest.approx(flops_s)
    assert [s.attention for s in plans["bfloat16"].depth_curve[1:]] == ["attention compute"] * 3
    assert "KV cache bfloat16" in format_text(plans["bfloat16"])


def test_attention_compute_prices_the_depth_where_it_is_slower(cpu_profile) -> None:
    """Full MHA on a slow decode-attention rate: the attention FLOPs, not the KV read, set the price."""
    shape = ModelShape.of(_cfg(LLAMA2_7B), torch.float32, None, 64)
    dev = dataclasses.replace(this_device(cpu_profile, torch.float32, None), decode_attn_gflops=1.0)
    s = decode_step(shape, dev, 1, 4096)
    att = 4096 * shape.attn_flops_per_pos / 1e9
    assert s.attention == "attention compute" and s.attn_flops == 4096 * shape.attn_flops_per_pos
    assert s.kernel_s == pytest.approx(shape.stream_bytes / 32e9 + att)
    fast = dataclasses.replace(dev, decode_attn_gflops=1e6)
    assert decode_step(shape, fast, 1, 4096).attention == "KV read"


def test_resolve_model_keeps_a_shapes_checkpoint_dtype() -> None:
    assert resolve_model("llama-3.2-3b")[0].torch_dtype == torch.bfloat16  # random_models writes bf16 shards
    assert resolve_model("smol-135m")[0].torch_dtype == torch.float32  # one fp32 file


def test_plan_honours_dtype_and_quantization() -> None:
    """A datasheet target plans what was asked: auto = the checkpoint's bf16; float32 doubles the
    weight bytes, int8 / int4 shrink them; the KV follows the compute dtype."""
    cfg = resolve_model("llama-3.2-1b")[0]

    def plan(**kw):
        return build_plan(PlanRequest(model="llama-3.2-1b", hardware="H100", max_model_len=4096, batch=2, **kw))

    auto, fp32 = plan(), plan(dtype="float32")
    int8, int4 = plan(quantization="int8"), plan(quantization="int4")
    assert auto.dtype == "bfloat16" and fp32.dtype == "float32"
    assert auto.memory.weight_bytes == cfg.num_params() * 2 == weight_bytes(cfg, torch.bfloat16)
    assert fp32.memory.weight_bytes == 2 * auto.memory.weight_bytes
    assert int8.quantization == "int8" and int8.memory.weight_bytes < 0.6 * auto.memory.weight_bytes
    assert int4.memory.weight_bytes < 0.6 * int8.memory.weight_bytes
    assert fp32.memory.kv_per_token == 2 * auto.memory.kv_per_token == kv_bytes_per_token(cfg, torch.float32)
    assert fp32.depth_curve[0].total_s > auto.depth_curve[0].total_s > int8.depth_curve[0].total_s
    assert any("planned in bfloat16" in n for n in auto.notes)
    # the streaming loader's peak: the final weights + its read staging, whatever the format
    from strata.graph.loader import STAGING_BYTES

    for p in (auto, fp32, int8, int4):
        assert p.memory.load_peak_bytes == p.memory.weight_bytes + STAGING_BYTES
    assert f"load peak      {fmt_bytes(int4.memory.load_peak_bytes)}" in format_text(int4)
    # what the engine refuses on a GPU, the plan refuses with the engine's words
    with pytest.raises(ConfigError, match="quantization bf16.*CPU path"):
        plan(quantization="bf16")
    with pytest.raises(ConfigError, match="kv_cache_dtype: bfloat16 is implemented on CPU only"):
        plan(kv_cache_dtype="bfloat16")


def test_this_machine_resolves_formats_as_the_engine(cpu_profile) -> None:
    """`this`: dtype auto is the engine's decision (platform/cpu.resolve_weight_storage, then
    engine/build.resolve_dtype) from the same profile; explicit flags are kept."""
    from strata.config import EngineConfig
    from strata.engine.build import kv_dtype, resolve_dtype
    from strata.planner.plan import engine_formats
    from strata.platform.cpu import resolve_weight_storage

    for shape in ("llama-3.2-1b", "smol-135m"):
        cfg = resolve_model(shape)[0]
        got = engine_formats(PlanRequest(model=shape), cfg, "cpu", 1, cpu_profile)
        config = resolve_weight_storage(EngineConfig(), cfg.torch_dtype, cpu_profile)
        assert got.quantization == config.quantization
        assert got.dtype == resolve_dtype(config.dtype, "cpu", cfg.torch_dtype, cpu_profile)
        assert got.kv_dtype == kv_dtype(config, got.dtype)
    cfg = resolve_model("llama-3.2-1b")[0]
    asked = engine_formats(PlanRequest(model="x", dtype="float32", quantization="int4", kv_cache_dtype="bf16"),
                           cfg, "cpu", 1, cpu_profile)
    assert (asked.dtype, asked.quantization, asked.kv_dtype) == (torch.float32, "int4", torch.bfloat16)
    bf16 = engine_formats(PlanRequest(model="x", quantization="bf16"), cfg, "cpu", 1, cpu_profile)
    assert (bf16.dtype, bf16.quantization) == (torch.float32, "bf16")


def test_this_plan_weight_bytes_follow_the_weight_format(tiny_ckpt, cpu_profile) -> None:
    def plan(**kw):
        return build_plan(PlanRequest(model=str(tiny_ckpt), hardware="this", max_model_len=128, batch=2,
                                      input_len=32, context=64, kv_cache_memory=2**20, **kw),
                          profile=cpu_profile, overhead=StepOverhead.zero())

    fp32, bf16 = plan(dtype="float32"), plan(dtype="float32", quantization="bf16")
    int8 = plan(dtype="float32", quantization="int8")
    assert bf16.quantization == "bf16" and bf16.dtype == "float32"
    assert bf16.memory.weight_bytes < 0.6 * fp32.memory.weight_bytes
    assert int8.memory.weight_bytes < bf16.memory.weight_bytes
    assert bf16.memory.kv_per_token == fp32.memory.kv_per_token  # fp32 compute: an fp32 cache

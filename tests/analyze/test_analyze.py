"""`strata analyze` names planted bottlenecks: tokenisation, memory bandwidth, compute, queueing."""

from __future__ import annotations

import html.parser

import pytest
import torch

from strata.analyze.analyze import Workload, analyze_engine, attribute, classify
from strata.config import EngineConfig
from strata.engine.llm_engine import LLMEngine
from strata.server import faults


def engine(model: str | None = None, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=model, dtype="float32", kv_cache_memory="256MiB", **kw))


@pytest.fixture(scope="module")
def demo():
    return engine()


@pytest.fixture(scope="module")
def smol():
    from strata.demo.random_models import random_model_path

    return engine(str(random_model_path("smol-135m")))


def test_operator_classes():
    assert classify("aten::mm") == "gemm" and classify("strata::gemv") == "gemm"
    assert classify("aten::_scaled_dot_product_flash_attention_for_cpu") == "attention"
    assert classify("aten::index_select") == "memory"
    assert classify("aten::rms_norm") == "norm_elementwise"


def test_slow_tokenizer_is_named(demo, monkeypatch):
    monkeypatch.setenv("STRATA_TEST_FAULTS", "tokenize_delay=0.2")  # large, so a busy machine cannot hide it
    faults.faults.cache_clear()
    try:
        a = analyze_engine(demo, Workload(num_prompts=8, input_len=(16, 16), output_len=(2, 2)))
    finally:
        monkeypatch.delenv("STRATA_TEST_FAULTS")
        faults.faults.cache_clear()
    assert a.verdict.layer == "CPU pipeline: tokenization", a.verdict
    assert any("--tokenizer-workers" in x.flag for x in a.verdict.actions)
    assert a.categories["tokenize"] >= 1.5  # 8 x 200 ms planted


def test_capped_batch_is_queueing():
    e = engine(max_num_seqs=1)
    a = analyze_engine(e, Workload(num_prompts=8, input_len=(16, 16), output_len=(12, 12)))
    assert a.verdict.layer == "scheduling / queueing", a.verdict
    assert a.verdict.actions[0].flag.startswith("--max-num-seqs")


def test_batch1_decode_is_memory_bandwidth(smol):
    a = analyze_engine(smol, Workload(num_prompts=1, input_len=(16, 16), output_len=(40, 40)))
    assert a.verdict.layer == "memory bandwidth", (a.verdict, [p.efficiency for p in a.phases])
    assert any(x.flag == "--quantization int8" for x in a.verdict.actions)
    dec = next(p for p in a.phases if p.name == "decode")
    assert 0 < dec.mbu <= 1.5 and dec.bound == "memory"


def test_long_prefill_is_compute(smol):
    a = analyze_engine(smol, Workload(num_prompts=1, input_len=(512, 512), output_len=(1, 1)))
    assert a.verdict.layer == "compute", (a.verdict, [p.efficiency for p in a.phases])
    pre = next(p for p in a.phases if p.name == "prefill")
    assert pre.bound == "compute" and pre.tokens >= 400  # a cached prefix block may be skipped


def test_report_and_html(demo):
    from strata.analyze.analyze_report import format_html, format_text

    a = analyze_engine(demo, Workload(num_prompts=3, input_len=(24, 24), output_len=(20, 20)))
    cats = a.categories
    assert abs(sum(cats.values()) - a.wall_s) < 1e-6 * max(1.0, a.wall_s) + 1e-9
    assert all(v >= 0 for v in cats.values())
    assert 1 <= len(a.top_ops) <= 5
    text = format_text(a)
    assert "verdict: limited by" in text and "top-5 operators" in text
    page = format_html(a)
    html.parser.HTMLParser().feed(page)
    assert page.count("<svg") >= 4
    assert a.to_json()["verdict"]["layer"] == a.verdict.layer


def test_attribute_splits_forward_by_profiled_shares():
    from strata.analyze.analyze import Measurement, StepRecord

    steps = [StepRecord("decode", 1.0, 0.1, 0.8, 0.1, 0, 1, 10, profiled=i == 0) for i in range(4)]
    m = Measurement(wall_s=4.5, tokenize_s=0.2, steps=steps, requests=[],
                    op_seconds={"prefill": {}, "decode": {"gemm": 0.6, "attention": 0.1}},
                    op_forward_s={"prefill": 0.0, "decode": 0.8}, top_ops=[], max_num_seqs=8, max_running=1)
    cats = attribute(m)
    assert cats["gemm"] == pytest.approx(2.4) and cats["attention"] == pytest.approx(0.4)
    assert cats["overhead"] == pytest.approx(0.4)  # 0.1 of each 0.8 s forward outside operators
    assert cats["idle"] == pytest.approx(4.5 - 0.2 - 0.4 - 0.4 - 3.2)


def test_serve_verdicts_from_stage_counters():
    from strata.analyze.analyze_serve import serve_verdict

    base = dict(tokenize=0.1, queue=0.1, prefill=1.0, decode=5.0, detokenize=0.01, stream=0.01)
    busy = dict(schedule=0.1, forward=8.0, sample=0.2, idle=0.5)
    assert serve_verdict({**base, "tokenize": 4.0}, busy, 10, 8, 10).layer == "CPU pipeline: tokenization"
    v = serve_verdict({**base, "queue": 20.0}, busy, 10, 2, 10)
    assert v.layer == "scheduling / queueing" and v.actions[0].flag == "--max-num-seqs 10"
    assert serve_verdict(base, {**busy, "idle": 30.0}, 10, 8, 3).layer.startswith("load")
    assert serve_verdict(base, busy, 10, 8, 3).layer == "memory bandwidth (decode)"
    # 5 s of summed decode over 8.3 s busy: ~0.6 sequences at a time; the crossover decides the layer
    assert serve_verdict(base, busy, 10, 8, 3, crossover=6.0).layer == "memory bandwidth (decode)"
    many = {**base, "decode": 100.0}  # ~12 sequences decoding at a time
    v = serve_verdict(many, busy, 10, 32, 20, crossover=6.3)
    assert v.layer == "compute (decode batches)" and v.actions[0].flag == "--max-num-seqs 6"
    assert "12.0 sequences" in v.evidence
    assert serve_verdict({**base, "prefill": 9.0}, busy, 10, 8, 3).layer == "compute (prefill)"


def test_serve_crossover_from_the_planner(tiny_ckpt, cpu_profile, monkeypatch):
    from strata.analyze import analyze_cli
    from strata.analyze.plan import ModelShape, crossover_batch, resolve_model, this_device
    from strata.hardware import probe as probe_mod

    monkeypatch.setattr(probe_mod, "probe", lambda device="cpu", refresh=False: cpu_profile)
    got = analyze_cli._decode_crossover(str(tiny_ckpt), "float32", None, 100)
    cfg, _ = resolve_model(str(tiny_ckpt))
    dev = this_device(cpu_profile, torch.float32, None)
    assert got == crossover_batch(ModelShape.of(cfg, torch.float32, None, 64), dev, 100)
    assert analyze_cli._decode_crossover(None, "float32", None, 100) is None  # demo: no verdict input
    assert analyze_cli._decode_crossover(str(tiny_ckpt), "float64", None, 100) is None  # bad dtype: skipped

"""`strata analyze` names planted bottlenecks: tokenisation, memory bandwidth, compute, queueing.

No assertion here depends on how fast this machine runs. The verdicts are asserted on recorded
measurements (Measurement / StepRecord / RequestRecord as run_offline produced them on the dev
box, rounded) fed through analyze_engine's own attribution, phases and verdict, with the synthetic
CPU profile (profiles.py) in place of a probe. The real runs on the engine check what does not
depend on timing: the records the run produces, the planner's bound of each phase, a planted
tokenisation delay counted, and the verdict consistent with the shares it measured.
"""

from __future__ import annotations

import html.parser
from types import SimpleNamespace

import pytest
import torch

from strata.analyze import analyze as analyze_mod
from strata.analyze.analyze import (
    Measurement,
    RequestRecord,
    StepRecord,
    Workload,
    analyze_engine,
    attribute,
    classify,
)
from strata.analyze.analyze_verdict import (
    BOUND_EFFICIENCY,
    KERNEL_SHARE,
    LOW_MBU,
    QUEUE_SHARE,
    TOKENIZE_SHARE,
    Phase,
)
from strata.config import EngineConfig
from strata.demo.random_models import SHAPES
from strata.engine.llm_engine import LLMEngine
from strata.model_config import ModelConfig
from strata.server import faults

LAYERS = {"CPU pipeline: tokenization", "scheduling / queueing", "framework / host overhead (CPU pipeline)",
          "memory bandwidth", "compute"}


def engine(model: str | None = None, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=model, dtype="float32", kv_cache_memory="256MiB", **kw))


@pytest.fixture(scope="module")
def demo():
    return engine()


@pytest.fixture(scope="module")
def smol():
    from strata.demo.random_models import random_model_path

    return engine(str(random_model_path("smol-135m")))


# ------------------------------------------------------------------ recorded measurements

SMOL = ModelConfig.from_dict(dict(SHAPES["smol-135m"], torch_dtype="float32"), "smol-135m")


def _demo_config() -> ModelConfig:
    from strata.demo.model import demo_config

    return ModelConfig.from_dict(demo_config(), "demo")


def analyze_recorded(monkeypatch, m: Measurement, profile, model_config: ModelConfig = SMOL, **config):
    """analyze_engine over a recorded run: the same context (shape, device, int8 alternative),
    attribution, phases and verdict as a live run, with run_offline replaced by the record."""
    fake = SimpleNamespace(model_config=model_config, dtype=torch.float32, model_path="(recorded)",
                           config=EngineConfig(dtype="float32", **config), warm_up=lambda: None,
                           expert_token_counts=dict)  # a dense model: no expert counts
    monkeypatch.setattr(analyze_mod, "run_offline", lambda engine, w, progress=False: m)
    return analyze_engine(fake, Workload(), profile=profile)


def _scaled(m: Measurement, k: float) -> Measurement:
    """The same run with every measured time k x longer: a machine uniformly slowed by other work."""
    steps = [StepRecord(s.kind, s.wall_s * k, s.schedule_s * k, s.forward_s * k, s.sample_s * k, s.prefill_tokens,
                        s.decode_seqs, s.decode_context, s.profiled) for s in m.steps]
    reqs = [RequestRecord(r.tokenize_s * k, r.queue_s * k, r.prefill_s * k, r.decode_s * k, r.ttft_s * k,
                          None if r.tpot_s is None else r.tpot_s * k, r.output_tokens) for r in m.requests]
    ops = {kind: {c: s * k for c, s in cats.items()} for kind, cats in m.op_seconds.items()}
    return Measurement(m.wall_s * k, m.tokenize_s * k, steps, reqs, ops,
                       {kind: s * k for kind, s in m.op_forward_s.items()},
                       [(n, s * k) for n, s in m.top_ops], m.max_num_seqs, m.max_running)


def _prefill_512(forward_s: float, ops: dict[str, float]) -> Measurement:
    """smol-135m, one 512-token prompt, one output token: a single (profiled) prefill step."""
    wall = forward_s + 4e-4
    step = StepRecord("prefill", wall, 6e-5, forward_s, 3.5e-4, 512, 0, 0, profiled=True)
    req = RequestRecord(2e-4, 8e-4, wall, 1e-4, wall + 1e-3, None, 1)
    return Measurement(wall + 2e-4, 2e-4, [step], [req], {"prefill": ops, "decode": {}},
                       {"prefill": forward_s, "decode": 0.0}, [("aten::mm", ops["gemm"])], 128, 0)


# recorded twice on the dev box (2 shared cores): a quiet run (0.81 s), and one while other work
# loaded the machine (4.46 s; its norm/elementwise operators slowed most)
PREFILL_QUIET = _prefill_512(0.806, {"gemm": 0.572, "attention": 0.119, "memory": 0.054,
                                     "norm_elementwise": 0.039, "other_ops": 0.004})
PREFILL_LOADED = _prefill_512(4.459, {"gemm": 2.016, "attention": 0.276, "memory": 0.460,
                                      "norm_elementwise": 1.661, "other_ops": 0.015})
# not recorded: the same step with most of its forward time outside any operator (host overhead)
PREFILL_HOST_BOUND = _prefill_512(4.459, {"gemm": 0.9, "attention": 0.2, "memory": 0.1,
                                          "norm_elementwise": 0.3, "other_ops": 0.1})


def _decode_batch1() -> Measurement:
    """smol-135m, one 16-token prompt, 40 output tokens: one prefill step, 39 batch-1 decode steps
    (~12 ms each); profiled: the first step, the first after the phase change, then every 8th."""
    steps = [StepRecord("prefill", 0.0448, 3.7e-5, 0.0444, 2.4e-4, 16, 0, 0, profiled=True)]
    steps += [StepRecord("decode", 0.0120, 2.3e-5, 0.0117, 2.2e-4, 0, 1, 17 + i, profiled=i + 1 in (2, 8, 16, 24, 32))
              for i in range(39)]
    decode_s = sum(s.wall_s for s in steps[1:])
    req = RequestRecord(3e-5, 7.6e-4, 0.0448, decode_s, 0.0456, decode_s / 39, 40)
    ops = {"prefill": {"gemm": 0.0340, "norm_elementwise": 0.0023, "memory": 0.0015, "other_ops": 0.0014,
                       "attention": 0.0013},
           "decode": {"gemm": 0.0469, "norm_elementwise": 0.0070, "other_ops": 0.0040, "attention": 0.0036,
                      "memory": 0.0002}}
    return Measurement(sum(s.wall_s for s in steps) + 1e-3, 3e-5, steps, [req], ops,
                       {"prefill": 0.0444, "decode": 0.0732}, [("numba::gemv", 0.0499)], 128, 1)


def _capped_batch(max_num_seqs: int = 1) -> Measurement:
    """The demo model, 8 prompts of 16 tokens x 12 output tokens, max_num_seqs=1: the requests run
    one after another (one prefill + 11 decode steps each); request times as recorded (they include
    the profiled steps' profiler time, which wall_s leaves out)."""
    steps = []
    for _ in range(8):
        steps.append(StepRecord("prefill", 0.0020, 2e-5, 0.0019, 1e-4, 16, 0, 0, profiled=False))
        steps += [StepRecord("decode", 0.0010, 1e-5, 0.0009, 5e-5, 0, 1, 17 + j, profiled=False) for j in range(11)]
    recorded = [(0.0009, 0.0029, 0.0671), (0.0708, 0.0016, 0.4086), (0.4815, 0.0023, 0.0939),
                (0.5777, 0.0018, 0.0998), (0.6799, 0.0023, 0.4031), (1.0853, 0.0016, 0.0706),
                (1.1581, 0.0026, 0.0866), (1.2472, 0.0018, 0.3898)]
    reqs = [RequestRecord(2e-5, q, p, d, q + p, d / 11, 12) for q, p, d in recorded]
    ops = {"prefill": {"gemm": 0.0042, "norm_elementwise": 0.0012, "other_ops": 0.0010, "attention": 0.0007,
                       "memory": 0.0004},
           "decode": {"gemm": 0.0110, "norm_elementwise": 0.0068, "other_ops": 0.0040, "attention": 0.0023,
                      "memory": 0.0005}}
    return Measurement(0.1205, 1.5e-4, steps, reqs, ops, {"prefill": 0.0098, "decode": 0.0361},
                       [("numba::gemv", 0.0101)], max_num_seqs, 1)


def _slow_tokenizer() -> Measurement:
    """The demo model, 8 prompts of 16 tokens x 2 output tokens, tokenisation delayed 200 ms per
    prompt (STRATA_TEST_FAULTS=tokenize_delay=0.2): one prefill of all 8, one decode step of 8."""
    steps = [StepRecord("prefill", 0.0106, 6.8e-5, 0.0102, 2.7e-4, 130, 0, 0, profiled=True),
             StepRecord("decode", 0.0024, 5.3e-5, 0.0020, 2.4e-4, 0, 8, 138, profiled=False)]
    reqs = [RequestRecord(0.2004, 1.4039 - 0.2005 * i, 0.0103, 0.0598, 1.6147 - 0.2005 * i, 0.0598, 2)
            for i in range(8)]
    ops = {"prefill": {"gemm": 0.0051, "attention": 0.0009, "norm_elementwise": 0.0009, "other_ops": 0.0008,
                       "memory": 0.0006}, "decode": {}}
    return Measurement(1.6166, 1.6026, steps, reqs, ops, {"prefill": 0.0102, "decode": 0.0},
                       [("aten::mm", 0.0048)], 128, 8)


# ------------------------------------------------------------------ verdicts on recorded runs


def test_operator_classes():
    assert classify("aten::mm") == "gemm" and classify("strata::gemv") == "gemm"
    assert classify("aten::_scaled_dot_product_flash_attention_for_cpu") == "attention"
    assert classify("aten::index_select") == "memory"
    assert classify("aten::rms_norm") == "norm_elementwise"
    # the CPU decode step's one-call layers, and its LM head (a GEMV with the final norm)
    assert classify("numba::decode_layer") == "decoder_layer" and classify("numba::decode_head") == "gemm"


def test_slow_tokenizer_is_named(monkeypatch, cpu_profile):
    a = analyze_recorded(monkeypatch, _slow_tokenizer(), cpu_profile, _demo_config())
    assert a.verdict.layer == "CPU pipeline: tokenization", a.verdict
    assert any("--tokenizer-workers" in x.flag for x in a.verdict.actions)
    assert a.categories["tokenize"] >= 1.5  # 8 x 200 ms planted


def test_capped_batch_is_queueing(monkeypatch, cpu_profile):
    a = analyze_recorded(monkeypatch, _capped_batch(), cpu_profile, _demo_config(), max_num_seqs=1)
    assert a.verdict.layer == "scheduling / queueing", a.verdict
    assert a.verdict.actions[0].flag.startswith("--max-num-seqs")
    # the same waits without a full batch (max_running 1 < max_num_seqs 4) are not the scheduler's cap
    m = _capped_batch(max_num_seqs=4)
    assert analyze_recorded(monkeypatch, m, cpu_profile, _demo_config(), max_num_seqs=4).verdict.layer != \
        "scheduling / queueing"


@pytest.mark.parametrize("slowdown", [1.0, 4.0], ids=["quiet", "loaded-4x"])
def test_batch1_decode_is_memory_bandwidth(monkeypatch, cpu_profile, slowdown):
    a = analyze_recorded(monkeypatch, _scaled(_decode_batch1(), slowdown), cpu_profile)
    dec = next(p for p in a.phases if p.name == "decode")
    assert a.verdict.layer == "memory bandwidth", (a.verdict, [p.efficiency for p in a.phases])
    assert any(x.flag == "--quantization int8" for x in a.verdict.actions)
    assert 0 < dec.mbu <= 1.5 and dec.bound == "memory" and dec.mean_batch == 1
    if slowdown > 1:  # the roofline no longer explains the time, the operator profile still does
        assert dec.efficiency < BOUND_EFFICIENCY <= KERNEL_SHARE <= dec.kernel_share
    if dec.mbu < LOW_MBU:  # "limited by memory bandwidth" next to a low MBU says why
        assert "the MBU is low because" in a.verdict.evidence, a.verdict.evidence
    else:
        assert "the MBU is low" not in a.verdict.evidence


def test_low_mbu_is_explained_in_either_case():
    from strata.analyze.analyze_verdict import memory_evidence

    dev = SimpleNamespace(stream_gbs=6.0, mem_gbs=60.0)
    fast = Phase("decode", 10, 1.0, 10, 1.0, 5e9, 5e9, 0.9, "memory", 0.08, 0.01, 0.9)
    assert "kernels stream weights at 6.0 GB/s (strata hw), 10% of its 60.0 GB/s" in memory_evidence(fast, 1.0, dev)
    slow = Phase("decode", 10, 1.0, 10, 1.0, 5e9, 5e9, 0.1, "memory", 0.08, 0.01, 0.9)
    assert "run below their measured rate" in memory_evidence(slow, 1.0, dev)
    ok = Phase("decode", 10, 1.0, 10, 1.0, 5e10, 5e9, 0.9, "memory", 0.8, 0.01, 0.9)
    assert "MBU is low" not in memory_evidence(ok, 1.0, dev)


@pytest.mark.parametrize("record", [PREFILL_QUIET, PREFILL_LOADED, _scaled(PREFILL_QUIET, 6.0)],
                         ids=["quiet", "loaded", "quiet-slowed-6x"])
def test_long_prefill_is_compute(monkeypatch, cpu_profile, record):
    a = analyze_recorded(monkeypatch, record, cpu_profile)
    assert a.verdict.layer == "compute", (a.verdict, [(p.efficiency, p.kernel_share) for p in a.phases])
    pre = next(p for p in a.phases if p.name == "prefill")
    assert pre.bound == "compute" and pre.tokens >= 400  # a cached prefix block may be skipped
    assert any(x.flag == "--dtype bfloat16" for x in a.verdict.actions)  # the profile's bf16 GEMMs are faster


def test_long_prefill_on_a_loaded_machine_is_judged_by_its_kernel_share(monkeypatch, cpu_profile):
    """The loaded recording is 5.5x slower than the quiet one: the roofline explains only ~17% of
    it, so the compute verdict rests on the profile (>= KERNEL_SHARE of its forward time inside
    GEMM, attention and KV copies); with the time outside the operators, it is host overhead."""
    pre = next(p for p in analyze_recorded(monkeypatch, PREFILL_LOADED, cpu_profile).phases if p.name == "prefill")
    assert pre.efficiency < BOUND_EFFICIENCY and pre.kernel_share >= KERNEL_SHARE
    a = analyze_recorded(monkeypatch, PREFILL_HOST_BOUND, cpu_profile)
    assert a.verdict.layer == "framework / host overhead (CPU pipeline)", a.verdict
    assert a.verdict.actions[0].flag == "--compile"


# ------------------------------------------------------------------ live runs: what timing cannot change


def test_planted_tokenize_delay_is_counted(demo, monkeypatch, cpu_profile):
    monkeypatch.setenv("STRATA_TEST_FAULTS", "tokenize_delay=0.2")
    faults.faults.cache_clear()
    try:
        a = analyze_engine(demo, Workload(num_prompts=8, input_len=(16, 16), output_len=(2, 2)), cpu_profile)
    finally:
        monkeypatch.delenv("STRATA_TEST_FAULTS")
        faults.faults.cache_clear()
    assert a.categories["tokenize"] >= 1.6  # 8 x 200 ms sleeps: a lower bound on any machine
    share = a.categories["tokenize"] / a.wall_s
    assert (a.verdict.layer == "CPU pipeline: tokenization") == (share >= TOKENIZE_SHARE), (share, a.verdict)


def test_capped_batch_runs_one_sequence_at_a_time(cpu_profile):
    a = analyze_engine(engine(max_num_seqs=1), Workload(num_prompts=8, input_len=(16, 16), output_len=(12, 12)),
                       cpu_profile)
    dec = next(p for p in a.phases if p.name == "decode")
    assert dec.mean_batch == 1 and dec.steps == 8 * 11 and a.requests["count"] == 8
    assert a.requests["mean_queue_s"] > 0 and a.verdict.layer in LAYERS
    r = a.requests
    queue_share = r["mean_queue_s"] / (r["mean_queue_s"] + r["mean_prefill_s"] + r["mean_decode_s"])
    if a.categories["tokenize"] / a.wall_s < TOKENIZE_SHARE:  # the verdict follows the measured shares
        assert (a.verdict.layer == "scheduling / queueing") == (queue_share >= QUEUE_SHARE), (queue_share, a.verdict)


def test_smol_run_records_both_phases(smol, cpu_profile):
    a = analyze_engine(smol, Workload(num_prompts=1, input_len=(512, 512), output_len=(8, 8)), cpu_profile)
    pre = next(p for p in a.phases if p.name == "prefill")
    dec = next(p for p in a.phases if p.name == "decode")
    assert pre.steps == 1 and pre.tokens >= 400 and pre.bound == "compute"  # planner: from shapes + profile
    assert dec.steps == 7 and dec.mean_batch == 1 and dec.bound == "memory"
    assert pre.seconds > 0 and dec.seconds > 0 and 0 < pre.kernel_share <= 1
    assert abs(sum(a.categories.values()) - a.wall_s) < 1e-6 * max(1.0, a.wall_s) + 1e-9
    assert a.verdict.layer in LAYERS, a.verdict
    if a.categories["tokenize"] / a.wall_s < TOKENIZE_SHARE:  # the verdict follows the measured shares
        top = max(a.phases, key=lambda p: p.seconds)
        assert (a.verdict.layer == "framework / host overhead (CPU pipeline)") == (not top.roofline_bound)


def test_report_and_html(demo, cpu_profile):
    from strata.analyze.analyze_report import format_html, format_text

    said: list[str] = []
    a = analyze_engine(demo, Workload(num_prompts=3, input_len=(24, 24), output_len=(20, 20)), cpu_profile,
                       progress=said.append)
    assert [s.split()[0] for s in said] == ["warming", "running", "attributing"]  # each phase announced
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
    from strata.analyze import cli as analyze_cli
    from strata.hardware import probe as probe_mod
    from strata.planner.plan import ModelShape, crossover_batch, resolve_model, this_device

    monkeypatch.setattr(probe_mod, "probe", lambda device="cpu", refresh=False: cpu_profile)
    got = analyze_cli._decode_crossover(str(tiny_ckpt), "float32", None, 100)
    cfg, _ = resolve_model(str(tiny_ckpt))
    dev = this_device(cpu_profile, torch.float32, None)
    assert got == crossover_batch(ModelShape.of(cfg, torch.float32, None, 64), dev, 100)
    assert analyze_cli._decode_crossover(None, "float32", None, 100) is None  # demo: no verdict input
    assert analyze_cli._decode_crossover(str(tiny_ckpt), "float64", None, 100) is None  # bad dtype: skipped


def test_profiler_start_stop_lines_stay_off_the_terminal():
    """kineto prints `USDT: ... profiler_start/stop` from C++ on stderr; quiet_profile drops those
    lines at the file descriptor and lets everything else through."""
    import subprocess
    import sys

    code = ("import os, torch\n"
            "from strata.kernels.profile import quiet_profile\n"
            "with quiet_profile(torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])) as p:\n"
            "    torch.mm(torch.ones(4, 4), torch.ones(4, 4))\n"
            "    os.write(2, b'kept line\\n')\n"
            "assert len(p.key_averages()) > 0\n"
            "with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):\n"
            "    pass\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    lines = r.stderr.splitlines()
    assert "kept line" in lines
    usdt = [ln for ln in lines if ln.startswith("USDT:")]
    assert len(usdt) <= 2 and all("profiler_st" in ln for ln in usdt)  # only the unwrapped profiler's

"""`strata bench plan-accuracy` end to end on the tiny random model: three real `strata bench latency`
children, predictions from the planner with a synthetic profile (no hardware probe in tests)."""

from __future__ import annotations

import json
import math

import pytest

from strata.bench import plan_accuracy
from strata.cli import main
from strata.planner.calibrate import StepOverhead
from strata.planner.plan import PlanRequest, build_plan


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("STRATA_CACHE", str(tmp_path / "cache"))


@pytest.fixture
def steady(monkeypatch):
    """Re-timings count as agreeing whatever this machine's speed does meanwhile (the rounds'
    retry rule is tested on its own below)."""
    monkeypatch.setattr(plan_accuracy, "STABLE_DRIFT", float("inf"))
    monkeypatch.setattr(plan_accuracy, "SETTLE_S", 0.0)


def test_plan_accuracy_pairs(tmp_path, capsys, monkeypatch, cpu_profile, steady):
    requests = []

    def predict(model, dtype, quantization):
        req = PlanRequest(model=model, dtype=dtype, quantization=quantization, batch=16, input_len=512,
                          context=192, max_model_len=2048)
        requests.append(req)
        return build_plan(req, profile=cpu_profile, overhead=StepOverhead.zero())

    monkeypatch.setattr(plan_accuracy, "_predict", predict)
    monkeypatch.setattr(plan_accuracy, "_stream_now", lambda dtype, quant: 16.0)  # half the profile's 32 GB/s
    out = tmp_path / "acc.json"
    assert main(["bench", "plan-accuracy", "--model", "tiny", "--rounds", "1", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "pairs within target" in printed and "batch-16 decode" in printed
    pairs = json.loads(out.read_text())["pairs"]
    assert [p["case"] for p in pairs] == [c[0] for c in plan_accuracy.CASES]
    for p in pairs:
        assert p["model"] == "tiny" and p["predicted"] > 0 and p["measured"] > 0
        assert math.isclose(p["error"], p["predicted"] / p["measured"] - 1)
        assert p["ok"] == (abs(p["error"]) <= p["target"])
        assert 1 <= len(p["rounds"]) <= 2 and p["error"] in [r["error"] for r in p["rounds"]]
    # every prediction uses the plan's probe model, re-timed around each run (decode steps; the prompt)
    assert all(p["probe_layer_ms"] is not None and p["probe_layer_ms"] > 0 for p in pairs)
    assert [p["stream_gbs"] for p in pairs] == [cpu_profile.linear_gbs["float32"]] * 3
    assert pairs[1]["unit"] == "ms" and pairs[0]["unit"] == "tok/s"
    assert len(requests) == 1


def test_plan_accuracy_without_a_decode_probe_re_measures_the_stream(tmp_path, monkeypatch, cpu_profile, steady):
    """A plan priced from the rates (no decode probe: the model too large to time) has its decode
    re-priced at the weight-streaming rate measured around each run."""
    def predict(model, dtype, quantization):
        req = PlanRequest(model=model, dtype=dtype, quantization=quantization, batch=16, input_len=512,
                          context=192, max_model_len=2048)
        plan = build_plan(req, profile=cpu_profile, overhead=StepOverhead.zero())
        plan.decode_probe = None
        return plan

    monkeypatch.setattr(plan_accuracy, "_predict", predict)
    monkeypatch.setattr(plan_accuracy, "_stream_now", lambda dtype, quant: 16.0)  # half the profile's 32 GB/s
    monkeypatch.setattr(plan_accuracy, "_measure", lambda *a: {"prefill_s": 1.0, "decode_tokens_per_s": 10.0})
    out = tmp_path / "acc.json"
    assert main(["bench", "plan-accuracy", "--model", "tiny", "--rounds", "1", "--json", str(out)]) == 0
    pairs = json.loads(out.read_text())["pairs"]
    assert [p["stream_gbs"] for p in pairs] == [16.0, cpu_profile.linear_gbs["float32"], 16.0]
    assert all(p["probe_layer_ms"] is None for p in pairs)


def test_plan_accuracy_bf16_weights_path(tmp_path, capsys, monkeypatch, cpu_profile, steady):
    """--quantization bf16: the plan prices decode at the bf16 GEMV rate and half the weight bytes."""
    seen = []

    def predict(model, dtype, quantization):
        seen.append(quantization)
        req = PlanRequest(model=model, dtype=dtype, quantization=quantization, batch=16, input_len=512,
                          context=192, max_model_len=2048)
        return build_plan(req, profile=cpu_profile, overhead=StepOverhead.zero())

    measured = []

    def measure(model, dtype, quantization, batch, n_in, n_out):
        measured.append(quantization)
        return {"prefill_s": 1.0, "decode_tokens_per_s": 10.0}

    monkeypatch.setattr(plan_accuracy, "_predict", predict)
    monkeypatch.setattr(plan_accuracy, "_stream_now", lambda dtype, quant: cpu_profile.linear_gbs["bfloat16"])
    monkeypatch.setattr(plan_accuracy, "_measure", measure)
    out = tmp_path / "acc.json"
    assert main(["bench", "plan-accuracy", "--model", "tiny", "--quantization", "bf16", "--rounds", "1",
                 "--json", str(out)]) == 0
    assert "float32 + bf16 weights" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["quantization"] == "bf16" and seen == ["bf16"] and measured == ["bf16"] * 3
    plan = predict("tiny", "float32", "bf16")
    assert plan.device.stream_gbs == cpu_profile.linear_gbs["bfloat16"]
    fp32 = build_plan(PlanRequest(model="tiny", dtype="float32", batch=16, input_len=512, context=192,
                                  max_model_len=2048), profile=cpu_profile, overhead=StepOverhead.zero())
    assert plan.memory.weight_bytes < 0.6 * fp32.memory.weight_bytes


def _round(error: float, drift: float = 0.0, unstable=()) -> plan_accuracy.Round:
    return plan_accuracy.Round(predicted=10 * (1 + error), measured=10.0, drift=drift, unstable=list(unstable),
                               layer_ms=None, stream=1.0)


def test_rounds_report_the_median_stable_round_and_retry_unstable_ones(capsys):
    """A round whose re-timings disagree (the machine changed under it) is re-run, up to twice the
    rounds asked for (the child's own warnings do not decide); the pair is the stable round with the
    median error."""
    script = iter([_round(-0.30, drift=0.25), _round(+0.04, unstable=["bandwidth moved"]), _round(-0.50, drift=0.11),
                   _round(-0.08), _round(+0.02)])
    picked, done = plan_accuracy._rounds(lambda: next(script), 3, "x")
    assert len(done) == 5 and [r.stable for r in done] == [False, True, False, True, True]
    assert picked.error == pytest.approx(0.02)  # median of -0.08, +0.02, +0.04
    assert "x, round 5" in capsys.readouterr().out


def test_rounds_give_up_after_twice_the_rounds_and_report_all_of_them():
    script = iter([_round(e, drift=0.5) for e in (0.3, -0.2, 0.1, 0.5)])
    picked, done = plan_accuracy._rounds(lambda: next(script), 2, "x")
    assert len(done) == 4 and not any(r.stable for r in done)
    assert picked.error == pytest.approx(0.1)  # the lower median of all four, none stable


def test_rounds_must_be_positive(capsys):
    assert main(["bench", "plan-accuracy", "--model", "tiny", "--rounds", "0"]) == 2
    assert "--rounds 0: must be at least 1" in capsys.readouterr().err

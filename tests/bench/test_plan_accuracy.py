"""`strata bench plan-accuracy` end to end on the tiny random model: three real `strata bench latency`
children, predictions from the planner with a synthetic profile (no hardware probe in tests)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from strata.bench import plan_accuracy
from strata.cli import main
from strata.planner.calibrate import StepOverhead
from strata.planner.cost_model import decode_step
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

    def predict(model, args):
        req = PlanRequest(model=model, dtype=args.dtype, quantization=args.quantization, batch=16, input_len=512,
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
    assert [p["key"] for p in pairs] == list(plan_accuracy.DEFAULT_CASES)
    assert [p["case"] for p in pairs] == [plan_accuracy.BY_KEY[k].label for k in plan_accuracy.DEFAULT_CASES]
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
    def predict(model, args):
        req = PlanRequest(model=model, dtype=args.dtype, quantization=args.quantization, batch=16, input_len=512,
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


def _plan(model, dtype, quantization, profile, **kw):
    req = PlanRequest(model=model, dtype=dtype, quantization=quantization, batch=16, input_len=512,
                      context=192, max_model_len=2048, **kw)
    return build_plan(req, profile=profile, overhead=StepOverhead.zero())


def test_plan_accuracy_bf16_weights_path(tmp_path, capsys, monkeypatch, cpu_profile, steady):
    """--quantization bf16: the plan prices decode at the bf16 GEMV rate and half the weight bytes."""
    seen = []

    def predict(model, args):
        seen.append(args.quantization)
        return _plan(model, args.dtype, args.quantization, cpu_profile)

    measured = []

    def measure(model, args, case):
        measured.append(args.quantization)
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
    plan = _plan("tiny", "float32", "bf16", cpu_profile)
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


def test_list_names_the_3b_shape_and_the_depth_cases(capsys):
    assert main(["bench", "plan-accuracy", "--list"]) == 0
    out = capsys.readouterr().out
    assert "llama-3.2-3b" in out
    for key, prompt in (("depth-4k", "4096"), ("depth-16k", "16384")):
        row = next(line for line in out.splitlines() if line.startswith(key))
        assert prompt in row and row.rstrip().endswith("no")  # not in the default (short) run
    assert set(plan_accuracy.DEFAULT_CASES) == {"batch-1", "prefill-512", "batch-16"}
    assert {"depth-4k", "depth-16k"} <= set(plan_accuracy.BY_KEY)
    assert "llama-3.2-3b" in plan_accuracy.MODELS and "llama-3.2-3b" not in plan_accuracy.DEFAULT_MODELS


def test_depth_pairs_on_a_tiny_model(tmp_path, monkeypatch, cpu_profile, steady):
    """--case depth-4k --case depth-16k on a tiny long-context shape: each child is `strata bench
    latency` at batch 1 with that prompt and no warm-up (its run is faked here: machine speed must
    not decide a test); the prediction is the plan's decode at the depth, falling with it."""
    model = tmp_path / "long-tiny"
    model.mkdir()
    from strata.demo.shapes import SHAPES

    (model / "config.json").write_text(json.dumps(dict(SHAPES["tiny"], max_position_embeddings=32768,
                                                       torch_dtype="float32")))
    plans = []

    def predict(m, args):  # small: a 32-token prefill probe, decode batch 1
        req = PlanRequest(model=m, dtype=args.dtype, batch=1, input_len=32, context=64, max_model_len=256)
        plans.append(build_plan(req, profile=cpu_profile, overhead=StepOverhead.zero()))
        return plans[-1]

    monkeypatch.setattr(plan_accuracy, "_predict", predict)
    monkeypatch.setattr(plan_accuracy, "_retime", lambda plan, cfg, args, batch: plan.decode_probe)  # steady
    commands = []

    def child(cmd, check, stdout):
        commands.append(cmd)
        out = cmd[cmd.index("--json") + 1]
        with open(out, "w") as f:
            json.dump({"strata": {"decode_tokens_per_s": 100.0, "prefill_s": 1.0}}, f)

    monkeypatch.setattr(plan_accuracy.subprocess, "run", child)
    out = tmp_path / "acc.json"
    assert main(["bench", "plan-accuracy", "--model", str(model), "--case", "depth-4k", "--case", "depth-16k",
                 "--rounds", "1", "--json", str(out)]) == 0
    pairs = json.loads(out.read_text())["pairs"]
    assert [p["key"] for p in pairs] == ["depth-4k", "depth-16k"]
    assert [p["input_len"] for p in pairs] == [4096, 16384]
    for cmd, n_in in zip(commands, (4096, 16384)):
        flags = dict(zip(cmd[5::2], cmd[6::2]))
        assert cmd[3:6] == ["bench", "latency", "--model"] and flags["--input-len"] == str(n_in)
        assert flags["--batch"] == "1" and flags["--warmup"] == "0" and flags["--output-len"] == "64"
    [plan] = plans  # the plan's decode at the mean depth of the measured steps (prompt + output / 2)
    shape = plan_accuracy.ModelShape.of(plan_accuracy.resolve_model(str(model))[0], torch.float32, None, 64)
    want = [decode_step(shape, plan.device, 1, n + 32, 1, plan.overhead, plan.decode_probe).tokens_per_s
            for n in (4096, 16384)]
    assert [p["predicted"] for p in pairs] == pytest.approx(want)
    assert want[0] > want[1] > 0  # deeper context, more KV read a token
    assert all(p["measured"] == 100.0 and p["unit"] == "tok/s" and p["target"] == 0.10 for p in pairs)


def test_cases_longer_than_the_model_are_skipped(capsys, monkeypatch):
    monkeypatch.setattr(plan_accuracy, "_predict", lambda *a: pytest.fail("nothing to plan"))
    assert main(["bench", "plan-accuracy", "--model", "tiny", "--case", "depth-4k", "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    assert "depth-4k skipped" in out and "2048" in out and "0/0 pairs" in out


def test_the_moe_shape_is_a_default_model_and_priced_with_its_routing(tmp_path, monkeypatch, cpu_profile, steady):
    """plan-accuracy's defaults include the MoE shape (qwen3-moe-0.2b); on tiny-moe (children faked)
    the pairs are predicted from the plan's probes and its measured routing."""
    assert "qwen3-moe-0.2b" in plan_accuracy.DEFAULT_MODELS and "qwen3-moe-2b" in plan_accuracy.MODELS
    plans = []

    def predict(model, args):
        req = PlanRequest(model=model, dtype=args.dtype, batch=16, input_len=512, context=192, max_model_len=2048)
        plans.append(build_plan(req, profile=cpu_profile, overhead=StepOverhead.zero()))
        return plans[-1]

    monkeypatch.setattr(plan_accuracy, "_predict", predict)
    monkeypatch.setattr(plan_accuracy, "_measure", lambda *a: {"prefill_s": 0.05, "decode_tokens_per_s": 100.0})
    out = tmp_path / "acc.json"
    assert main(["bench", "plan-accuracy", "--model", "tiny-moe", "--rounds", "1", "--json", str(out)]) == 0
    pairs = json.loads(out.read_text())["pairs"]
    assert [p["key"] for p in pairs] == list(plan_accuracy.DEFAULT_CASES)
    assert all(p["model"] == "tiny-moe" and p["predicted"] > 0 for p in pairs)
    assert plans[0].moe is not None and plans[0].routing is not None

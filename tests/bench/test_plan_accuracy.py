"""`strata bench plan-accuracy` end to end on the tiny random model: three real `strata bench latency`
children, predictions from the planner with a synthetic profile (no hardware probe in tests)."""

from __future__ import annotations

import json
import math

import pytest

from strata.analyze import plan_accuracy
from strata.analyze.calibrate import StepOverhead
from strata.analyze.plan import PlanRequest, build_plan
from strata.cli import main


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("STRATA_CACHE", str(tmp_path / "cache"))


def test_plan_accuracy_pairs(tmp_path, capsys, monkeypatch, cpu_profile):
    requests = []

    def predict(model, dtype):
        req = PlanRequest(model=model, dtype=dtype, batch=16, input_len=512, context=192, max_model_len=2048)
        requests.append(req)
        return build_plan(req, profile=cpu_profile, overhead=StepOverhead.zero())

    monkeypatch.setattr(plan_accuracy, "_predict", predict)
    monkeypatch.setattr(plan_accuracy, "_stream_now", lambda dtype: 16.0)  # half the profile's 32 GB/s
    out = tmp_path / "acc.json"
    assert main(["bench", "plan-accuracy", "--model", "tiny", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "pairs within target" in printed and "batch-16 decode" in printed
    pairs = json.loads(out.read_text())["pairs"]
    assert [p["case"] for p in pairs] == [c[0] for c in plan_accuracy.CASES]
    for p in pairs:
        assert p["model"] == "tiny" and p["predicted"] > 0 and p["measured"] > 0
        assert math.isclose(p["error"], p["predicted"] / p["measured"] - 1)
        assert p["ok"] == (abs(p["error"]) <= p["target"])
    # decode predictions use the re-measured stream rate; prefill the plan's own
    assert [p["stream_gbs"] for p in pairs] == [16.0, cpu_profile.linear_gbs["float32"], 16.0]
    assert pairs[1]["unit"] == "ms" and pairs[0]["unit"] == "tok/s"
    assert len(requests) == 1

"""Step-overhead calibration: interpolation, cache, and one fast real measurement on the engine."""

from __future__ import annotations

import pytest
import torch

from strata.analyze import calibrate
from strata.analyze.calibrate import StepOverhead, _interp


def test_interp_and_at() -> None:
    assert _interp([1, 16, 64], [1.0, 2.5, 4.9], 1) == 1.0
    assert _interp([1, 16, 64], [1.0, 2.5, 4.9], 8.5) == pytest.approx(1.75)
    assert _interp([1, 16, 64], [1.0, 2.5, 4.9], 40) == pytest.approx(3.7)
    assert _interp([1, 16, 64], [1.0, 2.5, 4.9], 128) == pytest.approx(4.9 + 64 * 0.05)  # extended
    o = StepOverhead([1, 16], [1e-3, 2e-3], [1e-4, 4e-4], {}, "cpu", "float32", None)
    assert o.at(1, 10) == pytest.approx(2e-3)
    assert o.at(16, 10) == pytest.approx(6e-3)
    assert StepOverhead.from_json(o.to_json()) == o
    with pytest.raises(ValueError):
        StepOverhead.from_json({**o.to_json(), "schema": 99})


def test_measure_on_engine_and_cache(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("STRATA_CACHE", str(tmp_path))
    monkeypatch.setattr(calibrate, "BATCHES", (1, 2))
    monkeypatch.setattr(calibrate, "DEPTHS", (1, 2))
    monkeypatch.setattr(calibrate, "DECODE_STEPS", 5)
    calls = []

    def kernel_seconds(cfg, batch, context):
        calls.append((cfg.num_layers, batch, context))
        return 0.0

    before = torch.get_num_threads()
    o = calibrate.step_overhead("cpu", torch.float32, None, kernel_seconds)
    assert torch.get_num_threads() == before
    assert o.batches == [1, 2] and len(o.per_step_s) == 2 and all(x >= 0 for x in o.per_layer_s)
    assert set(o.measured) == {"layers=1,batch=1", "layers=1,batch=2", "layers=2,batch=1", "layers=2,batch=2"}
    assert all(v > 0 for v in o.measured.values())
    assert {c[:2] for c in calls} == {(1, 1), (1, 2), (2, 1), (2, 2)}
    n = len(calls)
    assert calibrate.step_overhead("cpu", torch.float32, None, kernel_seconds) == o  # cached
    assert len(calls) == n

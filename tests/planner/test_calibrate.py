"""Step-overhead calibration: interpolation, cache, and one fast real measurement on the engine."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from strata.planner import calibrate
from strata.planner.calibrate import StepOverhead, _interp


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
    assert o.at(1, 10, steps=4) == o.at(1, 10) and o.steps_per_call(1e-3) == 1  # no multi-step measurement


def test_multi_step_overhead_is_a_plus_b_over_steps() -> None:
    """Measured at 1 and MAX_STEPS (8) steps per call: 1.0 and 0.3 ms a step, so b = 0.8, a = 0.2."""
    o = StepOverhead([1, 16], [1e-3, 2e-3], [0.0, 0.0], {}, "cpu", "float32", None, [0.3e-3, 2e-3])
    assert o.at(1, 0, steps=1) == pytest.approx(1e-3)
    assert o.at(1, 0, steps=8) == pytest.approx(0.3e-3)
    assert o.at(1, 0, steps=2) == pytest.approx(0.2e-3 + 0.8e-3 / 2)
    assert o.at(16, 0, steps=4) == pytest.approx(2e-3)  # nothing saved at 16 rows
    assert o.steps_per_call(8e-3) == 6 and o.steps_per_call(0.1) == 1  # the engine's rule (50 ms bursts)
    assert StepOverhead.from_json(o.to_json()) == o


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
    steps = {f"layers={d},batch={b}" for d in (1, 2) for b in (1, 2)}
    multi = {f"layers=1,batch={b},steps=8" for b in (1, 2)}  # the shallow engine at 8 steps a call too
    assert set(o.measured) == steps | {k + ",warm" for k in steps} | multi  # cold (every other call) and warm
    assert len(o.per_step_multi_s) == 2 and all(x >= 0 for x in o.per_step_multi_s)
    assert all(v > 0 for v in o.measured.values())
    assert {c[:2] for c in calls} == {(1, 1), (1, 2), (2, 1), (2, 2)}
    n = len(calls)
    assert calibrate.step_overhead("cpu", torch.float32, None, kernel_seconds) == o  # cached
    assert len(calls) == n


def test_every_other_decode_step_runs_after_the_eviction(monkeypatch) -> None:
    """Cold steps are the ones the eviction buffer was read just before; warm and cold means come
    from the decode steps only (the prefill step and the first decode step excluded)."""
    now = [0.0]

    class Evict:
        reads = 0

        def sum(self):
            Evict.reads += 1

    class Engine:
        class config:
            max_num_batched_tokens = 10**6

        last_schedule = SimpleNamespace(num_steps=1)

        class runner:  # noqa: N801 - the engine's attribute
            @staticmethod
            def execute_next(*args):
                pass

        def __init__(self):
            self.left, self.seen = 9, 0

        def add_request(self, *args):
            pass

        def has_unfinished(self):
            return self.left > 0

        def step(self):  # 3 s right after an eviction, 1 s otherwise
            now[0] += 3.0 if Evict.reads > self.seen else 1.0
            self.seen = Evict.reads
            self.left -= 1

    monkeypatch.setattr(calibrate.time, "perf_counter", lambda: now[0])
    assert calibrate._decode_step_seconds(Engine(), 1, Evict()) == (1.0, 3.0)
    assert Evict.reads == 4  # before steps 1, 3, 5, 7 of 9
    assert calibrate._decode_step_seconds(Engine(), 1) == (1.0, 1.0)  # no eviction: all steps warm


def test_multi_step_calls_count_each_step_and_evict_before_each(monkeypatch) -> None:
    """A call of several steps counts as that many steps; in a cold call each later step runs after
    the eviction read too, and those reads (inside the timed call) are not counted."""
    now = [0.0]

    class Evict:
        reads = 0

        def sum(self):
            Evict.reads += 1
            now[0] += 100.0  # reading the buffer takes long: it must not show in the times

    class Runner:
        def execute_next(self, *args):
            return None

    class Engine:
        class config:
            max_num_batched_tokens = 10**6

        def __init__(self):
            self.calls, self.runner, self.last_schedule = 0, Runner(), None

        def add_request(self, *args):
            pass

        def has_unfinished(self):
            return self.calls < 5

        def step(self):  # prefill, then calls of 4 steps: 1 s each step
            self.calls += 1
            n = 1 if self.calls == 1 else 4
            for _ in range(n - 1):
                self.runner.execute_next()
            now[0] += n * 1.0
            self.last_schedule = SimpleNamespace(num_steps=n)

    monkeypatch.setattr(calibrate.time, "perf_counter", lambda: now[0])
    eng = Engine()
    assert calibrate._decode_step_seconds(eng, 1, Evict()) == (1.0, 1.0)
    assert Evict.reads == 2 * (1 + 3)  # cold calls 2 and 4: before the call, and before its 3 later steps
    assert "execute_next" not in vars(eng.runner)  # the runner's own method again

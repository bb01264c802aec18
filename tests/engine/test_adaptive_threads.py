"""The opt-in thread tuner: it follows the measured decode step time, and only decode-only steps."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from strata.engine import adaptive_threads
from strata.engine.adaptive_threads import TRIAL_STEPS, AdaptiveThreads


class FakeEngine:
    """stage_seconds / last_schedule as LLMEngine exposes them; step time by thread count."""

    def __init__(self, step_s: dict[int, float]) -> None:
        self.step_s = step_s
        self.stage_seconds = {"forward": 0.0}
        self.last_schedule = None

    def step(self, tuner: AdaptiveThreads, tokens_per_seq: int = 1) -> None:
        self.stage_seconds["forward"] += self.step_s[torch.get_num_threads()]
        seqs = [SimpleNamespace(num_tokens=tokens_per_seq)]
        self.last_schedule = SimpleNamespace(scheduled=seqs, num_tokens=tokens_per_seq * len(seqs))
        tuner(self)


@pytest.fixture
def two_threads(monkeypatch):
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    clock = [0.0]
    monkeypatch.setattr(adaptive_threads.time, "monotonic", lambda: clock[0])
    yield clock
    torch.set_num_threads(before)


def _run(engine, tuner, clock, steps, **kw):
    for _ in range(steps):
        clock[0] += 0.1
        engine.step(tuner, **kw)


def test_contention_moves_to_fewer_threads_and_back(two_threads):
    clock = two_threads
    engine = FakeEngine({2: 0.080, 1: 0.030})  # a competing process stalls the 2-thread barrier
    tuner = AdaptiveThreads(max_threads=2)
    _run(engine, tuner, clock, 40)
    assert tuner.current == 1 and torch.get_num_threads() == 1
    engine.step_s = {2: 0.020, 1: 0.035}  # the machine is quiet again: the probe upward wins
    _run(engine, tuner, clock, 60)
    assert tuner.current == 2 and torch.get_num_threads() == 2 and tuner.switches == 2


def test_quiet_machine_keeps_the_configured_count(two_threads):
    clock = two_threads
    engine = FakeEngine({2: 0.020, 1: 0.035})
    tuner = AdaptiveThreads(max_threads=2)
    _run(engine, tuner, clock, 100)
    assert tuner.current == 2 and tuner.switches == 0
    trials = [n for n, t in tuner.samples.items() if t]
    assert trials and torch.get_num_threads() in (1, 2)  # at most a TRIAL_STEPS probe in flight


def test_prefill_steps_are_not_timed(two_threads):
    clock = two_threads
    engine = FakeEngine({2: 0.080, 1: 0.030})
    tuner = AdaptiveThreads(max_threads=2)
    _run(engine, tuner, clock, 10 * TRIAL_STEPS, tokens_per_seq=64)
    assert tuner.samples == {} and tuner.current == 2


def test_off_unless_asked(monkeypatch):
    monkeypatch.delenv("STRATA_ADAPTIVE_THREADS", raising=False)
    assert not adaptive_threads.enabled()
    monkeypatch.setenv("STRATA_ADAPTIVE_THREADS", "1")
    assert adaptive_threads.enabled()

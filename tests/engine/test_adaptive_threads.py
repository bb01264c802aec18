"""The thread tuner: it follows the measured decode step time, only decode-only steps, changes only
the numba kernels' thread cap (never torch's pool), and probes rarely on a quiet machine."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from strata.kernels import cpu_gemv
from strata.platform import adaptive_threads
from strata.platform.adaptive_threads import MAX_PERIOD_S, TRIAL_STEPS, AdaptiveThreads


class FakeEngine:
    """stage_seconds / last_schedule as LLMEngine exposes them; step time by kernel thread count."""

    def __init__(self, step_s: dict[int, float]) -> None:
        self.step_s = step_s
        self.stage_seconds = {"forward": 0.0}
        self.last_schedule = None

    def step(self, tuner: AdaptiveThreads, tokens_per_seq: int = 1, num_steps: int = 1, slow: float = 1.0) -> None:
        """One engine call: `num_steps` decode steps (multi-step decode), `slow` x their usual time."""
        self.stage_seconds["forward"] += self.step_s[tuner.policy.kernel_threads] * num_steps * slow
        seqs = [SimpleNamespace(num_tokens=tokens_per_seq)]
        self.last_schedule = SimpleNamespace(scheduled=seqs, num_tokens=tokens_per_seq * len(seqs),
                                             num_steps=num_steps)
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
    assert tuner.current == 1 and tuner.policy.kernel_threads == 1
    assert torch.get_num_threads() == 2  # torch's pool (prefill GEMMs) is never touched
    engine.step_s = {2: 0.020, 1: 0.035}  # the machine is quiet again: the probe upward wins
    _run(engine, tuner, clock, 60)
    assert tuner.current == 2 and tuner.policy.kernel_threads == 2 and tuner.switches == 2


def test_a_slowdown_triggers_a_trial_at_once(two_threads):
    clock = two_threads
    engine = FakeEngine({2: 0.020, 1: 0.035})
    tuner = AdaptiveThreads(max_threads=2)
    _run(engine, tuner, clock, 400)  # quiet: the probe period backs off to its maximum
    assert tuner.period == MAX_PERIOD_S and tuner.current == 2
    engine.step_s = {2: 0.080, 1: 0.030}  # another process arrives
    _run(engine, tuner, clock, 3 * TRIAL_STEPS)  # long before the next periodic probe
    assert tuner.current == 1


def test_quiet_machine_keeps_the_configured_count_and_probes_rarely(two_threads):
    clock = two_threads
    engine = FakeEngine({2: 0.020, 1: 0.035})
    tuner = AdaptiveThreads(max_threads=2)
    _run(engine, tuner, clock, 6000)  # 600 s of steps
    assert tuner.current == 2 and tuner.switches == 0
    assert 1 <= tuner.trials <= 600 / MAX_PERIOD_S + 5  # a fixed 2 s period would be ~300 probes
    assert tuner.policy.kernel_threads in (1, 2)  # at most a TRIAL_STEPS probe in flight


def test_a_trial_that_starts_far_slower_is_given_up_after_one_call(two_threads):
    """On a quiet machine the 1-thread trial's first call is ~2x slower: the trial ends there (one
    slow call, not TRIAL_STEPS of them) and the probe period still backs off."""
    clock = two_threads
    engine = FakeEngine({2: 0.020, 1: 0.040})
    tuner = AdaptiveThreads(max_threads=2)
    while tuner.trial is None:
        clock[0] += 0.1
        engine.step(tuner)
    assert tuner.policy.kernel_threads == 1
    engine.step(tuner)
    assert tuner.trial is None and tuner.given_up == 1 and tuner.current == 2 and tuner.policy.kernel_threads == 2
    assert tuner.period == 2 * adaptive_threads.PERIOD_S
    engine.step_s = {2: 0.020, 1: 0.024}  # a trial that is not clearly worse goes on measuring
    clock[0] += tuner.period + 1
    _run(engine, tuner, clock, TRIAL_STEPS + 1)  # the current count's window, then a trial call
    assert tuner.trials == 2 and tuner.trial == 1 and tuner.given_up == 1


def test_prefill_steps_are_not_timed(two_threads):
    clock = two_threads
    engine = FakeEngine({2: 0.080, 1: 0.030})
    tuner = AdaptiveThreads(max_threads=2)
    _run(engine, tuner, clock, 10 * TRIAL_STEPS, tokens_per_seq=64)
    assert tuner.samples == {} and tuner.current == 2


def test_on_unless_turned_off(monkeypatch):
    monkeypatch.delenv("STRATA_ADAPTIVE_THREADS", raising=False)
    assert adaptive_threads.enabled()
    monkeypatch.setenv("STRATA_ADAPTIVE_THREADS", "0")
    assert not adaptive_threads.enabled()


def test_the_kernel_cap_does_not_change_results(two_threads):
    """Why it may be on by default: a decode GEMV gives the same bits on 1 and 2 threads."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 200, generator=g), torch.randn(301, 200, generator=g)
    with cpu_gemv.thread_cap(1):
        one = cpu_gemv.gemv(x, w)
    with cpu_gemv.thread_cap(2):
        two = cpu_gemv.gemv(x, w)
    assert torch.equal(one, two)


def test_an_engine_does_not_leak_its_kernel_cap(tiny_models, llm_factory, prompt_of, monkeypatch):
    """The cap is process-wide: the engine applies it for its own steps only (the planner's
    measurements and other engines in the process run uncapped)."""
    from strata import SamplingParams

    monkeypatch.delenv("STRATA_ADAPTIVE_THREADS", raising=False)
    llm = llm_factory(tiny_models["llama"], num_threads=2)
    tuner = llm.engine.policy.tuner(AdaptiveThreads)
    assert tuner is not None and cpu_gemv.THREAD_CAP.get() is None
    seen = []
    monkeypatch.setattr(cpu_gemv, "sync_threads", lambda real=cpu_gemv.sync_threads: seen.append(
        cpu_gemv.THREAD_CAP.get()) or real())
    llm.generate([{"prompt_token_ids": prompt_of(1, 6)}], SamplingParams(max_tokens=4, temperature=0.0),
                 use_tqdm=False)
    assert seen and set(seen) == {tuner.cap}  # every kernel of its steps ran under its cap
    assert cpu_gemv.THREAD_CAP.get() is None  # and nothing is left behind


def test_multi_step_calls_are_one_sample_each(two_threads):
    """With 8 decode steps a call, one slow call among them does not start a trial (a window spans
    MIN_CALLS calls, median of their per-step means), a trial lasts MIN_CALLS calls, and contention
    still moves the count down."""
    clock = two_threads
    engine = FakeEngine({2: 0.010, 1: 0.012})
    tuner = AdaptiveThreads(max_threads=2)
    _run(engine, tuner, clock, 4, num_steps=8)
    engine.step(tuner, num_steps=8, slow=2.0)  # one noisy call
    assert tuner.trials == 0
    engine.step_s = {2: 0.040, 1: 0.012}  # contention
    calls = 0
    while tuner.trial is None and calls < 10:
        clock[0] += 0.1
        engine.step(tuner, num_steps=8)
        calls += 1
    assert tuner.trial == 1
    for _ in range(adaptive_threads.MIN_CALLS - 1):
        engine.step(tuner, num_steps=8)
        assert tuner.trial == 1  # still measuring
    engine.step(tuner, num_steps=8)
    assert tuner.trial is None and tuner.current == 1

"""On by default on CPU (STRATA_ADAPTIVE_THREADS=0 turns it off): the decode kernels' thread count
follows measured decode steps.

On a shared machine a thread of a statically split kernel that loses its core stalls the step at
the kernel's barrier: on the 2-core Zen 4 dev VM, with one busy process beside it, a 2-thread GEMV
ran 3.5-7x slower than on a quiet machine, a 1-thread one 1.1x (its core stays free). So the
engine now and then runs TRIAL_STEPS decode-only steps on another thread count (one fewer, or back
up to the configured count) and keeps whichever had the lower median forward time.

When: a trial starts as soon as the current count's recent steps run DEGRADED x slower than its
best recent median (another process arrived), and otherwise on a backing-off period, PERIOD_S
doubling after every trial that changed nothing up to MAX_PERIOD_S, so a quiet machine pays a
probe about every half minute, not every 2 s; a trial whose first call already runs GIVE_UP x
slower than the current count is ended there (on a quiet machine: one slow call, not 6+ steps).

What it changes: only the numba kernels' thread cap (the engine's StepPolicy.kernel_threads, which
the engine applies around its own steps: kernels/cpu_gemv.THREAD_CAP), never torch's pool. Those kernels' results do not depend on the thread count (each output row is one
thread's sequential sum), so outputs stay bitwise reproducible; torch's own ops (the prefill GEMMs,
whose reduction splits would change) keep the configured count.
"""

from __future__ import annotations

import logging
import statistics
import time

from strata.platform.policy import StepPolicy
from strata.settings import SETTINGS

logger = logging.getLogger(__name__)

ENV = "STRATA_ADAPTIVE_THREADS"
PERIOD_S = 2.0
MAX_PERIOD_S = 32.0
TRIAL_STEPS = 6
MIN_CALLS = 3  # multi-step decode: a window also spans this many engine steps (a call's mean is one sample)
SWITCH_MARGIN = 1.15  # the trial must be this much faster to be kept
DEGRADED = 1.3  # recent median this much above the best recent median: try another count now
# A trial whose first call is this much slower per step than the current count's median is given
# up there: it cannot win, and finishing it cost 6+ slow steps a probe (a 1-thread trial on a quiet
# 2-core Zen 5 ran qwen-0.5b's batch-16 step ~2x slower; the first ~15 s of an engine, with probes
# 2 and 4 s apart, ran 8-12% below its later rate).
GIVE_UP = 1.3


def enabled() -> bool:
    return SETTINGS.adaptive_threads


class AdaptiveThreads:
    """A tuner of the engine's StepPolicy: times decode-only steps per thread count and sets
    policy.kernel_threads."""

    def __init__(self, max_threads: int, policy: StepPolicy | None = None) -> None:
        self.policy = policy if policy is not None else StepPolicy()
        self.max_threads = max_threads
        self.current = max_threads
        self.trial: int | None = None
        self.samples: dict[int, list[float]] = {}  # thread count -> recent per-step seconds, a call each
        self._steps: dict[int, list[int]] = {}  # the decode steps of each of those calls
        self.best: float | None = None  # best median of the current count since the last decision
        self.period = PERIOD_S
        self.next_trial = time.monotonic() + self.period
        self._forward = None
        self.switches = 0
        self.trials = 0
        self.given_up = 0  # trials ended after their first call (GIVE_UP)
        self.policy.kernel_threads = max_threads

    @property
    def cap(self) -> int:
        """The kernel thread count this engine's next step runs with (a trial's, or the kept one)."""
        return self.trial if self.trial is not None else self.current

    def __call__(self, engine) -> None:
        forward = engine.stage_seconds["forward"]
        last, self._forward = self._forward, forward
        out = engine.last_schedule
        decode_only = out is not None and out.scheduled and out.num_tokens == len(out.scheduled)
        if last is None or not decode_only:
            return
        n = self.trial if self.trial is not None else self.current
        times = self.samples.setdefault(n, [])
        # one sample per call, its mean per decode step (multi-step decode runs several a call);
        # a window holds the last TRIAL_STEPS steps, and at least MIN_CALLS calls
        times.append((forward - last) / out.num_steps)
        steps = self._steps.setdefault(n, [])
        steps.append(out.num_steps)
        while len(times) > MIN_CALLS and sum(steps[1:]) >= TRIAL_STEPS:
            del times[0], steps[0]
        full = sum(steps) >= TRIAL_STEPS and len(times) >= MIN_CALLS
        if self.trial is not None:
            current = self.samples.get(self.current)
            if len(times) == 1 and current and times[0] > GIVE_UP * statistics.median(current):
                self.given_up += 1
                self._end_trial(keep=False)
            elif full:
                self._decide()
            return
        if not full:
            return
        median = statistics.median(times)
        self.best = median if self.best is None else min(self.best, median)
        if time.monotonic() >= self.next_trial or median > DEGRADED * self.best:
            self._start_trial()

    def _start_trial(self) -> None:
        other = self.current + 1 if self.current < self.max_threads else self.current - 1
        if other < 1:
            return
        self.trial = other
        self.trials += 1
        self._clear(other)
        self.policy.kernel_threads = other

    def _clear(self, n: int) -> None:
        self.samples[n], self._steps[n] = [], []

    def _decide(self) -> None:
        trial, cur = self.trial, self.current
        t_trial = statistics.median(self.samples[trial])
        t_cur = statistics.median(self.samples[cur])
        keep = t_trial * SWITCH_MARGIN < t_cur or (trial > cur and t_trial <= t_cur)
        if keep:
            logger.info("adaptive threads: %d -> %d decode kernel threads (step %.1f -> %.1f ms)", cur, trial,
                        t_cur * 1e3, t_trial * 1e3)
        self._end_trial(keep)

    def _end_trial(self, keep: bool) -> None:
        trial, cur = self.trial, self.current
        if keep:
            self.current = trial
            self.switches += 1
            self.period = PERIOD_S
        else:
            self.period = min(MAX_PERIOD_S, self.period * 2)
        self.policy.kernel_threads = self.current
        self._clear(cur if self.current == trial else trial)
        self._clear(self.current)  # the next best is measured afresh
        self.best = None
        self.trial = None
        self.next_trial = time.monotonic() + self.period

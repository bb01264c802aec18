"""Opt-in (STRATA_ADAPTIVE_THREADS=1, CPU): pick the compute thread count by measured decode steps.

On a shared machine a thread of a statically split kernel that loses its core stalls the step at
the kernel's barrier: on the 2-core Zen 4 dev VM, with one busy process beside it, a 2-thread GEMV
ran 3.5-7x slower than on a quiet machine, a 1-thread one 1.1x (its core stays free). So every
PERIOD_S the engine runs TRIAL_STEPS decode-only steps on another thread count (one fewer, or
back up to the configured count) and keeps whichever had the lower median forward time.
Off by default: thread counts change torch's reduction splits, so outputs are then not bitwise
reproducible run to run (the numba kernels' are: each output row is one thread's dot product).
"""

from __future__ import annotations

import logging
import os
import statistics
import time

import torch

logger = logging.getLogger(__name__)

ENV = "STRATA_ADAPTIVE_THREADS"
PERIOD_S = 2.0
TRIAL_STEPS = 6
SWITCH_MARGIN = 1.15  # the trial must be this much faster to be kept


def enabled() -> bool:
    return os.environ.get(ENV, "") not in ("", "0")


class AdaptiveThreads:
    """A step observer (engine.step_observers): times decode-only steps per thread count."""

    def __init__(self, max_threads: int) -> None:
        self.max_threads = max_threads
        self.current = torch.get_num_threads()
        self.trial: int | None = None
        self.samples: dict[int, list[float]] = {}
        self.next_trial = time.monotonic() + PERIOD_S
        self._forward = None
        self.switches = 0

    def __call__(self, engine) -> None:
        forward = engine.stage_seconds["forward"]
        last, self._forward = self._forward, forward
        out = engine.last_schedule
        decode_only = out is not None and out.scheduled and out.num_tokens == len(out.scheduled)
        if last is None or not decode_only:
            return
        n = torch.get_num_threads()
        times = self.samples.setdefault(n, [])
        times.append(forward - last)
        del times[:-TRIAL_STEPS]
        if self.trial is not None:
            if len(self.samples[self.trial]) >= TRIAL_STEPS:
                self._decide()
            return
        if time.monotonic() >= self.next_trial and len(times) >= TRIAL_STEPS:
            other = self.current - 1 if self.current > 1 else None
            if self.current < self.max_threads:
                other = self.current + 1
            if other is not None:
                self.trial = other
                self.samples[other] = []
                torch.set_num_threads(other)

    def _decide(self) -> None:
        trial, cur = self.trial, self.current
        t_trial = statistics.median(self.samples[trial])
        t_cur = statistics.median(self.samples[cur])
        if t_trial * SWITCH_MARGIN < t_cur or (trial > cur and t_trial <= t_cur):
            logger.info("adaptive threads: %d -> %d (decode step %.1f -> %.1f ms)", cur, trial,
                        t_cur * 1e3, t_trial * 1e3)
            self.current = trial
            self.switches += 1
        torch.set_num_threads(self.current)
        self.samples[cur if self.current == trial else trial] = []
        self.trial = None
        self.next_trial = time.monotonic() + PERIOD_S

"""The engine's run-time decisions that follow measurement, in one object the engine owns.

    lookahead       decode steps one scheduler call may run (multi-step decode)
    prefill_cap     prompt tokens a step may add while sequences decode (decode-first), None: no cap
    kernel_threads  the decode kernels' thread cap for the engine's steps, None: torch's count

The platform builds it with its tuners (build_engine: the CPU platform's multi-step count,
adaptive threads and, in `strata serve`, the adaptive prefill cap; the GPU platform's fixed
values); the engine hands it every finished step (`observe`) and runs each step inside `step()`
(the thread cap, for its own steps only); the scheduler reads lookahead and prefill_cap. Tuners
write here and nowhere else.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

from strata.kernels import cpu_gemv


class StepPolicy:
    def __init__(self, lookahead: int = 1, prefill_cap: int | None = None, kernel_threads: int | None = None) -> None:
        self.lookahead = lookahead
        self.prefill_cap = prefill_cap
        self.kernel_threads = kernel_threads
        self.tuners: list[Callable] = []  # callables(engine) after every step: they set the fields above

    def observe(self, engine) -> None:
        """After a step: each tuner reads the engine's step clocks and last schedule."""
        for tune in self.tuners:
            tune(engine)

    def step(self) -> contextlib.AbstractContextManager:
        """One engine step: its kernels run under kernel_threads (this context only; None: as they are)."""
        return contextlib.nullcontext() if self.kernel_threads is None else cpu_gemv.thread_cap(self.kernel_threads)

    def tuner(self, kind: type):
        """The tuner of class `kind`, or None."""
        return next((t for t in self.tuners if isinstance(t, kind)), None)

    def describe(self) -> str:
        names = ", ".join(type(t).__name__ for t in self.tuners) or "none"
        return f"lookahead {self.lookahead}, prefill cap {self.prefill_cap}, kernel threads {self.kernel_threads}; tuners: {names}"

"""The kernel dispatch point: which kernels the current thread's calls take, and how they show up.

The hand-placed CPU kernels (numba) are chosen at run time from shapes and dtypes by small
predicates (cpu_gemv.few_fp32_rows / usable, cpu_norm.usable, cpu_rope.usable, the fused decode
of the cpu attention backend, the quantised SwiGLU epilogue of kernels/linear.py). Two things
change how those calls go, and both live in one frozen `KernelMode` held in a ContextVar, so a
change is local to the thread (and context) that makes it; nothing is patched:

- `fast_paths` (default on): take the hand-placed kernels where their preconditions hold. The FX
  tracer of graph/fusion.py turns it off (`reference_kernels()`): every predicate answers False
  before it touches its arguments (fx Proxies while tracing), so the traced graph holds the torch
  reference ops its fusion patterns describe.
- `named` (default off): every numba entry point decorated with `kernel(...)` runs inside a
  `record_function("numba::<name>")` range, so profiles show it as an op (`named_kernels()`, used
  by kernels/profile.py's profile_decode and the analyzer).

Cost when nothing is on: one ContextVar.get per predicate or kernel call.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TypeVar

from torch.autograd.profiler import record_function

F = TypeVar("F", bound=Callable)


@dataclass(frozen=True)
class KernelMode:
    fast_paths: bool = True  # take the hand-placed CPU kernels where their preconditions hold
    named: bool = False  # wrap each numba kernel call in record_function("numba::<name>")


DEFAULT = KernelMode()
# The kernels read it directly (`KERNEL_MODE.get().fast_paths`: one lookup per call); change it
# only through kernel_mode() / reference_kernels() / named_kernels(), which restore it.
KERNEL_MODE: ContextVar[KernelMode] = ContextVar("strata_kernel_mode", default=DEFAULT)


def current() -> KernelMode:
    """This context's kernel mode."""
    return KERNEL_MODE.get()


def fast_paths() -> bool:
    """Whether the hand-placed CPU kernels may be taken (every kernel predicate asks this first)."""
    return KERNEL_MODE.get().fast_paths


@contextlib.contextmanager
def kernel_mode(**changes: bool) -> Iterator[KernelMode]:
    """For its duration, this context's mode with `changes` applied (nests; restored on exit)."""
    mode = dataclasses.replace(KERNEL_MODE.get(), **changes)
    token = KERNEL_MODE.set(mode)
    try:
        yield mode
    finally:
        KERNEL_MODE.reset(token)


def reference_kernels() -> contextlib.AbstractContextManager[KernelMode]:
    """Kernel predicates answer False: the torch reference paths run (the FX tracer uses this)."""
    return kernel_mode(fast_paths=False)


def named_kernels() -> contextlib.AbstractContextManager[KernelMode]:
    """Each numba kernel call runs inside a `numba::<name>` record_function range (profiling)."""
    return kernel_mode(named=True)


def kernel(name: str) -> Callable[[F], F]:
    """Decorator for a numba kernel entry point: named `numba::<name>` while `named` is on.

    The undecorated function stays reachable as `__wrapped_kernel__`, the label as `kernel_name`.
    """
    label = f"numba::{name}"

    def decorate(fn: F) -> F:
        @functools.wraps(fn)
        def entry(*args, **kwargs):
            if KERNEL_MODE.get().named:
                with record_function(label):
                    return fn(*args, **kwargs)
            return fn(*args, **kwargs)

        entry.__wrapped_kernel__ = fn
        entry.kernel_name = label
        return entry  # type: ignore[return-value]

    return decorate

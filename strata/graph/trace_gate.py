"""A shared/exclusive gate between model forwards and FX tracing.

torch.fx's symbolic tracer patches torch.nn.Module.__call__ (and the globals of functions
registered with torch.fx.wrap) process-wide while it traces, so a forward running in another
thread at that moment would have its module calls recorded into the graph being traced (and get
fx Proxies back). Forwards therefore hold `TRACE_GATE` shared (CausalLM.forward, FusedStep.__call__,
DecodeCapture.__call__), and graph/fusion.py holds it exclusively while it traces and rewrites:
a trace waits for running forwards to finish, and forwards that start meanwhile wait for the trace.

Shared holds are re-entrant per thread (a fused step inside a capture, a forward inside a forward),
and the thread holding the gate exclusively may run forwards (the tracer calls the model's forward
itself). Waiting traces take precedence over new forwards, so a loop of forwards cannot starve one.
Tracing from inside a forward would wait for itself, and raises instead.
"""

from __future__ import annotations

import threading


class _Hold:
    __slots__ = ("_enter", "_exit")

    def __init__(self, enter, exit_) -> None:
        self._enter, self._exit = enter, exit_

    def __enter__(self) -> None:
        self._enter()

    def __exit__(self, *exc) -> None:
        self._exit()


class TraceGate:
    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._readers = 0  # threads holding it shared (outermost holds, not counting the writer's)
        self._writer: int | None = None  # thread ident holding it exclusively
        self._writer_depth = 0
        self._writers_waiting = 0
        self._local = threading.local()  # .depth: this thread's shared nesting, .counted: in _readers
        self._shared = _Hold(self.acquire_shared, self.release_shared)
        self._exclusive = _Hold(self.acquire_exclusive, self.release_exclusive)

    def shared(self) -> _Hold:
        """`with gate.shared():` around a forward."""
        return self._shared

    def exclusive(self) -> _Hold:
        """`with gate.exclusive():` around FX tracing."""
        return self._exclusive

    def acquire_shared(self) -> None:
        local = self._local
        depth = getattr(local, "depth", 0)
        if depth:
            local.depth = depth + 1
            return
        if self._writer == threading.get_ident():  # the tracing thread's own forward
            local.depth, local.counted = 1, False
            return
        with self._cond:
            while self._writer is not None or self._writers_waiting:
                self._cond.wait()
            self._readers += 1
        local.depth, local.counted = 1, True

    def release_shared(self) -> None:
        local = self._local
        local.depth -= 1
        if local.depth or not local.counted:
            return
        with self._cond:
            self._readers -= 1
            if not self._readers:
                self._cond.notify_all()

    def acquire_exclusive(self) -> None:
        me = threading.get_ident()
        if self._writer == me:
            self._writer_depth += 1
            return
        if getattr(self._local, "depth", 0):
            raise RuntimeError(
                "FX tracing (graph/fusion.py) from inside a model forward would wait for that forward "
                "to finish; trace before running the model, or from another thread"
            )
        with self._cond:
            self._writers_waiting += 1
            try:
                while self._writer is not None or self._readers:
                    self._cond.wait()
            except BaseException:  # interrupted: let the forwards waiting behind this trace go
                self._writers_waiting -= 1
                self._cond.notify_all()
                raise
            self._writers_waiting -= 1
            self._writer, self._writer_depth = me, 1

    def release_exclusive(self) -> None:
        with self._cond:
            self._writer_depth -= 1
            if not self._writer_depth:
                self._writer = None
                self._cond.notify_all()


TRACE_GATE = TraceGate()

"""Hotspot report of the decode loop: the top operators/kernels by self time, and host overhead.

`profile_decode` prefills a batch unprofiled, then runs every remaining (decode) step of the engine
under torch.profiler, each step inside a `strata::decode_step` range, and reads the event tree:

- An *operator/kernel event* is any profiler event inside a step range except annotations that
  only group work (the step range itself, torch.compile's "Torch-Compiled Region" /
  "CompiledFunction" ranges, "## ... ##" markers). That is: aten ops, the strata:: custom ops of
  graph/fusion.py, and the numba kernels, which appear as `numba::<kernel>` ranges (the engine calls
  them as plain Python functions; under `named_kernels()` each entry point, decorated with
  kernels/dispatch.kernel, runs inside a record_function range of that name).
- *Self time* of an event: its duration minus its children's, so self times never double count.
- Figures are per decode step: an engine.step() call that runs several (multi-step decode,
  platform/multi_step.py) counts as that many, so a step's host overhead includes its share of the
  per-call work.
- On CPU, *step time* is the wall time of the step ranges (engine.step(): schedule, forward,
  sample, outputs), summed over the profiled steps, and
      host overhead = step time - sum of the self times of all operator/kernel events in the steps,
  i.e. the part of the step spent in Python and framework glue outside any operator: module calls,
  dispatch checks, building the step's tensors, scheduling and bookkeeping. Shares are of step time.
- On CUDA the kernels are the device's kernel events (their device time); host overhead is step
  time minus that sum (the time the GPU is not running a kernel of the step).

The profiler adds a few microseconds to every event, so the profiled step is slower than an
unprofiled one; the report gives both step times where the caller knows the unprofiled one.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field

import torch
from torch.autograd.profiler import record_function

from strata.kernels import cpu_attention, cpu_decode_layer, cpu_gemv, cpu_norm, cpu_quant, cpu_rope
from strata.kernels.dispatch import named_kernels
from strata.text_table import print_table

__all__ = ["HotspotRow", "ProfileReport", "analyze", "named_kernels", "profile_decode", "quiet_profile"]

STEP = "strata::decode_step"
_GROUPING = ("Torch-Compiled Region", "CompiledFunction", "## ", "ProfilerStep", STEP)


def _kernel_entry_points() -> list[tuple[object, str, str]]:
    """(module, function, range name) of every numba kernel entry point: each is decorated with
    kernels/dispatch.kernel, which names its calls while `named_kernels()` is on."""
    return [
        (cpu_gemv, "gemv", "numba::gemv"),
        (cpu_gemv, "gemv_swiglu", "numba::gemv_swiglu"),
        (cpu_norm, "add_rms_norm", "numba::add_rms_norm"),
        (cpu_rope, "rope_and_store", "numba::rope_and_store"),
        (cpu_attention, "paged_decode", "numba::paged_decode"),
        (cpu_quant, "gemv", "numba::quant_gemv"),
        (cpu_quant, "gemv_swiglu", "numba::quant_gemv_swiglu"),
        (cpu_quant, "matmul", "numba::quant_matmul"),
        (cpu_decode_layer, "decode_layers", "numba::decode_layer"),
    ]


@dataclass
class HotspotRow:
    name: str
    calls_per_step: float
    self_ms_per_step: float
    share: float  # of step time


@dataclass
class ProfileReport:
    device: str
    steps: int  # decode steps profiled
    step_ms: float  # mean wall time of a profiled step
    kernel_ms: float  # mean sum of operator/kernel self times per step
    host_overhead_ms: float
    host_overhead_share: float
    rows: list[HotspotRow] = field(default_factory=list)
    unprofiled_step_ms: float | None = None
    trace: str | None = None
    calls: int | None = None  # engine.step() calls they ran in (multi-step decode: several steps a call)

    def to_dict(self) -> dict:
        return asdict(self)

    def format(self) -> str:
        from io import StringIO

        buf = StringIO()
        calls = "" if self.calls in (None, self.steps) else f" in {self.calls} scheduler calls"
        print(f"decode hotspots ({self.steps} profiled steps{calls} on {self.device}; self time per step)", file=buf)
        print_table(
            ["operator/kernel", "calls/step", "self ms/step", "share of step"],
            [[r.name, r.calls_per_step, r.self_ms_per_step, f"{r.share:.1%}"] for r in self.rows],
            file=buf,
        )
        unprof = "" if self.unprofiled_step_ms is None else f" ({self.unprofiled_step_ms:.2f} ms unprofiled)"
        print(
            f"step {self.step_ms:.2f} ms profiled{unprof}; operators/kernels {self.kernel_ms:.2f} ms; "
            f"host overhead {self.host_overhead_ms:.2f} ms = {self.host_overhead_share:.1%} of step time\n"
            "host overhead = step wall time - sum of self times of all operator/kernel events in the "
            "step (time outside any op: Python, dispatch, scheduling, bookkeeping)",
            file=buf,
        )
        if self.trace:
            print(f"chrome trace: {self.trace}", file=buf)
        return buf.getvalue().rstrip("\n")


def _is_grouping(name: str) -> bool:
    return name.startswith(_GROUPING)


def _walk(ev) -> Iterator:
    for c in ev.cpu_children:
        yield c
        yield from _walk(c)


def analyze(events, device: str, top: int = 5, decode_steps: int | None = None) -> ProfileReport:
    """The report from a profile's events (FunctionEvents with their parent/child links), per decode
    step: `decode_steps` of them in the step ranges (multi-step decode runs several in one engine
    call; None: one per range)."""
    steps = [e for e in events if e.name == STEP]
    if not steps:
        raise ValueError(f"no {STEP} ranges in the profile")
    wall = sum(e.cpu_time_total for e in steps)  # microseconds
    by_name: dict[str, list[float]] = {}
    if device == "cuda":
        lo_hi = [(e.time_range.start, e.time_range.end) for e in steps]
        for e in events:
            if e.device_type == torch.autograd.DeviceType.CUDA and any(lo <= e.time_range.start <= hi for lo, hi in lo_hi):
                by_name.setdefault(e.name, []).append(e.self_device_time_total)
    else:
        for s in steps:
            for e in _walk(s):
                if not _is_grouping(e.name):
                    by_name.setdefault(e.name, []).append(e.self_cpu_time_total)
    kernel = sum(sum(v) for v in by_name.values())
    n = decode_steps or len(steps)
    ranked = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]
    rows = [HotspotRow(name, len(v) / n, sum(v) / n / 1e3, sum(v) / wall if wall else 0.0) for name, v in ranked]
    host = max(0.0, wall - kernel)
    return ProfileReport(
        device=device, steps=n, step_ms=wall / n / 1e3, kernel_ms=kernel / n / 1e3,
        host_overhead_ms=host / n / 1e3, host_overhead_share=host / wall if wall else 0.0, rows=rows,
        calls=len(steps),
    )


def profile_decode(engine, prompts: list[list[int]], params, top: int = 5, trace: str | None = None) -> ProfileReport:
    """Prefill `prompts` unprofiled, then profile every decode step until they finish."""
    base = f"profile-{engine.num_steps}-"
    ids = [f"{base}{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts):
        engine.validate(0, prompt, params)
        engine.add_request(rid, None, prompt, params)
    try:
        while any(r in engine.requests and engine.requests[r].timeline.first_token is None for r in ids):
            engine.step()
        device = "cuda" if str(engine.config.device).startswith("cuda") else "cpu"
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        decode_steps = 0
        with named_kernels(), quiet_profile(torch.profiler.profile(activities=activities)) as prof:
            while engine.has_unfinished():
                with record_function(STEP):
                    engine.step()
                decode_steps += engine.last_schedule.num_steps
                if device == "cuda":
                    torch.cuda.synchronize()
    except BaseException:
        for rid in ids:
            engine.abort(rid)
        raise
    report = analyze(prof.events(), device, top, decode_steps)
    if trace:
        prof.export_chrome_trace(trace)
        report.trace = trace
    return report


@contextlib.contextmanager
def _without_kineto_lines() -> Iterator[None]:
    """Run the block with file descriptor 2 captured; write back every line but kineto's
    `USDT: ... profiler_start/stop` notes (printed from C++, so only the descriptor can catch them)."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            kept = [line for line in tmp.read().splitlines(keepends=True) if not line.startswith(b"USDT:")]
            if kept:
                os.write(2, b"".join(kept))


@contextlib.contextmanager
def quiet_profile(prof):
    """A torch.profiler.profile entered and left without kineto's start/stop lines on the terminal
    (only its start and stop are captured: the profiled work's own output passes straight through)."""
    with _without_kineto_lines():
        prof.__enter__()
    try:
        yield prof
    finally:
        with _without_kineto_lines():
            prof.__exit__(None, None, None)

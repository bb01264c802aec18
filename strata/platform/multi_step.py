"""Multi-step decode: how many decode steps one scheduler call runs (vLLM's num_scheduler_steps).

A decode step's host work around the forward (schedule, build the step's tensors, wrap outputs)
is paid once per scheduler call. On CPU it is 0.2-0.4 ms of a 4-9 ms smol-135m step (issue 16's
host overhead), so while every running sequence decodes and nobody waits, the engine runs several
decode steps per call: Scheduler._steps_ahead reserves their blocks, the runner only moves the
positions (ModelRunner.execute_next), and every token is still sampled, stop-checked and
detokenised as it comes (LLMEngine._more_steps). The tokens are the same as one step per call;
they reach the caller in bursts.

`num_scheduler_steps` fixes the count (1 = off). Unset, on CPU, a tuner of the engine's StepPolicy
(platform/policy.py) sizes it from the engine's own decode steps: as many as fit BURST_S at the measured per-step time, at most
MAX_STEPS, so a stream's tokens never arrive more than ~BURST_S apart on account of it, and a
request arriving mid-burst waits at most that long for its prefill. GPU steps (CUDA graphs take
the host work off the critical path), compiled decode steps (--compile: graph capture is the other
answer to host overhead) and tensor-parallel engines (the other ranks follow the scheduler call by
call) run one step per call. STRATA_MULTI_STEP=0 turns the automatic count off.
"""

from __future__ import annotations

from strata.platform.policy import StepPolicy
from strata.settings import SETTINGS

ENV = "STRATA_MULTI_STEP"
BURST_S = 0.05  # longest burst of decode steps; 1/20 s is below what a reader of a stream notices
# 8 amortises ~90% of the host work per call; 16 halves the rest: smol-135m int4 host overhead
# 5.0-5.6% -> 4.5-4.6% of the step (`strata bench latency --profile`, alternated, Zen 5)
MAX_STEPS = 16
ALPHA = 0.3  # EWMA weight of the newest step


def add_tuner(policy: StepPolicy, config, tensor_parallel: bool, speculative: bool) -> AutoSteps | None:
    """Set the policy's lookahead: the configured count, or an AutoSteps tuner where it applies."""
    if config.num_scheduler_steps is not None:
        policy.lookahead = config.num_scheduler_steps
        return None
    if (not SETTINGS.multi_step or config.device != "cpu" or tensor_parallel or speculative
            or config.compile or config.cuda_graphs):
        return None
    tuner = AutoSteps(policy)
    policy.tuners.append(tuner)
    return tuner


class AutoSteps:
    """A tuner of the engine's StepPolicy: per-step seconds of decode-only scheduler calls (their
    wall time over the steps they ran) -> policy.lookahead."""

    def __init__(self, policy: StepPolicy) -> None:
        self.policy = policy
        self.step_s: float | None = None
        self._total: float | None = None

    def __call__(self, engine) -> None:
        total = sum(engine.stage_seconds.values())
        last, self._total = self._total, total
        out = engine.last_schedule
        if last is None or out is None or not out.scheduled or out.num_tokens != len(out.scheduled):
            return  # a step with prompt tokens says nothing about the decode step's time
        s = (total - last) / out.num_steps
        self.step_s = s if self.step_s is None else ALPHA * s + (1 - ALPHA) * self.step_s
        self.policy.lookahead = steps_for(self.step_s)


def steps_for(step_s: float) -> int:
    """The automatic count for decode steps of `step_s` seconds: as many as fit BURST_S, 1..MAX_STEPS."""
    return max(1, min(MAX_STEPS, int(BURST_S / step_s))) if step_s > 0 else MAX_STEPS

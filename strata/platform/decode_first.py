"""The decode-first prefill cap, lowered while the engine's measured steps say it is too large:
`strata serve` on CPU (STRATA_ADAPTIVE_PREFILL_CAP=0 keeps the start-up cap of
platform/cpu.py's CpuPlatform.prefill_cap as it is).

While sequences decode, a step that also prefills makes every one of them wait for its prompt
chunk: their inter-token latency is that mixed step's time. The start-up cap prices the chunk from
one GEMM probe, but a shared VM's speed swings 1.5-2x within minutes: the same near-saturation
serving run (smol-135m, Zen 4, cap 64) read ITL p99 328 ms one evening and 167-252 ms in three runs
the next morning. So a tuner of the engine's StepPolicy learns from the engine's own steps:

  decode_s[rows]  EWMA of decode-only forward seconds, per count of decoding rows
  token_s         EWMA of (a mixed step's seconds - decode_s at its rows) / its prefill tokens

and lowers the cap below the start-up one only while a mixed step at that cap would pass
LIMIT_STEP_S: to (LIMIT_STEP_S - decode_s) / token_s prefill tokens, but never below MIN_SHARE of
the decode step's own time (a large batch whose decode step alone passes the limit still admits
prompts at a steady pace), in whole blocks, at least MIN_BLOCKS. It never raises the cap above the
start-up one: a first version that sized every cap to a 0.17 s step measured worse in one A/B
pair at each rate (near saturation TTFT p50 1.08 vs 0.78 s, goodput 0.30 vs 0.42 req/s, while
the start-up cap kept ITL p99 at 167 ms; over saturation goodput 0.32 vs 0.41), so it only steps
in when the machine slows down.

Only the server's engine has it (LLMEngine(serving=True); it ignores the warm-up's steps): there
arrivals already make every schedule timing-dependent, while offline `LLM.generate` keeps the
start-up cap, so its chunking (and with it the last bits of the prompts' fp32 sums) is the same
from run to run.
"""

from __future__ import annotations

import logging

from strata.platform.policy import StepPolicy
from strata.settings import SETTINGS

logger = logging.getLogger(__name__)

ENV = "STRATA_ADAPTIVE_PREFILL_CAP"
LIMIT_STEP_S = 0.22  # a mixed step; ITL p99 <= 0.25 s leaves room for the front end's jitter
MIN_SHARE = 0.5  # the prefill part may take at least this share of the decode part's time
MIN_BLOCKS = 2
ALPHA = 0.3  # EWMA weight of the newest step


def enabled() -> bool:
    return SETTINGS.adaptive_prefill_cap


def _ewma(old: float | None, new: float) -> float:
    return new if old is None else old + ALPHA * (new - old)


def add_tuner(policy: StepPolicy, config) -> AdaptivePrefillCap | None:
    """Have `policy` tune its decode-first cap, unless the engine runs on a GPU (no cap there), the
    user fixed the cap (--max-prefill-tokens-while-decoding) or STRATA_ADAPTIVE_PREFILL_CAP=0."""
    if (not enabled() or config.device != "cpu" or policy.prefill_cap is None
            or config.max_prefill_tokens_while_decoding is not None):
        return None
    tuner = AdaptivePrefillCap(policy, config.block_size)
    policy.tuners.append(tuner)
    return tuner


class AdaptivePrefillCap:
    """A tuner of the engine's StepPolicy that sets policy.prefill_cap, at most the start-up cap.
    It ignores the engine's warm-up steps (engine.warming_up)."""

    def __init__(self, policy: StepPolicy, block_size: int) -> None:
        self.policy = policy
        self.block = block_size
        self.initial = policy.prefill_cap
        self.decode_s: dict[int, float] = {}
        self.token_s: float | None = None
        self._forward: float | None = None

    def __call__(self, engine) -> None:
        if engine.warming_up:
            return
        forward = engine.stage_seconds["forward"]
        last, self._forward = self._forward, forward
        out = engine.last_schedule
        if last is None or out is None or not out.scheduled:
            return
        rows = sum(1 for s in out.scheduled if s.num_tokens == 1 or s.draft)
        prefill = sum(s.num_tokens for s in out.scheduled if s.num_tokens > 1 and not s.draft)
        self.observe(rows, prefill, (forward - last) / out.num_steps)  # multi-step decode: per step

    def observe(self, rows: int, prefill_tokens: int, seconds: float) -> None:
        """One step's forward time with `rows` decoding sequences and `prefill_tokens` prompt tokens."""
        if rows == 0:  # nobody waits on a prefill-only step: it is not capped
            return
        if prefill_tokens == 0:
            self.decode_s[rows] = _ewma(self.decode_s.get(rows), seconds)
        else:
            decode = self._decode_at(rows)
            if decode is None:
                return
            self.token_s = _ewma(self.token_s, max(seconds - decode, 0.0) / prefill_tokens)
        self._update(rows)

    def _decode_at(self, rows: int) -> float | None:
        """decode_s at the nearest measured row count (the larger on a tie): the decoding rows
        change by a few between steps, and their decode-only steps come between the mixed ones."""
        if not self.decode_s:
            return None
        return self.decode_s[min(self.decode_s, key=lambda r: (abs(r - rows), -r))]

    def _update(self, rows: int) -> None:
        decode = self._decode_at(rows)
        if decode is None or not self.token_s:
            return
        budget_s = max(LIMIT_STEP_S - decode, MIN_SHARE * decode)
        blocks = max(MIN_BLOCKS, int(budget_s / self.token_s) // self.block)
        cap = min(self.initial, blocks * self.block)
        if cap != self.policy.prefill_cap:
            logger.debug("decode-first cap %s -> %d tokens (decode step %.0f ms at %d rows, %.2f ms a prefill token)",
                         self.policy.prefill_cap, cap, decode * 1e3, rows, self.token_s * 1e3)
            self.policy.prefill_cap = cap

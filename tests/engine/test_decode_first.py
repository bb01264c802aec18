"""The decode-first cap's ceiling from measured step times: it lowers the cap only while a mixed
step at it would pass LIMIT_STEP_S, comes back up to (never above) the start-up cap when the
machine is fast again, keeps prompts moving under a slow decode batch, and is attached only by the
server, on CPU, when the user fixed no cap."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from strata.platform import decode_first
from strata.platform.decode_first import LIMIT_STEP_S, MIN_BLOCKS, MIN_SHARE, AdaptivePrefillCap
from strata.platform.policy import StepPolicy

BLOCK = 16


class FakeEngine:
    """stage_seconds / last_schedule / policy as LLMEngine exposes them; a step costs decode_s plus
    token_s per prefill token."""

    def __init__(self, cap: int = 64) -> None:
        self.policy = StepPolicy(prefill_cap=cap)
        self.stage_seconds = {"forward": 0.0}
        self.last_schedule = None
        self.warming_up = False
        self.config = SimpleNamespace(device="cpu", block_size=BLOCK, max_prefill_tokens_while_decoding=None)

    def step(self, rows: int, prefill: int, decode_s: float, token_s: float) -> None:
        scheduled = [SimpleNamespace(num_tokens=1, draft=[]) for _ in range(rows)]
        if prefill:
            scheduled.append(SimpleNamespace(num_tokens=prefill, draft=[]))
        self.stage_seconds["forward"] += decode_s + token_s * prefill
        self.last_schedule = SimpleNamespace(scheduled=scheduled, num_steps=1)
        self.policy.observe(self)

    @property
    def cap(self) -> int:
        return self.policy.prefill_cap


def _serve(engine, steps: int, rows: int, decode_s: float, token_s: float) -> None:
    """Decode steps with a prompt chunk every third step, at the cap the tuner set."""
    for i in range(steps):
        engine.step(rows, engine.cap if i % 3 == 2 else 0, decode_s, token_s)


def _fits(decode_s: float, token_s: float) -> int:
    budget = max(LIMIT_STEP_S - decode_s, MIN_SHARE * decode_s)
    return max(MIN_BLOCKS, int(budget / token_s) // BLOCK) * BLOCK


def test_a_fast_machine_keeps_the_start_up_cap():
    engine = FakeEngine(cap=64)
    assert decode_first.add_tuner(engine.policy, engine.config) is not None
    _serve(engine, 60, rows=16, decode_s=0.080, token_s=0.0015)  # 64 tokens: a 0.176 s step
    assert engine.cap == 64


def test_a_slow_machine_lowers_the_cap_until_it_is_fast_again():
    engine = FakeEngine(cap=64)
    decode_first.add_tuner(engine.policy, engine.config)
    _serve(engine, 30, rows=16, decode_s=0.080, token_s=0.0015)
    _serve(engine, 60, rows=16, decode_s=0.110, token_s=0.0030)  # another VM took the bandwidth
    assert engine.cap == _fits(0.110, 0.0030) == 32
    assert 0.110 + engine.cap * 0.0030 <= LIMIT_STEP_S
    _serve(engine, 90, rows=16, decode_s=0.050, token_s=0.0010)
    assert engine.cap == 64  # back to the start-up cap, never above it


def test_a_slow_decode_batch_still_admits_prompts():
    """A decode step past the limit alone: the prefill still gets MIN_SHARE of its time."""
    engine = FakeEngine(cap=128)
    decode_first.add_tuner(engine.policy, engine.config)
    _serve(engine, 60, rows=64, decode_s=0.300, token_s=0.002)
    assert engine.cap == _fits(0.300, 0.002) == 64
    _serve(engine, 60, rows=64, decode_s=0.300, token_s=0.050)  # even a very slow prefill moves
    assert engine.cap == MIN_BLOCKS * BLOCK


def test_steps_without_decoding_rows_teach_nothing():
    engine = FakeEngine(cap=64)
    tuner = decode_first.add_tuner(engine.policy, engine.config)
    for _ in range(10):
        engine.step(0, 512, 0.0, 0.01)  # prefill-only steps are not capped
    assert tuner.token_s is None and not tuner.decode_s
    assert engine.cap == 64


def test_warm_up_steps_teach_nothing():
    """The server's engine has the tuner from its build; the warm-up's steps are not its traffic."""
    engine = FakeEngine(cap=64)
    tuner = decode_first.add_tuner(engine.policy, engine.config)
    engine.warming_up = True
    _serve(engine, 30, rows=16, decode_s=0.110, token_s=0.0030)
    assert tuner.token_s is None and not tuner.decode_s and engine.cap == 64


def test_a_mixed_step_is_priced_at_the_nearest_decode_batch():
    tuner = AdaptivePrefillCap(StepPolicy(prefill_cap=64), BLOCK)
    tuner.observe(4, 0, 0.030)
    tuner.observe(16, 0, 0.080)
    tuner.observe(15, 32, 0.080 + 32 * 0.002)  # 15 rows: priced at 16's decode time
    assert tuner.token_s == pytest.approx(0.002)


@pytest.mark.parametrize("why", ["gpu", "user cap", "no cap", "env"])
def test_attached_only_where_it_applies(why, monkeypatch):
    engine = FakeEngine(cap=64)
    if why == "gpu":
        engine.config.device = "cuda"
    elif why == "user cap":
        engine.config.max_prefill_tokens_while_decoding = 64
    elif why == "no cap":
        engine.policy.prefill_cap = None
    else:
        monkeypatch.setenv(decode_first.ENV, "0")
    assert decode_first.add_tuner(engine.policy, engine.config) is None and engine.policy.tuners == []


def test_offline_engines_prefill_uncapped_unless_told():
    """LLM.generate favours throughput: no decode-first cap (the server's), and its chunking does not
    depend on timing: no tuner. A cap the user sets is kept."""
    from strata import LLM

    llm = LLM(None, dtype="float32", max_model_len=256, kv_cache_memory="8MiB")
    try:
        assert llm.engine.policy.tuner(AdaptivePrefillCap) is None
        assert llm.engine.scheduler.policy.prefill_cap is None
    finally:
        llm.engine.close()
    llm = LLM(None, dtype="float32", max_model_len=256, kv_cache_memory="8MiB", max_prefill_tokens_while_decoding=48)
    try:
        assert llm.engine.scheduler.policy.prefill_cap == 48
    finally:
        llm.engine.close()

"""build_engine takes the machine's facts as an argument (the hardware profile, probed at most once
when not given), picks the platform from them once, and builds the step policy for the workload:
nothing is attached to the engine afterwards."""

from __future__ import annotations

import pytest

from strata.config import EngineConfig
from strata.engine import build
from strata.engine.llm_engine import LLMEngine
from strata.hardware.probe import probe
from strata.platform.adaptive_threads import AdaptiveThreads
from strata.platform.cpu import CpuPlatform
from strata.platform.decode_first import AdaptivePrefillCap
from strata.platform.multi_step import AutoSteps


def _config(model, **kw) -> EngineConfig:
    opts = dict(dtype="float32", max_model_len=96, block_size=16, kv_cache_memory="1MiB", num_threads=1)
    return EngineConfig(model=str(model.path), **{**opts, **kw})


@pytest.fixture
def probes(monkeypatch):
    calls = []
    real = build.probe

    def counting(device="cpu", refresh=False):
        calls.append(device)
        return real(device, refresh)

    monkeypatch.setattr(build, "probe", counting)
    return calls


def test_a_given_profile_is_the_only_one(tiny_models, probes):
    profile = probe("cpu")
    engine = LLMEngine(_config(tiny_models["llama"]), profile=profile)
    try:
        assert probes == []
        assert isinstance(engine.platform, CpuPlatform) and engine.platform.profile is profile
    finally:
        engine.close()


def test_without_one_the_build_probes_once(tiny_models, probes):
    engine = LLMEngine(_config(tiny_models["llama"], quantization="bf16"))
    try:
        assert probes == ["cpu"]
    finally:
        engine.close()


@pytest.mark.parametrize("workload", ["offline", "streaming", "serving"])
def test_the_policy_follows_the_workload(tiny_models, workload):
    engine = LLMEngine(_config(tiny_models["llama"]), workload=workload)
    try:
        policy = engine.policy
        assert engine.scheduler.policy is policy
        assert policy.tuner(AdaptiveThreads) is not None and policy.tuner(AutoSteps) is not None
        assert (policy.tuner(AdaptivePrefillCap) is not None) == (workload == "serving")
        assert (policy.prefill_cap is None) == (workload == "offline")
    finally:
        engine.close()


def test_an_unknown_workload_is_refused(tiny_models):
    with pytest.raises(ValueError, match="workload 'batch'"):
        LLMEngine(_config(tiny_models["llama"]), workload="batch")

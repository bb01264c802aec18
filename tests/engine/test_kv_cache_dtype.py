"""kv_cache_dtype=bfloat16: K/V stored in bf16 on CPU (half the bytes), answers as the fp32 cache's
within bf16's rounding, on every path that writes or reads the cache."""

from __future__ import annotations

import pytest
import torch
from conftest import make_llm

from strata import SamplingParams
from strata.config import EngineConfig
from strata.errors import ConfigError

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)


def _run(llm, prompts):
    return [o.outputs[0] for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def test_a_bf16_cache_halves_the_bytes_and_keeps_the_greedy_tokens(family_model, prompt_of):
    prompts = [prompt_of(i, 9 + 13 * i) for i in range(3)]
    ref_llm = make_llm(family_model)
    low_llm = make_llm(family_model, kv_cache_dtype="bfloat16")
    assert low_llm.engine.plan.kv_bytes_per_token * 2 == ref_llm.engine.plan.kv_bytes_per_token
    assert {c.dtype for c in low_llm.engine.kv_caches} == {torch.bfloat16}
    ref, low = _run(ref_llm, prompts), _run(low_llm, prompts)
    for r, b in zip(ref, low):
        assert b.token_ids[0] == r.token_ids[0]  # the prompt's own attention reads fresh fp32 K/V
        # the chosen token's logprob moves by bf16's rounding of K/V only (tiny random models: loose)
        assert abs(b.logprobs[0][b.token_ids[0]] - r.logprobs[0][r.token_ids[0]]) < 0.05
    same = sum(x == y for r, b in zip(ref, low) for x, y in zip(r.token_ids, b.token_ids))
    assert same / sum(len(r.token_ids) for r in ref) >= 0.75


@pytest.mark.parametrize("backend", ["cpu", "torch", "sdpa"])
def test_every_attention_backend_reads_the_bf16_cache_alike(llama, prompt_of, backend):
    """The numba kernels (fused decode step included) and the torch twins over the same bf16 cache;
    chunked prefill (max_num_batched_tokens) makes later chunks read the cached, rounded K/V."""
    prompts = [prompt_of(40 + i, 30 + 11 * i) for i in range(3)]
    kw = dict(kv_cache_dtype="bfloat16", max_num_batched_tokens=24, enable_prefix_caching=False)
    ref = _run(make_llm(llama, attention_backend="torch", **kw), prompts)
    got = _run(make_llm(llama, attention_backend=backend, **kw), prompts)
    assert [g.token_ids for g in got] == [r.token_ids for r in ref]
    for g, r in zip(got, ref):
        for step_g, step_r in zip(g.logprobs, r.logprobs):
            tok = next(iter(step_r))
            assert abs(step_g[tok] - step_r[tok]) < 1e-4


def test_swapped_sequences_come_back_from_a_bf16_host_pool(llama, prompt_of):
    prompts = [prompt_of(70 + i, 40) for i in range(4)]
    kw = dict(kv_cache_dtype="bfloat16", enable_prefix_caching=False)
    ref = _run(make_llm(llama, kv_cache_memory="1MiB", **kw), prompts)
    llm = make_llm(llama, kv_cache_memory="24KiB", preemption_mode="swap", swap_space="1MiB", **kw)
    got = _run(llm, prompts)
    assert llm.engine.scheduler.num_preemptions > 0
    assert [g.token_ids for g in got] == [r.token_ids for r in ref]


@pytest.mark.parametrize("value", ["float16", "int4", "fp8_e5m2"])
def test_an_unimplemented_cache_dtype_is_refused(value):
    with pytest.raises(ConfigError, match="kv_cache_dtype.*not implemented.*auto.*bfloat16"):
        EngineConfig(kv_cache_dtype=value)


def test_a_bf16_cache_on_cuda_is_refused_with_the_way_to_get_one():
    with pytest.raises(ConfigError, match="CPU only.*--dtype bfloat16"):
        EngineConfig(kv_cache_dtype="bfloat16", device="cuda")

"""kv_cache_dtype=int8 (and fp8): 1-byte K/V with a per-token-per-head fp32 scale. About twice
bf16's tokens per byte, the bf16 cache's greedy tokens on most prompts, and the same answers
through every path that moves blocks (swap, recompute, prefix caching)."""

from __future__ import annotations

import pytest
import torch
from conftest import ALL_FAMILIES, VOCAB, make_llm

from strata import SamplingParams
from strata.config import EngineConfig
from strata.errors import ConfigError

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
FULL = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=VOCAB)  # every token's logprob


def _run(llm, prompts, params=GREEDY):
    return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]


def _kl_steps(ref, got) -> list[float]:
    """KL(ref || got) of each step's next-token distribution, while both have generated the same
    tokens (after the first differing token the contexts differ, and so would the distributions)."""
    out = []
    for step, (lr, lg) in enumerate(zip(ref.logprobs, got.logprobs)):
        ids = sorted(lr)
        p = torch.tensor([lr[t] for t in ids], dtype=torch.float64)
        q = torch.tensor([lg[t] for t in ids], dtype=torch.float64)
        out.append(float((p.exp() * (p - q)).sum()))
        if ref.token_ids[step] != got.token_ids[step]:
            break
    return out


def test_int8_holds_about_twice_the_tokens_of_bf16(llama):
    bf16 = make_llm(llama, kv_cache_dtype="bfloat16").engine
    int8 = make_llm(llama, kv_cache_dtype="int8").engine
    d = llama.head_dim
    assert int8.plan.kv_bytes_per_token == 2 * llama.num_layers * llama.num_kv_heads * (d + 4)  # values + scales
    assert {c.dtype for c in int8.kv_caches} == {torch.int8}
    assert int8.kv_caches[0].shape[-1] == d + 4  # each row's scale in its block
    assert int8.plan.tokens / bf16.plan.tokens == pytest.approx(2 * d / (d + 4), rel=0.02)  # 1.6x at 16, 1.9x at 64


def test_int8_keeps_bf16s_greedy_tokens_and_logprobs(tiny_models, prompt_of):
    """Every tiny family, 4 prompts each: most greedy completions equal bf16 KV's, and the mean
    KL(bf16 KV || int8 KV) of the next-token distributions is <= 1e-3 (measured: 1.2e-4 over 442
    steps, 25 of 32 completions equal; gemma3's soft-capped random logits are the most sensitive,
    as they are to bf16 itself)."""
    prompts = [prompt_of(100 + j, 10 + 17 * j) for j in range(4)]
    kls, same = [], 0
    for family in ALL_FAMILIES:
        model = tiny_models[family]
        ref = _run(make_llm(model, kv_cache_dtype="bfloat16"), prompts, FULL)
        got = _run(make_llm(model, kv_cache_dtype="int8"), prompts, FULL)
        for r, g in zip(ref, got):
            assert g.token_ids[0] == r.token_ids[0], family
            same += g.token_ids == r.token_ids
            kls += _kl_steps(r, g)
    mean_kl = sum(kls) / len(kls)
    print(f"int8 vs bf16 KV: {same}/{len(ALL_FAMILIES) * len(prompts)} completions equal, "
          f"mean KL {mean_kl:.2e} over {len(kls)} steps")
    assert same > len(ALL_FAMILIES) * len(prompts) / 2
    assert mean_kl <= 1e-3


@pytest.mark.parametrize("backend", ["cpu", "torch", "sdpa"])
def test_every_attention_backend_reads_the_int8_cache_alike(llama, prompt_of, backend):
    """The numba kernels (fused decode step included) and the torch twins over the same int8 cache;
    chunked prefill (max_num_batched_tokens) makes later chunks read the cached rows."""
    prompts = [prompt_of(40 + i, 30 + 11 * i) for i in range(3)]
    kw = dict(kv_cache_dtype="int8", max_num_batched_tokens=24, enable_prefix_caching=False)
    ref = _run(make_llm(llama, attention_backend="torch", **kw), prompts, FULL)
    got = _run(make_llm(llama, attention_backend=backend, **kw), prompts, FULL)
    assert [g.token_ids for g in got] == [r.token_ids for r in ref]
    for g, r in zip(got, ref):
        for step_g, step_r in zip(g.logprobs, r.logprobs):
            tok = next(iter(step_r))
            assert abs(step_g[tok] - step_r[tok]) < 1e-4  # measured 2.4e-6


@pytest.mark.parametrize("dtype", ["int8", "fp8"])
@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preempted_sequences_come_back_with_the_same_tokens(llama, prompt_of, mode, dtype):
    """Swap copies the blocks, scales included, to the host pool and back; recompute rebuilds them
    from the tokens (prompts attend to the stored rows too, so it reads what decode read)."""
    prompts = [prompt_of(70 + i, 40) for i in range(4)]
    kw = dict(kv_cache_dtype=dtype, enable_prefix_caching=False, max_num_batched_tokens=32)
    ref = _run(make_llm(llama, kv_cache_memory="1MiB", **kw), prompts)
    one_sequence = 96 * 2 * llama.num_layers * llama.num_kv_heads * (llama.head_dim + 4)  # max_model_len 96
    llm = make_llm(llama, kv_cache_memory=one_sequence, preemption_mode=mode, swap_space="1MiB", **kw)
    got = _run(llm, prompts)
    engine = llm.engine
    assert engine.scheduler.num_preemptions > 0
    if mode == "swap":
        assert engine.runner.swapper.blocks_in == engine.runner.swapper.blocks_out > 0
        assert engine.host_pool.caches[0].dtype == engine.kv_caches[0].dtype
        assert engine.host_pool.caches[0].shape[2:] == engine.kv_caches[0].shape[2:]
    assert [g.token_ids for g in got] == [r.token_ids for r in ref]
    engine.check_blocks()


def test_a_prefix_cache_hit_reads_the_same_int8_rows(llama, prompt_of):
    shared = prompt_of(2000, 37)  # 2 full blocks of 16
    prompts = [shared + prompt_of(2001 + i, n) for i, n in enumerate((5, 12, 30))]
    ref = _run(make_llm(llama, kv_cache_dtype="int8", enable_prefix_caching=False), prompts)
    llm = make_llm(llama, kv_cache_dtype="int8")
    _run(llm, [shared])  # cold: caches the prefix's blocks
    got = _run(llm, prompts)
    assert llm.engine.block_manager.stats.hits == 2 * len(prompts)
    assert [g.token_ids for g in got] == [r.token_ids for r in ref]


def test_fp8_runs_on_cpu_through_the_torch_path(llama, prompt_of):
    prompts = [prompt_of(300 + i, 20 + 9 * i) for i in range(4)]
    ref = _run(make_llm(llama, kv_cache_dtype="bfloat16"), prompts)
    llm = make_llm(llama, kv_cache_dtype="fp8")
    assert {c.dtype for c in llm.engine.kv_caches} == {torch.float8_e4m3fn}
    got = _run(llm, prompts)
    same = sum(x == y for r, g in zip(ref, got) for x, y in zip(r.token_ids, g.token_ids))
    assert same / sum(len(r.token_ids) for r in ref) >= 0.75


@pytest.mark.parametrize("value", ["int4", "float16", "fp8_e5m2"])
def test_an_unknown_cache_dtype_names_the_choices(value):
    with pytest.raises(ConfigError, match=f"kv_cache_dtype: '{value}' is not implemented; choose auto.*bfloat16.*int8.*fp8"):
        EngineConfig(kv_cache_dtype=value)


def test_int8_on_cuda_and_quantised_kv_with_fuse_or_compile_are_refused():
    with pytest.raises(ConfigError, match="int8 is implemented on CPU only.*use fp8"):
        EngineConfig(kv_cache_dtype="int8", device="cuda")
    EngineConfig(kv_cache_dtype="fp8", device="cuda")  # accepted: the torch path reads it there
    for flag in ("fuse", "compile"):
        with pytest.raises(ConfigError, match="does not support --fuse / --compile"):
            EngineConfig(kv_cache_dtype="int8", **{flag: True})


def test_forked_samples_copy_the_partial_block_with_its_scales(llama, prompt_of):
    """n=2 forks the prompt's KV: full blocks shared, the partial last block copied (scales too)."""
    prompt = prompt_of(500, 37)
    llm = make_llm(llama, kv_cache_dtype="int8", enable_prefix_caching=False)
    one = _run(llm, [prompt])[0]
    outs = llm.generate([prompt], SamplingParams(n=2, temperature=0, max_tokens=16, ignore_eos=True),
                        use_tqdm=False)[0].outputs
    assert [o.token_ids for o in outs] == [one.token_ids] * 2

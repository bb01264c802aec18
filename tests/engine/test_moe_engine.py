"""The engine on every mixture-of-experts family against transformers: greedy 32 tokens alone, a
mixed batch under a tiny budget with preemption, and the paged path's logits (1e-4)."""

from __future__ import annotations

import pytest
import torch

from strata import SamplingParams

MAX_NEW = 32
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW)


def test_single_request_greedy(moe_model, llm_factory, hf_ref, prompt_of, engine_clean):
    llm = llm_factory(moe_model)
    prompt = prompt_of(100, 21)
    comp = llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0]
    assert comp.token_ids == hf_ref(moe_model, prompt, MAX_NEW)
    engine_clean(llm)


def test_batch_with_chunking_and_preemption(moe_model, llm_factory, hf_ref, prompt_of, engine_clean):
    """5 mixed-length prompts, budget 16 tokens a step, a KV cache of one max_model_len sequence:
    prefill chunks and decode rows of several requests share each step's expert groups."""
    llm = llm_factory(moe_model, max_num_batched_tokens=16, kv_cache_memory=moe_model.kv_bytes_for(96))
    prompts = [prompt_of(200 + i, n) for i, n in enumerate((3, 60, 17, 33, 8))]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for i, (p, o) in enumerate(zip(prompts, outs)):
        assert o.outputs[0].token_ids == hf_ref(moe_model, p, MAX_NEW), f"prompt {i} (len {len(p)})"
    assert llm.engine.scheduler.num_preemptions > 0
    engine_clean(llm)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_paged_logits_match_hf(moe_model, backend, llm_factory, hf_forward, prompt_of, engine_clean):
    llm = llm_factory(moe_model, max_num_batched_tokens=16, attention_backend=backend)
    records = []
    original = llm.engine.sampler

    def sampler(logits, seqs, *rest):
        records.extend((list(s.token_ids), row.detach().clone()) for row, s in zip(logits, seqs))
        return original(logits, seqs, *rest)

    llm.engine.sampler = sampler
    prompts = [prompt_of(10, 40), prompt_of(11, 16), prompt_of(12, 5)]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    assert len(records) == 15
    for ids, row in records:
        torch.testing.assert_close(row, hf_forward(moe_model, ids)[-1], atol=1e-4, rtol=0)
    engine_clean(llm)


def test_expert_token_counts_add_up(tiny_models, llm_factory, prompt_of):
    """Every token of every MoE layer is counted top_k times (prefill and decode)."""
    model = tiny_models["qwen3moe"]
    llm = llm_factory(model)
    llm.generate(prompt_of(5, 20), SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    counts = llm.engine.expert_token_counts()
    assert set(counts) == {0, 1} and all(len(c) == 8 for c in counts.values())
    assert all(sum(c) == (20 + 5) * 3 for c in counts.values())  # the last token is never fed back


@pytest.mark.parametrize("quantization", ["bf16", "int8", "int4"])
def test_quantized_moe_generates(tiny_models, llm_factory, prompt_of, quantization, engine_clean):
    llm = llm_factory(tiny_models["mixtral"], quantization=quantization)
    out = llm.generate([prompt_of(1, 12), prompt_of(2, 30)],
                       SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 8 for o in out)
    engine_clean(llm)

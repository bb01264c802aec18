"""SamplingParams(prompt_logprobs=N): each prompt token's logprob given the tokens before it, equal to
transformers' on the same weights, whatever the chunking, n, preemption or prefix cache."""

from __future__ import annotations

import pytest
from conftest import hf_logits, make_llm, random_prompt

from strata import SamplingParams
from strata.errors import RequestError


def _reference(model, ids: list[int], top: int) -> list[dict | None]:
    lp = hf_logits(model, ids).log_softmax(-1)
    out: list[dict | None] = [None]
    for i in range(1, len(ids)):
        d = dict(zip(*(t.tolist() for t in reversed(lp[i - 1].topk(top))))) if top else {}
        d[ids[i]] = lp[i - 1, ids[i]].item()
        out.append(d)
    return out


def _close(got, want):
    assert len(got) == len(want) and got[0] is None
    for g, w in zip(got[1:], want[1:]):
        assert set(g) == set(w)
        for t in w:
            assert g[t] == pytest.approx(w[t], abs=1e-4)


@pytest.mark.parametrize("budget", [512, 7])  # one pass, and chunked prefill of 7 tokens a step
def test_prompt_logprobs_equal_transformers(tiny_models, budget):
    model = tiny_models["qwen2"]
    prompts = [random_prompt(1, 30), random_prompt(2, 11), random_prompt(3, 2)]
    llm = make_llm(model, max_num_batched_tokens=budget)
    try:
        outs = llm.generate(prompts, SamplingParams(max_tokens=3, prompt_logprobs=2, temperature=0.0, n=2),
                            use_tqdm=False)
        for ids, out in zip(prompts, outs):
            _close(out.prompt_logprobs, _reference(model, ids, 2))
        plain = llm.generate(prompts[:1], SamplingParams(max_tokens=2), use_tqdm=False)[0]
        assert plain.prompt_logprobs is None
        again = llm.generate(prompts[:1], SamplingParams(max_tokens=2, prompt_logprobs=0), use_tqdm=False)[0]
        _close(again.prompt_logprobs, _reference(model, prompts[0], 0))  # cached prefix or not: all computed
    finally:
        llm.close()


def test_prompt_logprobs_survive_preemption(tiny_models):
    model = tiny_models["llama"]
    prompts = [random_prompt(10 + i, 40) for i in range(6)]
    llm = make_llm(model, kv_cache_memory=model.kv_bytes_for(140), max_num_seqs=6, preemption_mode="recompute")
    try:
        outs = llm.generate(prompts, SamplingParams(max_tokens=40, ignore_eos=True, prompt_logprobs=1,
                                                    temperature=0.0), use_tqdm=False)
        assert sum(o.num_preemptions for o in outs) > 0
        for ids, out in zip(prompts, outs):
            _close(out.prompt_logprobs, _reference(model, ids, 1))
    finally:
        llm.close()


def test_bad_prompt_logprobs(tiny_models):
    llm = make_llm(tiny_models["llama"])
    try:
        for bad in (-1, True, 10**6):
            with pytest.raises(RequestError, match="prompt_logprobs"):
                llm.generate([[1, 2, 3]], SamplingParams(prompt_logprobs=bad), use_tqdm=False)
    finally:
        llm.close()

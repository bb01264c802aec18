"""LLM.chat renders the checkpoint's template; bf16/fp16 run end to end close to fp32."""

from __future__ import annotations

import pytest
import torch
from conftest import make_llm

from strata import LLM, SamplingParams


@pytest.fixture
def demo_llm(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("STRATA_CACHE", str(tmp_path_factory.getbasetemp() / "strata-cache"))
    return LLM(None, dtype="float32", max_model_len=256, kv_cache_memory="8MiB")


def test_chat_uses_template_and_bos_once(demo_llm):
    tok = demo_llm.get_tokenizer()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    out = demo_llm.chat(messages, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)[0]
    rendered = tok.apply_chat_template(messages, add_generation_prompt=True)
    assert out.prompt == rendered
    assert out.prompt_token_ids == tok.encode(rendered, add_special_tokens=False)
    assert out.prompt_token_ids.count(tok.bos_token_id) == 1  # the template's BOS, not a second one
    assert "Hi there" in rendered and len(out.outputs[0].token_ids) == 5
    # a batch of conversations comes back in order
    outs = demo_llm.chat([messages, messages[1:]], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert [o.prompt for o in outs] == [rendered, tok.apply_chat_template(messages[1:])]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_runs_close_to_fp32(dtype, llama):
    prompt = list(range(5, 40))
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)
    ref = make_llm(llama).generate([prompt], params, use_tqdm=False)[0].outputs[0]
    low = make_llm(llama, dtype=dtype).generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert len(low.token_ids) == 6
    assert low.token_ids[0] == ref.token_ids[0]  # well-separated logits: the first token agrees
    # the chosen token's logprob under both precisions is close (half precision, loose bound)
    assert abs(low.logprobs[0][low.token_ids[0]] - ref.logprobs[0][ref.token_ids[0]]) < 0.1
    assert torch.finfo(getattr(torch, dtype)).bits == 16

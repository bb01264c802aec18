"""LoRA adapters in the engine: logits equal peft's on the same base and adapter, greedy tokens
exact, batches mixing adapters (and none) give each request its tokens alone, adapters over
quantised bases, the prefix cache keyed by adapter, the slot/host LRU, and bad adapters refused."""

from __future__ import annotations

import json
import re

import pytest
import torch
from conftest import ALL_FAMILIES, EOS_ID, MOE_FAMILIES, make_llm, random_prompt

from strata import LoRARequest, SamplingParams
from strata.errors import ConfigError
from strata.graph.loader import load_model
from strata.graph.lora import LoRABatch, lora_batch
from strata.graph.lora_adapter import attach_banks, read_adapter
from strata.protocol.lora import LoRAError
from tests.lora_adapters import make_adapter, peft_greedy

GREEDY = SamplingParams(temperature=0, max_tokens=16)


@pytest.fixture(scope="module")
def adapters(tiny_models, tmp_path_factory):
    """Two adapters per family: (dir, PeftModel) for A (rank 8) and B (rank 4, rsLoRA)."""
    root = tmp_path_factory.mktemp("adapters")
    cache = {}

    def get(family: str, which: str = "A"):
        key = (family, which)
        if key not in cache:
            tiny = tiny_models[family]
            kw = dict(r=8, alpha=16) if which == "A" else dict(r=4, alpha=8, rslora=True)
            out = root / f"{family}-{which}"
            cache[key] = (out, make_adapter(tiny.hf, out, seed=ord(which), family=family, **kw))
        return cache[key]

    return get


def _strata_logits(model, ids: list[int], slot: int | None) -> torch.Tensor:
    with torch.no_grad(), lora_batch(None if slot is None else LoRABatch.every_row(slot)):
        t = torch.tensor([ids])
        return model.compute_logits(model(t, torch.arange(len(ids))[None]))[0]


@pytest.mark.parametrize("family", ALL_FAMILIES + MOE_FAMILIES)
def test_logits_equal_peft(family, tiny_models, adapters):
    """The model with the adapter in a slot gives peft's logits (fp32, 1e-4); with no batch set, the
    base model's, unchanged."""
    path, pm = adapters(family)
    model = load_model(tiny_models[family].path, torch.float32)
    ids = random_prompt(5, 24)
    base = _strata_logits(model, ids, None)
    sites = attach_banks(model, slots=3, rank=16)
    weights = read_adapter("A", path, model, sites, max_rank=16)
    for module, segments in weights.modules.values():
        module.lora.set_slot(2, segments)
    with torch.no_grad():
        want = pm(torch.tensor([ids])).logits[0]
        with pm.disable_adapter():
            want_base = pm(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(_strata_logits(model, ids, 2), want, atol=1e-4, rtol=0)
    assert torch.equal(_strata_logits(model, ids, None), base)  # banks present, no batch: the base, bitwise
    torch.testing.assert_close(base, want_base, atol=1e-4, rtol=0)
    assert (want - want_base).abs().max() > 0.05  # the adapter matters


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "gemma3", "phi3", "qwen3moe"])
def test_greedy_equals_peft(family, tiny_models, adapters):
    """LLM(enable_lora=True).generate(lora_request=...) gives peft's greedy tokens, adapters A and B
    and the base in one call."""
    (pa, ma), (pb, mb) = adapters(family, "A"), adapters(family, "B")
    prompts = [random_prompt(10 + i, 6 + 3 * i) for i in range(3)]
    loras = [LoRARequest("A", 1, str(pa)), LoRARequest("B", 2, str(pb)), None]
    llm = make_llm(tiny_models[family], enable_lora=True, max_loras=2)
    try:
        outs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras)
    finally:
        llm.close()
    want = [peft_greedy(ma, prompts[0], 16, EOS_ID), peft_greedy(mb, prompts[1], 16, EOS_ID),
            peft_greedy(ma, prompts[2], 16, EOS_ID, adapter=False)]
    assert [o.outputs[0].token_ids for o in outs] == want


def test_mixed_batch_equals_alone(llama, adapters, engine_clean):
    """No adapter, A, B, A again in one batch (with chunked prefill and preemption): each request
    gets exactly the tokens it gets alone; with max_loras=1 the adapters take turns, same tokens."""
    (pa, _), (pb, _) = adapters("llama", "A"), adapters("llama", "B")
    a, b = LoRARequest("A", 1, str(pa)), LoRARequest("B", 2, str(pb))
    prompts = [random_prompt(30 + i, 20 + 7 * i) for i in range(4)]
    loras = [None, a, b, a]
    params = SamplingParams(temperature=0, max_tokens=24)
    alone = []
    with make_llm(llama, enable_lora=True, max_loras=2) as llm:
        for p, lora in zip(prompts, loras):
            alone.append(llm.generate([p], params, use_tqdm=False, lora_request=lora)[0].outputs[0].token_ids)
    assert alone[1] != alone[0] and alone[2] != alone[1]
    for kw in (dict(max_loras=2), dict(max_loras=1),
               dict(max_loras=2, kv_cache_memory="48KiB", max_num_batched_tokens=16)):  # preempts, chunks
        with make_llm(llama, enable_lora=True, **kw) as llm:
            outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
            assert [o.outputs[0].token_ids for o in outs] == alone, kw
            engine_clean(llm)


def test_bf16_adapters(llama, adapters):
    """lora_dtype: auto keeps fp32 banks over an fp32 base and stores them bf16 over an int8 one; bf16
    banks give a mixed batch each request's tokens alone and logits near the fp32 banks'."""
    (pa, _), (pb, _) = adapters("llama", "A"), adapters("llama", "B")
    a, b = LoRARequest("A", 1, str(pa)), LoRARequest("B", 2, str(pb))
    prompts = [random_prompt(50 + i, 12 + 5 * i) for i in range(4)]
    loras = [None, a, b, a]
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=1)
    with make_llm(llama, enable_lora=True, max_loras=2) as llm:
        assert llm.engine.lora.banks[0].lora_a.dtype == torch.float32
        fp32 = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    with make_llm(llama, enable_lora=True, max_loras=2, quantization="int8") as llm:
        assert llm.engine.lora.banks[0].lora_a.dtype == torch.bfloat16
    with make_llm(llama, enable_lora=True, max_loras=2, lora_dtype="bfloat16") as llm:
        assert all(bank.lora_b.dtype == torch.bfloat16 for bank in llm.engine.lora.banks)
        mixed = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
        for p, lora, out in zip(prompts, loras, mixed):
            alone = llm.generate([p], params, use_tqdm=False, lora_request=lora)[0].outputs[0]
            assert alone.token_ids == out.outputs[0].token_ids
    first = [(o.outputs[0].logprobs[0], m.outputs[0].logprobs[0]) for o, m in zip(fp32, mixed)]
    for want, got in first:  # the first token's logprob: bf16 weights' rounding only
        tok = max(want, key=want.get)
        assert tok in got and abs(got[tok] - want[tok]) < 5e-2
    with pytest.raises(ConfigError, match="float16 is not supported on CPU; use bfloat16"):
        make_llm(llama, enable_lora=True, lora_dtype="float16")


@pytest.mark.parametrize("storage", ["bf16", "int8", "int4"])
def test_adapter_over_quantised_base(llama, adapters, storage):
    """An adapter over a bf16 / int8 / int4 base equals it over an fp32 model holding the same
    (dequantised) weights, within the base format's tolerance."""
    path, _ = adapters("llama")
    m = load_model(llama.path, torch.float32, storage=storage)
    ref = load_model(llama.path, torch.float32)
    with torch.no_grad():
        ref_params = dict(ref.named_parameters())
        for name, mod in m.named_modules():
            if hasattr(mod, "dequantize"):
                ref.get_submodule(name).weight.copy_(mod.dequantize())
        for name, p in m.named_parameters():
            if p.dtype is torch.bfloat16 and name in ref_params:
                ref_params[name].copy_(p.float())
    for model in (m, ref):
        sites = attach_banks(model, slots=1, rank=8)
        for module, segments in read_adapter("A", path, model, sites, 8).modules.values():
            module.lora.set_slot(0, segments)
    ids = random_prompt(8, 30)
    tol = 1e-4 if storage == "bf16" else 2e-2  # int8/int4 kernels quantise activations (VNNI)
    torch.testing.assert_close(_strata_logits(m, ids, 0), _strata_logits(ref, ids, 0), atol=tol, rtol=0)


def test_prefix_cache_is_keyed_by_adapter(llama, adapters):
    """The same prompt under another adapter (or none) does not reuse its KV blocks; under the same
    adapter it does, with the same tokens."""
    path, _ = adapters("llama")
    a = LoRARequest("A", 1, str(path))
    prompt = random_prompt(40, 40)
    with make_llm(llama, enable_lora=True) as llm:
        eng = llm.engine
        first = llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=a)[0].outputs[0].token_ids
        hits = eng.stats().prefix_hits
        base = llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        assert eng.stats().prefix_hits == hits  # the base model: no hit on A's blocks
        again = llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=a)[0].outputs[0].token_ids
        assert eng.stats().prefix_hits > hits
        assert again == first and base != first


def test_host_lru_and_slots(llama, adapters, tmp_path, engine_clean):
    """Three adapters through one slot and a host cache of one: each request still runs its own
    adapter (weights re-read when the LRU dropped them)."""
    paths = [adapters("llama", w)[0] for w in ("A", "B")]
    c = tmp_path / "C"
    make_adapter(llama.hf, c, seed=99, r=2, alpha=4)
    loras = [LoRARequest(n, i + 1, str(p)) for i, (n, p) in enumerate(zip("ABC", [*paths, c]))]
    prompts = [random_prompt(50 + i, 12) for i in range(6)]
    order = [loras[i % 3] for i in range(6)]
    with make_llm(llama, enable_lora=True, max_loras=2) as llm:
        want = [llm.generate([p], GREEDY, use_tqdm=False, lora_request=r)[0].outputs[0].token_ids
                for p, r in zip(prompts, order)]
    with make_llm(llama, enable_lora=True, max_loras=1, max_cpu_loras=1) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=order)]
        engine_clean(llm)
    assert got == want


def test_remove_lora_lets_queued_requests_finish(llama, adapters):
    path, _ = adapters("llama")
    a = LoRARequest("A", 1, str(path))
    prompt = random_prompt(60, 10)
    with make_llm(llama, enable_lora=True) as llm:
        eng = llm.engine
        want = llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=a)[0].outputs[0].token_ids
        eng.add_request("q", None, prompt, GREEDY, a)
        assert eng.remove_lora(1) and not eng.remove_lora(1)
        assert eng.list_loras() == []
        outs = []
        while eng.has_unfinished():
            outs += [o for o in eng.step() if o.finished]
        assert outs[0].outputs[0].token_ids == want
        with pytest.raises(LoRAError, match="not loaded"):
            eng.add_request("r", None, prompt, GREEDY, a)
        eng.add_lora(a)  # added again: usable again
        assert llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=a)[0].outputs[0].token_ids == want


def test_speculative_and_structured_output_with_adapter(text_model, tmp_path):
    """Prompt-lookup speculative decoding keeps the adapter's greedy tokens; a regex constraint holds."""
    from strata import StructuredOutput

    path = tmp_path / "ad"
    make_adapter(text_model.hf, path, seed=3)
    a = LoRARequest("A", 1, str(path))
    prompt = "the quick brown fox jumps over the lazy dog. the quick brown fox"
    params = SamplingParams(temperature=0, max_tokens=24)
    with make_llm(text_model, enable_lora=True, max_model_len=128) as llm:
        want = llm.generate([prompt], params, use_tqdm=False, lora_request=a)[0].outputs[0].token_ids
        pattern = "(fox|dog)( (fox|dog)){2}"  # this tokenizer's vocabulary has no JSON punctuation
        rx = SamplingParams(temperature=0, max_tokens=40, structured=StructuredOutput(regex=pattern))
        text = llm.generate([prompt], rx, use_tqdm=False, lora_request=a)[0].outputs[0].text
        assert re.fullmatch(pattern, text), text
    with make_llm(text_model, enable_lora=True, max_model_len=128, speculative_model="ngram") as llm:
        got = llm.generate([prompt], params, use_tqdm=False, lora_request=a)[0].outputs[0].token_ids
    assert got == want


def _write(d, config: dict | None = None, tensors: dict | None = None, bin_only=False):
    from safetensors.torch import save_file

    d.mkdir(parents=True, exist_ok=True)
    if config is not None:
        (d / "adapter_config.json").write_text(json.dumps(config))
    if bin_only:
        (d / "adapter_model.bin").write_bytes(b"\x80\x04not loaded")
    elif tensors is not None:
        save_file(tensors, str(d / "adapter_model.safetensors"))
    return d


def test_bad_adapters_are_refused_by_name(llama, tiny_models, adapters, tmp_path):
    good, _ = adapters("llama")
    cfg = json.loads((good / "adapter_config.json").read_text())
    other, _ = adapters("qwen3")  # another base: other shapes
    k = "base_model.model.model.layers.0.self_attn.q_proj.lora_"
    t = {k + "A.weight": torch.zeros(4, 64), k + "B.weight": torch.zeros(64, 4)}
    cases = {
        "other-base": (other, "trained on another model|not in the base model"),
        "missing": (tmp_path / "nope", "not a directory"),
        "no-config": (_write(tmp_path / "nc", None, t), "no adapter_config.json"),
        "pickle": (_write(tmp_path / "pk", cfg, bin_only=True), "pickle"),
        "dora": (_write(tmp_path / "do", {**cfg, "use_dora": True}, t), "DoRA"),
        "modules-to-save": (_write(tmp_path / "ms", {**cfg, "modules_to_save": ["lm_head"]}, t), "modules_to_save"),
        "not-lora": (_write(tmp_path / "ia", {**cfg, "peft_type": "IA3"}, t), "peft_type"),
        "lm-head": (_write(tmp_path / "lh", cfg, {"base_model.model.lm_head.lora_A.weight": torch.zeros(4, 64),
                                                   "base_model.model.lm_head.lora_B.weight": torch.zeros(384, 4)}),
                    "lm_head"),
        "shape": (_write(tmp_path / "sh", cfg, {k + "A.weight": torch.zeros(4, 32), k + "B.weight": torch.zeros(64, 4)}),
                  "do not fit"),
        "rank": (_write(tmp_path / "rk", cfg, {k + "A.weight": torch.zeros(32, 64),
                                                k + "B.weight": torch.zeros(64, 32)}), "--max-lora-rank 32"),
        "nan": (_write(tmp_path / "nn", cfg, {k + "A.weight": torch.full((4, 64), float("nan")),
                                               k + "B.weight": torch.zeros(64, 4)}), "NaN"),
    }
    prompt = random_prompt(1, 5)
    with make_llm(llama, enable_lora=True) as llm:
        for i, (name, (path, match)) in enumerate(cases.items()):
            with pytest.raises(LoRAError, match=match):
                llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=LoRARequest(name, i + 1, str(path)))
        assert not llm.engine.has_unfinished() and llm.engine.list_loras() == []
        # the engine is untouched: a good adapter still runs
        llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=LoRARequest("good", 99, str(good)))
    with make_llm(llama) as llm, pytest.raises(LoRAError, match="enable_lora"):
        llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=LoRARequest("good", 1, str(good)))
    with pytest.raises(LoRAError, match="lora_int_id"):
        LoRARequest("x", 0, str(good))

"""LoRA adapters with tensor parallelism: LLM(enable_lora=True, tensor_parallel_size=2) on gloo ranks
over loopback gives exactly tensor_parallel_size=1's greedy tokens for a batch mixing adapters (and
none); an adapter added after start reaches rank 1 through the step plan; a bad adapter is the same
clear LoRAError (checked against the full model's shapes, not the shard's); expert parallelism with
attention adapters; no process is left."""

from __future__ import annotations

import time
from pathlib import Path

import psutil
import pytest
import torch
from conftest import _COMMON, EOS_ID, TinyModel, _randomise, make_llm, random_prompt
from safetensors.torch import load_file, save_file

from strata import LoRARequest, SamplingParams
from strata.protocol.lora import WEIGHTS_FILE, LoRAError
from tests.lora_adapters import make_adapter

GREEDY = SamplingParams(temperature=0, max_tokens=8)


@pytest.fixture
def no_leftovers():
    """No process this test started outlives it (ones an earlier test left are not this test's)."""
    before = {p.pid for p in psutil.Process().children(recursive=True)}

    def started_here():
        return [p for p in psutil.Process().children(recursive=True) if p.pid not in before]

    yield
    deadline = time.monotonic() + 15
    while started_here() and time.monotonic() < deadline:
        time.sleep(0.1)
    left = started_here()
    for p in left:
        p.kill()
    assert not left, f"processes left behind: {left}"


@pytest.fixture(scope="module")
def biased(tmp_path_factory) -> TinyModel:
    """A tiny Llama with every bias (q/k/v, o, gate/up, down): the row-parallel o/down add theirs
    once, after the all-reduce that also sums the ranks' LoRA deltas."""
    import transformers as tf

    torch.manual_seed(11)
    cfg = tf.LlamaConfig(**_COMMON, num_attention_heads=4, num_key_value_heads=2, attention_bias=True,
                         mlp_bias=True, tie_word_embeddings=False)
    hf = tf.LlamaForCausalLM(cfg)
    _randomise(hf, 11)
    hf = hf.float().eval()
    path = tmp_path_factory.mktemp("tp_biased") / "llama_bias"
    hf.save_pretrained(path, safe_serialization=True)
    return TinyModel("llama_bias", path, hf, [EOS_ID], cfg.vocab_size, cfg.num_hidden_layers, 2,
                     cfg.hidden_size // 4)


@pytest.fixture(scope="module")
def adapters(tiny_models, biased, tmp_path_factory):
    """(A rank 8, B rank 4 rsLoRA) LoRARequests per family, every projection targeted."""
    root = tmp_path_factory.mktemp("tp_adapters")
    cache = {}

    def get(family: str):
        if family not in cache:
            hf = biased.hf if family == "llama_bias" else tiny_models[family].hf
            make_adapter(hf, root / f"{family}-A", seed=1, r=8, alpha=16, family=family)
            make_adapter(hf, root / f"{family}-B", seed=2, r=4, alpha=8, rslora=True, family=family)
            cache[family] = (LoRARequest("A", 1, str(root / f"{family}-A")),
                             LoRARequest("B", 2, str(root / f"{family}-B")))
        return cache[family]

    return get


def _generate(model, prompts, loras, **kw):
    with make_llm(model, enable_lora=True, max_loras=2, **kw) as llm:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras)]


# qwen2: q/k/v bias; llama3: one KV head (replicated on both ranks); llama_bias: o and down biases too
@pytest.mark.parametrize("family", ["llama", "qwen2", "llama3", "llama_bias"])
def test_tp2_mixed_batch_equals_tp1(family, tiny_models, biased, adapters, no_leftovers):
    model = biased if family == "llama_bias" else tiny_models[family]
    a, b = adapters(family)
    prompts = [random_prompt(60 + i, 9 + 5 * i) for i in range(4)]
    loras = [None, a, b, a]
    ref = _generate(model, prompts, loras)
    assert ref[1] != ref[0] and ref[2] != ref[1]  # the adapters matter
    assert _generate(model, prompts, loras, tensor_parallel_size=2) == ref


def test_tp2_adapter_added_after_start_and_slot_turns(tiny_models, adapters, no_leftovers):
    """add_lora on a running TP engine, then max_loras=1 so A and B take turns in slot 0 (each turn a
    slot change rank 1 follows), then A removed and added again: TP=1's tokens every time."""
    model = tiny_models["llama"]
    a, b = adapters("llama")
    prompts = [random_prompt(80 + i, 7 + 4 * i) for i in range(3)]
    loras = [a, b, None]
    want = _generate(model, prompts, loras)
    with make_llm(model, enable_lora=True, max_loras=1, tensor_parallel_size=2) as llm:
        llm.engine.add_lora(a)
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras)]
        assert got == want
        assert llm.engine.remove_lora(a.lora_int_id)
        llm.engine.add_lora(a)
        again = llm.generate([prompts[0]], GREEDY, use_tqdm=False, lora_request=a)
        assert again[0].outputs[0].token_ids == want[0]


def test_tp2_bad_adapter_is_a_clear_error(tiny_models, adapters, tmp_path, no_leftovers):
    """An adapter whose q_proj B has one rank's rows (what a shard holds) is refused against the full
    model's shape; the engine goes on serving."""
    a, _ = adapters("llama")
    bad = tmp_path / "half"
    bad.mkdir()
    (bad / "adapter_config.json").write_text((Path(a.path) / "adapter_config.json").read_text())
    tensors = load_file(f"{a.path}/{WEIGHTS_FILE}")
    key = next(k for k in tensors if "layers.0.self_attn.q_proj.lora_B" in k)
    tensors[key] = tensors[key][: tensors[key].shape[0] // 2].contiguous()
    save_file(tensors, str(bad / WEIGHTS_FILE))
    with make_llm(tiny_models["llama"], enable_lora=True, tensor_parallel_size=2) as llm:
        out = tiny_models["llama"].hf.config.hidden_size
        with pytest.raises(LoRAError, match=rf"q_proj lora_A .* do not fit the base's .*q_proj \[{out}, {out}\]"):
            llm.engine.add_lora(LoRARequest("half", 3, str(bad)))
        ok = llm.generate([random_prompt(5, 8)], GREEDY, use_tqdm=False, lora_request=a)
        assert len(ok[0].outputs[0].token_ids) == GREEDY.max_tokens


def test_ep2_attention_adapters_equal_one_process(tiny_models, adapters, no_leftovers):
    """An MoE model's experts split over the ranks (--enable-expert-parallel), its attention sharded
    with the adapters' A/B: the tokens of one process."""
    a, b = adapters("qwen2moe")  # attention only: LoRA on experts is refused
    prompts = [random_prompt(70 + i, 8 + 6 * i) for i in range(3)]
    loras = [a, None, b]
    ref = _generate(tiny_models["qwen2moe"], prompts, loras)
    assert ref[0] != ref[1]
    assert _generate(tiny_models["qwen2moe"], prompts, loras, tensor_parallel_size=2,
                     enable_expert_parallel=True) == ref


def test_shard_sites_cut_like_the_weights(tiny_models):
    """The sites of a (one-process) shard name the full shapes and this rank's rows / columns."""
    from strata.graph.loader import load_model
    from strata.graph.lora_adapter import attach_banks
    from strata.graph.tensor_parallel import shard_model

    class _Comm:
        rank, world_size = 1, 2

    model = shard_model(load_model(tiny_models["llama"].path, torch.float32), 1, 2, _Comm())
    sites = attach_banks(model, slots=2, rank=8)
    cfg = model.full_config
    d, hidden, inter = cfg.head_dim, cfg.hidden_size, cfg.intermediate_size
    q = sites["model.layers.0.self_attn.q_proj"]
    k = sites["model.layers.0.self_attn.k_proj"]
    o = sites["model.layers.0.self_attn.o_proj"]
    down = sites["model.layers.0.mlp.down_proj"]
    assert (q.in_features, q.out_features, q.rows) == (hidden, cfg.num_heads * d, slice(2 * d, 4 * d))
    assert (k.out_features, k.rows) == (cfg.num_kv_heads * d, slice(d, 2 * d))
    assert (o.in_features, o.out_features, o.cols) == (cfg.num_heads * d, hidden, slice(2 * d, 4 * d))
    assert (down.in_features, down.cols) == (inter, slice(inter // 2, inter))
    layer = model.layers[0]
    assert layer.self_attn.qkv_proj.lora.segments == ((0, 2 * d), (2 * d, 3 * d), (3 * d, 4 * d))
    assert layer.self_attn.o_proj.inner.lora.lora_a.shape == (2, 8, 2 * d)  # A over this rank's columns
    assert layer.mlp.down_proj.inner.lora.lora_b.shape == (2, hidden, 8)

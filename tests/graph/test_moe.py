"""Mixture-of-experts families against transformers (fp32, 1e-4), the grouped dispatch against a
dense torch twin, routing ties, and the config checks."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from strata.errors import ModelLoadError
from strata.graph.loader import load_model
from strata.graph.models.llama import MoEDecoderLayer
from strata.graph.moe import MoEBlock
from strata.model_config import ModelConfig, MoEConfig

ATOL = 1e-4


def _logits(path, batch: list[list[int]], **kw) -> torch.Tensor:
    m = load_model(path, torch.float32, "cpu", 256, **kw)
    ids = torch.tensor(batch)
    with torch.no_grad():
        return m.compute_logits(m(ids, torch.arange(ids.shape[1]).expand_as(ids))).float()


def test_plain_forward_matches_hf(moe_model, hf_forward, prompt_of):
    batch = [prompt_of(1, 50), prompt_of(2, 50)]
    got = _logits(moe_model.path, batch)
    for b, ids in enumerate(batch):
        torch.testing.assert_close(got[b], hf_forward(moe_model, ids), atol=ATOL, rtol=0)


def test_moe_layers_are_where_the_config_puts_them(moe_model):
    cfg = ModelConfig.from_file(moe_model.path / "config.json")
    m = load_model(moe_model.path, torch.float32)
    kinds = [type(layer).__name__ for layer in m.layers]
    expected = ["MoEDecoderLayer", "DecoderLayer"] if moe_model.family == "qwen2moe" else ["MoEDecoderLayer"] * 2
    assert kinds == expected
    block = m.layers[0].mlp
    assert len(block.experts) == cfg.moe.num_experts and block.gate.weight.dtype is torch.float32
    assert (block.shared_expert is not None) == (moe_model.family == "qwen2moe")


def _dense_twin(block: MoEBlock, rows: torch.Tensor) -> torch.Tensor:
    """Every expert over every row, weighted by the router's top-k (zero elsewhere): the reference."""
    logits = rows @ block.gate.weight.T
    probs = torch.softmax(logits, -1)
    w, ids = torch.topk(probs, block.top_k, -1)
    if block.gate.norm_topk_prob:
        w = w / w.sum(-1, keepdim=True)
    dense = torch.zeros(rows.shape[0], block.num_experts)
    dense.scatter_(1, ids, w)
    outs = torch.stack([e(rows) for e in block.experts], 1)  # [T, E, hidden]
    return (dense[..., None] * outs).sum(1)


def _block(experts=6, top_k=2, hidden=32, inter=24, norm=False, seed=0) -> MoEBlock:
    torch.manual_seed(seed)
    moe = MoEConfig(experts, top_k, inter, norm, 0, (True,), 0.0)
    block = MoEBlock(hidden, moe)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape) * 0.3)
    return block


@pytest.mark.parametrize("norm", [False, True])
def test_grouped_dispatch_equals_the_dense_twin(norm):
    block = _block(norm=norm)
    rows = torch.randn(37, 32)
    with torch.no_grad():
        torch.testing.assert_close(block(rows), _dense_twin(block, rows), atol=1e-5, rtol=0)
    assert int(block.token_counts.sum()) == 37 * 2  # every (token, slot) pair counted once


def test_every_token_on_one_expert_and_a_decode_row():
    """A batch whose tokens all pick the same expert (it runs once over all of them), and one row."""
    block = _block(experts=4, top_k=1)
    with torch.no_grad():
        block.gate.weight.zero_()
        block.gate.weight[2] = 5.0
        rows = torch.rand(9, 32) + 0.1  # positive: expert 2 wins every row
        got = block(rows)
        torch.testing.assert_close(got, block.experts[2](rows), atol=1e-6, rtol=0)
        assert block.token_counts.tolist() == [0, 0, 9, 0]
        torch.testing.assert_close(block(rows[:1]), got[:1], atol=1e-6, rtol=0)


def test_routing_ties_break_as_transformers(tiny_models, tmp_path, prompt_of):
    """Experts 1 and 2 of every router score equal (identical router rows): which of the tied pair
    is picked, and in which slot, must be transformers' choice (torch.topk on the same probabilities)."""
    import transformers as tf

    src = tiny_models["qwen3moe"].path
    dst = tmp_path / "tied"
    shutil.copytree(src, dst)
    weights = load_file(dst / "model.safetensors")
    for name in [n for n in weights if n.endswith("mlp.gate.weight")]:
        weights[name][2] = weights[name][1]
    save_file(weights, dst / "model.safetensors", metadata={"format": "pt"})
    hf = tf.Qwen3MoeForCausalLM.from_pretrained(dst, attn_implementation="eager").float().eval()
    ids = prompt_of(7, 40)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
        block = load_model(dst, torch.float32).layers[0].mlp
        hidden = torch.randn(50, block.gate.weight.shape[1])
        _, _, picked = block.gate(hidden)
    assert ((picked == 1) | (picked == 2)).any()  # the tie is live
    torch.testing.assert_close(_logits(dst, [ids])[0], ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("storage", ["bf16", "int8", "int4"])
def test_experts_take_every_weight_storage(moe_model, storage, prompt_of):
    """Each expert's projections are stored like a dense MLP's (the router stays fp32), and the
    model's logits equal an fp32 model holding the same (dequantised) weights."""
    m = load_model(moe_model.path, torch.float32, storage=storage)
    block = m.layers[0].mlp
    assert block.gate.weight.dtype is torch.float32
    ref = load_model(moe_model.path, torch.float32)
    with torch.no_grad():
        ref_params = dict(ref.named_parameters())
        for name, mod in m.named_modules():
            if hasattr(mod, "dequantize"):
                ref.get_submodule(name).weight.copy_(mod.dequantize())
        for name, p in m.named_parameters():  # the bf16-narrowed weights (projections, embedding)
            if p.dtype is torch.bfloat16 and name in ref_params:
                ref_params[name].copy_(p.float())
        ids = torch.tensor([prompt_of(3, 30)])
        pos = torch.arange(30)[None]
        got = m.compute_logits(m(ids, pos))
        want = ref.compute_logits(ref(ids, pos))
    kind = type(block.experts[0].down_proj).__name__
    assert kind == ("Linear" if storage == "bf16" else "QuantLinear")
    # int8/int4 kernels quantise their activations (VNNI paths) where the CPU has them: a looser bound
    torch.testing.assert_close(got, want, atol=2e-2 if storage != "bf16" else 1e-4, rtol=0)


def _config(**changes) -> dict:
    d = {"architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
         "vocab_size": 100, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
    d.update(changes)
    return d


def test_sparse_layers_follow_step_and_mlp_only_layers():
    cfg = ModelConfig.from_dict(_config(decoder_sparse_step=2, mlp_only_layers=[3]))
    assert cfg.moe.sparse == (False, True, False, False)
    assert ModelConfig.from_dict(_config()).moe.sparse == (True,) * 4


@pytest.mark.parametrize("changes,needle", [
    ({"num_experts_per_tok": 9}, "num_experts_per_tok = 9 exceeds num_experts = 8"),
    ({"num_experts": 0}, "num_experts = 0 is out of range"),
    ({"mlp_only_layers": [7]}, "mlp_only_layers = [7] is not a list of layer indices"),
    ({"moe_intermediate_size": "32"}, "moe_intermediate_size = \"32\" is not an integer"),
    ({"norm_topk_prob": 1}, "norm_topk_prob = 1 is not true or false"),
    ({"architectures": ["GptOssForCausalLM"]}, "'GptOssForCausalLM' is not supported yet (gpt-oss needs attention sinks"),
    ({"architectures": ["DeepseekV2ForCausalLM"]}, "multi-head latent attention"),
])
def test_bad_moe_fields_are_refused_by_name(changes, needle):
    with pytest.raises(ModelLoadError) as e:
        ModelConfig.from_dict(_config(**changes), "cfg.json")
    assert needle in str(e.value) and str(e.value).startswith("cfg.json: ")


def test_param_counts_total_and_active():
    cfg = ModelConfig.from_dict(_config())
    dense_mlp_each = 3 * 64 * 32
    assert cfg.num_params() - cfg.num_params(active=True) == 4 * (8 - 2) * dense_mlp_each


def test_a_missing_expert_tensor_is_named(tiny_models, tmp_path):
    dst = tmp_path / "missing"
    shutil.copytree(tiny_models["mixtral"].path, dst)
    weights = load_file(dst / "model.safetensors")
    del weights["model.layers.1.block_sparse_moe.experts.3.w2.weight"]
    save_file(weights, dst / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"missing tensor\(s\) model.layers.1.block_sparse_moe.experts.3.w2"):
        load_model(dst, torch.float32)
    cfg = json.loads((tiny_models["mixtral"].path / "config.json").read_text())
    assert cfg["num_local_experts"] == 4
    assert isinstance(load_model(tiny_models["mixtral"].path, torch.float32).layers[1], MoEDecoderLayer)

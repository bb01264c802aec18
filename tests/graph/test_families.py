"""Gemma 3 and Phi-3 / Phi-4-mini configs: what is read from released config.json files, what is
refused, and the paths (fusion, compile, tensor parallelism) that refuse these families clearly.
Their numerics against transformers are in test_models_vs_hf.py and engine/test_engine_vs_hf.py."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from strata.errors import ConfigError, ModelLoadError
from strata.graph import fusion
from strata.graph.models.llama import CausalLM
from strata.graph.tensor_parallel import check_shardable
from strata.model_config import SUPPORTED_ARCHITECTURES, ModelConfig

# config.json of released models, as published (unread fields kept: they must be ignored)
GEMMA3_1B = {
    "architectures": ["Gemma3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "attn_logit_softcapping": None, "bos_token_id": 2, "cache_implementation": "hybrid", "eos_token_id": [1, 106],
    "final_logit_softcapping": None, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
    "hidden_size": 1152, "initializer_range": 0.02, "intermediate_size": 6912, "max_position_embeddings": 32768,
    "model_type": "gemma3_text", "num_attention_heads": 4, "num_hidden_layers": 26, "num_key_value_heads": 1,
    "pad_token_id": 0, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000,
    "rope_scaling": None, "rope_theta": 1000000, "sliding_window": 512, "sliding_window_pattern": 6,
    "torch_dtype": "bfloat16", "transformers_version": "4.50.0.dev0", "use_cache": True, "vocab_size": 262144,
}
PHI3_MINI_4K = {
    "architectures": ["Phi3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 1,
    "embd_pdrop": 0.0, "eos_token_id": 32000, "hidden_act": "silu", "hidden_size": 3072, "initializer_range": 0.02,
    "intermediate_size": 8192, "max_position_embeddings": 4096, "model_type": "phi3", "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 32, "original_max_position_embeddings": 4096,
    "pad_token_id": 32000, "resid_pdrop": 0.0, "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 10000.0,
    "sliding_window": 2047, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
    "vocab_size": 32064,
}
PHI4_MINI = {
    "architectures": ["Phi3ForCausalLM"], "attention_bias": False, "bos_token_id": 199999, "embd_pdrop": 0.0,
    "eos_token_id": 199999, "full_attn_mod": 1, "hidden_act": "silu", "hidden_size": 3072,
    "intermediate_size": 8192, "interpolate_factor": 1, "lm_head_bias": False, "max_position_embeddings": 131072,
    "mlp_bias": False, "model_type": "phi3", "num_attention_heads": 24, "num_hidden_layers": 32,
    "num_key_value_heads": 8, "original_max_position_embeddings": 4096, "pad_token_id": 199999,
    "partial_rotary_factor": 0.75, "resid_pdrop": 0.0, "rms_norm_eps": 1e-05,
    "rope_scaling": {"long_factor": [1.0 + i / 10 for i in range(48)], "short_factor": [1.0] * 48,
                     "type": "longrope"},
    "rope_theta": 10000.0, "sliding_window": 262144, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "vocab_size": 200064,
}


def test_gemma3_1b_config():
    cfg = ModelConfig.from_dict(GEMMA3_1B)
    assert (cfg.head_dim, cfg.num_kv_heads, cfg.hidden_act, cfg.gemma_norms, cfg.qk_norm) == (
        256, 1, "gelu_pytorch_tanh", True, True)
    assert cfg.embed_scale == pytest.approx(math.sqrt(1152)) and cfg.attn_scale == pytest.approx(1 / 16)
    assert (cfg.rope_theta, cfg.rope_local_theta, cfg.rope_scaling) == (1e6, 10000, None)
    globals_ = [i for i in range(26) if cfg.layer_window(i) is None]
    assert globals_ == [5, 11, 17, 23] and cfg.layer_window(0) == 512  # every 6th layer is global
    assert cfg.eos_token_ids == [1, 106] and cfg.tie_word_embeddings
    assert not cfg.llama_structure
    assert cfg.num_params() == pytest.approx(1.0e9, rel=0.01)  # "Gemma 3 1B"


def test_gemma3_layer_types_and_per_type_rope_parameters():
    """transformers >= 5 writes layer_types and rope_parameters per layer type."""
    d = {**GEMMA3_1B, "num_hidden_layers": 3, "layer_types": ["full_attention", "sliding_attention", "full_attention"],
         "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}
    d.pop("rope_theta"), d.pop("rope_local_base_freq"), d.pop("rope_scaling")
    cfg = ModelConfig.from_dict(d)
    assert cfg.layer_windows == (None, 512, None)
    assert (cfg.rope_theta, cfg.rope_local_theta, cfg.rope_scaling["factor"]) == (1e6, 1e4, 8.0)


def test_phi3_and_phi4_mini_configs():
    phi3 = ModelConfig.from_dict(PHI3_MINI_4K)
    assert phi3.layer_windows == (2047,) * 32 and phi3.rotary_dims == 96 and phi3.llama_structure
    phi4 = ModelConfig.from_dict(PHI4_MINI)
    assert phi4.rotary_dims == 96 and phi4.head_dim == 128 and not phi4.llama_structure
    assert phi4.layer_windows == ()  # a 262144-token window never binds under 131072 positions
    s = phi4.rope_scaling
    assert s["rope_type"] == "longrope" and s["original_max_position_embeddings"] == 4096
    assert s["attention_factor"] == pytest.approx(math.sqrt(1 + math.log(32) / math.log(4096)))


@pytest.mark.parametrize("change, words", [
    ({"attn_logit_softcapping": 50.0}, ["attn_logit_softcapping", "not implemented"]),
    ({"use_bidirectional_attention": True}, ["use_bidirectional_attention", "not implemented"]),
    ({"hidden_activation": "relu"}, ["hidden_activation", "relu", "gelu_pytorch_tanh"]),
    ({"layer_types": ["full_attention"]}, ["layer_types", "26 entries"]),
    ({"query_pre_attn_scalar": 0}, ["query_pre_attn_scalar", "out of range"]),
])
def test_gemma3_refusals(change, words):
    with pytest.raises(ModelLoadError) as e:
        ModelConfig.from_dict({**GEMMA3_1B, **change}, "/m/config.json")
    assert all(w in str(e.value) for w in words), str(e.value)


@pytest.mark.parametrize("change, words", [
    ({"rope_scaling": {"type": "longrope", "short_factor": [1.0] * 47, "long_factor": [1.0] * 48}},
     ["short_factor", "48 positive numbers"]),
    ({"rope_scaling": {"type": "mrope", "factor": 4.0}}, ["rope_scaling.type", "mrope", "longrope"]),
    ({"partial_rotary_factor": 0.01}, ["partial_rotary_factor", "rotary dims"]),
    ({"hidden_act": "gelu_new"}, ["hidden_act", "gelu_new"]),
])
def test_phi_refusals(change, words):
    with pytest.raises(ModelLoadError) as e:
        ModelConfig.from_dict({**PHI4_MINI, **change}, "/m/config.json")
    assert all(w in str(e.value) for w in words), str(e.value)


def test_unsupported_architecture_lists_every_family():
    with pytest.raises(ModelLoadError) as e:
        ModelConfig.from_dict({**PHI3_MINI_4K, "architectures": ["Gemma3ForConditionalGeneration"]})
    msg = str(e.value)
    assert "Gemma3ForConditionalGeneration" in msg
    assert all(a in msg for a in SUPPORTED_ARCHITECTURES)
    assert "Gemma3ForCausalLM" in msg and "Phi3ForCausalLM" in msg


def _small(d: dict) -> ModelConfig:
    cfg = ModelConfig.from_dict(d)
    return dataclasses.replace(cfg, num_layers=2, vocab_size=64, hidden_size=64, intermediate_size=32,
                               num_heads=2, num_kv_heads=1, head_dim=32, embed_scale=cfg.embed_scale and 8.0,
                               rotary_dim=cfg.rotary_dim and 24, layer_windows=cfg.layer_windows[:2],
                               max_position_embeddings=64, rope_scaling=None)


@pytest.mark.parametrize("config", [GEMMA3_1B, PHI4_MINI], ids=["gemma3", "phi4-mini"])
def test_fusion_refuses_non_llama_layers(config):
    with torch.device("meta"):
        model = CausalLM(_small(config))
    with pytest.raises(ConfigError, match="--fuse / --compile: the FX fusion passes describe the Llama-shaped"):
        fusion.fuse_model(model)


def test_compile_refuses_windowed_layers_but_fuse_keeps_the_window():
    from strata.graph.capture_passes import lower_for_compile

    with torch.device("meta"):
        model = CausalLM(_small(PHI3_MINI_4K))  # Llama-shaped, every layer windowed
    step = fusion.fuse_model(model)  # --fuse: the attention leaf carries the window
    from strata.kernels.attention import attend_cached

    windows = [n.args[6] for n in step.graph_module.graph.nodes if n.target is attend_cached]
    assert windows == [2047, 2047]
    with pytest.raises(ConfigError, match="--compile: .* no sliding-window attention"):
        lower_for_compile(step.graph_module)


@pytest.mark.parametrize("config", [GEMMA3_1B, PHI3_MINI_4K], ids=["gemma3", "phi3"])
def test_tensor_parallel_refuses_new_families(config):
    with pytest.raises(ConfigError, match="is not sharded yet"):
        check_shardable(ModelConfig.from_dict(config), 2)

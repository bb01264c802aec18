"""The memory formula: KV bytes per token, byte-size parsing, and the number of KV blocks."""

from __future__ import annotations

import pytest
import torch

from strata.config import EngineConfig, parse_bytes
from strata.errors import CapacityError, ConfigError
from strata.memory import planner
from strata.memory.planner import kv_bytes_per_token, plan_memory, weight_bytes
from strata.model_config import ModelConfig

LLAMA2_7B = {
    "architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 11008,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
    "vocab_size": 32000, "max_position_embeddings": 4096, "torch_dtype": "float16",
}
LLAMA3_8B = dict(LLAMA2_7B, hidden_size=4096, intermediate_size=14336, num_key_value_heads=8,
                 vocab_size=128256, max_position_embeddings=8192, torch_dtype="bfloat16")
QWEN3_0_6B = {
    "architectures": ["Qwen3ForCausalLM"], "hidden_size": 1024, "intermediate_size": 3072,
    "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
    "vocab_size": 151936, "max_position_embeddings": 40960, "tie_word_embeddings": True,
}


def test_kv_bytes_per_token_llama2_7b_fp16():
    cfg = ModelConfig.from_dict(LLAMA2_7B)
    assert cfg.head_dim == 128
    assert kv_bytes_per_token(cfg, torch.float16) == 524288  # 2 * 32 * 32 * 128 * 2 = 0.5 MiB
    assert kv_bytes_per_token(cfg, torch.float32) == 2 * 524288


def test_kv_bytes_per_token_gqa_and_explicit_head_dim():
    assert kv_bytes_per_token(ModelConfig.from_dict(LLAMA3_8B), torch.bfloat16) == 131072
    # Qwen3: head_dim 128 although hidden / heads = 64
    assert kv_bytes_per_token(ModelConfig.from_dict(QWEN3_0_6B), torch.bfloat16) == 2 * 28 * 8 * 128 * 2


def test_param_count_llama2_7b():
    assert ModelConfig.from_dict(LLAMA2_7B).num_params() == 6_738_415_616


def test_param_count_matches_transformers(tiny_models):
    from strata.model_config import ModelConfig as MC

    for m in tiny_models.values():
        cfg = MC.from_file(m.path / "config.json")
        assert cfg.num_params() == sum(p.numel() for p in m.hf.parameters()), m.family


@pytest.mark.parametrize(
    "text,expected",
    [
        ("4GiB", 4 * 2**30), ("4 GiB", 4 * 2**30), ("4gib", 4 * 2**30), ("512MiB", 512 * 2**20),
        ("1MiB", 2**20), ("2GB", 2 * 10**9), ("1.5GB", 1_500_000_000), ("64KiB", 65536),
        ("1024", 1024), ("100b", 100), (4096, 4096), (1.5e9, 1_500_000_000),
    ],
)
def test_parse_bytes(text, expected):
    assert parse_bytes(text, "kv_cache_memory") == expected


@pytest.mark.parametrize("bad", ["", "lots", "4 GiBs", "-1GiB", "0", 0, -5, True, "1e9", "GiB"])
def test_parse_bytes_rejects(bad):
    with pytest.raises(ConfigError, match="kv_cache_memory"):
        parse_bytes(bad, "kv_cache_memory")


def test_engine_config_parses_size():
    assert EngineConfig(kv_cache_memory="4GiB").kv_cache_memory == 4 * 2**30
    with pytest.raises(ConfigError, match="kv_cache_memory"):
        EngineConfig(kv_cache_memory="four gigs")


def _plan(cfg, budget, block_size=16, max_len=4096, max_num_seqs=8, dtype=torch.float16, fraction=0.5):
    return plan_memory(cfg, dtype, block_size, max_len, max_num_seqs, budget, fraction, "cpu")


def test_blocks_from_explicit_budget():
    cfg = ModelConfig.from_dict(LLAMA2_7B)
    plan = _plan(cfg, 4 * 2**30)
    per_block = 524288 * 16
    assert plan.num_blocks == 4 * 2**30 // per_block == 512
    assert plan.tokens == 8192 and plan.kv_cache_bytes == 4 * 2**30
    assert plan.max_len_sequences == 2.0
    plan = _plan(cfg, 4 * 2**30 + per_block - 1)  # a partial block is not a block
    assert plan.num_blocks == 512
    assert "512 blocks" in plan.summary()


def test_exactly_one_sequence_fits_and_one_byte_less_does_not():
    cfg = ModelConfig.from_dict(LLAMA2_7B)
    need = 4096 // 16 * 16 * 524288  # 256 blocks
    assert _plan(cfg, need).num_blocks == 256
    with pytest.raises(CapacityError) as err:
        _plan(cfg, need - 1)
    msg = str(err.value)
    assert "255 blocks" in msg and "256 blocks" in msg and "max_model_len=4096" in msg


def test_max_model_len_not_multiple_of_block_size():
    cfg = ModelConfig.from_dict(LLAMA2_7B)
    per_block = 524288 * 16
    assert _plan(cfg, 7 * per_block, max_len=97).num_blocks == 7  # ceil(97 / 16) = 7
    with pytest.raises(CapacityError):
        _plan(cfg, 6 * per_block, max_len=97)


def test_auto_budget_capped_by_max_num_seqs(monkeypatch):
    cfg = ModelConfig.from_dict(LLAMA2_7B)
    monkeypatch.setattr(planner, "free_memory", lambda device: 2**50)
    plan = _plan(cfg, None, max_len=1000, max_num_seqs=3)
    assert plan.num_blocks == 3 * 63  # ceil(1000 / 16) = 63 blocks per sequence
    monkeypatch.setattr(planner, "free_memory", lambda device: 201 * 16 * 524288)
    plan = _plan(cfg, None, max_len=1000, max_num_seqs=3, fraction=0.5)
    assert plan.num_blocks == 100  # half of the free memory, below the cap of 189


def test_engine_block_count(tiny_models, llm_factory):
    m = tiny_models["qwen3"]
    assert m.kv_bytes_per_token == 2 * 2 * 2 * 32 * 4
    llm = llm_factory(m, kv_cache_memory="1MiB", block_size=16)
    assert llm.engine.plan.kv_bytes_per_token == m.kv_bytes_per_token
    assert llm.engine.block_manager.num_blocks == 2**20 // (16 * m.kv_bytes_per_token)
    caches = llm.engine.kv_caches
    assert len(caches) == 2 and tuple(caches[0].shape) == (2, llm.engine.block_manager.num_blocks, 16, 2, 32)


def test_streamed_weight_bytes_leave_out_an_untied_embedding():
    """A decode step reads every weight but an untied input embedding (one row per sequence), in
    the bytes the embedding is held in: fp32, or bf16 under bf16 storage and for a bf16 checkpoint
    quantised into an fp32 model (quant.narrow_untied_embedding)."""
    import dataclasses

    from strata.demo.shapes import SHAPES
    from strata.memory.planner import streamed_weight_bytes

    untied = ModelConfig.from_dict(dict(SHAPES["llama-3.1-8b"]), "8b")  # bf16 checkpoint, untied
    tied = dataclasses.replace(untied, tie_word_embeddings=True)
    embed = untied.vocab_size * untied.hidden_size
    f32 = torch.float32
    assert streamed_weight_bytes(tied, f32, "int4") == weight_bytes(tied, f32, "int4")
    assert streamed_weight_bytes(untied, f32) == weight_bytes(untied, f32) - 4 * embed
    for q in ("bf16", "int8", "int4"):
        assert streamed_weight_bytes(untied, f32, q) == weight_bytes(untied, f32, q) - 2 * embed
    fp32_ckpt = dataclasses.replace(untied, torch_dtype=f32)
    assert streamed_weight_bytes(fp32_ckpt, f32, "int8") == weight_bytes(fp32_ckpt, f32, "int8") - 4 * embed

"""YaRN and dynamic-NTK rope against transformers (fp32, 1e-4), at positions up to 4x the
pre-training window (original_max_position_embeddings 32, sequences of 128).

YaRN's table is static, so every sequence matches transformers. Dynamic NTK's base depends on the
sequence length; Strata stretches one table for max_model_len (graph/layers.py: _dynamic_theta),
so it matches transformers for a forward of max_model_len tokens, and everywhere when
max_model_len stays within max_position_embeddings."""

from __future__ import annotations

import math

import pytest
import torch
import transformers as tf
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from strata import SamplingParams
from strata.errors import ConfigError, ModelLoadError
from strata.graph.layers import RotaryEmbedding
from strata.graph.loader import load_model
from strata.kernels import cpu_decode_layer
from strata.model_config import ModelConfig
from strata.platform import cpu_decode_step

ATOL = 1e-4
ORIG, LONG = 32, 128  # the pre-training window and 4x it
# Qwen2.5's long-context recipe: max_position_embeddings stays at the pre-training length
YARN_QWEN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIG,
             "beta_fast": 4.0, "beta_slow": 0.5}  # small betas: the ramp spans dims 0..5 of 8 here
DYNAMIC = {"rope_type": "dynamic", "factor": 4.0}

_SMALL = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6, initializer_range=0.1,
              bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)


def _config(arch: str, rope: dict, max_positions: int, theta: float = 1000.0, **extra) -> dict:
    """A config.json of a small model: what Strata reads and transformers builds from."""
    return {"architectures": [arch], **_SMALL, "max_position_embeddings": max_positions, "rope_theta": theta,
            "rope_scaling": dict(rope), **extra}


# --- the cos/sin tables against transformers' rotary module -----------------------------------

def _hf_tables(d: dict, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    cfg = tf.LlamaConfig(**{k: v for k, v in d.items() if k != "architectures"})
    rotary = LlamaRotaryEmbedding(cfg)
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32), torch.arange(length)[None])
    return cos[0], sin[0]


def _strata_tables(d: dict, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    cfg = ModelConfig.from_dict(d)
    rotary = RotaryEmbedding(cfg.rotary_dims, length, cfg.rope_theta, cfg.rope_scaling)
    return rotary.cos, rotary.sin


TABLE_CASES = [
    pytest.param(_config("LlamaForCausalLM", YARN_QWEN, ORIG), id="yarn-qwen2.5-betas"),
    pytest.param(_config("LlamaForCausalLM", {**YARN_QWEN, "beta_fast": None, "beta_slow": None}, ORIG, 10000.0),
                 id="yarn-default-betas"),
    pytest.param(_config("LlamaForCausalLM", {**YARN_QWEN, "truncate": False}, ORIG), id="yarn-no-truncate"),
    pytest.param(_config("LlamaForCausalLM", {**YARN_QWEN, "attention_factor": 0.8}, ORIG), id="yarn-attn-factor"),
    # DeepSeek-V2's fields: factor 40, mscale 0.707, mscale_all_dim 1 (V3's are both 1: gain 1)
    pytest.param(_config("LlamaForCausalLM", {"rope_type": "yarn", "factor": 40.0, "mscale": 0.707,
                                              "mscale_all_dim": 1.0, "original_max_position_embeddings": ORIG,
                                              "beta_fast": 32, "beta_slow": 1}, 40 * ORIG, 10000.0),
                 id="yarn-deepseek-mscale"),
    pytest.param(_config("LlamaForCausalLM", {"rope_type": "yarn", "factor": 4.0, "mscale": 1.0,
                                              "mscale_all_dim": 1.0, "original_max_position_embeddings": ORIG},
                         LONG), id="yarn-deepseek-v3-mscale"),
    # the pre-training length given at the config's top level wins over rope_scaling's (transformers)
    pytest.param(_config("LlamaForCausalLM", {**YARN_QWEN, "original_max_position_embeddings": 64}, LONG,
                         original_max_position_embeddings=ORIG), id="yarn-top-level-original"),
]


@pytest.mark.parametrize("d", TABLE_CASES)
def test_yarn_tables_match_transformers(d):
    cos, sin = _strata_tables(d, LONG)
    ref_cos, ref_sin = _hf_tables(d, LONG)
    torch.testing.assert_close(cos, ref_cos, atol=1e-6, rtol=0)
    torch.testing.assert_close(sin, ref_sin, atol=1e-6, rtol=0)


def test_yarn_deepseek_attention_factor_is_transformers():
    """The mscale / mscale_all_dim ratio, and factor null = max_position_embeddings / original
    (DeepSeek's rule, in _compute_yarn_parameters; transformers' validation wants factor, so the
    reference gets the ratio explicitly)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {"rope_type": "yarn", "mscale": 0.707, "mscale_all_dim": 1.0, "original_max_position_embeddings": ORIG}
    d = _config("LlamaForCausalLM", {**rope, "factor": None}, 40 * ORIG, 10000.0)
    ref = _config("LlamaForCausalLM", {**rope, "factor": 40.0}, 40 * ORIG, 10000.0)
    inv_freq, gain = ROPE_INIT_FUNCTIONS["yarn"](tf.LlamaConfig(**{k: v for k, v in ref.items() if k != "architectures"}))
    s = ModelConfig.from_dict(d).rope_scaling
    assert s["factor"] == 40.0 and s["attention_factor"] == pytest.approx(gain, rel=1e-12)
    assert gain == pytest.approx((0.1 * 0.707 * math.log(40) + 1) / (0.1 * math.log(40) + 1))
    cos, _ = _strata_tables(d, LONG)
    torch.testing.assert_close(cos, _hf_tables(ref, LONG)[0], atol=1e-6, rtol=0)


@pytest.mark.parametrize("length", [ORIG // 2, ORIG, 3 * ORIG, LONG])
def test_dynamic_table_is_transformers_for_a_sequence_of_its_length(length):
    d = _config("LlamaForCausalLM", DYNAMIC, ORIG)
    cos, sin = _strata_tables(d, length)
    ref_cos, ref_sin = _hf_tables(d, length)  # a fresh module: one forward of `length` tokens
    torch.testing.assert_close(cos, ref_cos, atol=1e-5, rtol=0)
    torch.testing.assert_close(sin, ref_sin, atol=1e-5, rtol=0)


def test_dynamic_table_is_plain_rope_within_the_window():
    d = _config("LlamaForCausalLM", DYNAMIC, ORIG)
    plain = _config("LlamaForCausalLM", {"rope_type": "default"}, ORIG)
    assert torch.equal(_strata_tables(d, ORIG)[0], _strata_tables(plain, ORIG)[0])
    assert not torch.allclose(_strata_tables(d, LONG)[0][:ORIG], _strata_tables(plain, ORIG)[0], atol=1e-3)


# --- tiny models: logits of a whole sequence, and greedy generation ------------------------------

def _tiny(tmp_path, name: str, d: dict, seed: int):
    from conftest import TinyModel, _randomise

    torch.manual_seed(seed)
    cls = {"Qwen2ForCausalLM": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
           "LlamaForCausalLM": (tf.LlamaConfig, tf.LlamaForCausalLM)}[d["architectures"][0]]
    cfg = cls[0](**{k: v for k, v in d.items() if k != "architectures"})
    cfg._attn_implementation = "eager"
    model = cls[1](cfg)
    _randomise(model, seed)
    model = model.float().eval()
    model.save_pretrained(tmp_path / name, safe_serialization=True)
    return TinyModel(name, tmp_path / name, model, [2], 384, 2, 2, 16)


@pytest.fixture(scope="module")
def yarn_model(tmp_path_factory):
    d = _config("Qwen2ForCausalLM", YARN_QWEN, ORIG, use_sliding_window=False)
    return _tiny(tmp_path_factory.mktemp("yarn"), "qwen2-yarn", d, seed=11)


@pytest.fixture(scope="module")
def dynamic_model(tmp_path_factory):
    return _tiny(tmp_path_factory.mktemp("dynamic"), "llama-dynamic", _config("LlamaForCausalLM", DYNAMIC, ORIG),
                 seed=12)


def _strata_logits(path, ids: list[int], max_positions: int) -> torch.Tensor:
    m = load_model(path, torch.float32, "cpu", max_positions)
    t = torch.tensor([ids])
    with torch.no_grad():
        return m.compute_logits(m(t, torch.arange(len(ids))[None])).float()[0]


@torch.no_grad()
def _hf_logits(model, ids: list[int]) -> torch.Tensor:
    return model.hf(torch.tensor([ids])).logits[0].float()


def test_yarn_logits_match_transformers_past_the_window(yarn_model, prompt_of):
    for length in (20, LONG):  # yarn's table is static: within and past the window alike
        ids = prompt_of(31, length)
        torch.testing.assert_close(_strata_logits(yarn_model.path, ids, LONG), _hf_logits(yarn_model, ids),
                                   atol=ATOL, rtol=0)


def test_yarn_attention_factor_is_exercised(yarn_model, prompt_of, tmp_path):
    """Guard: a gain of 1 instead of yarn's 0.1 ln(4) + 1 changes the logits visibly."""
    import json
    import shutil

    dst = tmp_path / "gain1"
    shutil.copytree(yarn_model.path, dst)
    cfg = json.loads((dst / "config.json").read_text())
    key = "rope_parameters" if "rope_parameters" in cfg else "rope_scaling"
    cfg[key]["attention_factor"] = 1.0
    (dst / "config.json").write_text(json.dumps(cfg))
    ids = prompt_of(32, 64)
    assert (_strata_logits(yarn_model.path, ids, LONG) - _strata_logits(dst, ids, LONG)).abs().max() > 1e-2


def test_dynamic_logits_match_transformers(dynamic_model, prompt_of):
    """max_model_len 128: a 128-token sequence is transformers' (fresh rotary state, so it grows to
    128); max_model_len 32: every sequence within it is transformers' plain rotary."""
    dynamic_model.hf.model.rotary_emb.__init__(dynamic_model.hf.config)  # fresh dynamic state
    ids = prompt_of(33, LONG)
    torch.testing.assert_close(_strata_logits(dynamic_model.path, ids, LONG), _hf_logits(dynamic_model, ids),
                               atol=ATOL, rtol=0)
    for length in (ORIG // 2, ORIG):
        ids = prompt_of(34, length)
        torch.testing.assert_close(_strata_logits(dynamic_model.path, ids, ORIG), _hf_logits(dynamic_model, ids),
                                   atol=ATOL, rtol=0)


@pytest.fixture
def count_fused(monkeypatch):
    calls = []
    real = cpu_decode_layer.decode_layers

    def counting(x, layers, step):
        calls.append(x.shape[0])
        return real(x, layers, step)

    monkeypatch.setattr(cpu_decode_step.cpu_decode_layer, "decode_layers", counting)
    return calls


@torch.no_grad()
def _hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):  # no KV cache: each step a whole forward, as the reference
        ids.append(int(model.hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_yarn_greedy_matches_transformers(backend, yarn_model, llm_factory, prompt_of, engine_clean, count_fused):
    """A 40-token prompt (past the 32-token window), 40 greedy tokens, max_model_len 128 (beyond
    max_position_embeddings 32: yarn's factor allows it). The cpu backend runs the fused numba
    decode layer, which reads the same (attention-factor-scaled) tables."""
    prompt = prompt_of(35, 40)
    llm = llm_factory(yarn_model, attention_backend=backend, max_model_len=LONG)
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False)
    assert out[0].outputs[0].token_ids == _hf_greedy(yarn_model, prompt, 40)
    assert bool(count_fused) == (backend == "cpu" and cpu_decode_layer.available())
    engine_clean(llm)


def test_dynamic_greedy_matches_transformers_at_max_model_len(dynamic_model, llm_factory, prompt_of, engine_clean):
    """transformers keeps the longest base it has seen while sequences stay past the window, so
    after one 128-token forward its rotary is the table of a max_model_len-128 engine."""
    rotary = dynamic_model.hf.model.rotary_emb
    rotary.__init__(dynamic_model.hf.config)
    with torch.no_grad():
        dynamic_model.hf(torch.tensor([prompt_of(36, LONG)]))
    assert rotary.max_seq_len_cached == LONG
    prompt = prompt_of(37, 40)
    llm = llm_factory(dynamic_model, max_model_len=LONG)
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), use_tqdm=False)
    assert out[0].outputs[0].token_ids == _hf_greedy(dynamic_model, prompt, 30)
    assert rotary.max_seq_len_cached == LONG
    engine_clean(llm)


# --- context limits and bad fields -------------------------------------------------------------

def test_context_limits():
    yarn = ModelConfig.from_dict(_config("Qwen2ForCausalLM", YARN_QWEN, ORIG))
    assert yarn.max_model_len(None) == LONG and yarn.max_model_len(100) == 100
    with pytest.raises(ConfigError, match=r"129 exceeds .*original_max_position_embeddings 32 x factor 4 = 128"):
        yarn.max_model_len(LONG + 1)
    dynamic = ModelConfig.from_dict(_config("LlamaForCausalLM", DYNAMIC, ORIG))
    assert dynamic.max_model_len(None) == ORIG and dynamic.max_model_len(LONG) == LONG  # opt-in stretch
    with pytest.raises(ConfigError, match="dynamic rope context"):
        dynamic.max_model_len(LONG + 1)
    # a config whose max_position_embeddings is already the long one (DeepSeek, Qwen2.5-1M)
    long = ModelConfig.from_dict(_config("LlamaForCausalLM", {**YARN_QWEN, "factor": 2.0}, LONG))
    assert long.max_model_len(None) == LONG


@pytest.mark.parametrize("rope, words", [
    ({**YARN_QWEN, "factor": 0.5}, ["rope_scaling.factor", "0.5", ">= 1"]),
    ({**YARN_QWEN, "factor": "4"}, ["rope_scaling.factor", '"4"', "not a number"]),
    ({**YARN_QWEN, "beta_fast": 1.0, "beta_slow": 2.0}, ["rope_scaling.beta_fast", ">= rope_scaling.beta_slow=2"]),
    ({**YARN_QWEN, "beta_fast": None, "beta_slow": 40.0}, ["beta_fast (32) is below beta_slow (40)"]),
    ({**YARN_QWEN, "beta_slow": 0}, ["rope_scaling.beta_slow", "= 0", "> 0"]),
    ({**YARN_QWEN, "mscale": "x"}, ["rope_scaling.mscale", '"x"', "not a number"]),
    ({**YARN_QWEN, "mscale_all_dim": -1}, ["rope_scaling.mscale_all_dim", ">= 0"]),
    ({**YARN_QWEN, "attention_factor": 0}, ["rope_scaling.attention_factor", "> 0"]),
    ({**YARN_QWEN, "truncate": "yes"}, ["rope_scaling.truncate", "true or false"]),
    ({**YARN_QWEN, "original_max_position_embeddings": 0}, ["rope_scaling.original_max_position_embeddings",
                                                            "out of range", "[1, "]),
    ({**YARN_QWEN, "factor": None, "original_max_position_embeddings": 64},
     ["factor is null", "max_position_embeddings (32) / original_max_position_embeddings (64)", "factor >= 1"]),
    ({"rope_type": "dynamic"}, ["rope_scaling.factor", "is missing", ">= 1"]),
    ({"rope_type": "dynamic", "factor": 0.9}, ["rope_scaling.factor", "0.9", ">= 1"]),
])
def test_bad_fields(rope, words):
    with pytest.raises(ModelLoadError) as e:
        ModelConfig.from_dict(_config("Qwen2ForCausalLM", rope, ORIG), "/m/config.json")
    msg = str(e.value)
    assert msg.startswith("/m/config.json: ") and all(w in msg for w in words), msg


def test_dynamic_needs_more_than_two_rotary_dims():
    d = {**_config("LlamaForCausalLM", DYNAMIC, ORIG), "head_dim": 2}
    with pytest.raises(ModelLoadError, match="dynamic rope needs more than 2 rotary dims"):
        ModelConfig.from_dict(d)

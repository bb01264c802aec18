"""config.json is untrusted input: a bad field is a ModelLoadError naming the file, the field, the
value and what is accepted (model_config.SCHEMA, ROPE_SCHEMAS, cross-field rules); every config of
the supported families, with the many fields Strata does not read, stays valid."""

from __future__ import annotations

import json
import shutil

import pytest

from strata import LLM
from strata.demo.random_models import SHAPES
from strata.errors import ModelLoadError
from strata.model_config import REQUIRED, SCHEMA, ModelConfig

VOCAB = 384  # tests/conftest.py


@pytest.fixture
def model_copy(tiny_models, tmp_path):
    """A private copy of the tiny Llama checkpoint (GQA 4:2, head_dim 16, tied) to corrupt."""
    dst = tmp_path / "model"
    shutil.copytree(tiny_models["llama"].path, dst)
    return dst


def _set(**fields):
    def edit(cfg: dict) -> dict:
        return {**cfg, **fields}
    return edit


def _drop(*names, **fields):
    def edit(cfg: dict) -> dict:
        return {**{k: v for k, v in cfg.items() if k not in names}, **fields}
    return edit


def _rope(**params):
    def edit(cfg: dict) -> dict:
        return {**{k: v for k, v in cfg.items() if k != "rope_scaling"}, "rope_parameters": params}
    return edit


def _raw(text: bytes):
    return lambda cfg: text


LLAMA3_ROPE = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=32)

# (edit of the tiny Llama's config.json, fragments the message must contain besides its path)
CASES = [
    pytest.param(lambda cfg: [cfg], ["top level is a list", "JSON object"], id="list-not-object"),
    pytest.param(_raw(b'{"hidden_size": "\xff\xfe"}'), ["not valid UTF-8", "0xff"], id="invalid-utf8"),
    pytest.param(_raw(b'{"hidden_size": 64,'), ["cannot parse"], id="truncated-json"),
    pytest.param(_raw(b"[" * 100_000 + b"]" * 100_000), ["cannot parse"], id="nested-too-deep"),
    pytest.param(_set(hidden_size="abc"), ["hidden_size", '"abc"', "not an integer", "[1, 131072]"], id="hidden-str"),
    pytest.param(_set(hidden_size=None), ["hidden_size", "is null", "[1, 131072]"], id="hidden-null"),
    pytest.param(_set(hidden_size=255.5), ["hidden_size", "255.5", "not an integer"], id="hidden-float"),
    pytest.param(_set(hidden_size=True), ["hidden_size", "true", "not an integer"], id="hidden-bool"),
    pytest.param(_drop("hidden_size"), ["hidden_size", "is missing"], id="hidden-missing"),
    pytest.param(_set(num_hidden_layers=0), ["num_hidden_layers", "= 0", "out of range", "[1, 1024]"], id="layers-0"),
    pytest.param(_set(num_hidden_layers=-1), ["num_hidden_layers", "= -1", "out of range"], id="layers-neg"),
    pytest.param(_set(vocab_size=-5), ["vocab_size", "= -5", "out of range", "[1, 16777216]"], id="vocab-neg"),
    pytest.param(_set(intermediate_size=10**12), ["intermediate_size", "1000000000000", "[1, 1048576]"],
                 id="intermediate-1e12"),
    pytest.param(_set(max_position_embeddings=0), ["max_position_embeddings", "= 0", "out of range"], id="positions-0"),
    pytest.param(_set(rms_norm_eps="abc"), ["rms_norm_eps", '"abc"', "not a number", "(0, 1]"], id="eps-str"),
    pytest.param(_set(rms_norm_eps=0), ["rms_norm_eps", "= 0", "(0, 1]"], id="eps-0"),
    pytest.param(_raw(b'{"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128, '
                      b'"num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 384, "rms_norm_eps": NaN}'),
                 ["rms_norm_eps", "NaN", "not finite"], id="eps-nan"),
    pytest.param(_set(eos_token_id="abc"), ["eos_token_id", '"abc"', "not an integer", f"[0, vocab_size={VOCAB})"],
                 id="eos-str"),
    pytest.param(_set(eos_token_id=[2, "x"]), ["eos_token_id[1]", '"x"', "not an integer"], id="eos-list-str"),
    pytest.param(_set(eos_token_id=VOCAB), ["eos_token_id", f"= {VOCAB}", "out of range", f"vocab_size={VOCAB}"],
                 id="eos-outside-vocab"),
    pytest.param(_set(bos_token_id=-1), ["bos_token_id", "= -1", "out of range"], id="bos-neg"),
    pytest.param(_set(rope_theta=-1), ["rope_theta", "= -1", "out of range", "> 1"], id="rope-theta-neg"),
    pytest.param(_set(rope_theta="abc"), ["rope_theta", '"abc"', "not a number"], id="rope-theta-str"),
    pytest.param(_set(architectures="LlamaForCausalLM"), ["architectures", '"LlamaForCausalLM"', "not a list",
                                                          '["LlamaForCausalLM"]'], id="architectures-string"),
    pytest.param(_set(architectures=[]), ["architectures", "empty", "Qwen3ForCausalLM"], id="architectures-empty"),
    pytest.param(_set(num_key_value_heads=3), ["num_attention_heads = 4", "num_key_value_heads = 3",
                                               "not a multiple", "{1, 2, 4}"], id="kv-heads-not-dividing"),
    pytest.param(_set(num_key_value_heads=8), ["num_key_value_heads", "= 8", "num_attention_heads=4"],
                 id="kv-heads-above-heads"),
    pytest.param(_drop("head_dim", num_attention_heads=3, num_key_value_heads=1),
                 ["hidden_size = 64", "num_attention_heads = 3", "not divisible", "head_dim"], id="heads-not-dividing-hidden"),
    pytest.param(_set(head_dim=15), ["head_dim", "= 15", "odd", "even"], id="head-dim-odd"),
    pytest.param(_set(head_dim=0), ["head_dim", "= 0", "out of range"], id="head-dim-0"),
    pytest.param(_set(tie_word_embeddings="yes"), ["tie_word_embeddings", '"yes"', "true or false"], id="tie-str"),
    pytest.param(_set(attention_bias=1), ["attention_bias", "= 1", "true or false"], id="bias-int"),
    pytest.param(_set(sliding_window=0), ["sliding_window", "= 0", "out of range", "(or null)"], id="sliding-0"),
    pytest.param(_set(sliding_window=-1), ["sliding_window", "= -1", "out of range"], id="sliding-neg"),
    pytest.param(_set(torch_dtype=5), ["torch_dtype", "= 5", "not a string"], id="dtype-int"),
    pytest.param(_set(rope_parameters="abc"), ["rope_parameters", '"abc"', "not an object"], id="rope-not-object"),
    pytest.param(_rope(rope_type="mrope", factor=2.0), ["rope_parameters.rope_type", '"mrope"', "not supported",
                                                        "default, linear, dynamic, llama3, yarn"],
                 id="rope-type-unsupported"),
    pytest.param(_rope(rope_type="linear", factor=0.5), ["rope_parameters.factor", "0.5", ">= 1"], id="rope-linear-factor"),
    pytest.param(_rope(rope_type="linear"), ["rope_parameters.factor", "is missing"], id="rope-linear-no-factor"),
    pytest.param(_rope(**{**LLAMA3_ROPE, "factor": "x"}), ["rope_parameters.factor", '"x"', "not a number"],
                 id="rope-llama3-factor-str"),
    pytest.param(_rope(**{k: v for k, v in LLAMA3_ROPE.items() if k != "original_max_position_embeddings"}),
                 ["rope_parameters.original_max_position_embeddings", "is missing"], id="rope-llama3-no-original"),
    pytest.param(_rope(**{**LLAMA3_ROPE, "low_freq_factor": 4.0, "high_freq_factor": 1.0}),
                 ["rope_parameters.high_freq_factor", "= 1.0", "> rope_parameters.low_freq_factor=4.0"],
                 id="rope-llama3-high-below-low"),
    pytest.param(_rope(rope_type="default", rope_theta=-3), ["rope_parameters.rope_theta", "= -3", "> 1"],
                 id="rope-parameters-theta"),
    pytest.param(lambda cfg: {**_drop("rope_parameters")(cfg), "rope_scaling": {"type": 5}},
                 ["rope_scaling.type", "= 5", "not a string"], id="rope-scaling-legacy-type"),
]


@pytest.mark.parametrize("edit, fragments", CASES)
def test_corrupt_config_field_is_named(model_copy, edit, fragments):
    path = model_copy / "config.json"
    corrupted = edit(json.loads(path.read_text()))
    if isinstance(corrupted, bytes):
        path.write_bytes(corrupted)
    else:
        path.write_text(json.dumps(corrupted))
    with pytest.raises(ModelLoadError) as err:
        LLM(model=str(model_copy), dtype="float32", max_model_len=96, kv_cache_memory="1MiB", num_threads=1)
    msg = str(err.value)
    assert str(path) in msg, msg
    for fragment in fragments:
        assert fragment in msg, (fragment, msg)


def _base() -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": VOCAB,
        "max_position_embeddings": 256, "bos_token_id": 1, "eos_token_id": 2,
    }


def _bad_values(name: str, f) -> list:
    """Values of the wrong type and just outside the range of one SCHEMA field."""
    if f.kind is bool:
        return ["true", 1]
    if f.kind is str:
        return [5, ["float32"]]
    bad = ["1", [1, 2] if not f.many else {"a": 1}]
    if f.kind is int:
        bad += [True, 2.0, 2.5]
    if f.lo is not None:
        lo = _base()[f.lo] if isinstance(f.lo, str) else f.lo
        bad.append(lo if f.lo_open else lo - 1)
    if f.hi is not None:
        hi = _base()[f.hi] if isinstance(f.hi, str) else f.hi
        bad.append(hi if f.hi_open else hi + 1)
    return bad


# fields the Llama family reads (use_sliding_window: Qwen only; dtype: when torch_dtype is unset)
READ_BY_LLAMA = [n for n in SCHEMA if n != "use_sliding_window"]


@pytest.mark.parametrize("name", READ_BY_LLAMA)
def test_every_schema_field_refuses_wrong_type_and_range(name):
    f = SCHEMA[name]
    for value in _bad_values(name, f):
        with pytest.raises(ModelLoadError) as err:
            ModelConfig.from_dict({**_base(), name: value}, "/models/x/config.json")
        msg = str(err.value)
        assert msg.startswith("/models/x/config.json: ") and name in msg and json.dumps(value) in msg, msg
        assert "expected" in msg, msg
    if f.default is not REQUIRED:  # absent and null both mean the default
        base = {k: v for k, v in _base().items() if k != name}
        assert ModelConfig.from_dict(base) == ModelConfig.from_dict({**base, name: None})


def test_qwen_reads_sliding_window_only_when_used():
    qwen = {**_base(), "architectures": ["Qwen2ForCausalLM"], "sliding_window": 4096}
    assert ModelConfig.from_dict({**qwen, "use_sliding_window": False}).sliding_window is None
    assert ModelConfig.from_dict({**qwen, "use_sliding_window": True}).sliding_window == 4096
    with pytest.raises(ModelLoadError, match=r"use_sliding_window = \"no\""):
        ModelConfig.from_dict({**qwen, "use_sliding_window": "no"})
    with pytest.raises(ModelLoadError, match=r"sliding_window = 0"):
        ModelConfig.from_dict({**qwen, "use_sliding_window": True, "sliding_window": 0})


# config.json of released models, as published (unread fields kept: they must be ignored)
REAL_CONFIGS = {
    "Llama-3.1-8B-Instruct": {
        "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "hidden_act": "silu",
        "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
        "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama", "num_attention_heads": 32,
        "num_hidden_layers": 32, "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
        "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "transformers_version": "4.43.0.dev0", "use_cache": True, "vocab_size": 128256,
    },
    "Llama-2-7b (pad_token_id -1, legacy linear rope)": {
        "architectures": ["LlamaForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": -1,
        "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 11008, "max_position_embeddings": 4096,
        "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32, "rms_norm_eps": 1e-05,
        "rope_scaling": {"type": "linear", "factor": 2.0}, "torch_dtype": "float16", "vocab_size": 32000,
    },
    "SmolLM2-135M": {
        "architectures": ["LlamaForCausalLM"], "bos_token_id": 0, "eos_token_id": 0, "head_dim": 64,
        "hidden_size": 576, "intermediate_size": 1536, "is_llama_config": True, "max_position_embeddings": 8192,
        "num_attention_heads": 9, "num_hidden_layers": 30, "num_key_value_heads": 3, "rms_norm_eps": 1e-05,
        "rope_interleaved": False, "rope_scaling": None, "rope_theta": 100000, "tie_word_embeddings": True,
        "torch_dtype": "bfloat16", "vocab_size": 49152,
    },
    "Mistral-7B-v0.1": {
        "architectures": ["MistralForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
        "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
        "max_position_embeddings": 32768, "model_type": "mistral", "num_attention_heads": 32,
        "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
        "sliding_window": 4096, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 32000,
    },
    "Mistral-Nemo (head_dim 128 != 5120 / 32)": {
        "architectures": ["MistralForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "head_dim": 128,
        "hidden_size": 5120, "intermediate_size": 14336, "max_position_embeddings": 1024000,
        "num_attention_heads": 32, "num_hidden_layers": 40, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
        "rope_theta": 1000000.0, "sliding_window": None, "torch_dtype": "bfloat16", "vocab_size": 131072,
    },
    "Qwen2.5-0.5B-Instruct": {
        "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
        "eos_token_id": 151645, "hidden_act": "silu", "hidden_size": 896, "initializer_range": 0.02,
        "intermediate_size": 4864, "max_position_embeddings": 32768, "max_window_layers": 21,
        "model_type": "qwen2", "num_attention_heads": 14, "num_hidden_layers": 24, "num_key_value_heads": 2,
        "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": True,
        "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
    },
    "Qwen3-0.6B (head_dim 128 != 1024 / 16)": {
        "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
        "hidden_size": 1024, "intermediate_size": 3072, "max_position_embeddings": 40960,
        "max_window_layers": 28, "model_type": "qwen3", "num_attention_heads": 16, "num_hidden_layers": 28,
        "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000,
        "sliding_window": None, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
        "use_sliding_window": False, "vocab_size": 151936,
    },
}


@pytest.mark.parametrize("name", list(REAL_CONFIGS))
def test_released_configs_stay_valid(name):
    d = REAL_CONFIGS[name]
    cfg = ModelConfig.from_dict(json.loads(json.dumps(d)), f"{name}/config.json")
    assert cfg.head_dim == (d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"])
    assert all(0 <= i < cfg.vocab_size for i in cfg.eos_token_ids) and cfg.eos_token_ids
    assert isinstance(cfg.rope_theta, float) and isinstance(cfg.rms_norm_eps, float)


def test_released_config_values():
    llama31 = ModelConfig.from_dict(REAL_CONFIGS["Llama-3.1-8B-Instruct"])
    assert llama31.eos_token_ids == [128001, 128008, 128009] and llama31.bos_token_id == 128000
    assert llama31.rope_scaling["rope_type"] == "llama3" and llama31.rope_scaling["factor"] == 8.0
    assert llama31.num_kv_heads == 8 and llama31.head_dim == 128
    llama2 = ModelConfig.from_dict(REAL_CONFIGS["Llama-2-7b (pad_token_id -1, legacy linear rope)"])
    assert llama2.rope_scaling == {"type": "linear", "factor": 2.0, "rope_type": "linear"}
    assert ModelConfig.from_dict(REAL_CONFIGS["Mistral-Nemo (head_dim 128 != 5120 / 32)"]).head_dim == 128
    assert ModelConfig.from_dict(REAL_CONFIGS["Mistral-7B-v0.1"]).sliding_window == 4096
    assert ModelConfig.from_dict(REAL_CONFIGS["Qwen2.5-0.5B-Instruct"]).sliding_window is None  # not used
    qwen3 = ModelConfig.from_dict(REAL_CONFIGS["Qwen3-0.6B (head_dim 128 != 1024 / 16)"])
    assert qwen3.head_dim == 128 and qwen3.qk_norm and qwen3.rope_theta == 1e6


def test_fixture_checkpoints_and_shapes_stay_valid(tiny_models):
    for m in tiny_models.values():  # transformers-written (rope_parameters, dtype, head_dim, ...)
        cfg = ModelConfig.from_file(m.path / "config.json")
        assert cfg.head_dim == m.head_dim and cfg.num_kv_heads == m.num_kv_heads
    for shape in SHAPES.values():
        ModelConfig.from_dict(dict(shape, torch_dtype="float32"))

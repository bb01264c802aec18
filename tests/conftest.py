"""Shared fixtures: tiny random HF checkpoints of every supported family, plus HF references.

Every checkpoint is built once per session with `transformers`, saved as safetensors into a
temporary directory, and kept in memory as the transformers model that serves as the reference.
Weights are drawn with a larger std than HF's default (and norms/biases are randomised) so that
logits are well separated and every parameter matters.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings

# Fixture modules of subdirectories (plain modules, not conftest.py files: a second module named
# conftest would shadow this one for the tests that `from conftest import ...`).
pytest_plugins = ["tests.server.serverproc", "tests.analyze.profiles", "tests.train.train_fixtures"]

settings.register_profile(
    "strata",
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "strata"))

FAMILIES = ("llama", "llama3", "mistral", "qwen2", "qwen3")
# families whose layers differ from Llama's beyond flags (graph/fusion.py refuses them): checked
# against transformers by tests/graph/test_models_vs_hf.py and tests/engine/test_engine_vs_hf.py
NEW_FAMILIES = ("gemma3", "phi3", "phi4mini")
ALL_FAMILIES = FAMILIES + NEW_FAMILIES
# mixture-of-experts families (graph/moe.py): tests/graph/test_moe.py, tests/engine/test_moe_engine.py
MOE_FAMILIES = ("mixtral", "qwen2moe", "qwen3moe", "olmoe")
VOCAB = 384
EOS_ID = 2
BOS_ID = 1

_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    initializer_range=0.1,
    bos_token_id=BOS_ID,
    eos_token_id=EOS_ID,
)


def _build_hf(family: str, vocab_size: int = VOCAB):
    """(config, model) for a family; imported lazily so collecting tests stays cheap."""
    import transformers as tf

    common = dict(_COMMON, vocab_size=vocab_size)
    if family == "llama":  # GQA 4:2, tied embeddings
        cfg = tf.LlamaConfig(**common, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
        cls = tf.LlamaForCausalLM
    elif family == "llama3":  # llama3 rope scaling, MQA, untied
        cfg = tf.LlamaConfig(
            **common, num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=False,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 32,
            },
        )
        cls = tf.LlamaForCausalLM
    elif family == "mistral":
        cfg = tf.MistralConfig(
            **common, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
            sliding_window=4096,
        )
        cls = tf.MistralForCausalLM
    elif family == "qwen2":  # q/k/v bias
        cfg = tf.Qwen2Config(
            **common, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
            rope_theta=1000000.0, use_sliding_window=False,
        )
        cls = tf.Qwen2ForCausalLM
    elif family == "qwen3":  # q/k norm, head_dim 32 != 64 / 4
        cfg = tf.Qwen3Config(
            **common, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
            tie_word_embeddings=True, use_sliding_window=False,
        )
        cls = tf.Qwen3ForCausalLM
    elif family == "gemma3":  # sliding (window 8) / global layers, local rope base, soft-capped logits
        cfg = tf.Gemma3TextConfig(
            **dict(common, num_hidden_layers=3), num_attention_heads=4, num_key_value_heads=2, head_dim=32,
            sliding_window=8, sliding_window_pattern=2, query_pre_attn_scalar=24, final_logit_softcapping=30.0,
            rope_theta=1000000.0, rope_local_base_freq=10000.0, pad_token_id=0,
        )
        cls = tf.Gemma3ForCausalLM
    elif family == "phi3":  # fused qkv / gate_up checkpoint, every layer slides (window 20 > a block)
        cfg = tf.Phi3Config(**common, num_attention_heads=4, num_key_value_heads=2, sliding_window=20,
                            pad_token_id=0, original_max_position_embeddings=256)
        cls = tf.Phi3ForCausalLM
    elif family in ("phi4mini", "phi4mini-long"):  # partial rotary 0.75, longrope, tied embeddings
        # phi4mini: pre-training length = max positions, so the short factors apply to every length;
        # phi4mini-long: pre-trained on 32 positions, so prompts past 32 use the long factors
        orig = 32 if family == "phi4mini-long" else common["max_position_embeddings"]
        cfg = tf.Phi3Config(
            **common, num_attention_heads=4, num_key_value_heads=2, partial_rotary_factor=0.75,
            tie_word_embeddings=True, pad_token_id=0, original_max_position_embeddings=orig,
            rope_scaling={"rope_type": "longrope", "short_factor": [1.0 + 0.15 * i for i in range(6)],
                          "long_factor": [1.5 + 0.5 * i for i in range(6)]},
        )
        cls = tf.Phi3ForCausalLM
    elif family == "mixtral":  # 4 experts, top 2 (softmax, top-k, renormalised)
        cfg = tf.MixtralConfig(**dict(common, intermediate_size=48), num_attention_heads=4, num_key_value_heads=2,
                               num_local_experts=4, num_experts_per_tok=2)
        cls = tf.MixtralForCausalLM
    elif family == "qwen2moe":  # 8 experts top 2 + the gated shared expert; layer 1 dense (mlp_only_layers)
        cfg = tf.Qwen2MoeConfig(**common, num_attention_heads=4, num_key_value_heads=2, num_experts=8,
                                num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                                mlp_only_layers=[1], use_sliding_window=False, tie_word_embeddings=False)
        cls = tf.Qwen2MoeForCausalLM
    elif family == "qwen3moe":  # 8 experts top 3, norm_topk_prob, per-head q/k norms, head_dim 32
        cfg = tf.Qwen3MoeConfig(**common, num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8,
                                num_experts_per_tok=3, moe_intermediate_size=32, norm_topk_prob=True,
                                use_sliding_window=False, tie_word_embeddings=True)
        cls = tf.Qwen3MoeForCausalLM
    elif family == "olmoe":  # 6 experts top 2, not renormalised, whole-projection q/k norms, clip_qkv
        cfg = tf.OlmoeConfig(**dict(common, intermediate_size=40), num_attention_heads=4, num_key_value_heads=2,
                             num_experts=6, num_experts_per_tok=2, clip_qkv=3.0, pad_token_id=0)
        cls = tf.OlmoeForCausalLM
    else:
        raise ValueError(family)
    cfg._attn_implementation = "eager"
    return cfg, cls(cfg)


def _randomise(model: torch.nn.Module, seed: int) -> None:
    """Biases and norm weights away from 0/1, so a loader that skips them is caught."""
    g = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
            elif "norm" in name:
                p.copy_(1.0 + torch.randn(p.shape, generator=g) * 0.3)


@dataclass
class TinyModel:
    family: str
    path: Path
    hf: torch.nn.Module  # the transformers model (eval, fp32) with the same weights
    eos_ids: list[int]
    vocab_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * 4

    def kv_bytes_for(self, tokens: int, block_size: int = 16) -> int:
        """Bytes of a KV cache holding exactly ceil(tokens / block_size) blocks (fp32)."""
        return -(-tokens // block_size) * block_size * self.kv_bytes_per_token


def make_tiny_model(family: str, out: Path, seed: int = 0, vocab_size: int = VOCAB) -> TinyModel:
    torch.manual_seed(seed)
    cfg, model = _build_hf(family, vocab_size)
    _randomise(model, seed)
    model = model.float().eval()
    model.save_pretrained(out, safe_serialization=True)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return TinyModel(
        family, out, model, [EOS_ID], vocab_size, cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim
    )


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, TinyModel]:
    root = tmp_path_factory.mktemp("models")
    return {f: make_tiny_model(f, root / f, seed=i) for i, f in enumerate(ALL_FAMILIES + MOE_FAMILIES)}


@pytest.fixture(params=FAMILIES)
def tiny_model(request, tiny_models) -> TinyModel:
    return tiny_models[request.param]


@pytest.fixture(params=ALL_FAMILIES)
def family_model(request, tiny_models) -> TinyModel:
    """Every supported family (the Llama-shaped ones and Gemma 3 / Phi-3 / Phi-4-mini)."""
    return tiny_models[request.param]


@pytest.fixture(params=MOE_FAMILIES)
def moe_model(request, tiny_models) -> TinyModel:
    """Every mixture-of-experts family (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE)."""
    return tiny_models[request.param]


@pytest.fixture
def llama(tiny_models) -> TinyModel:
    return tiny_models["llama"]


# --- references over transformers' plain forward (no KV cache, no generate()) ---------------


@torch.no_grad()
def hf_logits(model: TinyModel, ids: list[int]) -> torch.Tensor:
    """Logits [len(ids), vocab] of a plain transformers forward."""
    return model.hf(torch.tensor([ids])).logits[0].float()


_GREEDY_CACHE: dict[tuple, list[int]] = {}


@torch.no_grad()
def hf_greedy(model: TinyModel, prompt: list[int], max_new: int, stop_at_eos: bool = True) -> list[int]:
    """Greedy tokens from a loop over transformers' forward; stops after EOS like the engine."""
    key = (model.family, str(model.path), tuple(prompt), max_new, stop_at_eos)
    if key not in _GREEDY_CACHE:
        ids, out = list(prompt), []
        for _ in range(max_new):
            tok = int(hf_logits(model, ids)[-1].argmax())
            out.append(tok)
            ids.append(tok)
            if stop_at_eos and tok in model.eos_ids:
                break
        _GREEDY_CACHE[key] = out
    return list(_GREEDY_CACHE[key])


@pytest.fixture(scope="session")
def hf_ref() -> Callable:
    return hf_greedy


@pytest.fixture(scope="session")
def hf_forward() -> Callable:
    return hf_logits


def random_prompt(seed: int, length: int, vocab: int = VOCAB) -> list[int]:
    """Token ids avoiding BOS/EOS, deterministic in seed."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(3, vocab, (length,), generator=g)).tolist()


@pytest.fixture(scope="session")
def prompt_of() -> Callable:
    return random_prompt


def make_llm(model: TinyModel | Path | str, **kw):
    """An LLM over a tiny checkpoint with small, test-friendly defaults."""
    from strata import LLM

    path = model.path if isinstance(model, TinyModel) else model
    opts = dict(dtype="float32", max_model_len=96, block_size=16, kv_cache_memory="1MiB",
                num_threads=1, seed=0)
    opts.update(kw)
    return LLM(model=str(path), **opts)


@pytest.fixture(scope="session")
def llm_factory() -> Callable:
    return make_llm


def assert_engine_clean(llm) -> None:
    """No request left, no block owned (each free, or cached by the prefix cache), tables consistent."""
    eng = llm.engine
    assert not eng.has_unfinished()
    eng.check_blocks()
    assert eng.block_manager.num_free == eng.block_manager.num_blocks
    assert not eng.scheduler.running and not eng.scheduler.waiting


@pytest.fixture(scope="session")
def engine_clean() -> Callable:
    return assert_engine_clean


# --- a checkpoint with a real (byte-level BPE) tokenizer, for text and stop strings -----------

_TOKENIZER_TEXT = """\
The quick brown fox jumps over the lazy dog. A paged cache keeps keys and values in blocks.
Every block is free or owned; the scheduler decides what runs and the runner decides how.
Small models make fast tests, and fast tests get run. Greedy decoding picks the argmax token.
Stop strings end a completion; the text returned ends right before the stop string.
"""


def _train_tokenizer(out: Path) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|pad|>", "<|bos|>", "<|eos|>"], initial_alphabet=[],
        show_progress=False,
    )
    tok.train_from_iterator([_TOKENIZER_TEXT] * 4, trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<|bos|>", "eos_token": "<|eos|>", "pad_token": "<|pad|>",
                    "tokenizer_class": "PreTrainedTokenizerFast"})
    )
    return tok.get_vocab_size(with_added_tokens=True)


@pytest.fixture(scope="session")
def text_model(tmp_path_factory) -> TinyModel:
    """A tiny Llama whose directory has tokenizer.json (ASCII-only byte-level BPE)."""
    root = tmp_path_factory.mktemp("text_model")
    tok_dir = root / "tok"
    tok_dir.mkdir()
    vocab = _train_tokenizer(tok_dir)
    model = make_tiny_model("llama", root / "model", seed=11, vocab_size=vocab)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (model.path / name).write_bytes((tok_dir / name).read_bytes())
    model.eos_ids = [EOS_ID]  # <|eos|> is id 2, as in the config
    return model


@pytest.fixture(scope="session")
def byte_fallback_model(tmp_path_factory) -> TinyModel:
    """A tiny Llama with a sentencepiece-style tokenizer: letters plus <0xHH> byte-fallback tokens."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for c in "\u2581abcdefghijklmnopqrstuvwxyz":
        vocab[c] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    root = tmp_path_factory.mktemp("byte_fallback")
    model = make_tiny_model("llama", root / "model", seed=5, vocab_size=tok.get_vocab_size())
    tok.save(str(model.path / "tokenizer.json"))
    (model.path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"})
    )
    return model

"""The named shapes of the random-weight checkpoints (--random-model), as config.json fields. No
torch here: the CLI's flags list them (demo/random_models.py writes the checkpoints)."""

from __future__ import annotations

SHAPES: dict[str, dict] = {
    "smol-135m": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
        "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152,
        "tie_word_embeddings": True, "rope_theta": 100000.0, "rms_norm_eps": 1e-5,
        "max_position_embeddings": 2048, "bos_token_id": 1, "eos_token_id": 2,
    },
    "qwen-0.5b": {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
        "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
        "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936,
        "tie_word_embeddings": True, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096, "bos_token_id": 151643, "eos_token_id": 151643,
    },
    "tiny": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": 128, "intermediate_size": 352, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1024,
        "tie_word_embeddings": True, "rope_theta": 10000.0, "rms_norm_eps": 1e-5,
        "max_position_embeddings": 2048, "bos_token_id": 1, "eos_token_id": 2,
    },
}

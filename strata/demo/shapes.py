"""The named shapes of the random-weight checkpoints (--random-model), as config.json fields. No
torch here: the CLI's flags list them (demo/random_models.py writes the checkpoints).

The shapes with "torch_dtype": "bfloat16" are the sizes people run (1-8B, their real configs and
vocabularies): they are written tensor by tensor as bf16 shards (~2-16 GB on disk). The others
are written as one fp32 model.safetensors, as they always were.

The mixture-of-experts shapes (Qwen3-MoE: 128 or fewer experts, top-k renormalised, q/k norms) have
no released model at their size; they keep Qwen3-30B-A3B's family (its vocabulary, rotary base,
expert ratio 8 of 128) at sizes a CPU runs. Counts by ModelConfig.num_params (tied embedding
counted once; `active`: what one token reads, the embedding included, as Qwen's "A3B" counts):
  qwen3-moe-2b    2,033,635,328 stored, 334,942,208 active (24 layers of 128 experts x 192, top 8)
  qwen3-moe-0.2b    184,236,032 stored,  52,115,456 active (12 layers of 32 experts x 256, top 4)
  tiny-moe              625,408 stored,     330,496 active (2 layers of 8 experts x 64, top 2)"""

from __future__ import annotations

# Llama 3.1 / 3.2's rope scaling (rope_type "llama3"; 3.1 has factor 8, 3.2 factor 32)
_LLAMA3_ROPE_32 = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192}

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
    # Values from the Hub configs (meta-llama/Llama-3.2-1B, -3.2-3B, -3.1-8B; Qwen/Qwen2.5-7B). The
    # Llama 3.x eos is the base models' (the Instruct configs list 128001, 128008, 128009).
    "llama-3.2-1b": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": "bfloat16",
        "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 128256,
        "tie_word_embeddings": True, "rope_theta": 500000.0, "rope_scaling": dict(_LLAMA3_ROPE_32),
        "rms_norm_eps": 1e-5, "max_position_embeddings": 131072,
        "bos_token_id": 128000, "eos_token_id": 128001,
    },
    "qwen2.5-1.5b": {  # Qwen/Qwen2.5-1.5B: the 1.5B Q4_K_M GGUF people fetch first
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "torch_dtype": "bfloat16",
        "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
        "num_attention_heads": 12, "num_key_value_heads": 2, "vocab_size": 151936,
        "tie_word_embeddings": True, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
        "max_position_embeddings": 32768, "bos_token_id": 151643, "eos_token_id": 151643,
    },
    "llama-3.2-3b": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": "bfloat16",
        "hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 28,
        "num_attention_heads": 24, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256,
        "tie_word_embeddings": True, "rope_theta": 500000.0, "rope_scaling": dict(_LLAMA3_ROPE_32),
        "rms_norm_eps": 1e-5, "max_position_embeddings": 131072,
        "bos_token_id": 128000, "eos_token_id": 128001,
    },
    "qwen2.5-7b": {  # q/k/v biases: random_models gives every Qwen2ForCausalLM shape them
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "torch_dtype": "bfloat16",
        "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
        "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064,
        "tie_word_embeddings": False, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
        "max_position_embeddings": 131072, "sliding_window": 131072, "use_sliding_window": False,
        "max_window_layers": 28, "bos_token_id": 151643, "eos_token_id": 151643,
    },
    # plan-accuracy's MoE shape (fp32 single file, ~0.74 GB): smol-135m's size in active parameters
    "qwen3-moe-0.2b": {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "hidden_size": 512, "intermediate_size": 1024, "moe_intermediate_size": 256, "num_hidden_layers": 12,
        "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64, "num_experts": 32,
        "num_experts_per_tok": 4, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "vocab_size": 49152, "tie_word_embeddings": True, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096, "bos_token_id": 1, "eos_token_id": 2,
    },
    "tiny-moe": {  # the tests' MoE shape (Strata vs transformers on its random checkpoint)
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "hidden_size": 128, "intermediate_size": 128, "moe_intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "num_experts": 8,
        "num_experts_per_tok": 2, "norm_topk_prob": True, "vocab_size": 1024, "tie_word_embeddings": True,
        "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 2048,
        "bos_token_id": 1, "eos_token_id": 2,
    },
    # the peers' MoE shape (item 7 of issue 45): 4.1 GB of bf16 shards, 8.1 GB in fp32; Qwen3-30B-A3B's
    # config less its width (hidden 2048 -> 1024, experts 768 -> 192 wide, 48 -> 24 layers) and tied
    "qwen3-moe-2b": {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "torch_dtype": "bfloat16",
        "hidden_size": 1024, "intermediate_size": 1536, "moe_intermediate_size": 192, "num_hidden_layers": 24,
        "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 64, "num_experts": 128,
        "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "vocab_size": 151936, "tie_word_embeddings": True, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
        "max_position_embeddings": 40960, "bos_token_id": 151643, "eos_token_id": 151643,
    },
    "llama-3.1-8b": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": "bfloat16",
        "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
        "tie_word_embeddings": False, "rope_theta": 500000.0,
        "rope_scaling": dict(_LLAMA3_ROPE_32, factor=8.0),
        "rms_norm_eps": 1e-5, "max_position_embeddings": 131072,
        "bos_token_id": 128000, "eos_token_id": 128001,
    },
}

# the shapes written as bf16 shards (the rest: one fp32 model.safetensors)
BF16_SHAPES = frozenset(name for name, cfg in SHAPES.items() if cfg.get("torch_dtype") == "bfloat16")

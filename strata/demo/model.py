"""The built-in demo checkpoint: a small Llama trained by `strata train` on Shakespeare, so Strata
runs offline with no --model and prints readable (Elizabethan) English.

The checkpoint is an ordinary HF directory (config.json, model.safetensors, tokenizer files,
generation_config.json) built on first use under the user cache from files that ship in this
package: the weights (model.safetensors, bf16, trained on data/shakespeare/train: the README has
the command that reproduces them) and the tokenizer (trained on the same corpus by
train_tokenizer.py).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from importlib import resources
from pathlib import Path
from typing import Any

import tokenizers

from strata.config import cache_root
from strata.errors import ModelLoadError

logger = logging.getLogger(__name__)

DEMO_NAME = "demo-v2"  # bump when the files below change, so stale caches are not reused
WEIGHTS_FILE = "model.safetensors"  # HF tensor names, bf16, no lm_head (tied)
BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKENS = ("<|end_of_text|>", "<|eot_id|>")
ARCHITECTURE: dict[str, Any] = {
    "hidden_size": 384,
    "intermediate_size": 1024,
    "num_hidden_layers": 6,
    "num_attention_heads": 6,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-5,
}
# what `strata generate` says the demo model is (tests/test_demo.py checks the count against the config)
DEMO_SUMMARY = "a small Llama, 11M parameters, trained on Shakespeare's plays: it writes Elizabethan pastiche"
PACKAGE_FILES = ("tokenizer.json", "tokenizer_config.json")
CHECKPOINT_FILES = ("config.json", "generation_config.json", "model.safetensors", *PACKAGE_FILES)


def _package_file(name: str) -> bytes:
    return resources.files("strata.demo").joinpath(name).read_bytes()


def demo_config() -> dict[str, Any]:
    """config.json for the demo LlamaForCausalLM, with ids taken from the shipped tokenizer."""
    tok = tokenizers.Tokenizer.from_str(_package_file("tokenizer.json").decode("utf-8"))
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    arch = ARCHITECTURE
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": -(-vocab_size // 64) * 64,
        **arch,
        "head_dim": arch["hidden_size"] // arch["num_attention_heads"],
        "hidden_act": "silu",
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "bos_token_id": tok.token_to_id(BOS_TOKEN),
        "eos_token_id": [tok.token_to_id(t) for t in EOS_TOKENS],
    }


def weight_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """HF Llama tensor names -> shapes ([out, in] for linears), in a fixed order."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    q_dim = config["num_attention_heads"] * config["head_dim"]
    kv_dim = config["num_key_value_heads"] * config["head_dim"]
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config["vocab_size"], hidden)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}"
        shapes |= {
            f"{p}.input_layernorm.weight": (hidden,),
            f"{p}.self_attn.q_proj.weight": (q_dim, hidden),
            f"{p}.self_attn.k_proj.weight": (kv_dim, hidden),
            f"{p}.self_attn.v_proj.weight": (kv_dim, hidden),
            f"{p}.self_attn.o_proj.weight": (hidden, q_dim),
            f"{p}.post_attention_layernorm.weight": (hidden,),
            f"{p}.mlp.gate_proj.weight": (inter, hidden),
            f"{p}.mlp.up_proj.weight": (inter, hidden),
            f"{p}.mlp.down_proj.weight": (hidden, inter),
        }
    shapes["model.norm.weight"] = (hidden,)
    return shapes


def write_demo_checkpoint(dest: Path) -> None:
    """Write every demo checkpoint file into the existing directory `dest`."""
    config = demo_config()
    generation = {
        "bos_token_id": config["bos_token_id"],
        "eos_token_id": config["eos_token_id"],
        "do_sample": False,
    }
    for name, data in (("config.json", config), ("generation_config.json", generation)):
        (dest / name).write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    for name in (WEIGHTS_FILE, *PACKAGE_FILES):
        (dest / name).write_bytes(_package_file(name))
    for name in CHECKPOINT_FILES:  # mkdtemp and some writers default to owner-only
        (dest / name).chmod(0o644)
    dest.chmod(0o755)


def _is_complete(path: Path) -> bool:
    return all((path / name).is_file() for name in CHECKPOINT_FILES)


def demo_model_path() -> Path:
    """Directory of the demo checkpoint, built on first use (atomically, so concurrent callers are safe)."""
    root = cache_root()
    final = root / DEMO_NAME
    if _is_complete(final):
        return final
    if final.exists():
        logger.warning("demo checkpoint at %s is incomplete; rebuilding it", final)
        shutil.rmtree(final, ignore_errors=True)
    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{DEMO_NAME}-", dir=root))
    except OSError as exc:
        raise ModelLoadError(
            f"cannot create the demo model under {root} ({exc}); set STRATA_CACHE to a writable directory"
        ) from exc
    try:
        write_demo_checkpoint(tmp)
        try:
            os.rename(tmp, final)
            logger.info("built demo checkpoint at %s", final)
        except OSError:
            if not _is_complete(final):  # not a lost race with another builder: a real failure
                raise
    except OSError as exc:
        raise ModelLoadError(f"cannot write the demo model to {final} ({exc})") from exc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final

"""`LLM(...)` keyword arguments by vLLM's names: what each means here, or why it is refused.

vLLM code moves over unchanged where the meaning carries (tensor_parallel_size, dtype, seed,
max_model_len, max_num_seqs, enable_prefix_caching, quantization, chat_template,
generation_config, ...: the same names as EngineConfig's fields). The few that differ are
translated or refused here with a message saying what to use instead, never a TypeError and
never silently ignored.
"""

from __future__ import annotations

import difflib
from dataclasses import fields
from typing import Any

from strata.config import EngineConfig
from strata.errors import ConfigError

_FIELDS = frozenset(f.name for f in fields(EngineConfig)) - {"model"}
VLLM_NAMES = ("gpu_memory_utilization", "trust_remote_code", "tokenizer")  # the translated ones


def engine_kwargs(model: str | None, kwargs: dict[str, Any]) -> dict[str, Any]:
    """EngineConfig keyword arguments from LLM's, vLLM's names translated."""
    out = dict(kwargs)
    device = str(out.get("device", "cpu"))
    if "gpu_memory_utilization" in out:
        share = out.pop("gpu_memory_utilization")
        if not device.startswith("cuda"):
            raise ConfigError(
                f"gpu_memory_utilization={share!r} sizes GPU memory, but device is {device!r}; on a CPU give "
                "kv_cache_memory='2GiB' (the KV cache outright) or memory_fraction=0.5 (its share of the memory "
                "free after loading)")
        if "memory_fraction" in out:
            raise ConfigError("give gpu_memory_utilization or memory_fraction, not both")
        # vLLM's share covers weights + KV of the whole GPU; Strata's memory_fraction is the KV cache's
        # share of what is free after the weights load: a share of less, so never more memory than asked
        out["memory_fraction"] = share
    if out.pop("trust_remote_code", False) is not False:
        raise ConfigError("trust_remote_code=True: Strata runs no code from a checkpoint; it implements each "
                          "architecture itself (an unsupported one lists the supported ones)")
    tokenizer = out.pop("tokenizer", None)
    if tokenizer is not None and str(tokenizer) != str(model):
        raise ConfigError(f"tokenizer={tokenizer!r}: Strata reads the tokenizer from the model directory "
                          f"({model!r}); copy tokenizer.json (and tokenizer_config.json) there")
    unknown = sorted(set(out) - _FIELDS)
    if unknown:
        name = unknown[0]
        close = difflib.get_close_matches(name, sorted(_FIELDS | set(VLLM_NAMES)), n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]!r}?" if close else f"; known: {', '.join(sorted(_FIELDS))}"
        raise ConfigError(f"LLM(): unknown keyword {name!r}{hint}")
    return out

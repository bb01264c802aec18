"""LoRA adapters as requests name them (vLLM's LoRARequest) and as PEFT writes them
(adapter_config.json), read and checked without torch: the server's front end and the engine share
these checks; the engine then checks the weights against the base (graph/lora_adapter.py)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from strata.errors import RequestError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.:/@")


class LoRAError(RequestError):
    """An adapter that cannot be used: names the adapter, the problem and the fix."""


@dataclass(frozen=True)
class LoRARequest:
    """An adapter to run a request with: vLLM's LoRARequest(lora_name, lora_int_id, lora_path).
    `lora_int_id` (>= 1) identifies the adapter's weights: two requests with the same id share them."""

    lora_name: str
    lora_int_id: int
    lora_path: str
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name or set(self.lora_name) - NAME_CHARS:
            raise LoRAError(f"LoRA adapter name {self.lora_name!r}: use letters, digits and -_.:/@")
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise LoRAError(f"LoRA adapter {self.lora_name}: lora_int_id must be an integer >= 1, "
                            f"got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str | Path) or not str(self.lora_path):
            raise LoRAError(f"LoRA adapter {self.lora_name}: lora_path must be the adapter's directory")

    # vLLM's short names
    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def id(self) -> int:
        return self.lora_int_id

    @property
    def path(self) -> str:
        return str(self.lora_path)


@dataclass(frozen=True)
class AdapterConfig:
    """What Strata reads of a PEFT LoRA adapter_config.json."""

    rank: int
    alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...] | str  # names, or PEFT's regular-expression form
    base_model: str | None
    dropout: float = 0.0
    rank_pattern: dict = field(default_factory=dict)

    def scale(self, rank: int) -> float:
        """PEFT's scaling for a module of `rank`: alpha / r, or alpha / sqrt(r) under rsLoRA."""
        return self.alpha / math.sqrt(rank) if self.use_rslora else self.alpha / rank


# adapter_config.json keys that change what the weights mean and that Strata does not implement:
# each refused by name when set to anything but its no-op value
_REFUSED = {
    "use_dora": (False, None, "DoRA (a learned magnitude per output row) is not supported; merge it into the "
                              "base with peft's merge_and_unload(), or retrain as plain LoRA"),
    "modules_to_save": (None, [], "adapters that carry full copies of modules ({value}) are not supported; "
                                  "retrain without modules_to_save (embed_tokens/lm_head stay the base's)"),
    "bias": ("none", None, "LoRA bias training ('{value}') changes the base's biases; retrain with bias='none'"),
    "fan_in_fan_out": (False, None, "fan_in_fan_out (GPT-2 Conv1D weights) is not used by these models"),
    "alpha_pattern": ({}, None, "per-module lora_alpha (alpha_pattern {value}) is not supported; retrain with "
                                "one lora_alpha"),
    "trainable_token_indices": (None, {}, "adapters that train token embeddings are not supported"),
    "lora_bias": (False, None, "lora_bias (a bias on lora_B) is not supported"),
    "use_qalora": (False, None, "QA-LoRA is not supported"),
    "layer_replication": (None, [], "layer_replication is not supported"),
}


def read_adapter_config(path: str | Path, name: str) -> AdapterConfig:
    """Check an adapter directory's files and config (no weights read): one LoRAError naming the
    adapter, what is wrong and the fix."""
    d = Path(path)
    if not d.is_dir():
        raise LoRAError(f"LoRA adapter {name}: {d} is not a directory (give the PEFT adapter's directory, "
                        f"holding {CONFIG_FILE} and {WEIGHTS_FILE})")
    cfg_file = d / CONFIG_FILE
    if not cfg_file.is_file():
        raise LoRAError(f"LoRA adapter {name}: {d} has no {CONFIG_FILE}; is it a PEFT adapter directory?")
    if not (d / WEIGHTS_FILE).is_file():
        if (d / "adapter_model.bin").is_file():
            raise LoRAError(f"LoRA adapter {name}: {d} holds adapter_model.bin (a pickle, which Strata never "
                            f"loads); save it as safetensors: PeftModel.save_pretrained(dir, safe_serialization=True)")
        raise LoRAError(f"LoRA adapter {name}: {d} has no {WEIGHTS_FILE}")
    try:
        raw = json.loads(cfg_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LoRAError(f"LoRA adapter {name}: {cfg_file} is not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise LoRAError(f"LoRA adapter {name}: {cfg_file} is not a JSON object")
    kind = raw.get("peft_type", "LORA")
    if str(kind).upper() != "LORA":
        raise LoRAError(f"LoRA adapter {name}: peft_type {kind!r} is not supported (only LORA adapters)")
    for key, (ok, also_ok, why) in _REFUSED.items():
        value = raw.get(key, ok)
        if value != ok and value != also_ok and value is not None:
            raise LoRAError(f"LoRA adapter {name}: {why.format(value=value)}")
    r, alpha = raw.get("r"), raw.get("lora_alpha", raw.get("r"))
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise LoRAError(f"LoRA adapter {name}: {CONFIG_FILE} 'r' must be a positive integer, got {r!r}")
    if not isinstance(alpha, int | float) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise LoRAError(f"LoRA adapter {name}: {CONFIG_FILE} 'lora_alpha' must be a number, got {alpha!r}")
    targets = raw.get("target_modules")
    if isinstance(targets, list):
        targets = tuple(str(t) for t in targets)
    elif not isinstance(targets, str):
        raise LoRAError(f"LoRA adapter {name}: {CONFIG_FILE} 'target_modules' must be a list of module names "
                        f"or a regular expression, got {targets!r}")
    rank_pattern = raw.get("rank_pattern") or {}
    if not isinstance(rank_pattern, dict):
        raise LoRAError(f"LoRA adapter {name}: {CONFIG_FILE} 'rank_pattern' must be an object")
    dropout = raw.get("lora_dropout", 0.0)
    return AdapterConfig(rank=r, alpha=float(alpha), use_rslora=bool(raw.get("use_rslora", False)),
                         target_modules=targets, base_model=raw.get("base_model_name_or_path"),
                         dropout=float(dropout) if isinstance(dropout, int | float) else 0.0,
                         rank_pattern=rank_pattern)

"""TrainConfig: every knob of `strata train`, one dataclass, loadable from TOML and overridable by flags.

Precedence: dataclass defaults < the TOML file (`--config FILE.toml`, keys = field names) < flags
given on the command line. Validated once, at construction, with messages naming the field.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from strata.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

PRECISIONS = ("auto", "float32", "bfloat16", "float16")
ACTIVATION_CHECKPOINTING = ("none", "selective", "attention", "full")
DISTRIBUTED = ("ddp", "fsdp")
COMM_DTYPES = ("none", "bfloat16", "float16")
# --lora: PEFT's module names (a Llama-shaped model's seven projections), or PEFT's "all-linear"
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ALL_LINEAR = "all-linear"
BASE_QUANTIZATION = ("int8", "int4")  # --quantization: a frozen base held in the engine's formats
QUANT_GROUP_SIZES = (32, 64, 128)


FSDP_LORA = ("--lora with --distributed fsdp is not supported: the frozen base is not sharded and the "
             "adapter is a few MB, which DDP replicates cheaply; use --distributed ddp")


@dataclass
class TrainConfig:
    # model: a named size (strata.train.model_init.NAMED_SIZES), a config.json, or an HF checkpoint dir
    model: str = "demo"
    tokenizer: str | None = None  # directory with tokenizer.json (default: the model dir's, else the demo's)
    # data: text files / directories of *.txt / JSONL files (a "text" field per line)
    data: list[str] = field(default_factory=list)
    eval_data: list[str] = field(default_factory=list)
    seq_len: int = 256
    micro_batch_size: int = 8  # sequences per forward, per rank
    grad_accum: int = 1  # micro-batches per optimizer step
    num_workers: int = 1  # DataLoader worker processes that tokenize (0 = in this process)
    seed: int = 0
    # optimisation
    max_steps: int = 100
    lr: float = 3e-3
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 10
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # global-norm clipping; 0 = off (--check fails it)
    # precision and memory
    precision: str = "auto"  # the hardware layer measures fp32 vs bf16 when "auto"
    activation_checkpointing: str = "none"
    ac_every: int = 2  # selective: checkpoint every k-th decoder layer
    loss_chunk_tokens: int = 0  # LM head + loss over this many tokens at a time (0 = all at once)
    fused_loss: bool = True  # LM head + loss fused by chunks, gradients in the forward (fused_loss.py)
    # mixture of experts (moe_loss.py): None = the model config's router_aux_loss_coef / router_z_loss_coef
    router_aux_loss_coef: float | None = None
    router_z_loss_coef: float | None = None
    # distributed (torchrun's environment, or --nproc-per-node to spawn locally)
    distributed: str = "ddp"
    nproc_per_node: int = 1
    ddp_bucket_mb: float = 25.0
    ddp_comm_dtype: str = "none"  # compress DDP's gradient all-reduce (a torch comm hook)
    comm_timeout_s: float = 300.0
    # checkpoints and outputs
    out_dir: str = "runs/train"
    save_every: int = 100  # steps; 0 = only at the end and on SIGTERM
    keep_last: int = 2
    resume: bool = True  # continue from the newest intact checkpoint in out_dir
    eval_every: int = 0  # steps; 0 = only at the end
    eval_batches: int = 16
    log_every: int = 10
    tensorboard: bool = True
    max_skipped_steps: int = 10  # stop after this many non-finite steps in a row
    spike_factor: float = 3.0  # report a loss above this x the running median
    threads: int | None = None
    device: str = "cpu"
    # LoRA (lora.py): train low-rank adapters on a frozen base, written as a PEFT adapter directory
    lora: bool = False
    lora_rank: int = 16
    lora_alpha: float = 32.0
    lora_dropout: float = 0.0
    lora_target_modules: list[str] = field(default_factory=lambda: list(LORA_TARGETS))
    use_rslora: bool = False
    # the frozen base's projections in int8 / int4 (QLoRA-style; --lora only), as the engine's --quantization
    quantization: str | None = None
    quantization_group_size: int = 64

    def __post_init__(self) -> None:
        for name in ("seq_len", "micro_batch_size", "grad_accum", "max_steps", "keep_last", "nproc_per_node",
                     "ac_every", "log_every", "eval_batches", "max_skipped_steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"train config: {name} = {value!r}; expected an integer >= 1")
        for name in ("num_workers", "warmup_steps", "save_every", "eval_every", "seed", "loss_chunk_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"train config: {name} = {value!r}; expected an integer >= 0")
        for name in ("lr", "eps", "comm_timeout_s", "spike_factor", "ddp_bucket_mb"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"train config: {name} = {getattr(self, name)!r}; expected a number > 0")
        for name in ("weight_decay", "grad_clip"):
            if not getattr(self, name) >= 0:
                raise ConfigError(f"train config: {name} = {getattr(self, name)!r}; expected a number >= 0")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"train config: min_lr_ratio = {self.min_lr_ratio}; expected 0 <= x <= 1")
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ConfigError(f"train config: {name} = {getattr(self, name)}; expected 0 <= x < 1")
        for name, choices in (("precision", PRECISIONS), ("activation_checkpointing", ACTIVATION_CHECKPOINTING),
                              ("distributed", DISTRIBUTED), ("ddp_comm_dtype", COMM_DTYPES)):
            if getattr(self, name) not in choices:
                raise ConfigError(
                    f"train config: {name} = {getattr(self, name)!r}; choose one of {', '.join(choices)}")
        if self.warmup_steps >= self.max_steps and self.max_steps > 1:
            raise ConfigError(
                f"train config: warmup_steps = {self.warmup_steps} >= max_steps = {self.max_steps}; the "
                "learning rate would never decay (lower warmup_steps)")
        for name in ("router_aux_loss_coef", "router_z_loss_coef"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, (int, float)) and 0 <= value < math.inf):
                raise ConfigError(f"train config: {name} = {value!r}; expected a number >= 0")
        if self.threads is not None and self.threads < 1:
            raise ConfigError(f"train config: threads = {self.threads}; expected >= 1")
        self._check_lora()

    def _check_lora(self) -> None:
        if isinstance(self.lora_target_modules, str):  # TOML: "all-linear" or "q_proj,v_proj"
            self.lora_target_modules = [self.lora_target_modules]
        names = [n.strip() for item in self.lora_target_modules for n in str(item).split(",") if n.strip()]
        if not names:
            raise ConfigError("train config: lora_target_modules is empty; name PEFT modules (e.g. q_proj "
                              f"v_proj) or {ALL_LINEAR}")
        if ALL_LINEAR in names and len(names) > 1:
            raise ConfigError(f"train config: lora_target_modules = {names}: {ALL_LINEAR} already means every "
                              "projection; give it alone")
        self.lora_target_modules = names
        if not isinstance(self.lora_rank, int) or isinstance(self.lora_rank, bool) or self.lora_rank < 1:
            raise ConfigError(f"train config: lora_rank = {self.lora_rank!r}; expected an integer >= 1")
        if not (isinstance(self.lora_alpha, (int, float)) and 0 < self.lora_alpha < math.inf):
            raise ConfigError(f"train config: lora_alpha = {self.lora_alpha!r}; expected a number > 0")
        if not (isinstance(self.lora_dropout, (int, float)) and 0 <= self.lora_dropout < 1):
            raise ConfigError(f"train config: lora_dropout = {self.lora_dropout!r}; expected 0 <= x < 1")
        if self.quantization is not None and self.quantization not in BASE_QUANTIZATION:
            raise ConfigError(f"train config: quantization = {self.quantization!r}; choose one of "
                              f"{', '.join(BASE_QUANTIZATION)} (or leave it unset for an fp32 base)")
        if self.quantization_group_size not in QUANT_GROUP_SIZES:
            raise ConfigError(f"train config: quantization_group_size = {self.quantization_group_size!r}; "
                              f"choose one of {', '.join(map(str, QUANT_GROUP_SIZES))}")
        if self.quantization is not None and not self.lora:
            raise ConfigError(f"--quantization {self.quantization}: a quantized base cannot be trained in full "
                              "(its int weights have no gradient); add --lora to train adapters on it frozen")
        if self.lora and self.distributed == "fsdp" and self.nproc_per_node > 1:
            raise ConfigError(FSDP_LORA)

    @property
    def tokens_per_micro_batch(self) -> int:
        return self.micro_batch_size * self.seq_len

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


FIELD_NAMES = tuple(f.name for f in fields(TrainConfig))


def load_toml(path: str | Path) -> dict[str, Any]:
    """The [train] table of a TOML file (or its top level), checked for unknown keys."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise ConfigError(f"--config {path}: cannot read it ({e.strerror})") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"--config {path}: not valid TOML ({e})") from None
    table = data.get("train", data)
    unknown = sorted(set(table) - set(FIELD_NAMES))
    if unknown:
        raise ConfigError(
            f"--config {path}: unknown key(s) {', '.join(unknown)}; the keys are TrainConfig's fields: "
            f"{', '.join(FIELD_NAMES)}")
    for key in ("data", "eval_data", "lora_target_modules"):
        if isinstance(table.get(key), str):
            table[key] = [table[key]]
    return table


def build_config(file_values: dict[str, Any], flag_values: dict[str, Any]) -> TrainConfig:
    """Defaults < file < flags (flags given as None were not set)."""
    merged = {**file_values, **{k: v for k, v in flag_values.items() if v is not None}}
    try:
        return TrainConfig(**merged)
    except TypeError as e:
        raise ConfigError(f"train config: {e}") from None

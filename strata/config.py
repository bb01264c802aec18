"""Engine configuration: one dataclass, validated once, with messages that name the field and fix."""

from __future__ import annotations

import re
from dataclasses import MISSING, dataclass, fields
from pathlib import Path
from typing import Any

from strata.errors import ConfigError
from strata.settings import SETTINGS

DTYPE_NAMES = ("float32", "bfloat16", "float16")  # the keys of DTYPES


def __getattr__(name: str) -> Any:
    """DTYPES (dtype name -> torch.dtype) is built on first use (PEP 562), so that importing this
    module does not import torch: the server's front end reads parse_bytes from here."""
    if name == "DTYPES":
        import torch

        value = {n: getattr(torch, n) for n in DTYPE_NAMES}
        globals()["DTYPES"] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def cache_root() -> Path:
    """Strata's cache directory (demo model, random checkpoints, hardware profile):
    $STRATA_CACHE, else ~/.cache/strata."""
    return SETTINGS.cache or Path.home() / ".cache" / "strata"

_PREFIXES = {"k": 1, "m": 2, "g": 3, "t": 4, "p": 5}
# every decimal (kB = 1000) and binary (KiB = 1024) unit, any case; a bare prefix is decimal
_SIZE_UNITS = {"": 1, "b": 1} | {
    unit: base**power
    for p, power in _PREFIXES.items()
    for unit, base in ((p, 1000), (p + "b", 1000), (p + "i", 1024), (p + "ib", 1024))
}


def parse_bytes(value: int | float | str, field: str) -> int:
    """Parse 4096, "512MiB", "4GiB", "1.5GB", "1TB", "2Ti" into bytes."""
    if isinstance(value, bool):
        raise ConfigError(f"{field}: expected bytes (int) or a size such as '4GiB', got {value!r}")
    if isinstance(value, int | float):
        if value <= 0:
            raise ConfigError(f"{field}: must be positive, got {value}")
        return int(value)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
    if not m or m.group(2).lower() not in _SIZE_UNITS:
        raise ConfigError(
            f"{field}: cannot parse {value!r}; use bytes (e.g. 4294967296) or a size such as "
            "'512MiB', '4GiB', '2GB'"
        )
    n = int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])
    if n <= 0:
        raise ConfigError(f"{field}: must be positive, got {value!r}")
    return n


# int8 / fp8: 1-byte K/V with an fp32 scale per (token, KV head) row (kernels/kv_quant.py)
KV_CACHE_DTYPES = ("auto", "bfloat16", "int8", "fp8")


LORA_DTYPES = ("auto", "float32", "bfloat16")  # EngineConfig.lora_dtype


@dataclass
class EngineConfig:
    """Everything the engine needs to start; validated at construction."""

    model: str | None = None  # HF directory; None = the built-in demo model
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "cpu"
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    block_size: int = 16
    kv_cache_memory: int | str | None = None  # bytes or "4GiB"; None = fraction of free memory
    memory_fraction: float = 0.5  # of free memory, used when kv_cache_memory is None
    # auto = the model's dtype; bfloat16 = K/V stored in bf16 whatever the model computes in (CPU:
    # half the bytes decode attention reads, twice the tokens per GiB; llama.cpp's default is f16);
    # int8 (CPU) / fp8 (e4m3, CPU through the torch path, CUDA) = 1 byte per value plus an fp32
    # scale per token and KV head: ~1.9x the tokens of bf16 at head_dim 64
    kv_cache_dtype: str = "auto"
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    # decode-first: while sequences decode, prefill at most this many tokens a step (None = auto:
    # on CPU from the measured prefill rate and a target step time, engine/build.py; off on GPU)
    max_prefill_tokens_while_decoding: int | None = None
    # multi-step decode (vLLM's name): up to this many decode steps per scheduler call while every
    # running sequence decodes and nobody waits; None = auto (CPU: as many as fit a 50 ms burst by
    # the measured step time, platform/multi_step.py; GPU and tensor parallel: 1)
    num_scheduler_steps: int | None = None
    num_threads: int | None = None
    attention_backend: str = "auto"  # auto | torch | sdpa | cpu | triton
    quantization: str | None = None  # None | int8 | int4: weight-only, quantised at load
    quantization_group_size: int = 64  # int4: input columns per scale (32 | 64 | 128)
    preemption_mode: str = "auto"  # auto (cost model) | recompute | swap
    swap_space: int | str | None = None  # host KV pool; None = as big as the device KV cache, <= 1GiB
    seed: int = 0
    enable_prefix_caching: bool = True  # share cached KV blocks of equal prompt prefixes
    # graph/fusion.py FX fusion passes for the eager step; None = auto (off: see docs/design-notes.md)
    fuse: bool | None = None
    compile: bool = False  # torch.compile the decode step (graph/capture.py), batch-bucketed
    cuda_graphs: bool = False  # capture + replay the decode step as CUDA graphs (CUDA only)
    tensor_parallel_size: int = 1  # ranks sharing the model (torch.distributed; engine/parallel.py)
    enable_expert_parallel: bool = False  # MoE: experts split across those ranks (graph/expert_parallel.py)
    comm_dtype: str | None = None  # None | bfloat16 | float16: compressed tensor-parallel all-reduce
    comm_timeout: float = 60.0  # seconds any collective may take before a rank counts as dead
    # speculative decoding (engine/speculative.py): "ngram" = prompt lookup, or a draft model's directory
    speculative_model: str | None = None
    num_speculative_tokens: int = 4  # draft tokens verified per step
    prompt_lookup_max: int = 4  # n-gram sizes prompt lookup matches, longest first
    prompt_lookup_min: int = 2
    chat_template: str | None = None  # a Jinja template, or a file holding one; None = the checkpoint's
    tokenizer: str | None = None  # a directory with tokenizer.json to use instead of the model's
    # sampling defaults: auto = the model's generation_config.json, vllm = none (vLLM's name), or a directory
    generation_config: str = "auto"
    # LoRA adapters (vLLM's names; graph/lora.py, engine/lora_manager.py): adapters resident in one
    # batch (a request's adapter waits while max_loras others run), the largest rank they may have,
    # and how many adapters' weights the host keeps read (an LRU; None = max_loras)
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # the resident adapters' storage: auto = float32 over an fp32 base, bfloat16 over a narrower one
    # (bf16, int8, int4 weights), where fp32 adapters would cost more bytes a step than they are worth
    lora_dtype: str = "auto"

    def _check_lora(self) -> None:
        if not isinstance(self.enable_lora, bool):
            raise ConfigError(f"enable_lora: must be True or False, got {self.enable_lora!r}")
        for name in ("max_loras", "max_lora_rank") + (("max_cpu_loras",) if self.max_cpu_loras is not None else ()):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"{name}: must be a positive integer, got {v!r}")
        if self.lora_dtype not in LORA_DTYPES:
            hint = " (float16 is not supported on CPU; use bfloat16)" if self.lora_dtype == "float16" else ""
            raise ConfigError(f"lora_dtype: {self.lora_dtype!r} is not one of {', '.join(LORA_DTYPES)}{hint}")
        if self.max_lora_rank > 512:
            raise ConfigError(f"max_lora_rank: {self.max_lora_rank} is above the 512 supported")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ConfigError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras}): "
                              "the adapters of a batch are read on the host first")
        if self.enable_lora and (self.fuse or self.compile or self.cuda_graphs):
            raise ConfigError("enable_lora does not support --fuse / --compile / CUDA graphs yet (the traced or "
                              "captured step has no adapter inputs); drop one of them")

    def __post_init__(self) -> None:
        self._check_lora()
        if self.dtype not in ("auto", "float32", "bfloat16", "float16", "fp32", "bf16", "fp16"):
            raise ConfigError(
                f"dtype: unknown {self.dtype!r}; choose auto, float32, bfloat16 or float16"
            )
        self.dtype = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}.get(
            self.dtype, self.dtype
        )
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ConfigError(f"device: unknown {self.device!r}; use 'cpu' or 'cuda[:N]'")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"{name}: must be a positive integer, got {v!r}")
        v = self.num_scheduler_steps
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise ConfigError(f"num_scheduler_steps: must be a positive integer (1 = one decode step per "
                              f"scheduler call), got {v!r}")
        v = self.max_prefill_tokens_while_decoding
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise ConfigError(f"max_prefill_tokens_while_decoding: must be a positive integer, got {v!r}")
        if self.max_model_len is not None and (
            not isinstance(self.max_model_len, int) or self.max_model_len < 1
        ):
            raise ConfigError(f"max_model_len: must be a positive integer, got {self.max_model_len!r}")
        if self.kv_cache_memory is not None:
            self.kv_cache_memory = parse_bytes(self.kv_cache_memory, "kv_cache_memory")
        kv = self.kv_cache_dtype = {"bf16": "bfloat16", "fp8_e4m3": "fp8"}.get(self.kv_cache_dtype,
                                                                               self.kv_cache_dtype)
        if kv not in KV_CACHE_DTYPES:
            raise ConfigError(
                f"kv_cache_dtype: {kv!r} is not implemented; choose auto (the model's dtype), bfloat16, "
                "int8 (CPU) or fp8 (e4m3)"
            )
        if kv == "bfloat16" and self.device != "cpu":
            raise ConfigError(
                f"kv_cache_dtype: {kv} is implemented on CPU only; on {self.device} the KV "
                "cache takes the model's dtype (for a bf16 cache there, run the model with --dtype bfloat16)"
            )
        if kv == "int8" and self.device != "cpu":
            raise ConfigError(f"kv_cache_dtype: int8 is implemented on CPU only (its kernels are the CPU "
                              f"attention's); on {self.device} use fp8")
        if kv in ("int8", "fp8") and (self.compile or self.fuse):
            raise ConfigError(f"kv_cache_dtype {kv} does not support --fuse / --compile yet (the traced step "
                              "writes the cache unquantised); drop one of them")
        if not 0.0 < self.memory_fraction <= 1.0:
            raise ConfigError(f"memory_fraction: must be in (0, 1], got {self.memory_fraction}")
        if self.attention_backend not in ("auto", "torch", "sdpa", "cpu", "triton"):
            raise ConfigError(
                f"attention_backend: unknown {self.attention_backend!r}; "
                "choose auto, torch, sdpa, cpu or triton"
            )
        if self.preemption_mode not in ("auto", "recompute", "swap"):
            raise ConfigError(
                f"preemption_mode: unknown {self.preemption_mode!r}; choose auto, recompute or swap"
            )
        if self.swap_space is not None:
            self.swap_space = parse_bytes(self.swap_space, "swap_space")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ConfigError(f"enable_prefix_caching: must be True or False, got {self.enable_prefix_caching!r}")
        if self.quantization in ("none", ""):
            self.quantization = None
        if self.quantization not in (None, "int8", "int4", "bf16"):
            raise ConfigError(
                f"quantization: unknown {self.quantization!r}; choose int8, int4 or bf16 (or None for none)"
            )
        if self.quantization == "bf16":
            if not self.device == "cpu":
                raise ConfigError(f"quantization bf16 (bf16 weights, fp32 compute) is a CPU path; on "
                                  f"{self.device!r} use --dtype bfloat16")
            if self.dtype not in ("auto", "float32"):
                raise ConfigError(f"quantization bf16 computes in fp32 over bf16 weights; --dtype {self.dtype} "
                                  "contradicts it: use --dtype float32 (or auto)")
            if self.tensor_parallel_size != 1:
                raise ConfigError("quantization bf16 does not support tensor parallelism yet; use --dtype "
                                  "bfloat16 or --quantization int8 with --tensor-parallel-size")
        if self.quantization_group_size not in (32, 64, 128):
            raise ConfigError(
                f"quantization_group_size: must be 32, 64 or 128, got {self.quantization_group_size!r}"
            )
        if self.num_threads is not None and self.num_threads < 1:
            raise ConfigError(f"num_threads: must be >= 1, got {self.num_threads}")
        for name in ("compile", "cuda_graphs"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name}: must be True or False, got {getattr(self, name)!r}")
        if self.fuse not in (None, True, False):
            raise ConfigError(f"fuse: must be True, False or None (auto), got {self.fuse!r}")
        if self.cuda_graphs and not self.device.startswith("cuda"):
            raise ConfigError(
                f"cuda_graphs (--cuda-graphs): CUDA graphs need a CUDA device, but device is {self.device!r}; "
                "use --device cuda, or drop --cuda-graphs (--compile works on CPU)"
            )
        if self.compile and self.quantization is not None:
            raise ConfigError(
                "compile (--compile) does not support quantized weights yet (the quantised projections "
                "are not opaque ops for torch.compile); drop --compile or --quantization"
            )
        tp = self.tensor_parallel_size
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
            raise ConfigError(f"tensor_parallel_size: must be a positive integer, got {tp!r}")
        if tp > 1 and (self.compile or self.cuda_graphs or self.fuse):
            raise ConfigError(
                "tensor_parallel_size > 1 does not support --fuse / --compile / --cuda-graphs yet (the "
                "traced and captured steps have no collectives); drop one of them"
            )
        if self.comm_dtype not in (None, "bfloat16", "float16"):
            raise ConfigError(f"comm_dtype: unknown {self.comm_dtype!r}; choose bfloat16 or float16 (or None)")
        if not isinstance(self.comm_timeout, int | float) or isinstance(self.comm_timeout, bool) \
                or not self.comm_timeout > 0:
            raise ConfigError(f"comm_timeout: must be a positive number of seconds, got {self.comm_timeout!r}")
        if self.speculative_model is not None and not isinstance(self.speculative_model, str):
            raise ConfigError(f"speculative_model: 'ngram' (prompt lookup) or a draft model's directory, got "
                              f"{self.speculative_model!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= 64:
                raise ConfigError(f"{name}: must be an integer in [1, 64], got {v!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ConfigError(f"prompt_lookup_min ({self.prompt_lookup_min}) must be <= prompt_lookup_max "
                              f"({self.prompt_lookup_max})")
        if (self.num_scheduler_steps or 1) > 1 and self.tensor_parallel_size > 1:
            raise ConfigError("num_scheduler_steps > 1 is not implemented with tensor parallelism (the other ranks "
                              "follow the scheduler one step at a time); leave it unset or 1")
        if (self.num_scheduler_steps or 1) > 1 and self.speculative_model is not None:
            raise ConfigError("num_scheduler_steps > 1 and speculative decoding do not combine (each scheduler "
                              "call verifies one draft); leave num_scheduler_steps unset or 1")
        if self.generation_config not in ("auto", "vllm") and not Path(self.generation_config).is_dir():
            raise ConfigError(
                f"generation_config: {self.generation_config!r} is neither 'auto' (the model's "
                "generation_config.json), 'vllm' (ignore it) nor a directory holding a generation_config.json"
            )
        if self.fuse is None:
            self.fuse = False


def engine_default(name: str):
    """The default of one EngineConfig field: the single place each engine default is written."""
    for f in fields(EngineConfig):
        if f.name == name:
            if f.default is MISSING:
                raise KeyError(f"EngineConfig.{name} has no default")
            return f.default
    raise KeyError(f"EngineConfig has no field {name!r}")

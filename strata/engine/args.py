"""EngineArgs: the single home of every engine flag, its help text and model resolution.

Each flag maps onto one EngineConfig field; its default is that field's default (written once, in
strata/config.py) and is shown in the help. `add_cli_args` puts the flags on any argparse parser
(generate, serve, bench, analyze); `EngineArgs.from_cli_args(args)` reads back only the flags that
were given, and `create_engine_config()` resolves the model (an HF directory | `--random-model
SHAPE` | the built-in demo model) and builds the validated EngineConfig, as vLLM's EngineArgs does.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from strata.config import EngineConfig, engine_default
from strata.demo.shapes import SHAPES
from strata.errors import ConfigError
from strata.graph.hub import check_model_dir, is_hub_id, split_revision


@dataclass(frozen=True)
class _Flag:
    field: str  # EngineConfig field
    help: str
    flag: str = ""  # default: --field-name
    type: Any = None
    choices: tuple | None = None
    kind: str = "value"  # value | true (store_true) | false (store_true, sets False) | bool (--x/--no-x)
    default_text: str | None = None  # how to describe a None default

    @property
    def option(self) -> str:
        return self.flag or "--" + self.field.replace("_", "-")

    def help_text(self) -> str:
        if self.kind in ("true", "false"):
            return self.help
        default = engine_default(self.field)
        shown = self.default_text if default is None else default
        return f"{self.help} (default: {shown})" if shown is not None else self.help


FLAGS: tuple[_Flag, ...] = (
    _Flag("dtype", "auto | float32 | bfloat16 | float16; auto picks the fastest measured on this device"),
    _Flag("device", "cpu | cuda[:N]"),
    _Flag("max_model_len", "longest sequence (prompt + output) in tokens", type=int,
          default_text="the model's max_position_embeddings"),
    _Flag("kv_cache_memory", "KV cache size, e.g. 2GiB",
          default_text="what max_num_seqs x max_model_len can use, capped at --memory-fraction of available "
          "memory; pages become resident only as blocks are used"),
    _Flag("memory_fraction", "share of free memory for the KV cache when --kv-cache-memory is unset",
          type=float),
    _Flag("kv_cache_dtype", "KV cache storage: auto (the model's dtype) | bfloat16 (CPU: K/V rounded to bf16 "
          "as written, read back exactly; half the bytes decode attention streams, twice the tokens per GiB) | "
          "int8 (CPU: 1 byte a value plus an fp32 scale per token and KV head, quantised as written, read by "
          "the decode kernels; ~1.9x bf16's tokens per GiB at head_dim 64) | fp8 (float8 e4m3 with the same "
          "scales; CUDA, or CPU through the slower torch path: prefer int8 there)",
          choices=("auto", "bfloat16", "bf16", "int8", "fp8", "fp8_e4m3")),
    _Flag("block_size", "tokens per KV block", type=int),
    _Flag("max_num_seqs", "most sequences running at once", type=int),
    _Flag("max_num_batched_tokens", "token budget of one step (prefill chunks + decodes)", type=int),
    _Flag("max_prefill_tokens_while_decoding", "decode-first: while sequences decode, prefill at most this "
          "many tokens a step, so running streams are not frozen behind a long prompt", type=int,
          default_text="strata serve on CPU: measured prefill rate x 0.10 s; offline LLM / GPU: no cap"),
    _Flag("num_scheduler_steps", "multi-step decode: up to this many decode steps per scheduler call while "
          "every running sequence decodes and no request waits (tokens then stream in bursts; 1 = off)",
          type=int, default_text="CPU: as many as fit a 50 ms burst at the measured step time, at most 16; GPU: 1"),
    _Flag("num_threads", "compute threads", flag="--threads", type=int, default_text="physical cores"),
    _Flag("speculative_model", "speculative decoding: 'ngram' drafts by prompt lookup (tokens that followed "
          "the same n-gram earlier in the prompt or output), or a small draft model's directory (same "
          "vocabulary); drafts are verified in one forward, exact under greedy and sampling", default_text="off"),
    _Flag("num_speculative_tokens", "speculative decoding: draft tokens verified per step", type=int),
    _Flag("prompt_lookup_max", "speculative ngram: longest n-gram to match", type=int),
    _Flag("prompt_lookup_min", "speculative ngram: shortest n-gram to match", type=int),
    _Flag("attention_backend", "paged attention kernels: auto | torch | sdpa | cpu | triton",
          choices=("auto", "torch", "sdpa", "cpu", "triton")),
    _Flag("quantization", "weight-only quantisation of the dense projections at load (bf16: bf16 weights, "
          "fp32 compute; dtype auto picks it on CPUs where it measures faster)", choices=("int8", "int4", "bf16"),
          default_text="none"),
    _Flag("quantization_group_size", "int4: input columns sharing one scale", type=int, choices=(32, 64, 128)),
    _Flag("enable_prefix_caching", "do not share cached KV blocks between requests with equal prompt prefixes",
          flag="--no-prefix-caching", kind="false"),
    _Flag("preemption_mode", "when KV blocks run out: recompute, swap to host memory, or auto (cost model)",
          choices=("auto", "recompute", "swap")),
    _Flag("swap_space", "host KV pool for swapping, e.g. 4GiB", default_text="size of the KV cache, <= 1GiB"),
    _Flag("fuse", "run the step as an FX graph with fused ops (add+RMSNorm, SiLU*up, rotary q/k, KV write; "
          "graph/fusion.py) (default: off; on CPU the eager step's hand-placed numba kernels measured "
          "faster)", kind="bool"),
    _Flag("compile", "torch.compile the decode step (the FX-traced, fused step; batch padded to buckets) "
          "(default: off, eager)", kind="true"),
    _Flag("cuda_graphs", "capture the decode step as CUDA graphs per batch bucket and replay it (CUDA only)",
          kind="true"),
    _Flag("tensor_parallel_size", "ranks sharing the model (tensor parallelism over torch.distributed; local "
          "ranks are spawned, or run the command under torchrun)", type=int),
    _Flag("enable_expert_parallel", "MoE models: split the experts across the tensor-parallel ranks, tokens sent to "
          "their experts' rank and back with all-to-alls (vLLM's name; attention stays tensor-parallel)", kind="true"),
    _Flag("enable_lora", "serve LoRA adapters (PEFT directories): each request may name one; requests with "
          "different adapters share a batch", kind="true"),
    _Flag("max_loras", "LoRA adapters resident in one batch (a request whose adapter does not fit waits)", type=int),
    _Flag("max_lora_rank", "the largest LoRA rank an adapter may have (the resident adapters are padded to it)",
          type=int),
    _Flag("lora_dtype", "how the resident LoRA adapters are stored; auto: float32 over an fp32 base, bfloat16 "
          "over bf16/int8/int4 weights (vLLM's name)", choices=("auto", "float32", "bfloat16")),
    _Flag("max_cpu_loras", "LoRA adapters whose weights the host keeps read (least recently used dropped first)",
          type=int, default_text="--max-loras"),
    _Flag("comm_dtype", "compress the tensor-parallel all-reduce to this dtype", choices=("bfloat16", "float16"),
          default_text="the activations' dtype"),
    _Flag("comm_timeout", "seconds a collective may take before a rank counts as dead", type=float),
    _Flag("chat_template", "FILE|STRING: a Jinja chat template (a file, or the template text) that replaces "
          "the checkpoint's", default_text="the checkpoint's tokenizer_config.json / chat_template.jinja"),
    _Flag("tokenizer", "DIR: the tokenizer (tokenizer.json, tokenizer_config.json) to use instead of the "
          "model's; for a GGUF, vLLM's habit of passing the base model's: its vocabulary must be the file's "
          "(checked token for token)", default_text="the model's own"),
    _Flag("generation_config", "sampling defaults: auto = the model's generation_config.json, vllm = none "
          "(vLLM's name; requests and flags alone decide), or a directory holding a generation_config.json"),
)
_BY_FIELD = {f.field: f for f in FLAGS}


@dataclass
class EngineArgs:
    """The engine flags that differ from EngineConfig's defaults, and the model choice."""

    model: str | None = None  # HF directory or Hub id; None (and no random_model) = the built-in demo model
    random_model: str | None = None  # a named random-weight shape (strata.demo.shapes.SHAPES)
    revision: str | None = None  # Hub branch, tag or commit of a Hub id (graph/hub.py)
    download_dir: str | None = None  # Hugging Face cache to read and download into
    overrides: dict[str, Any] = field(default_factory=dict)  # EngineConfig field -> value given

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser, title: str = "engine") -> None:
        g = parser.add_argument_group(title)
        g.add_argument("--model", default=None,
                       help="HF model directory, or a Hugging Face Hub id ORG/NAME[@REVISION] read from the HF "
                       "cache or downloaded (default: the built-in demo model)")
        g.add_argument("--revision", default=None,
                       help="Hub branch, tag or commit of a Hub id (default: main)")
        g.add_argument("--download-dir", default=None,
                       help="Hugging Face cache to read Hub models from and download into (default: "
                       "$HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub)")
        g.add_argument(
            "--random-model", default=None, choices=sorted(SHAPES), metavar="SHAPE",
            help=f"random-weight checkpoint of a named shape ({', '.join(SHAPES)}), written once under "
            "$STRATA_CACHE; excludes --model",
        )
        for f in FLAGS:  # argparse defaults are EngineConfig's, so args.<field> always holds a value
            default = engine_default(f.field)
            if f.kind == "value":
                g.add_argument(f.option, dest=f.field, default=default, type=f.type, choices=f.choices,
                               help=f.help_text())
            elif f.kind == "bool":
                g.add_argument(f.option, dest=f.field, default=default, action=argparse.BooleanOptionalAction,
                               help=f.help_text())
            else:
                g.add_argument(f.option, dest=f.field, action="store_const", const=f.kind == "true",
                               default=default, help=f.help_text())

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        given = {f.field: getattr(args, f.field) for f in FLAGS if hasattr(args, f.field)}
        model, tag = getattr(args, "model", None), getattr(args, "model_tag", None)
        if model is not None and tag is not None and model != tag:
            raise ConfigError(f"two models given: {tag!r} (positional) and --model {model!r}; give one")
        return cls(
            model=model or tag, random_model=getattr(args, "random_model", None),
            revision=getattr(args, "revision", None), download_dir=getattr(args, "download_dir", None),
            overrides={k: v for k, v in given.items() if v != engine_default(k)},
        )

    def get(self, name: str) -> Any:
        """The value a flag resolves to: given, else EngineConfig's default."""
        return self.overrides.get(name, engine_default(name))

    @staticmethod
    def add_model_positional(parser: argparse.ArgumentParser) -> None:
        """`strata serve MODEL` / `strata generate MODEL`, as `vllm serve MODEL`: the same as --model."""
        parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                            help="HF model directory or Hub id ORG/NAME[@REVISION] (same as --model)")

    def hub_id(self) -> str | None:
        """The Hub id (ORG/NAME, no revision) when the model is one rather than a local path."""
        if self.model is None or self.random_model is not None or Path(self.model).expanduser().exists():
            return None
        return split_revision(self.model)[0] if is_hub_id(self.model) else None

    def model_path(self) -> str | None:
        """Checkpoint directory from --model (a Hub id resolved to its snapshot, downloading it when
        it is not cached: graph/hub.py) / --random-model; None selects the demo model."""
        if self.random_model is not None:
            if self.model is not None:
                raise ConfigError("give --model PATH or --random-model SHAPE, not both")
            from strata.demo.random_models import (
                random_model_path,  # reason: writes with torch; `strata serve`'s front end stays torch-free without --random-model
            )

            return str(random_model_path(self.random_model))
        if self.model is None:
            return None
        return str(check_model_dir(self.model, self.revision, self.download_dir))

    def config_kwargs(self, **overrides: Any) -> dict[str, Any]:
        """EngineConfig keyword arguments (model excluded): the flags set, then `overrides`."""
        return {**self.overrides, **overrides}

    def all_kwargs(self) -> dict[str, Any]:
        """Every flag's field with the value it resolves to (given, else the default)."""
        return {f.field: self.get(f.field) for f in FLAGS}

    def create_engine_config(self, **overrides: Any) -> EngineConfig:
        return EngineConfig(model=self.model_path(), **self.config_kwargs(**overrides))

    def to_cli(self) -> list[str]:
        """The same flags as a command line (to start `strata serve` with them)."""
        out = []
        if self.random_model is not None:
            out += ["--random-model", self.random_model]
        if self.model is not None:
            out += ["--model", self.model]
        if self.revision is not None:
            out += ["--revision", self.revision]
        if self.download_dir is not None:
            out += ["--download-dir", self.download_dir]
        for name, value in self.overrides.items():
            f = _BY_FIELD[name]
            if f.kind == "value":
                out += [f.option, str(value)]
            elif f.kind == "bool":
                out.append(f.option if value else "--no-" + f.option[2:])
            elif value == (f.kind == "true"):
                out.append(f.option)
        return out

"""build_engine(config): the engine's assembly as an ordered list of small steps.

    probe once -> platform -> open checkpoint -> load (quantising as it reads) -> (shard) -> prepare ->
    KV memory -> fuse -> decode step -> runner, policy, scheduler, sampler

Each step takes the pieces it needs and returns the pieces it makes or changes; none sees the
engine (torchtitan's `parallelize` style). The machine's facts come in once, as the hardware
profile; the platform (strata/platform: CPU or GPU) chosen from it supplies the device's pieces:
weight storage, kernel marks, the decode step and the step policy with its tuners. Tensor
parallelism adds its shard step after the load. The engine (llm_engine.py) only runs steps over
the parts built here.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import importlib
import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from strata.comm.collectives import Communicator
from strata.config import DTYPES, EngineConfig
from strata.demo.model import demo_model_path
from strata.engine.draft_model import DraftModelProposer
from strata.engine.grammar import GrammarCompiler
from strata.engine.lifecycle import SequenceLifecycle
from strata.engine.lora_manager import LoRAManager
from strata.engine.parallel import Ranks
from strata.engine.preemption import SwapPolicy
from strata.engine.runner import ModelRunner
from strata.engine.sampler import Sampler
from strata.engine.scheduler import Scheduler
from strata.engine.speculative import NgramProposer, Speculator
from strata.errors import ConfigError, ModelLoadError
from strata.graph import prequantized
from strata.graph.fusion import fuse_model
from strata.graph.gguf_model import default_storage, gguf_files
from strata.graph.hub import check_model_dir
from strata.graph.loader import load_model
from strata.graph.lora_adapter import lora_dtype
from strata.graph.tensor_parallel import check_shardable, per_rank_config, shard_model
from strata.hardware.dtype_policy import auto_dtype
from strata.hardware.host_allocator import keep_freed_memory
from strata.hardware.placement import rank_placement, set_compute_threads
from strata.hardware.probe import cached_comm_model, probe
from strata.hardware.profile import HardwareProfile
from strata.kernels.attention import select_backend
from strata.memory.blocks import BlockManager
from strata.memory.kv_cache import allocate_kv_cache
from strata.memory.planner import MemoryPlan, check_fits, kv_bytes_per_token, plan_memory
from strata.memory.quant import model_weight_bytes
from strata.memory.swap import HostBlockPool, KVSwapper
from strata.model_config import ModelConfig
from strata.platform import Platform, select_platform
from strata.platform.base import WORKLOADS
from strata.platform.cpu import resolve_weight_storage
from strata.platform.policy import StepPolicy
from strata.protocol.tokenizer import Tokenizer
from strata.protocol.tokenizer_dir import tokenizer_dir
from strata.text_table import fmt_bytes

logger = logging.getLogger(__name__)

DEFAULT_SWAP_CAP = 2**30  # the default swap pool: as big as the KV cache, at most this


# --- checkpoint ------------------------------------------------------------------------------------


@dataclass
class Checkpoint:
    """What the model directory says besides its weights."""

    path: Path
    model_config: ModelConfig
    tokenizer: Tokenizer | None  # None without tokenizer.json
    eos_token_ids: list[int]
    generation_defaults: dict  # sampling defaults from generation_config.json


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{path}: cannot parse ({e})") from None


def _generation_defaults(gen: dict) -> dict:
    """Sampling defaults from generation_config.json, used where a request sets nothing."""
    out = {k: gen[k] for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty") if k in gen}
    if gen.get("do_sample") is False:
        out["temperature"] = 0.0  # HF semantics: greedy whatever the temperature says
    if out.get("top_k") == 0:
        out["top_k"] = -1  # HF's "disabled"
    return out


def open_checkpoint(model: str | None, generation_config: str = "auto", chat_template: str | None = None,
                    tokenizer: str | None = None) -> Checkpoint:
    """An HF model directory (None: the built-in demo model): config, tokenizer, EOS, defaults.

    generation_config: where the sampling defaults come from (EngineConfig.generation_config; the
    EOS ids always come from the model's own file); chat_template overrides the checkpoint's;
    tokenizer: --tokenizer DIR (tokenizer_dir)."""
    if model is None:
        path = demo_model_path()
    else:
        path = check_model_dir(model)
    cfg = ModelConfig.from_file(path / "config.json")
    tok_dir = tokenizer_dir(path, tokenizer, cfg.vocab_size)
    tokenizer = None
    if (tok_dir / "tokenizer.json").is_file():
        tokenizer = Tokenizer.from_dir(tok_dir, chat_template=chat_template)
    else:
        logger.info("%s has no tokenizer.json: only token-id prompts will work", path)
    gen = _read_json(path / "generation_config.json")
    defaults = sampling_defaults(path, gen, generation_config)
    eos = gen.get("eos_token_id")
    ids = [] if eos is None else (list(eos) if isinstance(eos, list) else [eos])
    ids += cfg.eos_token_ids
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return Checkpoint(path, cfg, tokenizer, sorted({int(i) for i in ids}), defaults)


def sampling_defaults(model_dir: Path, gen: dict, source: str) -> dict:
    """--generation-config: auto = the model's file, vllm = none, else DIR/generation_config.json."""
    if source == "vllm":
        return {}
    if source != "auto":
        file = Path(source) / "generation_config.json"
        if not file.is_file():
            raise ModelLoadError(f"--generation-config {source}: no generation_config.json in that directory")
        gen = _read_json(file)
    found = _generation_defaults(gen)
    if found:
        logger.info("sampling defaults from %s: %s (--generation-config vllm ignores them)",
                    model_dir / "generation_config.json" if source == "auto" else source, found)
    return found


def gguf_storage(config: EngineConfig, path: Path) -> EngineConfig:
    """A GGUF model with no --quantization: its projections in the format nearest the file's
    (graph/gguf_model.default_storage); an explicit --quantization wins."""
    if config.quantization is not None or gguf_files(path) is None:
        return config
    method, group, why = default_storage(path)
    logger.info("%s", why + ("" if method is None else " (--quantization overrides)"))
    if method is None:
        return config
    return dataclasses.replace(config, quantization=method,
                               quantization_group_size=group or config.quantization_group_size)


def prequantized_storage(config: EngineConfig, path: Path) -> EngineConfig:
    """A checkpoint quantized elsewhere (AWQ / GPTQ / compressed-tensors / FP8, graph/prequantized.py):
    its projections in the storage that holds them exactly (FP8: bf16 unless --quantization says);
    a --quantization that would change an int4 / int8 checkpoint is refused."""
    config_json = path / "config.json"
    if gguf_files(path) is not None or not config_json.is_file():
        return config
    scheme = prequantized.scheme_of(json.loads(config_json.read_text()), path)
    if scheme is None:
        return config
    if config.quantization not in (None, scheme.storage) and scheme.method != "fp8":
        raise ConfigError(f"{path}: the checkpoint is already quantized ({scheme.describe()}); "
                          f"--quantization {config.quantization} cannot change that: drop it")
    if config.quantization is not None:
        return config
    logger.info("prequantized checkpoint: %s; served as %s", scheme.describe(), scheme.storage)
    return dataclasses.replace(config, quantization=scheme.storage)


def resolve_dtype(name: str, device: str, checkpoint_dtype: torch.dtype, profile: HardwareProfile | None) -> torch.dtype:
    """auto: the fastest dtype measured on this device (hardware layer); else the one named."""
    if name != "auto":
        return DTYPES[name]
    return auto_dtype(device, checkpoint_dtype, profile if device == "cpu" else None, cpu_profile=probe)


def resolve_max_model_len(cfg: ModelConfig, requested: int | None) -> int:
    """The requested context length, default the model's; refused above it (ModelConfig's rule)."""
    return cfg.max_model_len(requested)


# --- model ------------------------------------------------------------------------------------------


def load(ckpt: Checkpoint, dtype: torch.dtype, device: str, max_model_len: int,
         storage: str | None = None, group_size: int = 64):
    """The model, its projections streamed into `storage` (bf16 / int8 / int4 weight-only
    quantisation: memory/bf16_weights.py, memory/quant.py) as the checkpoint is read."""
    t0 = time.perf_counter()
    model = load_model(ckpt.path, dtype, device, max_model_len, storage, group_size)
    logger.info("loaded %s (%s, %s%s) in %.2fs; weights %s", ckpt.path, ckpt.model_config.architecture, dtype,
                f", {storage} projections" if storage else "", time.perf_counter() - t0,
                fmt_bytes(model_weight_bytes(model)))
    return model


def fuse(model, config: EngineConfig):
    """The step's forward: the model, or its FX-traced step with fused ops (--fuse)."""
    if not config.fuse:
        return model, None
    t0 = time.perf_counter()
    fused = fuse_model(model)
    logger.info("fusion: %s in %.2fs", fused.summary(), time.perf_counter() - t0)
    return fused, fused


# --- memory -----------------------------------------------------------------------------------------


def kv_dtype(config: EngineConfig, dtype: torch.dtype) -> torch.dtype:
    """The KV cache's storage dtype: the model's (`dtype`) unless kv_cache_dtype names another."""
    name = {"fp8": "float8_e4m3fn"}.get(config.kv_cache_dtype, config.kv_cache_dtype)  # int8 / fp8: kernels/kv_quant.py
    return dtype if name == "auto" else getattr(torch, name)


def host_pool(config: EngineConfig, plan: MemoryPlan, cfg: ModelConfig, dtype: torch.dtype) -> HostBlockPool | None:
    """Swap space for preempted sequences (none in recompute mode)."""
    if config.preemption_mode == "recompute":
        return None
    per_block = plan.kv_bytes_per_token * config.block_size
    if config.swap_space is not None:
        check_fits("swap_space", "--swap-space", config.swap_space, "cpu", "default: the KV cache's size, <= 1 GiB")
    size = config.swap_space if config.swap_space is not None else min(plan.kv_cache_bytes, DEFAULT_SWAP_CAP)
    blocks = size // per_block
    if blocks == 0:
        if config.preemption_mode == "swap":
            raise ConfigError(f"swap_space: {size} bytes hold no {per_block}-byte KV block; raise it")
        return None
    logger.info("swap space: %s = %d host blocks", fmt_bytes(blocks * per_block), blocks)
    return HostBlockPool(cfg, blocks, config.block_size, dtype, pin=config.device.startswith("cuda"))


def kv_memory(config: EngineConfig, cfg: ModelConfig, dtype: torch.dtype, max_model_len: int,
              agree: Callable[[int], int] | None = None, weights: int | None = None):
    """The memory plan, the block manager (device blocks, scratch block, host pool) and the KV
    cache tensors it hands out. `cfg` is this rank's (its share of the heads, with tensor
    parallelism); `dtype` the model's (the cache's is kv_dtype of it); `agree(num_blocks)` makes
    every rank use the same block count (the smallest)."""
    cache_dtype = kv_dtype(config, dtype)
    if config.kv_cache_memory is not None:  # after loading: the weights are already counted out
        check_fits("kv_cache_memory", "--kv-cache-memory", config.kv_cache_memory, config.device,
                   f"the default sizes the cache from max_num_seqs x max_model_len, capped at "
                   f"{config.memory_fraction:.0%} of available memory")
    plan = plan_memory(
        cfg, dtype, config.block_size, max_model_len, config.max_num_seqs, config.kv_cache_memory,
        config.memory_fraction, config.device, config.quantization, config.quantization_group_size, cache_dtype,
        weights,
    )
    if agree is not None:
        plan = dataclasses.replace(plan, num_blocks=agree(plan.num_blocks))
    blocks = BlockManager(
        plan.num_blocks, config.block_size, config.enable_prefix_caching,
        scratch_block=config.compile or config.cuda_graphs,  # padded rows of a captured decode step
        host_pool=host_pool(config, plan, cfg, cache_dtype),
    )
    kv_caches = allocate_kv_cache(cfg, blocks.num_device_blocks, config.block_size, cache_dtype, config.device)
    sized = ("kv_cache_memory" if config.kv_cache_memory is not None else
             f"max_num_seqs x max_model_len, capped at {config.memory_fraction:.0%} of available memory")
    logger.info(
        "KV cache reserved: %s (%s, %d blocks of %d tokens; sized from %s; pages resident only as used); "
        "prefix caching %s", fmt_bytes(plan.kv_cache_bytes), str(cache_dtype).removeprefix("torch."), plan.num_blocks,
        config.block_size, sized,
        "on" if config.enable_prefix_caching else "off",
    )
    return plan, blocks, kv_caches


@functools.cache
def import_apart(module: str) -> None:
    """Import `module` from a short-lived thread, once per process.

    torch.fx.wrap, called at import by torch._dynamo (which torch imports lazily on the first call
    of many ops: nn.init on the meta device does), keeps its own frame in a local
    (inspect.currentframe()): that frame cycle keeps the whole caller chain alive until the
    garbage collector runs. Imported from inside an `LLM(...)` call, the chain would run through
    the user's frame holding the LLM under construction, and `del llm` would free nothing. From a
    thread, the chain ends in the thread.
    """
    failed: list[BaseException] = []

    def run() -> None:  # an import the caller's Ctrl-C cut short fails here: raise it there, not print it
        try:
            importlib.import_module(module)
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            failed.append(e)

    t = threading.Thread(target=run, name="strata-import", daemon=True)
    t.start()
    t.join()
    if failed:
        raise failed[0]


# --- the whole -------------------------------------------------------------------------------------


@dataclass
class EngineParts:
    config: EngineConfig
    threads: int
    checkpoint: Checkpoint
    dtype: torch.dtype
    max_model_len: int
    model: torch.nn.Module
    plan: MemoryPlan
    block_manager: BlockManager
    kv_caches: list[torch.Tensor]
    fusion: object | None  # graph.fusion.FusedStep with --fuse
    runner: ModelRunner
    scheduler: Scheduler
    sampler: Sampler
    platform: Platform
    policy: StepPolicy  # the tuners' decisions; the scheduler reads it, the engine feeds it
    ranks: object | None = None  # engine.parallel.Ranks with tensor parallelism
    control: object | None = None  # the Communicator step plans travel on
    lora: LoRAManager | None = None  # with enable_lora


def shard(model, ranks, comm, expert_parallel: bool = False):
    """Tensor parallelism (+ expert parallelism), applied to the built (and quantised) model from outside."""
    t0 = time.perf_counter()
    model = shard_model(model, ranks.rank, ranks.world.world_size, comm, expert_parallel)
    logger.info("sharded for rank %d of %d in %.2fs", ranks.rank, ranks.world.world_size, time.perf_counter() - t0)
    return model


DRAFT_KV_BYTES = 512 << 20  # the draft model's KV cache: at most this (sequences without room do not draft)


def draft_proposer(config: EngineConfig, target: ModelConfig, dtype: torch.dtype, max_len: int, backend,
                   platform: Platform):
    """--speculative-model DIR: the draft model on its own paged KV cache (engine/draft_model.py)."""
    ckpt = open_checkpoint(config.speculative_model)
    cfg = ckpt.model_config
    if cfg.vocab_size != target.vocab_size:
        raise ConfigError(f"--speculative-model {config.speculative_model}: its vocabulary ({cfg.vocab_size} tokens) "
                          f"is not the target's ({target.vocab_size}); a draft model must share the tokenizer")
    if config.tensor_parallel_size > 1:
        raise ConfigError("--speculative-model with a draft model does not support tensor parallelism yet; use "
                          "--speculative-model ngram")
    limit, why = cfg.context_limit()  # a yarn / dynamic rope stretches the window
    if limit < max_len:
        raise ConfigError(f"--speculative-model {config.speculative_model}: it handles {limit} positions "
                          f"({why}), fewer than max_model_len ({max_len}); lower --max-model-len or pick a "
                          "draft model with a longer context")
    model = load(ckpt, dtype, config.device, max_len)
    one = kv_bytes_per_token(cfg, kv_dtype(config, dtype)) * max_len
    budget = max(one, min(DRAFT_KV_BYTES, one * config.max_num_seqs))
    draft_cfg = dataclasses.replace(config, kv_cache_memory=budget, preemption_mode="recompute",
                                    quantization=None, enable_prefix_caching=False)
    _, blocks, kv_caches = kv_memory(draft_cfg, cfg, dtype, max_len)
    runner = ModelRunner(model, kv_caches, config.block_size, config.device, backend,
                         decode_step=platform.draft_decode_step(model, kv_caches, config.block_size))
    logger.info("draft model %s (%s): KV %s for drafts", ckpt.path, cfg.architecture, fmt_bytes(budget))
    return DraftModelProposer(runner, blocks)


def build_engine(config: EngineConfig, detokenize: bool = True, profile: HardwareProfile | None = None,
                 workload: str = "streaming") -> EngineParts:
    """detokenize=False: sequences carry token ids only; text and stop strings are the caller's.
    profile: this machine's measured hardware profile (hardware/probe.py; None: probed here, once,
    where the build needs one: a CPU engine, or bf16 weight storage). workload: "offline" (every
    prompt known up front: LLM.generate), "streaming" (driven step by step) or "serving" (arrivals:
    `strata serve`); the platform's policy follows it (platform/base.py)."""
    if workload not in WORKLOADS:
        raise ConfigError(f"workload {workload!r}: choose one of {', '.join(WORKLOADS)}")
    import_apart("torch._dynamo")
    if profile is None and (config.device == "cpu" or config.quantization == "bf16"):
        profile = probe("cpu")
    platform = select_platform(config.device, profile)
    ckpt = open_checkpoint(config.model, config.generation_config, config.chat_template, config.tokenizer)
    ranks = comm = control = None
    if config.tensor_parallel_size > 1:
        # before any rank starts
        check_shardable(ckpt.model_config, config.tensor_parallel_size, config.enable_expert_parallel)
        ranks = Ranks(config)  # spawns the other local ranks, or joins torchrun's world
        # the measured alpha-beta model (`strata bench comm`) picks SHM or gloo per message size
        comm = Communicator(comm_dtype=config.comm_dtype, cost=cached_comm_model(config.device),
                            timeout_s=config.comm_timeout)
        comm.setup_shm()  # collectively, now, rather than inside the first forward
        control = Communicator(ranks.control, shm=False)
        w = ranks.world
        threads, _ = rank_placement(w.local_rank, w.local_world_size, config.num_threads)
    else:
        threads = set_compute_threads(config.num_threads)
    if config.device == "cpu":
        keep_freed_memory()  # activations reused, not page-faulted anew every step
    try:
        return _build(config, ckpt, detokenize, threads, platform, workload, ranks, comm, control)
    except BaseException:
        if ranks is not None:
            ranks.close()
        raise


def _build(config: EngineConfig, ckpt: Checkpoint, detokenize: bool, threads: int, platform: Platform,
           workload: str, ranks, comm, control) -> EngineParts:
    cfg = ckpt.model_config
    config = prequantized_storage(gguf_storage(config, ckpt.path), ckpt.path)
    config = resolve_weight_storage(config, cfg.torch_dtype, platform.profile)
    dtype = resolve_dtype(config.dtype, config.device, cfg.torch_dtype, platform.profile)
    max_len = resolve_max_model_len(cfg, config.max_model_len)
    model = load(ckpt, dtype, config.device, max_len, config.quantization, config.quantization_group_size)
    rank_cfg, agree = cfg, None
    if ranks is not None:
        model = shard(model, ranks, comm, config.enable_expert_parallel)
        rank_cfg = per_rank_config(cfg, ranks.world.world_size)
        agree = control.all_min
    platform.prepare_model(model, config)
    lora = None
    if config.enable_lora:  # the adapters' banks count in the weights the KV plan leaves room for
        # tensor parallelism: the banks are the shard's; ranks > 0 follow rank 0's slots
        lora = LoRAManager(model, config.max_loras, config.max_lora_rank, config.max_cpu_loras, str(ckpt.path),
                           lora_dtype(config.lora_dtype, model), follower=ranks is not None and ranks.rank != 0)
    # the loaded model's own bytes: a GGUF's or a prequantized checkpoint's layouts are not the
    # estimate's (memory/planner.weight_bytes counts --quantization's)
    plan, blocks, kv_caches = kv_memory(config, rank_cfg, dtype, max_len, agree, model_weight_bytes(model))
    backend = select_backend(config.attention_backend, config.device, dtype)
    forward, fusion = fuse(model, config)
    decode_step = platform.decode_step(model, forward, kv_caches, blocks, backend, config, max_len)
    if config.fuse or config.compile or config.cuda_graphs:
        # torch.fx's tracer leaves frame cycles (Proxy.__iter__ and torch.fx.wrap keep
        # inspect.currentframe() in a local) whose frames hold the model: collect them now, once,
        # so that dropping the last reference to the engine frees it (~0.15 s, on top of seconds)
        gc.collect()
    swapper = KVSwapper(kv_caches, blocks.host) if blocks.host is not None else None
    runner = ModelRunner(model, kv_caches, config.block_size, config.device, backend,
                         forward=forward, decode_step=decode_step, swapper=swapper, lora=lora)
    grammars = None
    if ckpt.tokenizer is not None:  # structured output; compiled lazily, at the first such request
        grammars = GrammarCompiler(ckpt.tokenizer.to_json(), cfg.vocab_size, ckpt.eos_token_ids)
    lifecycle = SequenceLifecycle(ckpt.eos_token_ids, max_len, ckpt.tokenizer if detokenize else None, grammars)
    prefer_swap = SwapPolicy(config, plan, dtype, cfg)
    speculator = None
    if config.speculative_model == "ngram":
        speculator = Speculator(config.num_speculative_tokens,
                                NgramProposer(config.prompt_lookup_max, config.prompt_lookup_min))
    elif config.speculative_model is not None:
        speculator = Speculator(config.num_speculative_tokens,
                                draft_proposer(config, cfg, dtype, max_len, backend, platform))
    policy = platform.policy(config, cfg, threads, tensor_parallel=ranks is not None,
                             speculative=speculator is not None, workload=workload)
    logger.info("%s platform, %s workload: step policy %s", platform.name, workload, policy.describe())
    scheduler = Scheduler(blocks, config.max_num_seqs, config.max_num_batched_tokens, prefer_swap, lifecycle,
                          policy, speculator, lora)
    sampler = Sampler(cfg.vocab_size, ckpt.eos_token_ids, config.seed)
    return EngineParts(config, threads, ckpt, dtype, max_len, model, plan, blocks, kv_caches, fusion,
                       runner, scheduler, sampler, platform, policy, ranks, control, lora)

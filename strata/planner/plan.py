"""`strata plan`: what a model needs and how fast it can run, from first principles.

Memory: weights (planner.weight_bytes, quantisation included), KV bytes per token
(planner.kv_bytes_per_token), an activation/workspace estimate, and the KV capacity sized by
the engine's own planner.plan_memory, so the blocks predicted for `this` machine with a given
kv_cache_memory are the blocks LLMEngine allocates.

Time, per device (tensor parallel degree t divides weights, FLOPs and, when the KV heads split,
the KV cache):
  decode step at batch b, context (depth) c:
    bytes  = W + KV                      W = weights streamed per step (an untied input
                                          embedding is gathered, not streamed; lm_head is)
    KV     = b*c*kv_per_token            kv_per_token = 2*layers*kv_heads*head_dim*bytes of the KV
                                          cache's dtype (+ its scales where it has them)
    FLOPs  = b * (2*P_lin + 4*layers*heads*head_dim*c)   P_lin = dense projections + lm_head
    roofline = max(W/stream + KV/mem, FLOPs/rate)
  the depth curve: batch-1 decode at c = 0, 4k, 16k (those below L) and L; the weight read stays,
  the KV read (or the attention compute, where that is slower) grows with c
Formats: --dtype, --quantization and --kv-cache-dtype as the engine resolves them (auto on `this`:
the engine's own rule from the measured profile, platform/cpu.resolve_weight_storage and
engine/build.resolve_dtype; on a datasheet GPU: the checkpoint's dtype).
  prefill of p tokens (one sequence, chunks of max_num_batched_tokens):
    FLOPs  = 2*P_layers*p + 2*vocab*hidden (lm_head, last token)     at the GEMM rate
           + 2*layers*heads*head_dim*p*(p+1) (causal attention)       at the attention rate
    time   = those + chunks * W/stream
On a datasheet accelerator the rates are its dense peaks and the prediction is the roofline.
On `this` machine the rates are measured (strata hw) through the kernels Strata runs:
  stream   = the batch-1 GEMV rate (probe linear_gbs / quant_linear_gbs), not the DRAM peak,
  rate     = the 16-row kernel rate (matmul_gflops) up to 16 rows, the 512-row GEMM beyond,
  attention = causal SDPA in the prefill layout (sdpa_gflops),
and the CPU prediction follows the measured kernels rather than the max(): a 1..16-row GEMV
streams the weights once and its time grows linearly between the two measured points
(t1 = W/stream at 1 row, t16 = 16 rows' FLOPs / rate at 16; linear in between), attention
is max(KV/mem, FLOPs/rate), and the step overhead (calibrate.py: Python, dispatch, sampler,
measured on the engine itself) is added. Those formulas are the fallback: decode on `this` is
priced from the model's own layers built in the engine's weight format and timed for decode steps
of 1/4/16/64 sequences (decode_probe.py: layers x per-layer time + the LM head + the KV beyond the
probe's context as max(KV/mem, attention FLOPs/rate)), when that fits its time and memory budget; the
calibrated overhead is then what the engine adds around those kernels. Prefill on `this` is priced from one decoder layer of
the model timed at its own shapes (layer_probe.py: projections, attention, and the elementwise
work no FLOP count sees), times the layers, plus the lm_head read; the rates above are the
fallback when that layer would take too long to time. Tensor parallel adds 2 all-reduces per layer of
hidden*bytes*b, alpha-beta model: ring 2(N-1)/N*bytes/bw + 2(N-1)*alpha, tree
2*log2(N)*(alpha + bytes/bw); the cheaper is taken. Datasheet targets use the link's bandwidth and
an assumed alpha; `thisxN` (N ranks of this machine) uses the alpha and beta that `strata bench
comm --world-size N` fitted here (SHM, gloo, NCCL; stored in the hardware profile), and says so.
Mixture of experts (Mixtral, Qwen2/3-MoE, OLMoE): memory holds every expert (total parameters, in
the weight format); a decode step of b tokens reads, of each MoE layer, the expected distinct
experts E*(1-(1-k/E)^b) (k at batch 1, all E as b grows), each an expert GEMV over its share of
the rows, plus the attention, shared expert, router and head; FLOPs (decode and prefill) are the
active ones (top_k experts a token); routing (router GEMV + a cost per expert visited) is
measured on `this` by moe_probe.py, assumed on a datasheet GPU (cost_model.GPU_ROUTING), and
inside the decode probe's times where it ran. Over N devices an MoE model is expert parallel (the
engine's --enable-expert-parallel, graph/expert_parallel.py; the EP rows): attention split by heads
as TP (1 all-reduce a layer), E/N whole experts a device, and per MoE layer 2 all-to-alls of
ceil(b/N) x top_k x hidden x bytes a rank plus 1 all-gather of the N slices: the comm model's
all-to-all fit on `thisxN` (its all-gather fit as a labelled stand-in where no all-to-all was
measured), the link's pairwise (n-1)*alpha + (n-1)/n*S/bw on a datasheet target.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from strata.config import DTYPES, EngineConfig, engine_default
from strata.demo.random_models import SHAPES
from strata.engine.build import kv_dtype, resolve_dtype
from strata.errors import CapacityError, ConfigError
from strata.graph import prequantized
from strata.graph.gguf_model import default_storage, gguf_files, gguf_formats
from strata.graph.hub import local_model
from strata.graph.loader import STAGING_BYTES
from strata.hardware import probe as hw_probe
from strata.hardware.specs import AcceleratorSpec, lookup, parse_hardware
from strata.memory.planner import plan_memory
from strata.model_config import ModelConfig
from strata.planner.calibrate import step_overhead
from strata.planner.cost_model import (
    Device,
    ModelShape,
    Prefill,
    Step,
    _kv_split,
    allreduce_seconds,  # noqa: F401  (re-exported: the datasheet formula)
    check_tp_count,
    crossover_batch,
    decode_step,
    depth_curve,
    ep_all_to_all_bytes,
    ep_exchange_seconds,
    prefill,
    spec_device,
    this_device,
    tp_allreduce_seconds,
)
from strata.planner.decode_probe import PROBE_BATCHES, decode_probe, plan_probe, whole_prompt_layer
from strata.planner.layer_probe import (
    PROBE_MAX_TOKENS,
    measure_prefill_layer,
    probe_seconds,
)
from strata.planner.lora_cost import lora_cost, plan_lora_dtype
from strata.planner.lora_cost import measure as measure_lora
from strata.planner.moe_probe import measure_routing
from strata.platform.cpu import resolve_weight_storage
from strata.text_table import fmt_bytes

logger = logging.getLogger(__name__)

# `this` device: prefill is priced from one layer timed at the model's shapes (layer_probe.py)
# when that costs at most this long; larger models fall back to the measured rates
LAYER_PROBE_BUDGET_S = 5.0


# ---------------------------------------------------------------- inputs


@dataclass(frozen=True)
class PlanRequest:
    model: str
    hardware: str = "this"
    dtype: str = engine_default("dtype")
    quantization: str | None = None
    group_size: int = engine_default("quantization_group_size")
    kv_cache_dtype: str = engine_default("kv_cache_dtype")
    max_model_len: int | None = None  # L; default the model's max_position_embeddings
    batch: int = 64  # B: decode batches 1..B
    input_len: int | None = None  # prefill prompt; default L
    context: int | None = None  # decode context per sequence; default L
    kv_cache_memory: int | None = None  # like the engine flag
    memory_fraction: float = engine_default("memory_fraction")  # `this`: the engine's default share of free memory
    max_num_seqs: int = engine_default("max_num_seqs")
    block_size: int = engine_default("block_size")
    max_num_batched_tokens: int = engine_default("max_num_batched_tokens")
    price_per_hour: float | None = None
    alpha_us: float | None = None
    refresh: bool = False
    lora_adapters: int = 0  # LoRA slots resident (the engine's max_loras with enable_lora); 0: none
    lora_rank: int = 16  # max_lora_rank: every slot padded to it
    lora_dtype: str = "auto"  # as the engine flag


def resolve_model(spec: str) -> tuple[ModelConfig, str]:
    """--model: an HF directory, a config.json, or a random shape name (smol-135m, ...). A shape's
    checkpoint dtype is the one random_models writes it in: bf16 for the 1-8B shapes, fp32 else."""
    if spec in SHAPES:
        return ModelConfig.from_dict({"torch_dtype": "float32", **SHAPES[spec]}, spec), spec
    path = local_model(spec) or Path(spec).expanduser()  # a GGUF (or DIR:QUANT): its derived directory
    if path.is_dir():
        path = path / "config.json"
    if not path.exists():
        raise ConfigError(
            f"--model {spec!r}: not a directory, config.json or shape name; shapes: {', '.join(SHAPES)}"
        )
    return ModelConfig.from_file(path), str(spec)


def _file_layouts(spec: str, derived: Path | None, scheme, cfg: ModelConfig, quantization: str | None) -> dict:
    """The projections' layouts a GGUF file or a prequantized checkpoint decides (as the loader
    builds them), for the weight bytes; {} for an ordinary checkpoint."""
    if derived is not None:
        return gguf_formats(derived, cfg.tie_word_embeddings, quantization)
    if scheme is not None:
        return prequantized.layouts(scheme, prequantized.projection_parts(cfg))
    return {}


def _prequantized_scheme(spec: str):
    """The quantization scheme of a model directory's config.json (graph/prequantized.py), or None."""
    path = Path(spec).expanduser()
    config = path / "config.json" if path.is_dir() else path
    if config.name != "config.json" or not config.is_file():
        return None
    return prequantized.scheme_of(json.loads(config.read_text()), path)


def activation_bytes(cfg: ModelConfig, itemsize: int, tokens: int, rows: int, tp: int = 1) -> int:
    """Peak step workspace: tokens x (residual + normed input + qkv + gate/up + SwiGLU out) x bytes
    + rows x vocab x 4 (fp32 logits of the sampled rows); TP splits the projection outputs. An MoE
    layer's gate/up is its top_k experts' (+ the shared expert's), plus fp32 router logits."""
    d = cfg.head_dim
    per_token = (2 * cfg.hidden_size + d * (cfg.num_heads + 2 * cfg.num_kv_heads) // tp
                 + 3 * _mlp_width(cfg) // tp)
    router = tokens * cfg.moe.num_experts * 4 if cfg.moe is not None else 0
    return tokens * per_token * itemsize + rows * cfg.vocab_size * 4 + router


def _mlp_width(cfg: ModelConfig) -> int:
    """The widest MLP one token computes in a layer (MoE: top_k experts + the shared expert)."""
    moe = cfg.moe
    return max(moe.top_k * moe.intermediate_size + moe.shared_intermediate_size if cfg.is_moe_layer(i)
               else cfg.intermediate_size for i in range(cfg.num_layers))


# ---------------------------------------------------------------- the plan


@dataclass
class MemoryPart:
    total_bytes: int
    weight_bytes: int
    kv_per_token: int
    kv_per_sequence: int
    activation_bytes: int
    kv_budget_bytes: int
    kv_budget_source: str
    num_blocks: int
    block_size: int
    kv_cache_bytes: int
    free_bytes: int
    max_sequences: int
    fits: bool
    error: str | None = None
    load_peak_bytes: int = 0  # the most a load holds: final weights + the loader's read staging

    @property
    def kv_tokens(self) -> int:
        return self.num_blocks * self.block_size


@dataclass
class TPOption:
    tp: int
    replicas: int
    memory: MemoryPart
    comm_bytes_per_token: int  # all-reduce payload per decode step and sequence (2 x layers x hidden x bytes)
    comm_ring_s: float  # 2 x layers ring all-reduces of one token's hidden state (batch 1)
    comm_tree_s: float  # the same with a tree
    tpot_s: float  # batch 1
    best_batch: int
    best_tokens_per_s: float  # all replicas together
    cost_per_mtok: float | None
    # MoE: tp > 1 is expert parallel (E / tp experts a rank; graph/expert_parallel.py)
    experts_per_device: int = 0
    a2a_bytes_per_rank: int = 0  # one all-to-all of a batch-1 step (top_k x hidden x bytes)
    ep_comm_s: float = 0.0  # a batch-1 step's MoE exchanges: 2 all-to-alls + 1 all-gather per MoE layer
    ep_comm_source: str = ""  # what priced the all-to-alls (cost_model.all_to_all_seconds)


@dataclass
class Plan:
    model: str
    architecture: str
    params: int
    dtype: str
    quantization: str | None
    hardware: str
    device: Device
    max_model_len: int
    input_len: int
    context: int
    memory: MemoryPart
    prefill: Prefill
    steps: list[Step]
    crossover: float | None
    overhead: Any
    depth_curve: list[Step] = field(default_factory=list)  # batch-1 decode at depths 0, 4k, 16k (< L) and L
    kv_cache_dtype: str = ""  # the KV cache's storage dtype
    decode_probe: Any = None  # decode_probe.DecodeTimes: `this` device's decode kernels, timed
    prefill_layer: Any = None  # layer_probe.LayerTimes the prefill was priced from (`this`)
    tp_options: list[TPOption] = field(default_factory=list)
    active_params: int = 0  # params one token reads (MoE: < params; dense: = params)
    moe: dict[str, Any] | None = None  # experts, top_k, MoE layers, expert bytes, the routing and its source
    routing: Any = None  # cost_model.Routing the MoE decode was priced with (None: dense)
    lora: Any = None  # lora_cost.LoRACost of the adapters served (None: no LoRA)
    best: dict[str, Any] | None = None
    price_per_hour: float | None = None
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        def conv(o: Any) -> Any:
            if dataclasses.is_dataclass(o) and not isinstance(o, type):
                d = {f.name: conv(getattr(o, f.name)) for f in dataclasses.fields(o)}
                for prop in ("total_s", "tokens_per_s", "intensity", "kv_tokens"):
                    if hasattr(type(o), prop):
                        d[prop] = getattr(o, prop)
                return d
            if isinstance(o, list | tuple):
                return [conv(x) for x in o]
            if isinstance(o, dict):
                return {str(k): conv(v) for k, v in o.items()}
            if isinstance(o, float) and not math.isfinite(o):
                return None
            return o

        out = conv(self)
        out["overhead"] = self.overhead.to_json() if hasattr(self.overhead, "to_json") else None
        return out


def _batches(b_max: int) -> list[int]:
    out, b = [], 1
    while b < b_max:
        out.append(b)
        b *= 2
    return out + [b_max]

def memory_part(shape: ModelShape, dev: Device, req: PlanRequest, dtype: torch.dtype, max_len: int,
                tp: int = 1, kv_dtype: torch.dtype | None = None, weights: int | None = None) -> MemoryPart:
    """Memory per device. The KV capacity comes from planner.plan_memory with an explicit budget:
    --kv-cache-memory if given (what the engine does with it); else on `this` the engine's rule
    (memory_fraction of what is free once the weights are loaded, capped by max_num_seqs
    sequences of max_model_len); else on a datasheet device everything left after weights and
    the activation estimate. `weights`: the bytes a device holds where they are not 1/tp of the
    model's (expert parallel)."""
    cfg = shape.cfg
    weights = -(-shape.weight_bytes // tp) if weights is None else weights
    kv_split = _kv_split(cfg, tp)
    per_token = shape.kv_per_token // kv_split
    per_block = per_token * req.block_size
    rows = min(req.max_num_seqs, req.max_num_batched_tokens)
    act = activation_bytes(cfg, shape.act_itemsize, req.max_num_batched_tokens, rows, tp)
    blocks_per_seq = -(-max_len // req.block_size)
    if req.kv_cache_memory is not None:
        budget, source = req.kv_cache_memory, "--kv-cache-memory"
    elif dev.available_bytes is not None:
        ceiling = req.max_num_seqs * blocks_per_seq * per_block
        free_after = max(0, dev.available_bytes - weights)
        budget = min(int(free_after * req.memory_fraction), ceiling)
        source = (f"the engine's rule: {req.memory_fraction:.0%} of available memory after the weights, "
                  f"capped at max_num_seqs={req.max_num_seqs} x max_model_len")
    else:
        budget = max(0, dev.memory_bytes - weights - act)
        source = "device memory - weights - activations"
    plan_cfg = cfg if kv_split == 1 else dataclasses.replace(cfg, num_kv_heads=cfg.num_kv_heads // kv_split)
    error = None
    try:
        mp = plan_memory(plan_cfg, dtype, req.block_size, max_len, req.max_num_seqs, budget,
                         req.memory_fraction, dev.torch_device or "cpu", req.quantization, req.group_size,
                         kv_dtype, weights if tp == 1 else None)
        blocks = mp.num_blocks
    except CapacityError as e:
        blocks, error = budget // per_block if per_block else 0, str(e)
    kv_cache = blocks * per_block
    # the streaming loader holds the final weights plus its read staging, never a float copy; with
    # tensor parallelism each rank loads the whole model before keeping its shard
    load_peak = shape.weight_bytes + STAGING_BYTES
    fits = error is None and weights + act <= dev.memory_bytes and load_peak <= dev.memory_bytes
    if weights + act > dev.memory_bytes:  # the first reason: no KV budget could fix it
        error = (f"weights ({fmt_bytes(weights)}) + activations ({fmt_bytes(act)}) exceed device memory "
                 f"({fmt_bytes(dev.memory_bytes)})")
    elif error is None and not fits:
        error = f"the load's peak ({fmt_bytes(load_peak)}) exceeds device memory"
    return MemoryPart(
        total_bytes=dev.memory_bytes, weight_bytes=weights, kv_per_token=per_token,
        kv_per_sequence=per_token * max_len, activation_bytes=act, kv_budget_bytes=int(budget),
        kv_budget_source=source, num_blocks=int(blocks), block_size=req.block_size, kv_cache_bytes=kv_cache,
        free_bytes=dev.memory_bytes - weights - act - kv_cache, max_sequences=int(blocks // blocks_per_seq),
        fits=fits, error=error, load_peak_bytes=load_peak,
    )


@dataclass(frozen=True)
class Formats:
    """What the engine would run the model in: compute dtype, weight format, KV cache dtype."""

    dtype: torch.dtype
    quantization: str | None
    kv_dtype: torch.dtype
    how: str  # how they were decided (a note of the plan)


def engine_formats(req: PlanRequest, cfg: ModelConfig, device: str, count: int, profile=None,
                   spec: AcceleratorSpec | None = None) -> Formats:
    """--dtype / --quantization / --kv-cache-dtype resolved as the engine resolves them: EngineConfig
    validates them for `device`; on `this` machine (its hardware `profile`) dtype auto is decided by
    platform/cpu.resolve_weight_storage (bf16 weight storage with fp32 compute, where measured
    faster) and engine/build.resolve_dtype (the fastest measured dtype), the cache's dtype by
    engine/build.kv_dtype. A datasheet `spec` has no measurements: auto keeps the checkpoint's dtype
    (float32 for a dtype the engine has no kernels for), as the engine does on a GPU, and a bf16
    checkpoint computes in float16 where the datasheet lists no bf16 rate."""
    config = EngineConfig(dtype=req.dtype, device=device, quantization=req.quantization,
                          quantization_group_size=req.group_size, kv_cache_dtype=req.kv_cache_dtype,
                          tensor_parallel_size=count)
    ckpt = cfg.torch_dtype if cfg.torch_dtype in DTYPES.values() else torch.float32
    if spec is None:
        config = resolve_weight_storage(config, ckpt, profile)
        dtype = resolve_dtype(config.dtype, config.device, ckpt, profile)
        how = "as the engine decides on this machine (platform/cpu.resolve_weight_storage, engine/build.resolve_dtype)"
    elif config.dtype != "auto":
        dtype, how = DTYPES[config.dtype], "as asked"
    else:
        dtype = ckpt
        if dtype == torch.bfloat16 and "bf16" not in spec.tflops:
            dtype = torch.float16
        how = f"auto on a GPU: the checkpoint's {str(ckpt).removeprefix('torch.')}"
    quant = f" + {config.quantization} weights" if config.quantization else ""
    cache = kv_dtype(config, dtype)
    note = (f"{str(dtype).removeprefix('torch.')}{quant}, KV cache {str(cache).removeprefix('torch.')} "
            f"(--dtype {req.dtype}" + (f" --quantization {req.quantization}" if req.quantization else "")
            + f" --kv-cache-dtype {req.kv_cache_dtype}: {how})")
    return Formats(dtype, config.quantization, cache, note)


def build_plan(req: PlanRequest, profile=None, overhead=None) -> Plan:
    """The whole plan. `profile` (a HardwareProfile) and `overhead` (a StepOverhead) are measured
    here for `this` when not given; tests inject them."""
    if req.quantization not in (None, "int8", "int4", "bf16"):
        raise ConfigError(f"--quantization {req.quantization!r}: choose int8, int4 or bf16")
    if req.batch < 1:
        raise ConfigError(f"--batch: must be >= 1, got {req.batch}")
    cfg, model_name = resolve_model(req.model)
    hw_name, count = parse_hardware(req.hardware)
    is_this = hw_name.lower() == "this"
    notes: list[str] = []
    local = local_model(req.model)
    derived = local if local is not None and gguf_files(local) is not None else None
    if derived is not None and req.quantization is None:  # as the engine serves the file (engine/build.py)
        method, group, why = default_storage(derived)
        req = dataclasses.replace(req, quantization=method, group_size=group or req.group_size)
        notes.append(why)
    scheme = _prequantized_scheme(req.model) if derived is None else None
    if scheme is not None and req.quantization is None:  # AWQ / GPTQ / ...: served in its own storage
        group = scheme.group_size if scheme.group_size in (32, 64, 128) else req.group_size
        req = dataclasses.replace(req, quantization=scheme.storage, group_size=group)
        notes.append(f"prequantized checkpoint: {scheme.describe()}, served as {scheme.storage}")
    if is_this:
        if profile is None:
            where = "cuda:0" if torch.cuda.is_available() else "cpu"
            if count != 1 and hw_probe.cached_comm_model(where) is None:  # refused before measuring anything
                check_tp_count(None, count)
            profile = hw_probe.probe(where, refresh=req.refresh)
        formats = engine_formats(req, cfg, profile.device, count, profile)
        dtype, quantization = formats.dtype, formats.quantization
        dev = this_device(profile, dtype, quantization, count)
    else:
        spec = lookup(hw_name)
        formats = engine_formats(req, cfg, "cuda", count, spec=spec)
        dtype, quantization = formats.dtype, formats.quantization
        dev = spec_device(spec, count, dtype, req.alpha_us)
    notes.append(f"planned in {formats.how}")
    req = dataclasses.replace(req, quantization=quantization)  # the weight format decided (auto: maybe bf16)
    layouts = _file_layouts(req.model, derived, scheme, cfg, quantization)
    shape = ModelShape.of(cfg, dtype, quantization, req.group_size, formats.kv_dtype, layouts)
    if cfg.moe is not None and is_this:  # the router and dispatch, timed here (moe_probe.py)
        shape = dataclasses.replace(shape, routing=measure_routing(cfg, dtype, quantization, req.group_size,
                                                                   dev.torch_device or "cpu"))
    if layouts:
        notes.append(f"weights counted in the file's own layouts ({len(layouts)} projections)")
    lora = None
    if req.lora_adapters:  # the banks count in the weights held, as the engine counts them
        lora = lora_cost(cfg, req.lora_adapters, req.lora_rank, plan_lora_dtype(req.lora_dtype, dtype, quantization))
        shape = dataclasses.replace(shape, weight_bytes=shape.weight_bytes + lora.resident_bytes)
    max_len = cfg.max_model_len(req.max_model_len)
    input_len = req.input_len or max_len
    context = req.context or max_len
    if is_this and overhead is None:
        tiny_probes: dict[str, Any] = {}

        def kernel_seconds(c: ModelConfig, batch: int, ctx: int) -> float:
            # the calibration models' kernels timed as the plan times this model's: what is left
            # of their measured steps is the engine's per-step work (scheduler, runner, sampler)
            s = ModelShape.of(c, dtype, req.quantization, req.group_size, formats.kv_dtype)
            key = repr(c)
            if key not in tiny_probes:
                tiny_probes[key] = plan_probe(c, s, dev, dtype, req.quantization, req.group_size, [])
            return decode_step(s, dev, batch, ctx, probe=tiny_probes[key]).kernel_s

        overhead = step_overhead(dev.torch_device or "cpu", dtype, req.quantization, kernel_seconds,
                                 refresh=req.refresh)
    if not is_this:
        notes.append("no per-step software overhead on datasheet targets (assumes CUDA graphs or equal)")
    probe = plan_probe(cfg, shape, dev, dtype, req.quantization, req.group_size, notes) if is_this else None

    options = _tp_options(shape, dev, req, dtype, max_len, context, overhead, probe, formats.kv_dtype)  # [0]: TP=1
    steps = [decode_step(shape, dev, b, context, 1, overhead, probe) for b in _batches(req.batch)]
    layer = None
    if is_this:
        tokens = min(input_len, req.max_num_batched_tokens, PROBE_MAX_TOKENS)
        cost = probe_seconds(2 * shape.p_layers / cfg.num_layers * tokens / (dev.gemm_gflops * 1e9))
        if shape.num_experts:  # building the layer's experts dominates: ~1 GB/s (decode_probe's rule)
            cost += cfg.num_params() / cfg.num_layers * 4 / 1e9
        if cost <= LAYER_PROBE_BUDGET_S:
            layer = measure_prefill_layer(cfg, dtype, tokens, dev.torch_device or "cpu", req.quantization,
                                          req.group_size)
            if probe is not None:
                layer = whole_prompt_layer(cfg, dtype, req.quantization, req.group_size, dev, layer, probe, notes)
        else:
            notes.append(f"prefill from the measured rates: timing one layer at {tokens} tokens would take "
                         f"~{cost:.0f} s (layer probe budget {LAYER_PROBE_BUDGET_S:.0f} s)")
    pre = prefill(shape, dev, input_len, req.max_num_batched_tokens, 1, overhead, layer)
    if lora is not None and probe is not None:  # the adapters' time on the probe's own model
        lora = measure_lora(decode_probe(cfg, dtype, req.quantization, req.group_size, dev.torch_device or "cpu"),
                            lora, min(req.batch, max(PROBE_BATCHES)))
    elif lora is not None:
        notes.append("LoRA time not measured (no decode probe here): its memory, bytes and FLOPs are shown")
    plan = Plan(
        model=model_name, architecture=cfg.architecture, params=shape.params,
        dtype=str(dtype).replace("torch.", ""), quantization=req.quantization, hardware=req.hardware,
        device=dev, max_model_len=max_len, input_len=input_len, context=context, memory=options[0].memory,
        prefill=pre, steps=steps, crossover=crossover_batch(shape, dev, context), overhead=overhead,
        depth_curve=depth_curve(shape, dev, max_len, overhead, probe),
        kv_cache_dtype=str(formats.kv_dtype).removeprefix("torch."), decode_probe=probe, prefill_layer=layer,
        tp_options=options, price_per_hour=req.price_per_hour, notes=notes + list(dev.notes),
        active_params=shape.active_params, moe=_moe_summary(shape, dev, probe),
        routing=shape.routing_for(dev) if shape.num_experts else None, lora=lora,
    )
    plan.best = _best(plan)
    return plan


def _fitting(steps: list[Step], blocks: int, block_size: int) -> list[Step]:
    per_seq = -(-steps[0].context // block_size) if steps else 1
    return [s for s in steps if s.batch * per_seq <= blocks]


def _tp_options(shape: ModelShape, dev: Device, req: PlanRequest, dtype: torch.dtype, max_len: int,
                context: int, overhead, probe=None, kv_dtype: torch.dtype | None = None) -> list[TPOption]:
    out = []
    tp = 1
    while tp <= dev.count:
        splits = shape.cfg.num_heads % tp == 0 and (not shape.num_experts or shape.num_experts % tp == 0)
        if dev.count % tp == 0 and splits:
            mem = memory_part(shape, dev, req, dtype, max_len, tp, kv_dtype)
            steps = [decode_step(shape, dev, b, context, tp, overhead, probe) for b in _batches(req.batch)]
            fit = _fitting(steps, mem.num_blocks, req.block_size) if mem.fits else []
            best = max(fit, key=lambda s: s.tokens_per_s) if fit else None
            replicas = dev.count // tp
            nbytes = shape.cfg.hidden_size * shape.act_itemsize
            ar = tp_allreduce_seconds(dev, nbytes, tp)
            per_step = 2 * shape.cfg.num_layers - shape.moe_layers  # an MoE layer: attention's all-reduce only
            thr = best.tokens_per_s * replicas if best else 0.0
            cost = (req.price_per_hour / 3600 / thr * 1e6) if (req.price_per_hour and thr) else None
            out.append(TPOption(
                tp=tp, replicas=replicas, memory=mem, comm_bytes_per_token=per_step * nbytes,
                comm_ring_s=per_step * ar["ring"], comm_tree_s=per_step * ar["tree"], tpot_s=steps[0].total_s,
                best_batch=best.batch if best else 0, best_tokens_per_s=thr, cost_per_mtok=cost,
                **_ep_fields(shape, dev, tp),
            ))
        tp *= 2
    return out


def _ep_fields(shape: ModelShape, dev: Device, tp: int) -> dict[str, Any]:
    """An MoE model's expert-parallel figures at degree tp (batch 1); {} for a dense model."""
    if not shape.num_experts:
        return {}
    one, source = ep_exchange_seconds(shape, dev, 1, tp)
    return {"experts_per_device": shape.num_experts // tp, "a2a_bytes_per_rank": ep_all_to_all_bytes(shape, 1, tp),
            "ep_comm_s": shape.moe_layers * one, "ep_comm_source": source}


def _moe_summary(shape: ModelShape, dev: Device, probe) -> dict[str, Any] | None:
    """What the plan says of a mixture-of-experts model's experts and routing (None: dense)."""
    if not shape.num_experts:
        return None
    routing = shape.routing_for(dev)
    return {"num_experts": shape.num_experts, "top_k": shape.top_k, "moe_layers": shape.moe_layers,
            "layers": shape.cfg.num_layers, "expert_bytes": shape.expert_bytes,
            "one_expert_bytes": shape.one_expert_bytes, "dense_stream_bytes": shape.dense_stream_bytes,
            "routing_fixed_s": routing.fixed_s, "routing_per_expert_s": routing.per_expert_s,
            "routing_source": routing.source, "routing_in_probe": probe is not None}


def _best(plan: Plan) -> dict[str, Any] | None:
    usable = [o for o in plan.tp_options if o.best_tokens_per_s > 0]
    if not usable:
        return None
    o = max(usable, key=lambda o: o.best_tokens_per_s)
    return {"tp": o.tp, "replicas": o.replicas, "batch": o.best_batch, "tokens_per_s": o.best_tokens_per_s,
            "cost_per_mtok": o.cost_per_mtok}

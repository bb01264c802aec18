"""`strata plan`: what a model needs and how fast it can run, from first principles.

Memory: weights (planner.weight_bytes, quantisation included), KV bytes per token
(planner.kv_bytes_per_token), an activation/workspace estimate, and the KV capacity sized by
the engine's own planner.plan_memory, so the blocks predicted for `this` machine with a given
kv_cache_memory are the blocks LLMEngine allocates.

Time, per device (tensor parallel degree t divides weights, FLOPs and, when the KV heads split,
the KV cache):
  decode step at batch b, context c:
    bytes  = W + b*c*kv_per_token        W = weights streamed per step (an untied input
                                          embedding is gathered, not streamed; lm_head is)
    FLOPs  = b * (2*P_lin + 4*layers*heads*head_dim*c)   P_lin = dense projections + lm_head
    roofline = max(W/stream + KV/mem, FLOPs/rate)
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
measured on the engine itself) is added. Prefill on `this` is priced from one decoder layer of
the model timed at its own shapes (layer_probe.py: projections, attention, and the elementwise
work no FLOP count sees), times the layers, plus the lm_head read; the rates above are the
fallback when that layer would take too long to time. Tensor parallel adds 2 all-reduces per layer of
hidden*bytes*b, alpha-beta model: ring 2(N-1)/N*bytes/bw + 2(N-1)*alpha, tree
2*log2(N)*(alpha + bytes/bw); the cheaper is taken.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from strata.config import DTYPES
from strata.errors import CapacityError, ConfigError
from strata.hardware.specs import AcceleratorSpec, lookup, parse_hardware
from strata.memory.planner import kv_bytes_per_token, plan_memory, weight_bytes
from strata.model_config import ModelConfig

logger = logging.getLogger(__name__)

# alpha (per-message latency) is on no datasheet: an assumption of NCCL-typical order, shown in
# the output and overridable with --alpha-us
DEFAULT_ALPHA_US = {"nvlink": 5.0, "pcie": 10.0}
# `this` device: prefill is priced from one layer timed at the model's shapes (layer_probe.py)
# when that costs at most this long; larger models fall back to the measured rates
LAYER_PROBE_BUDGET_S = 5.0


# ---------------------------------------------------------------- inputs


@dataclass(frozen=True)
class PlanRequest:
    model: str
    hardware: str = "this"
    dtype: str = "auto"
    quantization: str | None = None
    group_size: int = 64
    max_model_len: int | None = None  # L; default the model's max_position_embeddings
    batch: int = 64  # B: decode batches 1..B
    input_len: int | None = None  # prefill prompt; default L
    context: int | None = None  # decode context per sequence; default L
    kv_cache_memory: int | None = None  # like the engine flag
    memory_fraction: float = 0.5  # `this`: the engine's default share of free memory
    max_num_seqs: int = 128
    block_size: int = 16
    max_num_batched_tokens: int = 2048
    price_per_hour: float | None = None
    alpha_us: float | None = None
    refresh: bool = False


def resolve_model(spec: str) -> tuple[ModelConfig, str]:
    """--model: an HF directory, a config.json, or a random shape name (smol-135m, ...)."""
    from strata.demo.random_models import SHAPES

    if spec in SHAPES:
        return ModelConfig.from_dict(dict(SHAPES[spec], torch_dtype="float32"), spec), spec
    path = Path(spec).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if not path.exists():
        raise ConfigError(
            f"--model {spec!r}: not a directory, config.json or shape name; shapes: {', '.join(SHAPES)}"
        )
    return ModelConfig.from_file(path), str(spec)


@dataclass(frozen=True)
class ModelShape:
    """The counts the formulas need, derived from a ModelConfig."""

    cfg: ModelConfig
    params: int
    p_lin: int  # dense projections of every layer + lm_head
    p_layers: int  # dense projections of every layer
    stream_bytes: int  # weight bytes read per decode step
    weight_bytes: int  # weight bytes held
    kv_per_token: int
    attn_flops_per_pos: int  # 4 * layers * heads * head_dim: one query against one cached position
    act_itemsize: int

    @classmethod
    def of(cls, cfg: ModelConfig, dtype: torch.dtype, quantization: str | None, group: int) -> ModelShape:
        h, d = cfg.hidden_size, cfg.head_dim
        per_layer = (h * d * (cfg.num_heads + 2 * cfg.num_kv_heads) + cfg.num_heads * d * h
                     + 3 * h * cfg.intermediate_size)
        p_layers = cfg.num_layers * per_layer
        held = weight_bytes(cfg, dtype, quantization, group)
        untied_embedding = 0 if cfg.tie_word_embeddings else cfg.vocab_size * h * dtype.itemsize
        return cls(
            cfg=cfg, params=cfg.num_params(), p_lin=p_layers + cfg.vocab_size * h, p_layers=p_layers,
            stream_bytes=held - untied_embedding, weight_bytes=held,
            kv_per_token=kv_bytes_per_token(cfg, dtype),
            attn_flops_per_pos=4 * cfg.num_layers * cfg.num_heads * d, act_itemsize=dtype.itemsize,
        )


@dataclass(frozen=True)
class Device:
    """The rates of one device that the formulas read (per device; `count` of them)."""

    name: str
    source: str
    kind: str  # "cpu" | "gpu"
    count: int
    memory_bytes: int
    available_bytes: int | None  # `this`: free now (the engine sizes its KV cache from it)
    stream_gbs: float  # weights streamed at batch 1
    mem_gbs: float  # KV and other reads
    few_rows: int  # rows up to which `few_rows_gflops` applies (0: one rate)
    few_rows_gflops: float
    gemm_gflops: float
    attn_gflops: float = 0.0  # prefill attention (causal SDPA); 0: the GEMM rate
    link: str | None = None
    link_gbs: float = 0.0  # per direction, per device
    alpha_s: float = 0.0
    measured: bool = False
    torch_device: str | None = None  # `this`: "cpu" / "cuda:0"
    notes: tuple[str, ...] = ()

    def rate(self, rows: int) -> float:
        return (self.few_rows_gflops if rows <= self.few_rows else self.gemm_gflops) * 1e9


def spec_device(spec: AcceleratorSpec, count: int, dtype: torch.dtype, alpha_us: float | None) -> Device:
    dname = str(dtype).replace("torch.", "")
    peak = spec.peak_flops(dname) / 1e9
    if spec.link and 1 < count <= (spec.link_max_devices or count):
        link, link_gbs = spec.link, (spec.link_gbs or 0.0) / 2
        alpha = DEFAULT_ALPHA_US["nvlink"] if alpha_us is None else alpha_us
    else:
        link, link_gbs = f"PCIe gen{spec.pcie_gen} x16", spec.pcie_gbs
        alpha = DEFAULT_ALPHA_US["pcie"] if alpha_us is None else alpha_us
    notes = [f"datasheet peaks ({spec.source}); dense FLOP/s, real kernels reach less"]
    if spec.note:
        notes.append(spec.note)
    return Device(
        name=spec.name, source=spec.source, kind="gpu", count=count, memory_bytes=spec.memory_bytes,
        available_bytes=None, stream_gbs=spec.mem_bandwidth_gbs, mem_gbs=spec.mem_bandwidth_gbs,
        few_rows=0, few_rows_gflops=peak, gemm_gflops=peak, attn_gflops=peak, link=link, link_gbs=link_gbs,
        alpha_s=alpha * 1e-6, notes=tuple(notes),
    )


def this_device(profile, dtype: torch.dtype, quantization: str | None) -> Device:
    """Rates measured on this machine (a HardwareProfile), matched to the kernels Strata runs."""
    from strata.hardware.probe import MATMUL_BATCH

    dname = str(dtype).replace("torch.", "")
    cpu = profile.device == "cpu"

    def need(table: dict[str, float], key: str, what: str) -> float:
        if key not in table or table[key] <= 0:
            raise ConfigError(f"this machine's profile has no {what} figure for {key}; run strata hw --refresh")
        return table[key]

    notes = [f"measured on this machine by strata hw ({profile.name}, {profile.threads} threads)"]
    if cpu and quantization is not None:
        stream = need(profile.quant_linear_gbs, quantization, "quantised batch-1")
        few = need(profile.quant_matmul_gflops, quantization, "quantised batch-16")
        gemm = need(profile.gemm_gflops, "float32", "GEMM")
        attn = profile.sdpa_gflops.get("float32", 0.0)
        if dname != "float32":
            notes.append(f"quantised kernels need float32 activations; {dname} dequantises per call")
        notes.append("quantised prefill = tile dequantisation + fp32 GEMM; the dequantisation is not modelled")
    else:
        stream = need(profile.linear_gbs, dname, "batch-1 linear")
        few = need(profile.matmul_gflops, dname, "batched linear")
        gemm = need(profile.gemm_gflops, dname, "GEMM")
        attn = profile.sdpa_gflops.get(dname, 0.0)
        if quantization is not None:
            notes.append("Strata has no GPU quantised kernels: it dequantises per call; predicted as fused")
    if not attn:
        notes.append("no measured attention rate for this dtype: prefill attention at the GEMM rate")
    if cpu:
        import psutil

        available = int(psutil.virtual_memory().available)
    else:
        available = int(torch.cuda.mem_get_info(torch.device(profile.device))[0])
    return Device(
        name=f"this ({profile.name})", source="measured (strata hw)", kind="cpu" if cpu else "gpu", count=1,
        memory_bytes=profile.memory_bytes, available_bytes=available, stream_gbs=stream,
        mem_gbs=profile.mem_bandwidth_gbs, few_rows=MATMUL_BATCH if cpu else 0, few_rows_gflops=few,
        gemm_gflops=gemm, attn_gflops=attn, measured=True, torch_device=profile.device, notes=tuple(notes),
    )


# ---------------------------------------------------------------- formulas


def allreduce_seconds(nbytes: float, n: int, bw_gbs: float, alpha_s: float) -> dict[str, float]:
    """Alpha-beta all-reduce times of `nbytes` over n devices with per-direction bandwidth bw."""
    if n <= 1:
        return {"ring": 0.0, "tree": 0.0}
    bw = bw_gbs * 1e9
    ring = 2 * (n - 1) / n * nbytes / bw + 2 * (n - 1) * alpha_s
    tree = 2 * math.log2(n) * (alpha_s + nbytes / bw)
    return {"ring": ring, "tree": tree}


@dataclass(frozen=True)
class Step:
    batch: int
    context: int
    tp: int
    bytes: float
    flops: float
    mem_s: float
    compute_s: float
    roofline_s: float
    kernel_s: float  # the prediction for the bytes and FLOPs (= roofline on datasheets)
    overhead_s: float
    comm_s: float
    bound: str

    @property
    def total_s(self) -> float:
        return self.kernel_s + self.overhead_s + self.comm_s

    @property
    def tokens_per_s(self) -> float:
        return self.batch / self.total_s if self.total_s > 0 else float("inf")

    @property
    def intensity(self) -> float:
        return self.flops / self.bytes if self.bytes else float("inf")


def _kv_split(cfg: ModelConfig, tp: int) -> int:
    return tp if cfg.num_kv_heads % tp == 0 else 1


def decode_step(shape: ModelShape, dev: Device, batch: int, context: int, tp: int = 1,
                overhead=None) -> Step:
    cfg = shape.cfg
    w = shape.stream_bytes / tp
    kv = batch * context * shape.kv_per_token / _kv_split(cfg, tp)
    f_lin = 2 * batch * shape.p_lin / tp
    f_att = batch * context * shape.attn_flops_per_pos / tp
    stream, mem = dev.stream_gbs * 1e9, dev.mem_gbs * 1e9
    mem_s = w / stream + kv / mem
    compute_s = (f_lin + f_att) / dev.rate(batch)
    roofline = max(mem_s, compute_s)
    if dev.few_rows and batch <= dev.few_rows:  # measured kernel line between 1 and few_rows rows
        t1 = w / stream
        tn = 2 * dev.few_rows * shape.p_lin / tp / dev.rate(dev.few_rows)
        lin = t1 + (batch - 1) * max(0.0, tn - t1) / max(1, dev.few_rows - 1)
        kernel = lin + max(kv / mem, f_att / dev.rate(batch))
    elif dev.few_rows:
        kernel = max(w / stream, f_lin / dev.rate(batch)) + max(kv / mem, f_att / dev.rate(batch))
    else:
        kernel = roofline
    comm = 0.0
    if tp > 1:
        nbytes = cfg.hidden_size * shape.act_itemsize * batch
        comm = 2 * cfg.num_layers * min(allreduce_seconds(nbytes, tp, dev.link_gbs, dev.alpha_s).values())
    over = overhead.at(batch, cfg.num_layers) if overhead is not None else 0.0
    return Step(batch, context, tp, w + kv, f_lin + f_att, mem_s, compute_s, roofline, kernel, over, comm,
                "compute" if compute_s > mem_s else "memory")


@dataclass(frozen=True)
class Prefill:
    tokens: int
    chunks: int
    flops: float
    bytes: float
    compute_s: float  # projections + attention (at the rates, or the layer probe's times)
    attention_s: float  # the attention part of compute_s
    weight_read_s: float
    overhead_s: float
    comm_s: float
    elementwise_s: float = 0.0  # norms, rotary, SiLU * up, KV write: measured by the layer probe only
    source: str = "roofline"  # "roofline" (rates) | "layer probe" (this device's measured layer)

    @property
    def total_s(self) -> float:
        return self.compute_s + self.elementwise_s + self.weight_read_s + self.overhead_s + self.comm_s

    @property
    def intensity(self) -> float:
        return self.flops / self.bytes


def prefill(shape: ModelShape, dev: Device, tokens: int, chunk: int, tp: int = 1, overhead=None,
            layer=None) -> Prefill:
    """Prefill of one `tokens`-token prompt. `layer` (layer_probe.LayerTimes, `this` device):
    measured per-layer times at min(tokens, chunk) tokens replace the rates; projections and
    elementwise work scale with tokens, attention with its causal FLOPs."""
    cfg = shape.cfg
    chunks = -(-tokens // chunk)
    attn = 2 * cfg.num_layers * cfg.num_heads * cfg.head_dim * tokens * (tokens + 1) / tp
    lin = (2 * shape.p_layers * tokens + 2 * cfg.vocab_size * cfg.hidden_size) / tp
    flops = lin + attn
    w = chunks * shape.stream_bytes / tp
    elementwise_s, source = 0.0, "roofline"
    if layer is not None:
        n, per_token = cfg.num_layers / tp, tokens / layer.tokens
        attn_s = n * layer.attention_s * tokens * (tokens + 1) / (layer.tokens * (layer.tokens + 1))
        compute_s = n * layer.gemm_s * per_token + attn_s
        elementwise_s = n * layer.elementwise_s * per_token
        # the layers' weight reads are inside their measured times; the lm_head's GEMV is not
        read_s = chunks * cfg.vocab_size * cfg.hidden_size * shape.act_itemsize / tp / (dev.stream_gbs * 1e9)
        source = "layer probe"
    else:
        attn_s = attn / ((dev.attn_gflops or dev.gemm_gflops) * 1e9)
        compute_s = lin / dev.rate(min(tokens, chunk)) + attn_s
        read_s = w / (dev.stream_gbs * 1e9)
    comm = 0.0
    if tp > 1:
        nbytes = cfg.hidden_size * shape.act_itemsize * min(tokens, chunk)
        comm = chunks * 2 * cfg.num_layers * min(allreduce_seconds(nbytes, tp, dev.link_gbs, dev.alpha_s).values())
    over = chunks * overhead.at(1, cfg.num_layers) if overhead is not None else 0.0
    return Prefill(tokens, chunks, flops, w + tokens * shape.kv_per_token / tp, compute_s, attn_s, read_s, over,
                   comm, elementwise_s, source)


def crossover_batch(shape: ModelShape, dev: Device, context: int, tp: int = 1) -> float | None:
    """Smallest batch where the roofline's FLOP time reaches its byte time; None if never
    (per-sequence KV bytes outgrow per-sequence FLOPs at this context)."""
    w_s = shape.stream_bytes / tp / (dev.stream_gbs * 1e9)
    kv_s = context * shape.kv_per_token / _kv_split(shape.cfg, tp) / (dev.mem_gbs * 1e9)
    flops = (2 * shape.p_lin + context * shape.attn_flops_per_pos) / tp
    candidates = [(dev.few_rows, dev.few_rows_gflops), (None, dev.gemm_gflops)] if dev.few_rows else [
        (None, dev.gemm_gflops)]
    lo = 0
    for hi, gflops in candidates:
        per = flops / (gflops * 1e9) - kv_s
        if per > 0:
            b = w_s / per
            if b >= lo and (hi is None or b <= hi):
                return max(1.0, b)
        lo = hi or 0
    return None


def activation_bytes(cfg: ModelConfig, itemsize: int, tokens: int, rows: int, tp: int = 1) -> int:
    """Peak step workspace: tokens x (residual + normed input + qkv + gate/up + SwiGLU out) x bytes
    + rows x vocab x 4 (fp32 logits of the sampled rows); TP splits the projection outputs."""
    d = cfg.head_dim
    per_token = (2 * cfg.hidden_size + d * (cfg.num_heads + 2 * cfg.num_kv_heads) // tp
                 + 3 * cfg.intermediate_size // tp)
    return tokens * per_token * itemsize + rows * cfg.vocab_size * 4


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
    tp_options: list[TPOption] = field(default_factory=list)
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


def _max_model_len(cfg: ModelConfig, requested: int | None) -> int:
    """The engine's rule (LLMEngine._max_model_len), without its logging."""
    want = requested or cfg.max_position_embeddings
    if want > cfg.max_position_embeddings:
        raise ConfigError(
            f"--max-model-len {want} exceeds the model's max_position_embeddings ({cfg.max_position_embeddings})"
        )
    if cfg.sliding_window is not None and want > cfg.sliding_window:
        want = cfg.sliding_window
    return want


def memory_part(shape: ModelShape, dev: Device, req: PlanRequest, dtype: torch.dtype, max_len: int,
                tp: int = 1) -> MemoryPart:
    """Memory per device. The KV capacity comes from planner.plan_memory with an explicit budget:
    --kv-cache-memory if given (what the engine does with it); else on `this` the engine's rule
    (memory_fraction of what is free once the weights are loaded, capped by max_num_seqs
    sequences of max_model_len); else on a datasheet device everything left after weights and
    the activation estimate."""
    cfg = shape.cfg
    weights = -(-shape.weight_bytes // tp)
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
                         req.memory_fraction, dev.torch_device or "cpu", req.quantization, req.group_size)
        blocks = mp.num_blocks
    except CapacityError as e:
        blocks, error = budget // per_block if per_block else 0, str(e)
    kv_cache = blocks * per_block
    fits = error is None and weights + act <= dev.memory_bytes
    if error is None and not fits:
        error = "weights + activations exceed device memory"
    return MemoryPart(
        total_bytes=dev.memory_bytes, weight_bytes=weights, kv_per_token=per_token,
        kv_per_sequence=per_token * max_len, activation_bytes=act, kv_budget_bytes=int(budget),
        kv_budget_source=source, num_blocks=int(blocks), block_size=req.block_size, kv_cache_bytes=kv_cache,
        free_bytes=dev.memory_bytes - weights - act - kv_cache, max_sequences=int(blocks // blocks_per_seq),
        fits=fits, error=error,
    )


def _resolve_dtype(name: str, cfg: ModelConfig, profile) -> torch.dtype:
    name = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}.get(name, name)
    if name == "auto":
        if profile is None:
            return cfg.torch_dtype if cfg.torch_dtype in DTYPES.values() else torch.float32
        from strata.hardware.probe import auto_dtype

        return auto_dtype(profile.device, cfg.torch_dtype, profile)
    if name not in DTYPES:
        raise ConfigError(f"--dtype {name!r}: choose auto, float32, bfloat16 or float16")
    return DTYPES[name]


def build_plan(req: PlanRequest, profile=None, overhead=None) -> Plan:
    """The whole plan. `profile` (a HardwareProfile) and `overhead` (a StepOverhead) are measured
    here for `this` when not given; tests inject them."""
    if req.quantization not in (None, "int8", "int4"):
        raise ConfigError(f"--quantization {req.quantization!r}: choose int8 or int4")
    if req.batch < 1:
        raise ConfigError(f"--batch: must be >= 1, got {req.batch}")
    cfg, model_name = resolve_model(req.model)
    hw_name, count = parse_hardware(req.hardware)
    is_this = hw_name.lower() == "this"
    notes: list[str] = []
    if is_this:
        if count != 1:
            raise ConfigError("--hardware this: plans one device of this machine; use NAMExN for several")
        if profile is None:
            from strata.hardware.probe import probe

            profile = probe("cuda:0" if torch.cuda.is_available() else "cpu", refresh=req.refresh)
        dtype = _resolve_dtype(req.dtype, cfg, profile)
        dev = this_device(profile, dtype, req.quantization)
    else:
        spec = lookup(hw_name)
        dtype = _resolve_dtype(req.dtype, cfg, None)
        dev = spec_device(spec, count, dtype, req.alpha_us)
    shape = ModelShape.of(cfg, dtype, req.quantization, req.group_size)
    max_len = _max_model_len(cfg, req.max_model_len)
    input_len = req.input_len or max_len
    context = req.context or max_len
    if is_this and overhead is None:
        from strata.analyze.calibrate import step_overhead

        def kernel_seconds(c: ModelConfig, batch: int, ctx: int) -> float:
            s = ModelShape.of(c, dtype, req.quantization, req.group_size)
            return decode_step(s, dev, batch, ctx).kernel_s

        overhead = step_overhead(dev.torch_device or "cpu", dtype, req.quantization, kernel_seconds,
                                 refresh=req.refresh)
    if not is_this:
        notes.append("no per-step software overhead on datasheet targets (assumes CUDA graphs or equal)")

    options = _tp_options(shape, dev, req, dtype, max_len, context, overhead)  # options[0]: TP=1
    steps = [decode_step(shape, dev, b, context, 1, overhead) for b in _batches(req.batch)]
    layer = None
    if is_this and req.quantization is None:
        from strata.analyze.layer_probe import (
            PROBE_MAX_TOKENS,
            measure_prefill_layer,
            probe_seconds,
        )

        tokens = min(input_len, req.max_num_batched_tokens, PROBE_MAX_TOKENS)
        cost = probe_seconds(2 * shape.p_layers / cfg.num_layers * tokens / (dev.gemm_gflops * 1e9))
        if cost <= LAYER_PROBE_BUDGET_S:
            layer = measure_prefill_layer(cfg, dtype, tokens, dev.torch_device or "cpu")
        else:
            notes.append(f"prefill from the measured rates: timing one layer at {tokens} tokens would take "
                         f"~{cost:.0f} s (layer probe budget {LAYER_PROBE_BUDGET_S:.0f} s)")
    pre = prefill(shape, dev, input_len, req.max_num_batched_tokens, 1, overhead, layer)
    plan = Plan(
        model=model_name, architecture=cfg.architecture, params=shape.params,
        dtype=str(dtype).replace("torch.", ""), quantization=req.quantization, hardware=req.hardware,
        device=dev, max_model_len=max_len, input_len=input_len, context=context, memory=options[0].memory,
        prefill=pre, steps=steps, crossover=crossover_batch(shape, dev, context), overhead=overhead,
        tp_options=options, price_per_hour=req.price_per_hour, notes=notes + list(dev.notes),
    )
    plan.best = _best(plan)
    return plan


def _fitting(steps: list[Step], blocks: int, block_size: int) -> list[Step]:
    per_seq = -(-steps[0].context // block_size) if steps else 1
    return [s for s in steps if s.batch * per_seq <= blocks]


def _tp_options(shape: ModelShape, dev: Device, req: PlanRequest, dtype: torch.dtype, max_len: int,
                context: int, overhead) -> list[TPOption]:
    out = []
    tp = 1
    while tp <= dev.count:
        if dev.count % tp == 0 and shape.cfg.num_heads % tp == 0:
            mem = memory_part(shape, dev, req, dtype, max_len, tp)
            steps = [decode_step(shape, dev, b, context, tp, overhead) for b in _batches(req.batch)]
            fit = _fitting(steps, mem.num_blocks, req.block_size) if mem.fits else []
            best = max(fit, key=lambda s: s.tokens_per_s) if fit else None
            replicas = dev.count // tp
            nbytes = shape.cfg.hidden_size * shape.act_itemsize
            ar = allreduce_seconds(nbytes, tp, dev.link_gbs, dev.alpha_s)
            per_step = 2 * shape.cfg.num_layers
            thr = best.tokens_per_s * replicas if best else 0.0
            cost = (req.price_per_hour / 3600 / thr * 1e6) if (req.price_per_hour and thr) else None
            out.append(TPOption(
                tp=tp, replicas=replicas, memory=mem, comm_bytes_per_token=2 * shape.cfg.num_layers * nbytes,
                comm_ring_s=per_step * ar["ring"], comm_tree_s=per_step * ar["tree"], tpot_s=steps[0].total_s,
                best_batch=best.batch if best else 0, best_tokens_per_s=thr, cost_per_mtok=cost,
            ))
        tp *= 2
    return out


def _best(plan: Plan) -> dict[str, Any] | None:
    usable = [o for o in plan.tp_options if o.best_tokens_per_s > 0]
    if not usable:
        return None
    o = max(usable, key=lambda o: o.best_tokens_per_s)
    return {"tp": o.tp, "replicas": o.replicas, "batch": o.best_batch, "tokens_per_s": o.best_tokens_per_s,
            "cost_per_mtok": o.cost_per_mtok}


"""The cost model of `strata plan`: what one decode step or prefill costs on a device.

The rates a device offers (a datasheet's peaks or this machine's measured kernels, `Device`),
the counts a model gives them (`ModelShape`), and the pricing: the roofline / measured-kernel
decode step, prefill (at the rates or from the layer probe's times), the compute crossover
batch, and the alpha-beta all-reduce. The formulas are written out in plan.py's docstring
(the text of `strata plan --help`); plan.py assembles these prices into a plan.

The tensor-parallel all-reduce: on a datasheet target, ring and tree over the link's bandwidth
with an assumed alpha; on `thisxN` (N ranks of this machine), the alpha-beta model that
`strata bench comm` fitted here and stored in the hardware profile (strata/comm/alpha_beta.py:
one fitted alpha and beta per transport, SHM and gloo on CPU, NCCL on GPUs).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from strata.comm.alpha_beta import CommModel, model_seconds
from strata.errors import ConfigError
from strata.hardware.measure import MATMUL_BATCH
from strata.hardware.specs import AcceleratorSpec
from strata.memory.planner import (
    expected_experts,
    expert_weight_bytes,
    kv_bytes_per_token,
    streamed_weight_bytes,
    weight_bytes,
)
from strata.model_config import ModelConfig
from strata.platform.cpu_policy import GEMM_RATE_KEY as rate_key
from strata.platform.cpu_policy import int8_prefill_gemm, prefill_gemms

# alpha (per-message latency) is on no datasheet: an assumption of NCCL-typical order, shown in
# the output and overridable with --alpha-us
DEFAULT_ALPHA_US = {"nvlink": 5.0, "pcie": 10.0}


# ---------------------------------------------------------------- model and device


@dataclass(frozen=True)
class Routing:
    """What an MoE layer costs a decode step beyond its experts' weight reads and FLOPs: `fixed_s`
    (the router GEMV, softmax / top-k, the sort of the rows by expert) plus `per_expert_s` for each
    distinct expert the step's tokens visit (gathering its rows, its kernel calls, the weighted
    scatter back: graph/moe.py dispatches expert by expert)."""

    fixed_s: float
    per_expert_s: float
    source: str

    def seconds(self, layers: int, experts: float) -> float:
        return layers * (self.fixed_s + self.per_expert_s * experts)


# No probe prices a datasheet GPU's routing: assumed, of the order of small kernels under CUDA
# graphs (router GEMV + softmax/top-k + sort ~5 us a layer; an expert's gather, two GEMVs, SiLU * up
# and the scatter ~2 us), and said so in the plan
GPU_ROUTING = Routing(5e-6, 2e-6, "assumed for a GPU (cost_model.GPU_ROUTING: 5 us a layer + 2 us an expert)")
# a CPU plan without the routing probe (analyze, deploy sizing): moe_probe.py's order on the 2-core
# Xeon dev VM (eager MoEBlock dispatch, fp32 / bf16 / int8, 128 experts of hidden 2048: ~100-180 us an
# expert, the fixed part 0-30 us; under other agents' load)
CPU_ROUTING = Routing(20e-6, 120e-6, "assumed for a CPU (cost_model.CPU_ROUTING: 20 us a layer + 120 us an expert)")


@dataclass(frozen=True)
class ModelShape:
    """The counts the formulas need, derived from a ModelConfig. Mixture of experts: params and
    weight_bytes count every expert (all are stored); p_lin / p_layers count what one token
    computes (top_k experts, the shared expert, the router); a step of B tokens reads
    expected_experts(E, k, B) experts of each MoE layer (stream_at)."""

    cfg: ModelConfig
    params: int
    p_lin: int  # dense projections of every layer + lm_head (MoE: the active ones, per token)
    p_layers: int  # dense projections of every layer (MoE: the active ones, per token)
    stream_bytes: int  # weight bytes read per decode step (MoE: with every expert)
    weight_bytes: int  # weight bytes held
    kv_per_token: int  # KV bytes one cached token adds (memory/planner.kv_bytes_per_token, the cache's dtype)
    attn_flops_per_pos: int  # 4 * layers * heads * head_dim: one query against one cached position
    act_itemsize: int
    active_params: int = 0  # params one token reads (ModelConfig.num_params(active=True))
    expert_bytes: int = 0  # of weight_bytes: every routed expert of every MoE layer, as held
    expert_params: int = 0  # one routed expert's projections (3 x hidden x expert width)
    moe_layers: int = 0
    num_experts: int = 0
    top_k: int = 0
    routing: Routing | None = None  # measured on `this` (moe_probe.py); None: the device kind's assumption

    @classmethod
    def of(cls, cfg: ModelConfig, dtype: torch.dtype, quantization: str | None, group: int,
           kv_dtype: torch.dtype | None = None, layouts: dict | None = None) -> ModelShape:
        """kv_dtype: the KV cache's storage dtype when it is not `dtype` (engine/build.kv_dtype);
        layouts: a GGUF's / prequantized checkpoint's own (memory/planner.weight_bytes)."""
        h, d = cfg.hidden_size, cfg.head_dim
        p_layers = sum(_active_layer_params(cfg, i) for i in range(cfg.num_layers))
        held = weight_bytes(cfg, dtype, quantization, group, layouts)
        moe = cfg.moe
        return cls(
            cfg=cfg, params=cfg.num_params(), p_lin=p_layers + cfg.vocab_size * h, p_layers=p_layers,
            stream_bytes=streamed_weight_bytes(cfg, dtype, quantization, group, layouts), weight_bytes=held,
            kv_per_token=kv_bytes_per_token(cfg, kv_dtype or dtype),
            attn_flops_per_pos=4 * cfg.num_layers * cfg.num_heads * d, act_itemsize=dtype.itemsize,
            active_params=cfg.num_params(active=True),
            expert_bytes=expert_weight_bytes(cfg, dtype, quantization, group, layouts),
            expert_params=3 * h * moe.intermediate_size if moe else 0,
            moe_layers=sum(map(cfg.is_moe_layer, range(cfg.num_layers))),
            num_experts=moe.num_experts if moe else 0, top_k=moe.top_k if moe else 0,
        )

    def experts_at(self, tokens: float) -> float:
        """Distinct experts per MoE layer a step of `tokens` tokens reads (0 for a dense model)."""
        return expected_experts(self.num_experts, self.top_k, tokens) if self.num_experts else 0.0

    @property
    def dense_stream_bytes(self) -> int:
        """Of stream_bytes, what every step reads whatever the routing: all but the routed experts."""
        return self.stream_bytes - self.expert_bytes

    @property
    def one_expert_bytes(self) -> float:
        """One routed expert of one layer, as held (the mean, should layouts differ)."""
        return self.expert_bytes / (self.moe_layers * self.num_experts) if self.num_experts else 0.0

    @property
    def p_dense(self) -> int:
        """Of p_lin, the projections every token computes outside the routed experts."""
        return self.p_lin - self.moe_layers * self.top_k * self.expert_params

    def stream_at(self, tokens: float) -> float:
        """Weight bytes a decode step of `tokens` tokens reads: the routed experts it touches only."""
        if not self.num_experts:
            return float(self.stream_bytes)
        return self.dense_stream_bytes + self.expert_bytes * self.experts_at(tokens) / self.num_experts

    def routing_for(self, dev: Device) -> Routing:
        return self.routing or (GPU_ROUTING if dev.kind == "gpu" else CPU_ROUTING)


def _active_layer_params(cfg: ModelConfig, i: int) -> int:
    """Linear params one token computes in layer i: attention, then the MLP, or (MoE) its top_k
    experts, the shared expert and its gate, and the router's E x hidden."""
    h, d = cfg.hidden_size, cfg.head_dim
    attn = h * d * (cfg.num_heads + 2 * cfg.num_kv_heads) + cfg.num_heads * d * h
    if not cfg.is_moe_layer(i):
        return attn + 3 * h * cfg.intermediate_size
    moe = cfg.moe
    shared = 3 * h * moe.shared_intermediate_size + h if moe.shared_intermediate_size else 0
    return attn + moe.top_k * 3 * h * moe.intermediate_size + shared + moe.num_experts * h


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
    # decode attention (a few query rows per KV head against the cached keys and values): the few-row
    # matmul rate in the activations' dtype; 0: the batch's kernel rate
    decode_attn_gflops: float = 0.0
    link: str | None = None
    link_gbs: float = 0.0  # per direction, per device
    alpha_s: float = 0.0
    measured: bool = False
    torch_device: str | None = None  # `this`: "cpu" / "cuda:0"
    notes: tuple[str, ...] = ()
    comm: CommModel | None = None  # `thisxN`: the measured all-reduce model (strata bench comm)

    def rate(self, rows: int) -> float:
        return (self.few_rows_gflops if rows <= self.few_rows else self.gemm_gflops) * 1e9

    def decode_attn_rate(self, rows: int) -> float:
        return self.decode_attn_gflops * 1e9 if self.decode_attn_gflops > 0 else self.rate(rows)


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
        few_rows=0, few_rows_gflops=peak, gemm_gflops=peak, attn_gflops=peak, decode_attn_gflops=peak,
        link=link, link_gbs=link_gbs,
        alpha_s=alpha * 1e-6, notes=tuple(notes),
    )


def this_device(profile, dtype: torch.dtype, quantization: str | None, count: int = 1) -> Device:
    """Rates measured on this machine (a HardwareProfile), matched to the kernels Strata runs.
    count > 1 (`thisxN`): N ranks of this machine, their all-reduce priced by the profile's
    comm model (measured_tp)."""
    dname = str(dtype).replace("torch.", "")
    cpu = profile.device == "cpu"

    def need(table: dict[str, float], key: str, what: str) -> float:
        if key not in table or table[key] <= 0:
            raise ConfigError(f"this machine's profile has no {what} figure for {key}; run strata hw --refresh")
        return table[key]

    notes = [f"measured on this machine by strata hw ({profile.name}, {profile.threads} threads)"]
    if cpu:
        fp32_path, narrow_path, _ = prefill_gemms(profile)  # the GEMMs the engine will mark
    if cpu and quantization == "bf16":  # bf16 weights, fp32 compute (memory/bf16_weights.py)
        stream = need(profile.linear_gbs, "bfloat16", "batch-1 linear")
        few = need(profile.matmul_gflops, "bfloat16", "batched linear")
        gemm = need(profile.gemm_gflops, rate_key[narrow_path], "GEMM")
        attn = profile.sdpa_gflops.get("float32", 0.0)
        notes.append(f"bf16 weights read narrow at decode; prefill GEMM {narrow_path} (as the engine picks it)")
    elif cpu and quantization is not None:
        stream = need(profile.quant_linear_gbs, quantization, "quantised batch-1")
        few = need(profile.quant_matmul_gflops, quantization, "quantised batch-16")
        int8_path = int8_prefill_gemm(profile, narrow_path, quantization)[0]
        gemm = need(profile.gemm_gflops, "int8_int8" if int8_path == "int8" else rate_key[narrow_path], "GEMM")
        if int8_path == "int8":
            notes.append(f"{quantization} prefill = W8A8 (per-row int8 activations, torch's int8 GEMM) as the "
                         "engine picks it")
        attn = profile.sdpa_gflops.get("float32", 0.0)
        if dname != "float32":
            notes.append(f"quantised kernels need float32 activations; {dname} dequantises per call")
        notes.append(f"quantised prefill = tile dequantisation + the {narrow_path} GEMM; the dequantisation "
                     "is not modelled")
    else:
        stream = need(profile.linear_gbs, dname, "batch-1 linear")
        few = need(profile.matmul_gflops, dname, "batched linear")
        gemm = need(profile.gemm_gflops, rate_key[fp32_path] if cpu and dname == "float32" else dname, "GEMM")
        attn = profile.sdpa_gflops.get(dname, 0.0)
        if quantization is not None:
            notes.append("Strata has no GPU quantised kernels: it dequantises per call; predicted as fused")
    if not attn:
        notes.append("no measured attention rate for this dtype: prefill attention at the GEMM rate")
    decode_attn = profile.matmul_gflops.get(dname, 0.0)  # in the activations' dtype (fp32 under bf16 storage)
    if cpu:
        import psutil

        available = int(psutil.virtual_memory().available)
    else:
        available = int(torch.cuda.mem_get_info(torch.device(profile.device))[0])
    dev = Device(
        name=f"this ({profile.name})", source="measured (strata hw)", kind="cpu" if cpu else "gpu", count=1,
        memory_bytes=profile.memory_bytes, available_bytes=available, stream_gbs=stream,
        mem_gbs=profile.mem_bandwidth_gbs, few_rows=MATMUL_BATCH if cpu else 0, few_rows_gflops=few,
        gemm_gflops=gemm, attn_gflops=attn, decode_attn_gflops=decode_attn, measured=True,
        torch_device=profile.device, notes=tuple(notes),
    )
    return measured_tp(dev, profile.comm(), count)


def check_tp_count(comm: CommModel | None, count: int) -> bool:
    """Whether `comm` has an all-reduce to price; raises for thisxN (N > 1) when it has none."""
    if comm is not None and any("+" not in t for t in comm.transports("all_reduce")):
        return True
    if count != 1:
        raise ConfigError(f"--hardware thisx{count}: plans one device of this machine unless its comm model "
                          f"is measured: run `strata bench comm --world-size {count}` first")
    return False


def measured_tp(dev: Device, comm: CommModel | None, count: int) -> Device:
    """`this` as `count` ranks with the measured all-reduce. Ranks of one CPU host share its
    cores, DRAM bandwidth and memory, so each gets 1/count of the measured rates and memory (the
    host's total is what it is; TP there adds the all-reduces and no bandwidth); GPUs are
    separate devices with the measured rates each."""
    if not check_tp_count(comm, count):
        return dev
    fits = [comm.get("all_reduce", t, count) for t in comm.transports("all_reduce") if "+" not in t]
    desc = "; ".join(f"{f.transport} alpha {f.alpha_s * 1e6:.1f} us, beta {f.beta_bps / 1e9:.2f} GB/s "
                     f"({f.algorithm}, fitted at n={f.world_size})" for f in fits)
    if count == 1:
        return dataclasses.replace(dev, comm=comm, notes=dev.notes + (
            f"comm model measured by `{comm.source}` ({comm.measured_at}): {desc}; "
            "--hardware thisxN prices tensor parallelism with it",))
    best = min(fits, key=lambda f: f.predict(4096, count))
    notes = [f"tensor-parallel all-reduce priced from the comm model `{comm.source}` fitted on this machine "
             f"({comm.measured_at}), not a datasheet: {desc}; the cheaper transport per message is taken"]
    if any(f.world_size != count for f in fits):
        notes.append(f"comm model extrapolated to n={count} with each algorithm's formula (strata/comm/alpha_beta.py)")
    if any(f.transport == "shm" for f in fits):
        notes.append("'comm tree' column = the shared-memory (one-shot) all-reduce, 'comm ring' = gloo's ring")
    scale, share = (1.0 / count, f"{count} ranks share this host: each gets 1/{count} of its measured rates "
                    "and memory") if dev.kind == "cpu" else (1.0, "")
    if share:
        notes.append(share)
    return dataclasses.replace(
        dev, name=f"{dev.name} x{count} ranks", count=count, comm=comm,
        memory_bytes=int(dev.memory_bytes * scale),
        available_bytes=None if dev.available_bytes is None else int(dev.available_bytes * scale),
        stream_gbs=dev.stream_gbs * scale, mem_gbs=dev.mem_gbs * scale,
        few_rows_gflops=dev.few_rows_gflops * scale, gemm_gflops=dev.gemm_gflops * scale,
        attn_gflops=dev.attn_gflops * scale, decode_attn_gflops=dev.decode_attn_gflops * scale,
        link=f"measured {'/'.join(f.transport for f in fits)}",
        link_gbs=best.beta_bps / 1e9, alpha_s=best.alpha_s, notes=dev.notes + tuple(notes))


# ---------------------------------------------------------------- formulas


def allreduce_seconds(nbytes: float, n: int, bw_gbs: float, alpha_s: float) -> dict[str, float]:
    """Alpha-beta all-reduce times of `nbytes` over n devices with per-direction bandwidth bw."""
    if n <= 1:
        return {"ring": 0.0, "tree": 0.0}
    bw = bw_gbs * 1e9
    ring = 2 * (n - 1) / n * nbytes / bw + 2 * (n - 1) * alpha_s
    tree = 2 * math.log2(n) * (alpha_s + nbytes / bw)
    return {"ring": ring, "tree": tree}


def tp_allreduce_seconds(dev: Device, nbytes: float, n: int) -> dict[str, float]:
    """One tensor-parallel all-reduce, {"ring": s, "tree": s}; the cheaper is the price. With a
    measured comm model: "ring" = the fitted ring transport (gloo / NCCL), "tree" = the fitted
    shared-memory all-reduce where there is one, else the ring fit's alpha and beta in the tree
    formula. Else the datasheet's (allreduce_seconds)."""
    if dev.comm is None or n <= 1:
        return allreduce_seconds(nbytes, n, dev.link_gbs, dev.alpha_s)
    fits = [dev.comm.get("all_reduce", t, n) for t in dev.comm.transports("all_reduce") if "+" not in t]
    ring = [f.predict(nbytes, n) for f in fits if f.algorithm == "ring"]
    other = [f.predict(nbytes, n) for f in fits if f.algorithm != "ring"]
    if not other:
        other = [model_seconds("tree", nbytes, n, f.alpha_s, f.beta_bps) for f in fits]
    return {"ring": min(ring) if ring else min(other), "tree": min(other)}


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
    kv_bytes: float = 0.0  # of `bytes`: the KV cache read (batch x context x KV bytes per token)
    attn_flops: float = 0.0  # of `flops`: attention over the cached context
    attention: str = ""  # what prices the attention: "KV read" (memory) | "attention compute"
    routing_s: float = 0.0  # of kernel_s: MoE routing (Routing), where no probe timed the layers
    experts: float = 0.0  # MoE: distinct experts read per MoE layer (expected_experts)

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


def all_to_all_seconds(dev: Device, nbytes: float, n: int) -> tuple[float, str]:
    """(seconds, what priced it) of one all-to-all in which each of n ranks sends `nbytes` in all
    (nbytes / n to every rank, itself included): the measured comm model's all-to-all fit where
    `strata bench comm` has one; else its all-gather fit as a stand-in (each rank moves the same
    (n-1)/n x nbytes; the all-gather's S, the gathered bytes, is nbytes here); else, on a datasheet
    target, the link's alpha and bandwidth, pairwise exchange: (n-1) alpha + (n-1)/n nbytes / bw."""
    if n <= 1:
        return 0.0, "one rank: no all-to-all"
    for collective, what in (("all_to_all", "the measured all-to-all fit"),
                             ("all_gather", "STAND-IN: the measured all-gather fit (no all-to-all fit yet)")):
        measured = _measured(dev, collective, nbytes, n)
        if measured is not None:
            return measured[0], f"{what} ({measured[1]})"
    return _pairwise_s(dev, nbytes, n), f"{dev.link} alpha-beta, pairwise (n-1) alpha + (n-1)/n S/bw"


def all_gather_seconds(dev: Device, nbytes: float, n: int) -> float:
    """One all-gather of `nbytes` gathered bytes: the measured fit, else the link's ring (n-1) alpha
    + (n-1)/n S/bw (the pairwise formula)."""
    if n <= 1:
        return 0.0
    measured = _measured(dev, "all_gather", nbytes, n)
    return measured[0] if measured is not None else _pairwise_s(dev, nbytes, n)


def _measured(dev: Device, collective: str, nbytes: float, n: int) -> tuple[float, str] | None:
    """(seconds, transport) of the cheapest fitted transport of `collective`, or None."""
    comm = dev.comm
    fits = [comm.get(collective, t, n) for t in comm.transports(collective) if "+" not in t] if comm else []
    if not fits:
        return None
    best = min(fits, key=lambda f: f.predict(nbytes, n))
    return best.predict(nbytes, n), best.transport


def _pairwise_s(dev: Device, nbytes: float, n: int) -> float:
    return (n - 1) * dev.alpha_s + (n - 1) / n * nbytes / (dev.link_gbs * 1e9)


def ep_all_to_all_bytes(shape: ModelShape, tokens: int, n: int) -> int:
    """What one rank sends in one expert-parallel all-to-all: its slice of the step's tokens
    (ceil(tokens / n)), once per routed expert (top_k), hidden x the activations' bytes each."""
    return -(-tokens // n) * shape.top_k * shape.cfg.hidden_size * shape.act_itemsize


def ep_exchange_seconds(shape: ModelShape, dev: Device, tokens: int, n: int) -> tuple[float, str]:
    """(seconds, what priced the all-to-alls) of one MoE layer's exchange under expert parallelism
    over n ranks (graph/expert_parallel.py): dispatch and combine all-to-alls of
    ep_all_to_all_bytes, then the all-gather of the n slices (ceil(tokens / n) rows each)."""
    a2a, source = all_to_all_seconds(dev, ep_all_to_all_bytes(shape, tokens, n), n)
    gathered = n * -(-tokens // n) * shape.cfg.hidden_size * shape.act_itemsize
    return 2 * a2a + all_gather_seconds(dev, gathered, n), source


def _tp_comm_s(shape: ModelShape, dev: Device, tokens: int, tp: int) -> float:
    """A step's collectives at tp > 1: 2 all-reduces per dense layer of tokens x hidden; an MoE
    layer (expert parallel: the engine splits an MoE model's experts, whole, over its TP ranks)
    keeps attention's one and adds its exchange (ep_exchange_seconds)."""
    cfg = shape.cfg
    ar = min(tp_allreduce_seconds(dev, cfg.hidden_size * shape.act_itemsize * tokens, tp).values())
    comm = (2 * cfg.num_layers - shape.moe_layers) * ar
    if shape.moe_layers:
        comm += shape.moe_layers * ep_exchange_seconds(shape, dev, tokens, tp)[0]
    return comm


def _rows_line_s(nbytes: float, params: float, rows: float, dev: Device) -> float:
    """Measured-kernel time of matrices of `nbytes` / `params` over `rows` rows (a CPU's few-row
    line): the weights streamed once at one row, the few-row rate's FLOPs at few_rows, linear in
    between; past few_rows the slower of the stream and the FLOPs at the batch's rate."""
    t1 = nbytes / (dev.stream_gbs * 1e9)
    if rows <= dev.few_rows:
        tn = 2 * dev.few_rows * params / dev.rate(dev.few_rows)
        return t1 + (rows - 1) * max(0.0, tn - t1) / max(1, dev.few_rows - 1)
    return max(t1, 2 * rows * params / dev.rate(rows))


def decode_step(shape: ModelShape, dev: Device, batch: int, context: int, tp: int = 1,
                overhead=None, probe=None) -> Step:
    """One decode step of `batch` sequences attending over `context` tokens. The step reads the
    weights once and every sequence's KV cache at its depth: kv = batch x context x KV bytes per
    token (2 x layers x kv_heads x head_dim x the cache dtype's bytes, memory/planner.py), priced
    max(kv / memory bandwidth, attention FLOPs / the decode attention rate): the read, or the
    attention compute where that dominates. `probe` (decode_probe.DecodeTimes, `this` device,
    tp 1): the model's own layers and head timed at their shapes (attention at the probe's
    context included) replace the rate formulas; the attention beyond the probe's context is
    added at that price.

    Mixture of experts: the weights read are all but the routed experts, plus the expected
    distinct experts E(1-(1-k/E)^batch) of each MoE layer, each an expert GEMV over its share of the
    rows (batch x k / distinct); FLOPs are the active ones; routing (Routing: router + per-expert
    dispatch) is added where no probe timed the layers. At tp > 1 an MoE model is expert parallel
    (the engine's --enable-expert-parallel): attention split by heads as TP, whole experts E / tp a
    rank, each rank reading the distinct experts it holds; comm per _tp_comm_s."""
    cfg = shape.cfg
    ep = tp if shape.num_experts else 1
    experts = shape.experts_at(batch)
    rank_experts = experts / ep  # the distinct experts a rank holds that the batch visits
    w = shape.dense_stream_bytes / tp + shape.one_expert_bytes * shape.moe_layers * rank_experts
    per_pos = batch * shape.kv_per_token / _kv_split(cfg, tp)
    kv = per_pos * context
    f_lin = 2 * batch * shape.p_lin / tp
    f_att = batch * context * shape.attn_flops_per_pos / tp
    stream, mem = dev.stream_gbs * 1e9, dev.mem_gbs * 1e9
    mem_s = w / stream + kv / mem
    compute_s = (f_lin + f_att) / dev.rate(batch)
    roofline = max(mem_s, compute_s)
    routing = shape.routing_for(dev).seconds(shape.moe_layers, rank_experts) if shape.num_experts else 0.0

    attn_rate = dev.decode_attn_rate(batch)

    def attention_s(ctx: float) -> float:  # the KV read or the attention FLOPs at depth ctx, the slower
        return max(per_pos * ctx / mem, batch * ctx * shape.attn_flops_per_pos / tp / attn_rate)

    attention = "KV read" if kv / mem >= f_att / attn_rate else "attention compute"
    if probe is not None and tp == 1:  # routing included: the probe ran the MoE layers
        layer_s, head_s = probe.at(batch)
        kernel = max(0.0, cfg.num_layers * layer_s + head_s + attention_s(context) - attention_s(probe.context))
        routing = 0.0
    elif dev.few_rows:  # measured kernel line between 1 and few_rows rows
        kernel = _rows_line_s(shape.dense_stream_bytes / tp, shape.p_dense / tp, batch, dev) + attention_s(context)
        if experts:
            rows = batch * shape.top_k / experts
            one = _rows_line_s(shape.one_expert_bytes, shape.expert_params, rows, dev)
            kernel += shape.moe_layers * rank_experts * one
        kernel += routing
    else:
        kernel = roofline + routing
    comm = _tp_comm_s(shape, dev, batch, tp) if tp > 1 else 0.0
    over = overhead.at(batch, cfg.num_layers) if overhead is not None else 0.0
    if overhead is not None and tp == 1:  # multi-step decode pays part of it once per call
        steps = overhead.steps_per_call(kernel + over)
        if steps > 1:
            over = overhead.at(batch, cfg.num_layers, steps)
    return Step(batch, context, tp, w + kv, f_lin + f_att, mem_s, compute_s, roofline, kernel, over, comm,
                "compute" if compute_s > mem_s else "memory", kv, f_att, attention, routing, experts)


def depth_curve(shape: ModelShape, dev: Device, max_len: int, overhead=None, probe=None,
                depths: tuple[int, ...] = (0, 4096, 16384)) -> list[Step]:
    """Batch-1 decode at each depth (tokens already in the sequence's KV cache) below max_len,
    and at max_len itself: the KV read grows with the depth while the weight read stays."""
    return [decode_step(shape, dev, 1, d, 1, overhead, probe) for d in [d for d in depths if d < max_len] + [max_len]]


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
    routing_s: float = 0.0  # MoE routing per chunk (Routing) where the rates price it

    @property
    def total_s(self) -> float:
        return (self.compute_s + self.elementwise_s + self.weight_read_s + self.overhead_s + self.comm_s
                + self.routing_s)

    @property
    def intensity(self) -> float:
        return self.flops / self.bytes


def prefill(shape: ModelShape, dev: Device, tokens: int, chunk: int, tp: int = 1, overhead=None,
            layer=None) -> Prefill:
    """Prefill of one `tokens`-token prompt. `layer` (layer_probe.LayerTimes, `this` device):
    measured per-layer times at min(tokens, chunk) tokens replace the rates; projections and
    elementwise work scale with tokens, attention with its causal FLOPs. Mixture of experts: the
    active FLOPs (p_layers), the experts' at the rate of their rows (a chunk's tokens x k spread
    over the experts it reads), each chunk reading the experts it touches, plus the routing."""
    cfg = shape.cfg
    chunks = -(-tokens // chunk)
    rows = min(tokens, chunk)
    attn = 2 * cfg.num_layers * cfg.num_heads * cfg.head_dim * tokens * (tokens + 1) / tp
    lin = (2 * shape.p_layers * tokens + 2 * cfg.vocab_size * cfg.hidden_size) / tp
    expert_lin = 2 * tokens * shape.top_k * shape.moe_layers * shape.expert_params / tp
    flops = lin + attn
    w = chunks * shape.stream_at(rows) / tp
    elementwise_s, source, routing_s = 0.0, "roofline", 0.0
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
        compute_s = (lin - expert_lin) / dev.rate(rows) + attn_s
        if shape.num_experts:
            experts = shape.experts_at(rows)
            compute_s += expert_lin / dev.rate(rows * shape.top_k / experts)
            routing_s = chunks * shape.routing_for(dev).seconds(shape.moe_layers, experts / tp)  # tp: EP ranks
        read_s = w / (dev.stream_gbs * 1e9)
    comm = chunks * _tp_comm_s(shape, dev, rows, tp) if tp > 1 else 0.0
    over = chunks * overhead.at(1, cfg.num_layers) if overhead is not None else 0.0
    return Prefill(tokens, chunks, flops, w + tokens * shape.kv_per_token / tp, compute_s, attn_s, read_s, over,
                   comm, elementwise_s, source, routing_s)


def crossover_batch(shape: ModelShape, dev: Device, context: int, tp: int = 1) -> float | None:
    """Smallest batch where the roofline's FLOP time reaches its byte time; None if never
    (per-sequence KV bytes outgrow per-sequence FLOPs at this context)."""
    if shape.num_experts:
        return _moe_crossover(shape, dev, context, tp)
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


def _moe_crossover(shape: ModelShape, dev: Device, context: int, tp: int, limit: int = 1 << 20) -> float | None:
    """crossover_batch of an MoE model, searched: its bytes grow with the batch (more experts read)
    until every expert is, so the dense closed form does not apply."""
    def compute_bound(b: int) -> bool:
        step = decode_step(shape, dev, b, context, tp)
        return step.compute_s >= step.mem_s

    hi = 1
    while not compute_bound(hi):
        if hi >= limit:
            return None
        hi *= 2
    lo = hi // 2
    while hi - lo > 1:  # the smallest compute-bound batch in (lo, hi]
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if compute_bound(mid) else (mid, hi)
    return float(hi)

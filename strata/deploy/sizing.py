"""From a plan to a pod: GPUs per replica, tensor-parallel size, KV cache, CPU/memory and timeouts.

The planner (planner/plan.py) prices every tensor-parallel degree t of the hardware; here the
smallest t is chosen whose per-GPU memory holds the weights, the activation workspace and the KV
cache of `concurrency` sequences of max_model_len, within `gpu_memory_utilization` of the
device (the rest is left to the CUDA context, NCCL buffers and allocator fragmentation). The KV
cache then gets all of that usable memory (--kv-cache-memory, per rank, as the engine reads it),
and the plan is rebuilt with it so the block count is the one the engine's own memory planner
(memory/planner.plan_memory) allocates. Every degree tried leaves a reason.

Host side, per pod (rules of thumb, written once here): CPU = 2 cores (HTTP loop, tokenizer) + 2
per GPU rank; memory = 4 GiB (Python, torch, CUDA runtime) + per rank 1 GiB + its host swap pool
(the engine's default: the KV cache size, at most 1 GiB) + /dev/shm (a memory emptyDir counts
against the pod's limit). A CPU pod holds the weights, activations and KV cache in host memory
too, and its engine threads equal its CPU limit.

Timeouts: the startup budget covers reading the weights at LOAD_GBS plus WARMUP_S; the drain
timeout lets a request of max_model_len tokens that started just before SIGTERM finish at the
requested concurrency (the plan's prefill + max_model_len decode steps at that batch, x
DRAIN_SAFETY), at least MIN_DRAIN_S.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from strata.config import DTYPES, engine_default
from strata.errors import ConfigError
from strata.graph.tensor_parallel import check_shardable
from strata.hardware.probe import probe
from strata.hardware.specs import parse_hardware
from strata.planner.cost_model import ModelShape, decode_step, prefill
from strata.planner.plan import Plan, PlanRequest, TPOption, build_plan, resolve_model
from strata.text_table import fmt_bytes

MiB, GiB = 2**20, 2**30
CPU_BASE_CORES, CPU_PER_RANK = 2, 2
HOST_BASE, HOST_PER_RANK, SWAP_MAX = 4 * GiB, 1 * GiB, 1 * GiB
SHM_ONE_RANK, SHM_MULTI_RANK = 1 * GiB, 4 * GiB  # TP ranks on one pod share /dev/shm (NCCL, comm/shm.py)
LOAD_GBS = 0.5  # GB/s from the model volume (a network PVC; local NVMe is faster)
WARMUP_S = 120
MIN_STARTUP_S = 300
DRAIN_SAFETY = 1.5  # datasheet plans are rooflines: real steps are slower
MIN_DRAIN_S = 30


@dataclass(frozen=True)
class DeployRequest:
    model: str
    hardware: str = "this"
    replicas: int = 1
    max_model_len: int | None = None
    quantization: str | None = None
    dtype: str = engine_default("dtype")
    concurrency: int = 16  # sequences of max_model_len the KV cache must hold at once, per replica
    max_nodes: int = 1  # nodes one replica may span (tensor parallelism across nodes: LeaderWorkerSet)
    gpu_memory_utilization: float = 0.90
    cpus: int | None = None  # CPU pods: cores per pod (default: this machine's physical cores)
    drain_timeout: int | None = None  # seconds; default from the plan
    pre_stop_seconds: int = 10

    def __post_init__(self) -> None:
        for name in ("replicas", "concurrency", "max_nodes"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')}: must be >= 1, got {getattr(self, name)}")
        if not 0.1 <= self.gpu_memory_utilization <= 1.0:
            raise ConfigError(f"--gpu-memory-utilization: must be in [0.1, 1], got {self.gpu_memory_utilization}")
        if self.cpus is not None and self.cpus < 1:
            raise ConfigError(f"--cpus: must be >= 1, got {self.cpus}")
        if self.drain_timeout is not None and self.drain_timeout < 1:
            raise ConfigError(f"--drain-timeout: must be >= 1 second, got {self.drain_timeout}")
        if self.pre_stop_seconds < 0:
            raise ConfigError(f"--pre-stop-seconds: must be >= 0, got {self.pre_stop_seconds}")


@dataclass
class Sizing:
    """What the chart's values take from the plan (per pod unless said otherwise)."""

    model: str
    device: str  # "cuda" | "cpu"
    accelerator: str  # the plan's device name
    dtype: str
    quantization: str | None
    max_model_len: int
    concurrency: int
    tensor_parallel_size: int
    gpus_per_pod: int  # 0: CPU pod
    nodes_per_replica: int
    kv_cache_memory: int  # bytes per rank (--kv-cache-memory)
    kv_tokens: int  # per rank's cache: the tokens it holds (every rank holds the same positions)
    max_sequences: int  # sequences of max_model_len that fit
    weight_bytes: int  # per rank
    activation_bytes: int  # per rank
    cpu: int
    memory: int  # host bytes per pod, /dev/shm included
    shm: int
    threads: int | None  # CPU pods: = cpu
    startup_seconds: int
    drain_timeout: int
    pre_stop_seconds: int
    predicted_tpot_s: float  # at the requested concurrency
    reasons: list[str] = field(default_factory=list)
    plan: Plan | None = None

    @property
    def gpus_per_replica(self) -> int:
        return self.gpus_per_pod * self.nodes_per_replica

    def summary(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ("plan", "reasons")}
        d["gpus_per_replica"] = self.gpus_per_replica
        return d


def _plan(req: DeployRequest, hardware: str, kv: int | None, profile, overhead) -> Plan:
    return build_plan(PlanRequest(
        model=req.model, hardware=hardware, dtype=req.dtype, quantization=req.quantization,
        max_model_len=req.max_model_len, batch=req.concurrency, kv_cache_memory=kv,
    ), profile=profile, overhead=overhead)


def _shardable(plan: Plan, tp: int) -> str | None:
    cfg, _ = resolve_model(plan.model)
    try:
        check_shardable(cfg, tp)
    except ConfigError as e:
        return str(e)
    return None


def _timeouts(req: DeployRequest, plan: Plan, tp: int, weight_bytes_per_pod: int) -> tuple[int, int, float, list[str]]:
    """(startup budget s, drain timeout s, predicted TPOT at the concurrency, reasons)."""
    cfg, _ = resolve_model(plan.model)
    dtype = DTYPES[plan.dtype]
    shape = ModelShape.of(cfg, dtype, plan.quantization, engine_default("quantization_group_size"))
    step = decode_step(shape, plan.device, req.concurrency, plan.context, tp, plan.overhead)
    pre = prefill(shape, plan.device, plan.input_len, engine_default("max_num_batched_tokens"), tp, plan.overhead)
    longest = pre.total_s + plan.max_model_len * step.total_s
    startup = max(MIN_STARTUP_S, math.ceil((WARMUP_S + weight_bytes_per_pod / (LOAD_GBS * 1e9)) / 10) * 10)
    reasons = [f"startup budget {startup} s: {fmt_bytes(weight_bytes_per_pod)} of weights at {LOAD_GBS} GB/s "
               f"+ {WARMUP_S} s warm-up (at least {MIN_STARTUP_S} s)"]
    if req.drain_timeout is not None:
        drain = req.drain_timeout
        reasons.append(f"drain timeout {drain} s: --drain-timeout")
    else:
        drain = max(MIN_DRAIN_S, math.ceil(DRAIN_SAFETY * longest))
        reasons.append(f"drain timeout {drain} s: a {plan.max_model_len}-token request at batch {req.concurrency} "
                       f"takes {longest:.0f} s by the plan (prefill {pre.total_s:.1f} s + "
                       f"{plan.max_model_len} x {step.total_s * 1e3:.1f} ms), x{DRAIN_SAFETY}, at least {MIN_DRAIN_S} s")
    return startup, drain, step.total_s, reasons


def size_deployment(req: DeployRequest, profile=None, overhead=None) -> Sizing:
    """The plan-backed sizing of one replica. `profile`/`overhead` as build_plan's (tests inject them)."""
    name, per_node = parse_hardware(req.hardware)
    if name.lower() == "this":
        plan = _plan(req, req.hardware, None, profile, overhead)
        if plan.device.kind == "cpu":
            return _size_cpu(req, plan, profile, overhead)
        per_node = plan.device.count
        hardware = req.hardware
    else:
        hardware = f"{name}x{per_node * req.max_nodes}"
        plan = _plan(req, hardware, None, profile, overhead)
    return _size_gpu(req, plan, hardware, per_node, profile, overhead)


def _size_gpu(req: DeployRequest, plan: Plan, hardware: str, per_node: int, profile, overhead) -> Sizing:
    dev = plan.device
    usable = int(dev.memory_bytes * req.gpu_memory_utilization)
    reasons: list[str] = []
    chosen: TPOption | None = None
    kv = 0
    for o in plan.tp_options:
        m, tp = o.memory, o.tp
        if tp > per_node and tp % per_node:
            continue  # a replica spans whole nodes
        why = _shardable(plan, tp)
        if why is not None:
            reasons.append(f"TP={tp}: {why}")
            continue
        need = req.concurrency * m.kv_per_sequence
        room = usable - m.weight_bytes - m.activation_bytes
        head = (f"TP={tp}: weights {fmt_bytes(m.weight_bytes)} + activations {fmt_bytes(m.activation_bytes)} per GPU "
                f"of {fmt_bytes(usable)} usable ({req.gpu_memory_utilization:.0%} of {fmt_bytes(dev.memory_bytes)})")
        if room < need:
            have = max(0, room) // m.kv_per_sequence if m.kv_per_sequence else 0
            reasons.append(f"{head} leave KV room for {have} sequences of {plan.max_model_len} tokens; "
                           f"{req.concurrency} wanted (--concurrency)")
            continue
        chosen, kv = o, room // MiB * MiB
        reasons.append(f"{head} leave {fmt_bytes(kv)} of KV cache: chosen, the smallest degree that holds "
                       f"{req.concurrency} sequences of {plan.max_model_len} tokens")
        break
    if chosen is None:
        raise ConfigError(
            f"{plan.model} does not fit on {hardware} ({'; '.join(reasons) or 'no tensor-parallel degree divides it'}); "
            "fix: more GPUs (--hardware NAMExN, --max-nodes), --quantization int8/int4, a smaller --max-model-len "
            "or --concurrency")
    tp = chosen.tp
    final = _plan(req, hardware, kv, profile, overhead)
    mem = next(o.memory for o in final.tp_options if o.tp == tp)
    gpus_per_pod = min(tp, per_node)
    nodes = -(-tp // per_node)
    shm = SHM_MULTI_RANK if gpus_per_pod > 1 else SHM_ONE_RANK
    host = HOST_BASE + gpus_per_pod * (HOST_PER_RANK + min(kv, SWAP_MAX)) + shm
    cpu = CPU_BASE_CORES + CPU_PER_RANK * gpus_per_pod
    if nodes > 1:
        reasons.append(f"TP={tp} > {per_node} GPUs per node: {nodes} pods of {per_node} GPUs per replica "
                       "(LeaderWorkerSet; the plan prices the all-reduce over the node's link, the network between "
                       "nodes is slower)")
    reasons.append(f"host per pod: {cpu} CPUs ({CPU_BASE_CORES} + {CPU_PER_RANK} per GPU), memory "
                   f"{fmt_bytes(host)} ({fmt_bytes(HOST_BASE)} + per GPU {fmt_bytes(HOST_PER_RANK)} + swap "
                   f"{fmt_bytes(min(kv, SWAP_MAX))}, + /dev/shm {fmt_bytes(shm)})")
    startup, drain, tpot, why = _timeouts(req, final, tp, mem.weight_bytes * gpus_per_pod)
    return Sizing(
        model=final.model, device="cuda", accelerator=dev.name, dtype=final.dtype, quantization=final.quantization,
        max_model_len=final.max_model_len, concurrency=req.concurrency, tensor_parallel_size=tp,
        gpus_per_pod=gpus_per_pod, nodes_per_replica=nodes, kv_cache_memory=kv, kv_tokens=mem.kv_tokens,
        max_sequences=mem.max_sequences, weight_bytes=mem.weight_bytes, activation_bytes=mem.activation_bytes,
        cpu=cpu, memory=host, shm=shm, threads=None, startup_seconds=startup, drain_timeout=drain,
        pre_stop_seconds=req.pre_stop_seconds, predicted_tpot_s=tpot, reasons=reasons + why, plan=final,
    )


def _size_cpu(req: DeployRequest, plan: Plan, profile, overhead) -> Sizing:
    """A CPU pod like this machine: one rank (tensor parallelism cannot pay on one host's cores),
    the KV cache sized for the concurrency, everything in host memory."""
    m = plan.memory
    kv = -(-req.concurrency * m.kv_per_sequence // MiB) * MiB
    final = _plan(req, req.hardware, kv, profile, overhead)
    mem = final.memory
    if profile is None:
        profile = probe("cpu")
    cpu = req.cpus or int(profile.cores)
    host = -(-(mem.weight_bytes + mem.activation_bytes + kv + min(kv, SWAP_MAX) + HOST_BASE + SHM_ONE_RANK) // GiB) * GiB
    reasons = [
        f"CPU pod: weights {fmt_bytes(mem.weight_bytes)} + activations {fmt_bytes(mem.activation_bytes)} + KV "
        f"{fmt_bytes(kv)} ({req.concurrency} sequences of {final.max_model_len} tokens) + swap "
        f"{fmt_bytes(min(kv, SWAP_MAX))} + runtime {fmt_bytes(HOST_BASE)} + /dev/shm {fmt_bytes(SHM_ONE_RANK)} "
        f"= {fmt_bytes(host)}",
        f"{cpu} CPUs ({'--cpus' if req.cpus else 'this machine'}'s cores); engine threads = the CPU limit",
    ]
    startup, drain, tpot, why = _timeouts(req, final, 1, mem.weight_bytes)
    return Sizing(
        model=final.model, device="cpu", accelerator=final.device.name, dtype=final.dtype,
        quantization=final.quantization, max_model_len=final.max_model_len, concurrency=req.concurrency,
        tensor_parallel_size=1, gpus_per_pod=0, nodes_per_replica=1, kv_cache_memory=kv, kv_tokens=mem.kv_tokens,
        max_sequences=mem.max_sequences, weight_bytes=mem.weight_bytes, activation_bytes=mem.activation_bytes,
        cpu=cpu, memory=host, shm=SHM_ONE_RANK, threads=cpu, startup_seconds=startup, drain_timeout=drain,
        pre_stop_seconds=req.pre_stop_seconds, predicted_tpot_s=tpot, reasons=reasons + why, plan=final,
    )

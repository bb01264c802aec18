"""`strata analyze`: run a workload with instrumentation, attribute its time, name the bottleneck.

The offline workload runs through LLMEngine in this process. Wall time of the run is split into:
  CPU pipeline   tokenize, schedule, sample (+ stop checks), batch preparation and Python/dispatch
                 overhead (forward time not inside any operator, from torch.profiler)
  compute        GEMM, attention, norm and elementwise operators (profiler self time)
  memory         KV writes, gathers and copies, swap
  communication  (tensor parallel; 0 on one device)
  idle           the rest of the loop
Operator shares come from torch.profiler on a sample of steps (one step in PROFILE_EVERY, so the
profiler's own cost stays out of most steps) and are applied to the measured forward time of each
phase. Each phase (prefill, decode) is compared with the planner's kernel prediction for the same
batches (analyze/plan.py, from `strata hw`'s measured rates): predicted / measured is how much of
the time the hardware roofline explains. The verdict names the layer that limits the workload and
one to three actions, each with the flag and the gain the planner predicts.
"""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

from strata.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

PROFILE_EVERY = 8  # one profiled step in this many (the profiler's per-operator cost stays out of the rest)
BOUND_EFFICIENCY = 0.45  # a phase whose roofline prediction explains this share of its time is bound by it
KERNEL_SHARE = 0.5  # ... or whose forward time is at least this much inside its GEMM/attention/KV kernels
TOKENIZE_SHARE = 0.25  # tokenisation above this share of wall time is the bottleneck
QUEUE_SHARE = 0.5  # requests waiting this share of their latency for a capped batch: scheduling

# operator name fragments -> category (first match wins; names are lower-cased)
OP_CATEGORIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("attention", ("attention", "scaled_dot_product", "sdpa", "softmax", "flash", "paged_decode")),
    ("memory", ("index_select", "index_copy", "index_put", "copy_", "kv_write", "write_kv", "swap",
                "clone", "contiguous", "gather", "scatter", "cat", "stack", "fill_", "zero_", "to_copy")),
    ("gemm", ("mm", "linear", "matmul", "gemv", "bmm", "quant", "int8", "int4", "baddbmm", "einsum")),
    ("norm_elementwise", ("norm", "rsqrt", "silu", "swiglu", "mul", "add", "sub", "div", "neg", "exp", "pow",
                          "mean", "rope", "rotary", "sigmoid", "where", "masked", "embedding", "tanh", "sum")),
)
CATEGORY_LABELS = {
    "tokenize": "tokenize", "schedule": "schedule", "sample": "sample + detokenize",
    "overhead": "batch prep + Python/dispatch", "gemm": "GEMM", "attention": "attention",
    "norm_elementwise": "norm + elementwise", "other_ops": "other operators", "memory": "KV writes + copies",
    "communication": "communication", "idle": "idle",
}
LAYER_OF = {
    "tokenize": "CPU pipeline", "schedule": "CPU pipeline", "sample": "CPU pipeline", "overhead": "CPU pipeline",
    "gemm": "compute", "attention": "compute", "norm_elementwise": "compute", "other_ops": "compute",
    "memory": "memory traffic", "communication": "communication", "idle": "idle",
}


def classify(op_name: str) -> str:
    name = op_name.lower()
    for category, fragments in OP_CATEGORIES:
        if any(f in name for f in fragments):
            return category
    return "other_ops"


@dataclass
class Workload:
    num_prompts: int = 16
    input_len: tuple[int, int] = (128, 128)
    output_len: tuple[int, int] = (64, 64)
    seed: int = 0


@dataclass
class StepRecord:
    kind: str  # "prefill" (any prompt tokens in the step) | "decode"
    wall_s: float
    schedule_s: float
    forward_s: float
    sample_s: float
    prefill_tokens: int
    decode_seqs: int
    decode_context: int  # sum of the decoding sequences' context lengths
    profiled: bool


@dataclass
class RequestRecord:
    tokenize_s: float
    queue_s: float
    prefill_s: float
    decode_s: float
    ttft_s: float
    tpot_s: float | None
    output_tokens: int


@dataclass
class Measurement:
    wall_s: float
    tokenize_s: float
    steps: list[StepRecord]
    requests: list[RequestRecord]
    op_seconds: dict[str, dict[str, float]]  # kind -> category -> profiled self seconds
    op_forward_s: dict[str, float]  # kind -> profiled steps' forward seconds
    top_ops: list[tuple[str, float]]  # (operator, profiled self seconds), all kinds
    max_num_seqs: int
    max_running: int


def _prompts(engine, w: Workload) -> list[tuple[str | None, list[int]]]:
    """Random prompts: text (decoded from random ids) when the model has a tokenizer, else ids."""
    from strata.bench.common import random_prompts, special_ids

    rng = np.random.default_rng(w.seed)
    lens = rng.integers(w.input_len[0], w.input_len[1] + 1, size=w.num_prompts).tolist()
    ids = random_prompts(rng, engine.model_config.vocab_size, lens, special_ids(engine))
    tok = engine.tokenizer
    if tok is None:
        return [(None, p) for p in ids]
    out = []
    for p, n in zip(ids, lens):  # text whose re-encoding is about n tokens long
        again = tok.encode(tok.decode(p), add_special_tokens=False)[:n]
        out.append((tok.decode(again), again))
    return out


def run_offline(engine, w: Workload) -> Measurement:
    """All requests arrive at once; the engine steps until they finish, instrumented."""
    from strata.kernels.profile import named_kernels
    from strata.server.tokenizer_worker import tokenize

    rng = np.random.default_rng(w.seed + 1)
    outs = rng.integers(w.output_len[0], w.output_len[1] + 1, size=w.num_prompts).tolist()
    prompts = _prompts(engine, w)
    t_start = time.perf_counter()
    tok_times, rids = [], []
    for i, ((text, ids), n_out) in enumerate(zip(prompts, outs)):
        t0 = time.perf_counter()
        if text is not None:
            ids = tokenize(engine.tokenizer, {"kind": "text", "text": text, "add_special_tokens": False})
        tok_times.append(time.perf_counter() - t0)
        params = SamplingParams(temperature=0.0, max_tokens=n_out, ignore_eos=True)
        engine.validate(i, ids, params)
        rid = f"analyze-{i}"
        engine.add_request(rid, text, ids, params)
        rids.append(rid)
    tokenize_s = sum(tok_times)
    steps, finished = [], {}
    op_seconds: dict[str, dict[str, float]] = {"prefill": {}, "decode": {}}
    op_forward: dict[str, float] = {"prefill": 0.0, "decode": 0.0}
    op_totals: dict[str, float] = {}
    profiler_s = 0.0  # starting/stopping/reading the profiler: not the workload's time
    max_running = 0
    i = 0
    while engine.has_unfinished():
        # profile one step in PROFILE_EVERY, plus the first step and the first after a phase change
        profiled = i % PROFILE_EVERY == 0 or (len(steps) >= 2 and steps[-1].kind != steps[-2].kind)
        before = dict(engine.stage_seconds)
        prof = None
        if profiled:
            t0 = time.perf_counter()
            named = named_kernels()  # numba kernels show up as numba::<kernel> operators
            named.__enter__()
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            prof.__enter__()
            profiler_s += time.perf_counter() - t0
        t0 = time.perf_counter()
        outputs = engine.step()
        wall = time.perf_counter() - t0
        out = engine.last_schedule
        prefill_tokens = sum(s.num_tokens for s in out.scheduled if s.num_tokens > 1)
        decodes = [s for s in out.scheduled if s.num_tokens == 1]
        kind = "prefill" if prefill_tokens else "decode"
        st = engine.stage_seconds
        rec = StepRecord(kind, wall, st["schedule"] - before["schedule"], st["forward"] - before["forward"],
                         st["sample"] - before["sample"], prefill_tokens, len(decodes),
                         sum(s.seq.num_computed_tokens for s in decodes), profiled)
        steps.append(rec)
        if prof is not None:
            t0 = time.perf_counter()
            prof.__exit__(None, None, None)
            named.__exit__(None, None, None)
            op_forward[kind] += rec.forward_s
            for ev in prof.key_averages():
                secs = ev.self_cpu_time_total / 1e6
                if secs > 0:
                    cat = classify(ev.key)
                    op_seconds[kind][cat] = op_seconds[kind].get(cat, 0.0) + secs
                    op_totals[ev.key] = op_totals.get(ev.key, 0.0) + secs
            profiler_s += time.perf_counter() - t0
        max_running = max(max_running, len(engine.scheduler.running))
        for o in outputs:
            if o.finished:
                finished[o.request_id] = o
        i += 1
    wall_s = time.perf_counter() - t_start - profiler_s
    requests = []
    for rid, tok_s in zip(rids, tok_times):
        o = finished[rid]
        n = len(o.outputs[0].token_ids)
        sched, first, end = o.first_scheduled_time, o.first_token_time, o.finished_time
        requests.append(RequestRecord(
            tokenize_s=tok_s, queue_s=sched - o.arrival_time, prefill_s=first - sched, decode_s=end - first,
            ttft_s=first - o.arrival_time + tok_s, tpot_s=(end - first) / (n - 1) if n > 1 else None,
            output_tokens=n,
        ))
    top = sorted(op_totals.items(), key=lambda kv: -kv[1])[:5]
    return Measurement(wall_s, tokenize_s, steps, requests, op_seconds, op_forward, top,
                       engine.config.max_num_seqs, max_running)


# ------------------------------------------------------------------ attribution and phases


def attribute(m: Measurement) -> dict[str, float]:
    """Wall seconds per category (CATEGORY_LABELS); they sum to the run's wall time."""
    cats = dict.fromkeys(CATEGORY_LABELS, 0.0)
    cats["tokenize"] = m.tokenize_s
    for kind in ("prefill", "decode"):
        steps = [s for s in m.steps if s.kind == kind]
        if not steps:
            continue
        cats["schedule"] += sum(s.schedule_s for s in steps)
        cats["sample"] += sum(s.sample_s for s in steps)
        forward = sum(s.forward_s for s in steps)
        profiled_fwd = m.op_forward_s.get(kind, 0.0)
        ops = m.op_seconds.get(kind, {})
        if profiled_fwd > 0:
            scale = forward / profiled_fwd
            in_ops = min(sum(ops.values()), profiled_fwd)
            shrink = in_ops / sum(ops.values()) if ops and sum(ops.values()) > 0 else 1.0
            for cat, secs in ops.items():
                cats[cat] += secs * shrink * scale
            cats["overhead"] += (profiled_fwd - in_ops) * scale
        else:  # no profiled step in this phase: its forward time stays unsplit
            cats["other_ops"] += forward
    cats["idle"] = max(0.0, m.wall_s - sum(cats.values()))
    return cats


@dataclass
class Phase:
    name: str
    steps: int
    seconds: float
    tokens: int
    mean_batch: float
    bytes: float
    flops: float
    predicted_s: float  # the planner's kernel time for the same steps (no host overhead)
    bound: str  # what the planner says limits the kernels: "memory" | "compute"
    mbu: float  # achieved bytes/s over the measured DRAM bandwidth
    mfu: float  # achieved FLOP/s over the measured GEMM rate at this phase's rows
    kernel_share: float = 0.0  # profiled forward time inside GEMM, attention and KV-copy operators

    @property
    def efficiency(self) -> float:
        return self.predicted_s / self.seconds if self.seconds > 0 else 0.0

    @property
    def roofline_bound(self) -> bool:
        """The hardware roofline, not the host, limits this phase: the planner's kernel time explains
        enough of the measured time, or the profile shows the time inside the heavy kernels (robust
        when the whole machine is slowed by other work)."""
        return self.efficiency >= BOUND_EFFICIENCY or self.kernel_share >= KERNEL_SHARE

    @property
    def intensity(self) -> float:
        return self.flops / self.bytes if self.bytes else 0.0


def _kernel_share(m: Measurement, kind: str) -> float:
    ops = m.op_seconds.get(kind, {})
    fwd = m.op_forward_s.get(kind, 0.0)
    heavy = sum(ops.get(c, 0.0) for c in ("gemm", "attention", "memory"))
    return min(1.0, heavy / fwd) if fwd > 0 else 0.0


def phases(m: Measurement, shape, dev) -> list[Phase]:
    from strata.analyze import plan

    out = []
    dec = [s for s in m.steps if s.kind == "decode" and s.decode_seqs]
    if dec:
        pred = bytes_ = flops = 0.0
        bounds = []
        for s in dec:
            ctx = s.decode_context // s.decode_seqs
            st = plan.decode_step(shape, dev, s.decode_seqs, ctx)
            pred += st.kernel_s
            bytes_ += st.bytes
            flops += st.flops
            bounds.append(st.bound)
        secs = sum(s.wall_s for s in dec)
        batch = statistics.mean(s.decode_seqs for s in dec)
        out.append(Phase("decode", len(dec), secs, sum(s.decode_seqs for s in dec), batch, bytes_, flops, pred,
                         max(set(bounds), key=bounds.count), bytes_ / secs / (dev.mem_gbs * 1e9),
                         flops / secs / dev.rate(round(batch)), _kernel_share(m, "decode")))
    pre = [s for s in m.steps if s.kind == "prefill"]
    if pre:
        pred = bytes_ = flops = 0.0
        for s in pre:
            p = plan.prefill(shape, dev, s.prefill_tokens, max(s.prefill_tokens, 1))
            pred += p.compute_s + p.weight_read_s
            bytes_ += p.bytes
            flops += p.flops
        secs = sum(s.wall_s for s in pre)
        tokens = sum(s.prefill_tokens for s in pre)
        rows = max(1, tokens // len(pre))
        bound = "compute" if flops / dev.rate(rows) >= bytes_ / (dev.stream_gbs * 1e9) else "memory"
        out.append(Phase("prefill", len(pre), secs, tokens, tokens / len(pre), bytes_, flops, pred, bound,
                         bytes_ / secs / (dev.mem_gbs * 1e9), flops / secs / dev.rate(rows), _kernel_share(m, "prefill")))
    return out


# ------------------------------------------------------------------ verdict


@dataclass
class Action:
    flag: str
    why: str
    predicted_gain: str


@dataclass
class Verdict:
    layer: str  # the limiting layer, e.g. "CPU pipeline: tokenization", "memory bandwidth"
    evidence: str
    actions: list[Action] = field(default_factory=list)


def _decode_gain(shape, dev, batch: int, ctx: int, other_shape=None, other_dev=None, other_batch=None) -> float:
    """Predicted decode tokens/s ratio of (other shape/device/batch) over the current one."""
    from strata.analyze import plan

    now = plan.decode_step(shape, dev, batch, ctx)
    alt = plan.decode_step(other_shape or shape, other_dev or dev, other_batch or batch, ctx)
    return (alt.batch / alt.kernel_s) / (now.batch / now.kernel_s)


def verdict(m: Measurement, cats: dict[str, float], ph: list[Phase], ctx: dict[str, Any]) -> Verdict:
    """ctx: shape, dev, profile, dtype, quantization, engine config fields the actions refer to."""
    wall = m.wall_s or 1e-9
    req = m.requests
    tok_share = cats["tokenize"] / wall
    if tok_share >= TOKENIZE_SHARE:
        return Verdict(
            "CPU pipeline: tokenization",
            f"tokenising the prompts took {cats['tokenize']:.2f} s, {tok_share:.0%} of the run's wall time",
            [Action("strata serve --tokenizer-workers N", "tokenise in worker processes, off the engine loop",
                    f"up to {1 / (1 - tok_share):.2f}x end to end (the tokenisation share overlaps with compute)"),
             Action("prompt_token_ids", "send token ids instead of text when the client can tokenise",
                    f"removes {tok_share:.0%} of wall time")],
        )
    e2e = [r.queue_s + r.prefill_s + r.decode_s for r in req]
    queue_share = sum(r.queue_s for r in req) / max(sum(e2e), 1e-9)
    if queue_share >= QUEUE_SHARE and m.max_running >= m.max_num_seqs:
        want = min(len(req), 64)
        dec = next((p for p in ph if p.name == "decode"), None)
        c = int(statistics.mean([s.decode_context // s.decode_seqs for s in m.steps if s.decode_seqs] or [128]))
        gain = _decode_gain(ctx["shape"], ctx["dev"], max(1, m.max_num_seqs), c, other_batch=want)
        return Verdict(
            "scheduling / queueing",
            f"requests spent {queue_share:.0%} of their latency waiting for admission while the running batch "
            f"was capped at max_num_seqs={m.max_num_seqs}"
            + (f" (decode ran at batch {dec.mean_batch:.1f})" if dec else ""),
            [Action(f"--max-num-seqs {want}", f"admit up to {want} sequences per step",
                    f"{gain:.1f}x decode tokens/s at batch {want} vs {m.max_num_seqs} (planner)")],
        )
    dominant = max(ph, key=lambda p: p.seconds) if ph else None
    overhead_share = (cats["overhead"] + cats["schedule"] + cats["sample"]) / wall
    if dominant is None or not dominant.roofline_bound:
        expl = (f"the {dominant.name} phase takes {dominant.seconds:.2f} s but its kernels explain only "
                f"{dominant.efficiency:.0%} of it ({dominant.kernel_share:.0%} of its forward time is in GEMM, "
                "attention and KV copies)" if dominant else "no model steps ran")
        return Verdict(
            "framework / host overhead (CPU pipeline)",
            f"{expl}; Python, dispatch, scheduling and sampling take {overhead_share:.0%} of wall time",
            [Action("--compile", "capture the step so the host stops paying per-operator dispatch",
                    f"up to {1 / max(1 - overhead_share, 1e-3):.2f}x if the host overhead went away"),
             Action(f"--max-num-seqs {max(2 * m.max_num_seqs, 2)} / more concurrent requests",
                    "amortise the fixed per-step cost over more sequences", "per-step cost is shared by the batch")],
        )
    if dominant.name == "decode" and dominant.bound == "memory":
        actions = []
        c = int(statistics.mean([s.decode_context // s.decode_seqs for s in m.steps if s.decode_seqs] or [128]))
        b = max(1, round(dominant.mean_batch))
        if ctx.get("quantization") is None and ctx.get("int8_dev") is not None:
            g = _decode_gain(ctx["shape"], ctx["dev"], b, c, ctx["int8_shape"], ctx["int8_dev"])
            actions.append(Action("--quantization int8", "stream a quarter of the fp32 weight bytes per token",
                                  f"{g:.1f}x decode tokens/s (planner)"))
        g = _decode_gain(ctx["shape"], ctx["dev"], b, c, other_batch=4 * b)
        actions.append(Action(f"--max-num-seqs >= {4 * b} with more concurrent requests",
                              "read each weight once for more sequences", f"{g:.1f}x tokens/s at batch {4 * b} (planner)"))
        return Verdict(
            "memory bandwidth",
            f"decode is {dominant.seconds / wall:.0%} of wall time at batch {dominant.mean_batch:.1f}; it moves "
            f"{dominant.bytes / dominant.seconds / 1e9:.1f} GB/s (MBU {dominant.mbu:.0%} of the measured DRAM "
            f"bandwidth); the bandwidth roofline explains {dominant.efficiency:.0%} of its time and "
            f"{dominant.kernel_share:.0%} of its forward time is in GEMM, attention and KV copies",
            actions,
        )
    actions = []
    prof = ctx.get("profile")
    if prof is not None and ctx.get("dtype") == "float32":
        fp32 = prof.gemm_gflops.get("float32", 0.0)
        bf16 = prof.gemm_gflops.get("bfloat16", 0.0)
        if fp32 and bf16 > 1.1 * fp32:
            actions.append(Action("--dtype bfloat16", "run the GEMMs at the faster measured bf16 rate",
                                  f"{bf16 / fp32:.1f}x GEMM FLOP/s (measured by strata hw)"))
    if not ctx.get("enable_prefix_caching", True):
        actions.append(Action("drop --no-prefix-caching", "skip recomputing shared prompt prefixes",
                              "prefill cost of the shared part goes to ~0"))
    actions.append(Action("shorter prompts / prefix caching", "prefill FLOPs grow with prompt tokens",
                          "linear in the tokens removed"))
    return Verdict(
        "compute" if dominant.name == "prefill" or dominant.bound == "compute" else "memory bandwidth",
        f"{dominant.name} is {dominant.seconds / wall:.0%} of wall time at {dominant.flops / dominant.seconds / 1e9:.0f} "
        f"GFLOP/s (MFU {dominant.mfu:.0%} of the measured GEMM rate); the compute roofline explains "
        f"{dominant.efficiency:.0%} of its time, {dominant.kernel_share:.0%} of its forward time is in GEMM and attention",
        actions[:3],
    )


# ------------------------------------------------------------------ the whole analysis


@dataclass
class Analysis:
    model: str
    workload: dict
    wall_s: float
    categories: dict[str, float]
    layers: dict[str, float]
    phases: list[Phase]
    top_ops: list[tuple[str, float]]
    requests: dict[str, Any]
    verdict: Verdict
    device: dict[str, Any]
    ttft_s: list[float]
    tpot_s: list[float]

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["phases"] = [{**asdict(p), "efficiency": p.efficiency, "intensity": p.intensity,
                        "roofline_bound": p.roofline_bound} for p in self.phases]
        return d


def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) if xs else float("nan")


def analyze_engine(engine, w: Workload, profile=None) -> Analysis:
    """Run `w` on `engine` and analyse it against this machine's measured roofline."""
    from strata.analyze import plan
    from strata.hardware.probe import probe

    profile = profile or probe(engine.config.device)
    quant = engine.config.quantization
    group = engine.config.quantization_group_size
    shape = plan.ModelShape.of(engine.model_config, engine.dtype, quant, group)
    dev = plan.this_device(profile, engine.dtype, quant)
    ctx: dict[str, Any] = {"shape": shape, "dev": dev, "profile": profile, "quantization": quant,
                           "dtype": str(engine.dtype).removeprefix("torch."),
                           "enable_prefix_caching": engine.config.enable_prefix_caching}
    if quant is None and engine.config.device == "cpu":
        try:
            ctx["int8_dev"] = plan.this_device(profile, engine.dtype, "int8")
            ctx["int8_shape"] = plan.ModelShape.of(engine.model_config, engine.dtype, "int8", group)
        except Exception:  # a profile without quantised rates: no int8 action
            ctx["int8_dev"] = None
    engine.warm_up()
    m = run_offline(engine, w)
    cats = attribute(m)
    ph = phases(m, shape, dev)
    layers: dict[str, float] = {}
    for cat, secs in cats.items():
        layers[LAYER_OF[cat]] = layers.get(LAYER_OF[cat], 0.0) + secs
    ttft = [r.ttft_s for r in m.requests]
    tpot = [r.tpot_s for r in m.requests if r.tpot_s is not None]
    reqs = {
        "count": len(m.requests),
        "mean_tokenize_s": statistics.mean(r.tokenize_s for r in m.requests),
        "mean_queue_s": statistics.mean(r.queue_s for r in m.requests),
        "mean_prefill_s": statistics.mean(r.prefill_s for r in m.requests),
        "mean_decode_s": statistics.mean(r.decode_s for r in m.requests),
        "ttft_p50_s": _pct(ttft, 50), "ttft_p99_s": _pct(ttft, 99),
        "tpot_p50_s": _pct(tpot, 50), "tpot_p99_s": _pct(tpot, 99),
        "output_tokens": sum(r.output_tokens for r in m.requests),
    }
    return Analysis(
        model=str(engine.model_path), workload=asdict(w), wall_s=m.wall_s, categories=cats, layers=layers,
        phases=ph, top_ops=m.top_ops, requests=reqs, verdict=verdict(m, cats, ph, ctx),
        device={"name": dev.name, "mem_gbs": dev.mem_gbs, "stream_gbs": dev.stream_gbs,
                "few_rows_gflops": dev.few_rows_gflops, "gemm_gflops": dev.gemm_gflops, "few_rows": dev.few_rows},
        ttft_s=ttft, tpot_s=tpot,
    )

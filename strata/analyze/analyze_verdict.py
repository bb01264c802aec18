"""Attribution and verdict of `strata analyze`: where the measured time went and what limits it.

attribute() splits a run's wall time into categories (CATEGORY_LABELS, summing to the wall time);
phases() compares each phase (prefill, decode) with the planner's kernel prediction for the same
batches (cost_model.py, from `strata hw`'s measured rates); verdict() names the limiting layer
and one to three actions, each with the flag and the gain the planner predicts. The thresholds
(TOKENIZE_SHARE, QUEUE_SHARE) are shared with the serve verdict (analyze_serve.py).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

from strata.analyze.analyze_run import Measurement
from strata.planner import cost_model

BOUND_EFFICIENCY = 0.45  # a phase whose roofline prediction explains this share of its time is bound by it
KERNEL_SHARE = 0.5  # ... or whose forward time is at least this much inside its GEMM/attention/KV kernels
TOKENIZE_SHARE = 0.25  # tokenisation above this share of wall time is the bottleneck
QUEUE_SHARE = 0.5  # requests waiting this share of their latency for a capped batch: scheduling
LOW_MBU = 0.3  # a "memory bandwidth" verdict below this share of the DRAM roof says why the share is low

CATEGORY_LABELS = {
    "tokenize": "tokenize", "schedule": "schedule", "sample": "sample + detokenize",
    "overhead": "batch prep + Python/dispatch", "gemm": "GEMM", "attention": "attention",
    "norm_elementwise": "norm + elementwise", "other_ops": "other operators", "memory": "KV writes + copies",
    "communication": "communication", "idle": "idle",
    "decoder_layer": "fused decoder layers (GEMV + attention + norms)",
    "lora": "LoRA adapters (shrink + expand)",
}
LAYER_OF = {
    "tokenize": "CPU pipeline", "schedule": "CPU pipeline", "sample": "CPU pipeline", "overhead": "CPU pipeline",
    "gemm": "compute", "attention": "compute", "norm_elementwise": "compute", "other_ops": "compute",
    "memory": "memory traffic", "communication": "communication", "idle": "idle", "decoder_layer": "compute",
    "lora": "compute",
}


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
    heavy = sum(ops.get(c, 0.0) for c in ("gemm", "attention", "memory", "decoder_layer"))
    return min(1.0, heavy / fwd) if fwd > 0 else 0.0


def phases(m: Measurement, shape, dev) -> list[Phase]:
    out = []
    dec = [s for s in m.steps if s.kind == "decode" and s.decode_seqs]
    if dec:
        pred = bytes_ = flops = 0.0
        bounds = []
        for s in dec:
            ctx = s.decode_context // s.decode_seqs
            st = cost_model.decode_step(shape, dev, s.decode_seqs, ctx)
            pred += st.kernel_s * s.steps  # (the context grows a token a step: a few % at most)
            bytes_ += st.bytes * s.steps
            flops += st.flops * s.steps
            bounds.append(st.bound)
        secs = sum(s.wall_s for s in dec)
        batch = statistics.mean(s.decode_seqs for s in dec)
        out.append(Phase("decode", sum(s.steps for s in dec), secs, sum(s.decode_seqs * s.steps for s in dec), batch,
                         bytes_, flops, pred,
                         max(set(bounds), key=bounds.count), bytes_ / secs / (dev.mem_gbs * 1e9),
                         flops / secs / dev.rate(round(batch)), _kernel_share(m, "decode")))
    pre = [s for s in m.steps if s.kind == "prefill"]
    if pre:
        pred = bytes_ = flops = 0.0
        for s in pre:
            p = cost_model.prefill(shape, dev, s.prefill_tokens, max(s.prefill_tokens, 1))
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
    now = cost_model.decode_step(shape, dev, batch, ctx)
    alt = cost_model.decode_step(other_shape or shape, other_dev or dev, other_batch or batch, ctx)
    return (alt.batch / alt.kernel_s) / (now.batch / now.kernel_s)


def memory_evidence(dominant: Phase, wall: float, dev) -> str:
    """Why decode counts as bandwidth-bound, and, when its MBU is low, why that is no contradiction."""
    text = (f"decode is {dominant.seconds / wall:.0%} of wall time at batch {dominant.mean_batch:.1f}; it moves "
            f"{dominant.bytes / dominant.seconds / 1e9:.1f} GB/s (MBU {dominant.mbu:.0%} of the measured DRAM "
            f"bandwidth); the bandwidth roofline explains {dominant.efficiency:.0%} of its time and "
            f"{dominant.kernel_share:.0%} of its forward time is in GEMM, attention and KV copies")
    if dominant.mbu >= LOW_MBU:
        return text
    if dominant.efficiency >= BOUND_EFFICIENCY:
        why = (f"the MBU is low because this machine's decode kernels stream weights at {dev.stream_gbs:.1f} GB/s "
               f"(strata hw), {dev.stream_gbs / dev.mem_gbs:.0%} of its {dev.mem_gbs:.1f} GB/s DRAM bandwidth: decode "
               "is limited by the rate the kernels can read memory, not by the DRAM peak")
    else:
        why = (f"the MBU is low because the memory-bound kernels hold {dominant.kernel_share:.0%} of the forward "
               f"time yet run below their measured rate (the roofline explains only {dominant.efficiency:.0%}): "
               "other work competing for the cores or the memory bus, or batches too small to hide the kernels' "
               "fixed costs; the host is not what limits it")
    return f"{text}; {why}"


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
        return Verdict("memory bandwidth", memory_evidence(dominant, wall, ctx["dev"]), actions)
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

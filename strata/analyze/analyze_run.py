"""The instrumented offline run of `strata analyze`: what each step and request took.

All requests arrive at once and LLMEngine steps until they finish, in this process. Per step:
wall, schedule, forward and sample seconds and what it computed; per request: tokenize, queue,
prefill and decode times; on one step in PROFILE_EVERY, torch.profiler's self time per operator,
classified (OP_CATEGORIES) into communication (tensor-parallel collectives), GEMM, attention, KV memory
traffic, norm/elementwise and other.
analyze_verdict.py attributes these figures; analyze.py runs the whole analysis.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from strata.bench.common import random_prompts, special_ids
from strata.bench.lora import write_adapters
from strata.errors import ConfigError
from strata.graph.lora import LORA_RANGE
from strata.kernels.profile import named_kernels, quiet_profile
from strata.protocol.sampling_params import SamplingParams
from strata.server.tokenizer_worker import tokenize

PROFILE_EVERY = 8  # one profiled step in this many (the profiler's per-operator cost stays out of the rest)

# operator name fragments -> category (first match wins; names are lower-cased)
OP_CATEGORIES: tuple[tuple[str, tuple[str, ...]], ...] = (  # first match wins
    # LoRA adapters' shrink + expand (graph/lora.py's strata::lora range, the eager path's kernel);
    # the ops inside a strata::lora range are moved here too (lora_inside)
    ("lora", (LORA_RANGE, "lora_add")),
    ("communication", ("c10d::", "gloo:", "nccl:", "allreduce", "all_reduce", "allgather", "all_gather",
                       "strata::comm")),
    # the CPU decode step's one-call layers (kernels/cpu_decode_layer.py): GEMVs, attention and
    # norms in one compiled call, so the profiler cannot split them
    ("decoder_layer", ("decode_layer",)),
    ("attention", ("attention", "scaled_dot_product", "sdpa", "softmax", "flash", "paged_decode")),
    ("memory", ("index_select", "index_copy", "index_put", "copy_", "kv_write", "write_kv", "swap",
                "clone", "contiguous", "gather", "scatter", "cat", "stack", "fill_", "zero_", "to_copy")),
    # (decode_head: the CPU decode step's LM head GEMV, with the final norm in the same call)
    ("gemm", ("mm", "linear", "matmul", "gemv", "bmm", "quant", "int8", "int4", "baddbmm", "einsum",
              "decode_head")),
    ("norm_elementwise", ("norm", "rsqrt", "silu", "swiglu", "mul", "add", "sub", "div", "neg", "exp", "pow",
                          "mean", "rope", "rotary", "sigmoid", "where", "masked", "embedding", "tanh", "sum")),
)


def lora_inside(events) -> tuple[float, dict[str, float]]:
    """(seconds inside strata::lora ranges, the self seconds of the operators under them by category):
    an adapter's GEMMs and copies are LoRA's time, not the base model's."""
    total, inside = 0.0, {}
    for ev in events:
        if ev.name != LORA_RANGE:
            continue
        total += ev.cpu_time_total / 1e6
        stack = list(ev.cpu_children)
        while stack:
            child = stack.pop()
            stack += child.cpu_children
            cat = classify(child.name)
            inside[cat] = inside.get(cat, 0.0) + child.self_cpu_time_total / 1e6
    return total, inside


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
    lora_adapters: int = 0  # requests take this many random adapters round robin (0: none)


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
    steps: int = 1  # decode steps the scheduler call ran (multi-step decode, platform/multi_step.py)


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


def _adapters(engine, w: Workload) -> list:
    """w.lora_adapters random adapters (rank max_lora_rank on every linear, bench lora's), known to
    the engine; none without."""
    if not w.lora_adapters:
        return []
    if engine.lora is None:
        raise ConfigError("--lora-adapters needs an engine with --enable-lora")
    loras = write_adapters(engine, w.lora_adapters, engine.config.max_lora_rank, "all", w.seed)
    for lora in loras:
        engine.add_lora(lora)
    return loras


def run_offline(engine, w: Workload, progress: bool = False) -> Measurement:
    """All requests arrive at once; the engine steps until they finish, instrumented.
    progress: a bar of finished requests on stderr (its updates are outside the timed steps)."""
    from tqdm.auto import tqdm

    rng = np.random.default_rng(w.seed + 1)
    outs = rng.integers(w.output_len[0], w.output_len[1] + 1, size=w.num_prompts).tolist()
    prompts = _prompts(engine, w)
    loras = _adapters(engine, w)
    t_start = time.perf_counter()
    tok_times, rids = [], []
    for i, ((text, ids), n_out) in enumerate(zip(prompts, outs)):
        t0 = time.perf_counter()
        if text is not None:
            ids = tokenize(engine.tokenizer, {"kind": "text", "text": text, "add_special_tokens": False})
        tok_times.append(time.perf_counter() - t0)
        params = SamplingParams(temperature=0.0, max_tokens=n_out, ignore_eos=True)
        lora = loras[i % len(loras)] if loras else None
        engine.validate(i, ids, params, lora_request=lora)
        rid = f"analyze-{i}"
        engine.add_request(rid, text, ids, params, lora_request=lora)
        rids.append(rid)
    tokenize_s = sum(tok_times)
    steps, finished = [], {}
    op_seconds: dict[str, dict[str, float]] = {"prefill": {}, "decode": {}}
    op_forward: dict[str, float] = {"prefill": 0.0, "decode": 0.0}
    op_totals: dict[str, float] = {}
    profiler_s = 0.0  # starting/stopping/reading the profiler: not the workload's time
    max_running = 0
    i = 0
    bar = tqdm(total=w.num_prompts, desc="requests", unit="req", disable=not progress, leave=False)
    while engine.has_unfinished():
        # profile one step in PROFILE_EVERY, plus the first step and the first after a phase change
        profiled = i % PROFILE_EVERY == 0 or (len(steps) >= 2 and steps[-1].kind != steps[-2].kind)
        before = dict(engine.stage_seconds)
        prof = None
        if profiled:
            t0 = time.perf_counter()
            named = named_kernels()  # numba kernels show up as numba::<kernel> operators
            named.__enter__()
            prof = quiet_profile(torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]))
            prof_result = prof.__enter__()
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
                         sum(s.seq.num_computed_tokens for s in decodes), profiled, out.num_steps)
        steps.append(rec)
        if prof is not None:
            t0 = time.perf_counter()
            prof.__exit__(None, None, None)
            named.__exit__(None, None, None)
            op_forward[kind] += rec.forward_s
            cats = op_seconds[kind]
            for ev in prof_result.key_averages():
                secs = ev.self_cpu_time_total / 1e6
                if secs > 0:
                    cat = classify(ev.key)
                    cats[cat] = cats.get(cat, 0.0) + secs
                    op_totals[ev.key] = op_totals.get(ev.key, 0.0) + secs
            if loras:  # the adapters' ranges
                _, inside = lora_inside(prof_result.events())
                for cat, secs in inside.items():  # the adapters' own ops, out of the base's categories
                    moved = min(secs, cats.get(cat, 0.0))
                    cats[cat] = cats.get(cat, 0.0) - moved
                    cats["lora"] = cats.get("lora", 0.0) + moved
            profiler_s += time.perf_counter() - t0
        max_running = max(max_running, len(engine.scheduler.running))
        for o in outputs:
            if o.finished:
                finished[o.request_id] = o
                t0 = time.perf_counter()
                bar.update(1)
                profiler_s += time.perf_counter() - t0  # not the workload's time either
        i += 1
    bar.close()
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

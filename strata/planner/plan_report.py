"""Text and self-contained HTML renderings of a `strata plan` (plan.py)."""

from __future__ import annotations

from html import escape

from strata.graph.loader import STAGING_BYTES
from strata.planner import charts
from strata.planner.lora_cost import format_lines as lora_format_lines
from strata.planner.plan import Plan
from strata.text_table import fmt_bytes

ACT_FORMULA = ("max_num_batched_tokens x (2 x hidden + qkv width + 3 x intermediate) x bytes "
               "+ min(max_num_seqs, max_num_batched_tokens) x vocab x 4 (fp32 logits)")


def _ms(s: float) -> str:
    return f"{s * 1e3:,.2f}"


def _flops(gflops: float) -> str:
    return f"{gflops / 1e3:,.1f} TFLOP/s" if gflops >= 1e4 else f"{gflops:,.1f} GFLOP/s"


def _rates_line(p: Plan) -> str:
    d = p.device
    kind = "measured" if d.measured else "datasheet peak"
    few = f", <= {d.few_rows}-row kernel {_flops(d.few_rows_gflops)}" if d.few_rows else ""
    return (f"rates ({kind}): weights streamed {d.stream_gbs:,.1f} GB/s, memory {d.mem_gbs:,.1f} GB/s"
            f"{few}, GEMM {_flops(d.gemm_gflops)}, attention {_flops(d.attn_gflops or d.gemm_gflops)}")


def _params(p: Plan) -> str:
    if p.moe is None:
        return f"{p.params / 1e6:,.1f}M params"
    return f"{p.params / 1e9:,.2f}B params stored, {p.active_params / 1e9:,.2f}B active per token"


def header(p: Plan) -> list[str]:
    q = f", {p.quantization} weights" if p.quantization else ""
    kv = f", KV cache {p.kv_cache_dtype}" if p.kv_cache_dtype and p.kv_cache_dtype != p.dtype else ""
    count = f" x{p.device.count}" if p.device.count > 1 else ""
    return [
        f"strata plan: {p.model} ({p.architecture}, {_params(p)}) on {p.device.name}{count}, "
        f"{p.dtype}{q}{kv}",
        "  " + _rates_line(p),
        f"  max_model_len L={p.max_model_len}, prefill prompt {p.input_len} tokens, decode context {p.context}",
    ]


def memory_lines(p: Plan) -> list[str]:
    m = p.memory
    lines = [
        "Memory (per device)",
        f"  total          {fmt_bytes(m.total_bytes)}",
        f"  weights        {fmt_bytes(m.weight_bytes)}"
        + (f" (every expert: {p.params / 1e9:,.2f}B params, the routed experts {fmt_bytes(p.moe['expert_bytes'])} "
           "of it)" if p.moe else ""),
        f"  load peak      {fmt_bytes(m.load_peak_bytes)} (the final weights + {fmt_bytes(STAGING_BYTES)} of read "
        "staging: the loader converts each tensor as it reads it, never a float copy)",
        f"  KV cache       {fmt_bytes(m.kv_cache_bytes)} = {m.num_blocks} blocks x {m.block_size} = "
        f"{m.kv_tokens:,} tokens  (budget {fmt_bytes(m.kv_budget_bytes)}: {m.kv_budget_source})",
        f"    per token    {fmt_bytes(m.kv_per_token)}; per sequence at L={p.max_model_len}: "
        f"{fmt_bytes(m.kv_per_sequence)}",
        f"  activations    {fmt_bytes(m.activation_bytes)} (estimate: {ACT_FORMULA})",
        f"  free           {fmt_bytes(m.free_bytes)}",
        f"  max concurrent sequences at L={p.max_model_len}: {m.max_sequences:,}",
    ]
    if m.error:
        lines.append(f"  DOES NOT FIT: {m.error}")
    return lines


def prefill_lines(p: Plan) -> list[str]:
    f = p.prefill
    chunks = f" in {f.chunks} chunks" if f.chunks > 1 else ""
    return [
        f"Prefill of a {f.tokens}-token prompt{chunks}: {_ms(f.total_s)} ms "
        f"({f.tokens / f.total_s:,.0f} tok/s; TTFT floor)",
        f"  = {f.flops / 1e9:,.1f} GFLOP in {_ms(f.compute_s)} ms (attention {_ms(f.attention_s)} ms of it)"
        + (f"  + elementwise {_ms(f.elementwise_s)} ms" if f.elementwise_s else "")
        + f"  + {'lm_head' if f.source == 'layer probe' else 'weight'} read {_ms(f.weight_read_s)} ms"
        + (f"  + overhead {_ms(f.overhead_s)} ms" if f.overhead_s else "")
        + (f"  + all-reduce {_ms(f.comm_s)} ms" if f.comm_s else "")
        + (f"  + MoE routing {_ms(f.routing_s)} ms" if f.routing_s else ""),
    ] + (["  (projections, attention and elementwise: one layer of this model timed on this device "
          "at the prompt's chunk length, times the layer count; planner/layer_probe.py)"]
         if f.source == "layer probe" else [])


def decode_lines(p: Plan) -> list[str]:
    lines = [f"Decode (one step = one token per sequence), context {p.context}",
             "  batch  roofline ms  predicted ms  (kernels + overhead)  tok/s total  bound     fits"]
    per_seq = -(-p.context // p.memory.block_size)
    for s in p.steps:
        fits = "yes" if s.batch * per_seq <= p.memory.num_blocks else "no"
        lines.append(
            f"  {s.batch:5d}  {_ms(s.roofline_s):>11}  {_ms(s.total_s):>12}  "
            f"({_ms(s.kernel_s)} + {_ms(s.overhead_s)})".ljust(60)
            + f"  {s.tokens_per_s:11,.1f}  {s.bound:8}  {fits}"
        )
    if p.crossover is None:
        lines.append("  decode never turns compute-bound at this context (KV bytes grow as fast as FLOPs)")
    else:
        lines.append(f"  decode turns compute-bound at batch ~{p.crossover:.1f} (roofline crossover)")
    return lines


def depth_lines(p: Plan) -> list[str]:
    """Batch-1 decode by depth: the weights read once a token, the KV read growing with the context."""
    if not p.depth_curve:
        return []
    lines = ["Decode by context depth (batch 1; per token: weights + KV read at that depth)",
             "  depth     weights read  KV read      predicted ms  tok/s    attention priced by"]
    for s in p.depth_curve:
        lines.append(f"  {s.context:8,d}  {fmt_bytes(s.bytes - s.kv_bytes):>11}  {fmt_bytes(s.kv_bytes):>11}  "
                     f"{_ms(s.total_s):>12}  {s.tokens_per_s:7,.1f}  {s.attention if s.kv_bytes else '-'}")
    return lines


def moe_lines(p: Plan) -> list[str]:
    """Total vs active, the distinct experts a batch reads, the routing and what priced it."""
    if p.moe is None:
        return []
    m = p.moe
    routing = ("inside the decode probe's layer times (moe_probe's figure prices the rates path)"
               if m["routing_in_probe"] else "added to the decode step")
    lines = [
        f"Mixture of experts: {m['num_experts']} experts, top {m['top_k']} a token, {m['moe_layers']} of "
        f"{m['layers']} layers sparse",
        f"  parameters     {p.params / 1e9:,.2f}B stored (every expert, held in memory) vs "
        f"{p.active_params / 1e9:,.2f}B active per token (top_k experts + attention + embeddings)",
        f"  one expert     {fmt_bytes(m['one_expert_bytes'])} a layer; every step reads "
        f"{fmt_bytes(m['dense_stream_bytes'])} of non-expert weights",
        "  a batch of b tokens reads E x (1 - (1 - k/E)^b) distinct experts per MoE layer (uniform routing)",
        f"  routing        {m['routing_fixed_s'] * 1e6:,.1f} us a layer + {m['routing_per_expert_s'] * 1e6:,.1f} us "
        f"an expert visited ({m['routing_source']}); {routing}",
        "  batch  experts/layer  weights read  routing ms",
    ]
    for s in p.steps:
        cost = "in probe" if m["routing_in_probe"] else _ms(s.routing_s)
        lines.append(f"  {s.batch:5d}  {s.experts:13,.1f}  {fmt_bytes(s.bytes - s.kv_bytes):>12}  {cost:>10}")
    return lines


def ep_lines(p: Plan) -> list[str]:
    """An MoE model over several devices: expert parallel, its exchanges priced (the TP options)."""
    if p.device.count <= 1:
        return ["Expert parallel: one device here, nothing to split (--hardware thisxN or NAMExN prices EP)"]
    d = p.device
    sources = sorted({o.ep_comm_source for o in p.tp_options if o.tp > 1})
    lines = [
        f"Expert parallel over {d.count} devices ({d.link}, {d.link_gbs:,.0f} GB/s per direction, alpha "
        f"{d.alpha_s * 1e6:g} us; the engine's --tensor-parallel-size N --enable-expert-parallel): attention split "
        "by heads (1 all-reduce a layer), E/EP experts a device; per MoE layer 2 all-to-alls (dispatch, combine) "
        "of ceil(batch/EP) x top_k x hidden x bytes a rank + 1 all-gather of the slices",
        "  all-to-all priced by: " + ("; ".join(sources) if sources else "-"),
        "  EP  replicas  experts/dev  weights/dev  KV tokens/dev  a2a bytes/rank  a2a+gather us  all-reduce us  "
        "TPOT ms (b=1)  best batch  tok/s (all)  $/M tok",
    ]
    for o in p.tp_options:
        cost = f"{o.cost_per_mtok:,.3f}" if o.cost_per_mtok is not None else "-"
        fit = "" if o.memory.fits else "  (does not fit)"
        lines.append(
            f"  {o.tp:2d}  {o.replicas:8d}  {o.experts_per_device:11d}  {fmt_bytes(o.memory.weight_bytes):>11}  "
            f"{o.memory.kv_tokens:13,}  {o.a2a_bytes_per_rank:14,}  {o.ep_comm_s * 1e6:13.1f}  "
            f"{min(o.comm_ring_s, o.comm_tree_s) * 1e6:13.1f}  {o.tpot_s * 1e3:13.2f}  {o.best_batch:10d}  "
            f"{o.best_tokens_per_s:11,.0f}  {cost:>7}{fit}")
    return lines


def tp_lines(p: Plan) -> list[str]:
    if p.moe is not None:  # split over devices, an MoE model is expert parallel
        return ep_lines(p)
    if p.device.count <= 1:
        return []
    d = p.device
    lines = [
        f"Tensor parallel over {d.count} devices ({d.link}, {d.link_gbs:,.0f} GB/s per direction, "
        f"alpha {d.alpha_s * 1e6:g} us): 2 all-reduces per layer of hidden x {p.dtype} bytes x batch",
        "  (comm = the 2 x layers all-reduces of one decode step at batch 1; TPOT = decode step / TP + comm)",
        "  TP  replicas  weights/dev  KV tokens/dev  AR bytes/token  comm ring us  comm tree us  "
        "TPOT ms (b=1)  best batch  tok/s (all)  $/M tok",
    ]
    for o in p.tp_options:
        cost = f"{o.cost_per_mtok:,.3f}" if o.cost_per_mtok is not None else "-"
        fit = "" if o.memory.fits else "  (does not fit)"
        lines.append(
            f"  {o.tp:2d}  {o.replicas:8d}  {fmt_bytes(o.memory.weight_bytes):>11}  {o.memory.kv_tokens:13,}  "
            f"{o.comm_bytes_per_token:14,}  {o.comm_ring_s * 1e6:12.1f}  {o.comm_tree_s * 1e6:12.1f}  "
            f"{o.tpot_s * 1e3:13.2f}  {o.best_batch:10d}  {o.best_tokens_per_s:11,.0f}  {cost:>7}{fit}"
        )
    return lines


def cost_lines(p: Plan) -> list[str]:
    if p.best is None:
        return ["Best configuration: none fits"]
    b = p.best
    split = "EP" if p.moe is not None else "TP"  # an MoE model splits as expert parallel
    line = (f"Best throughput: {split}={b['tp']} x {b['replicas']} replica(s), batch {b['batch']}: "
            f"{b['tokens_per_s']:,.1f} output tok/s")
    if b["cost_per_mtok"] is not None:
        line += f"; at ${p.price_per_hour:g}/hour: ${b['cost_per_mtok']:,.3f} per million output tokens"
    return [line]


def lora_lines(p: Plan) -> list[str]:
    return [] if p.lora is None else lora_format_lines(p.lora)


def format_text(p: Plan) -> str:
    parts = [header(p), memory_lines(p), prefill_lines(p), decode_lines(p), depth_lines(p), moe_lines(p),
             lora_lines(p), tp_lines(p), cost_lines(p)]
    if p.overhead is not None and getattr(p.overhead, "measured", None):
        o = p.overhead
        parts.append([
            "Step overhead (measured on the engine with tiny models, calibrate.py): "
            + ", ".join(f"batch {b}: {s * 1e3:.2f} ms + {pl * 1e3:.3f} ms/layer"
                        for b, s, pl in zip(o.batches, o.per_step_s, o.per_layer_s))
        ])
    if p.notes:
        parts.append(["Notes"] + [f"  - {n}" for n in p.notes])
    return "\n\n".join("\n".join(x) for x in parts if x)


def roofline_svg(p: Plan) -> str:
    d = p.device
    ceilings = [(f"GEMM {p.dtype} {_flops(d.gemm_gflops)}", d.gemm_gflops * 1e9)]
    if d.few_rows:
        ceilings.append((f"<= {d.few_rows}-row kernel {_flops(d.few_rows_gflops)}", d.few_rows_gflops * 1e9))
    bandwidths = [(f"weights streamed {d.stream_gbs:,.1f} GB/s", d.stream_gbs * 1e9)]
    if abs(d.mem_gbs - d.stream_gbs) > 1e-6:
        bandwidths.append((f"memory {d.mem_gbs:,.1f} GB/s", d.mem_gbs * 1e9))
    points = [(f"decode b={s.batch}", s.intensity, s.flops / s.total_s) for s in p.steps]
    f = p.prefill
    points.append((f"prefill {f.tokens}", f.intensity, f.flops / f.total_s))
    return charts.roofline(ceilings, bandwidths, points, title=f"Roofline: {p.model} on {d.name}")


def memory_svg(p: Plan) -> str:
    m = p.memory
    segs = [("weights", m.weight_bytes), ("KV cache", m.kv_cache_bytes), ("activations", m.activation_bytes),
            ("free", max(0, m.free_bytes))]
    return charts.stacked_bar(segs, total=max(m.total_bytes, sum(v for _, v in segs)),
                           title=f"Memory per device ({fmt_bytes(m.total_bytes)})", fmt=fmt_bytes)


def format_html(p: Plan) -> str:
    def pre(lines: list[str]) -> str:
        return f"<pre>{escape(chr(10).join(lines))}</pre>"

    body = [
        f"<h1>strata plan: {escape(p.model)} on {escape(p.device.name)}</h1>",
        pre(header(p)),
        "<h2>Memory</h2>", memory_svg(p), pre(memory_lines(p)),
        "<h2>Roofline</h2>", roofline_svg(p), pre(prefill_lines(p)), pre(decode_lines(p)),
    ]
    if p.depth_curve:
        body.append(pre(depth_lines(p)))
    if p.moe is not None:
        body += ["<h2>Mixture of experts</h2>", pre(moe_lines(p) + [""] + ep_lines(p))]
    elif p.device.count > 1:
        body += ["<h2>Tensor parallel</h2>", pre(tp_lines(p))]
    body += ["<h2>Cost</h2>", pre(cost_lines(p))]
    if p.notes:
        body += ["<h2>Notes</h2>", "<ul>" + "".join(f"<li>{escape(n)}</li>" for n in p.notes) + "</ul>"]
    return (
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
        f"<title>strata plan: {escape(p.model)}</title>\n"
        "<style>body{font-family:sans-serif;max-width:980px;margin:2em auto;padding:0 1em}"
        "pre{background:#f7f7f7;padding:.6em;overflow-x:auto;font-size:12px}</style>\n"
        "</head>\n<body>\n" + "\n".join(body) + "\n</body>\n</html>\n"
    )

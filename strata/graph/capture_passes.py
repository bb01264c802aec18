"""FX lowering of the fused decode step for torch.compile (the runtime is graph/capture.py).

The model's own forward cannot be compiled in one piece on CPU: its decode path calls numba
kernels, which dynamo cannot trace (a graph break at every kernel call). What is compiled is the
FX-traced step of graph/fusion.py with the fusion passes of COMPILE_PATTERNS, lowered so that every
numba kernel is an opaque torch.library op (graph/fused_ops.py): projections -> strata::linear,
decode attention -> strata::paged_decode, the KV write -> strata::kv_write, and on CPU the eager
decode's hand-fused kernels where the graph has their pattern (strata::linear_swiglu,
strata::rope_store); dynamo then captures the whole step as one graph, and inductor generates code
for the rest. Quantised projections (QuantLinear) are not opaque ops yet, so EngineConfig refuses
compile with quantization.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch import Tensor

from strata.errors import ConfigError
from strata.graph.fusion import dce, fuse_model
from strata.graph.layers import Linear
from strata.kernels.attention import AttentionMetadata, attend_cached


def _decode_attention(q: Tensor, kv_cache: Tensor, meta: AttentionMetadata, scale: float) -> Tensor:
    """The compiled step's attention: all-decode, so the prefill branch of attend_cached is gone."""
    return torch.ops.strata.paged_decode.default(
        q, kv_cache, meta.decode_block_tables, meta.decode_context_lens, meta.decode_mask, scale, meta.backend.name
    )


def _slice_of(n, source: fx.Node, index: tuple) -> bool:
    return (
        isinstance(n, fx.Node) and n.op == "call_function" and n.target is operator.getitem
        and n.args[0] is source and n.args[1] == index
    )


def _rope_store_pass(graph: fx.Graph) -> int:
    """rotary_qk of q|k views of the qkv projection + kv_write of the rotated k and the v view
    -> strata::rope_store (the eager decode's numba rotary + KV-write kernel). Needs the decode-only
    attention first, so that rotated k and v feed nothing but the cache write."""
    rot, write = torch.ops.strata.rotary_qk.default, torch.ops.strata.kv_write.default
    done = 0
    for kw in [n for n in graph.nodes if n.op == "call_function" and n.target is write]:
        cache, k, v, slots = kw.args
        if not (k.op == "call_function" and k.target is operator.getitem and k.args[1] == 1):
            continue
        rq = k.args[0]
        if not (rq.op == "call_function" and rq.target is rot) or len(k.users) != 1 or len(v.users) != 1:
            continue
        q_in, k_in, cos, sin = rq.args
        qk = q_in.args[0] if q_in.op == "call_function" and q_in.target is operator.getitem else None
        if qk is None or not (qk.op == "call_method" and qk.target == "view" and len(qk.args) == 4):
            continue
        heads_kv, dim = qk.args[2], qk.args[3]
        heads = q_in.args[1][1].stop if isinstance(q_in.args[1], tuple) and len(q_in.args[1]) == 3 else None
        if not isinstance(heads, int):
            continue
        full = slice(None, None, None)
        if not (_slice_of(q_in, qk, (Ellipsis, slice(None, heads, None), full))
                and _slice_of(k_in, qk, (Ellipsis, slice(heads, None, None), full))):
            continue
        qk_src = qk.args[0]
        kv_heads = heads_kv - heads
        if not (qk_src.op == "call_function" and qk_src.target is operator.getitem):
            continue
        qkv = qk_src.args[0]
        width = heads_kv * dim
        if not (_slice_of(qk_src, qkv, (Ellipsis, slice(None, width, None)))
                and v.op == "call_method" and v.target == "view" and v.args[2:] == (kv_heads, dim)
                and _slice_of(v.args[0], qkv, (Ellipsis, slice(width, None, None)))):
            continue
        q_out = [u for u in rq.users if u is not k]
        with graph.inserting_before(kw):
            q_new = graph.call_function(
                torch.ops.strata.rope_store.default, (qkv, cos, sin, cache, slots, heads, kv_heads)
            )
        for u in q_out:  # getitem(rq, 0)
            u.replace_all_uses_with(q_new)
            graph.erase_node(u)
        graph.erase_node(kw)
        graph.erase_node(k)
        graph.erase_node(rq)
        done += 1
    return done


def _swiglu_pass(graph: fx.Graph) -> int:
    """strata::linear of the gate/up weight (no bias) followed by silu_mul -> strata::linear_swiglu
    (the eager decode's numba GEMV with its SwiGLU epilogue)."""
    lin, silu = torch.ops.strata.linear.default, torch.ops.strata.silu_mul.default
    done = 0
    for n in [n for n in graph.nodes if n.op == "call_function" and n.target is silu]:
        p = n.args[0]
        if p.op == "call_function" and p.target is lin and p.args[2] is None and len(p.users) == 1:
            with graph.inserting_before(n):
                new = graph.call_function(torch.ops.strata.linear_swiglu.default, (p.args[0], p.args[1]))
            n.replace_all_uses_with(new)
            graph.erase_node(n)
            graph.erase_node(p)
            done += 1
    return done


def lower_for_compile(gm: fx.GraphModule, device_type: str = "cpu") -> fx.GraphModule:
    """A decode-only copy of a traced step whose kernels are all opaque ops for dynamo:

    - dense projections -> strata::linear (the numba GEMV inside is not traceable);
    - attend_cached -> strata::paged_decode (the step is all-decode: no prefill branch);
    - on CPU, the eager decode's hand-fused kernels where the fused graph has their pattern:
      linear + silu_mul -> strata::linear_swiglu, rotary_qk + kv_write -> strata::rope_store.

    Shares the original's modules and parameters."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    for n in list(graph.nodes):
        if n.op == "call_module" and type(gm.get_submodule(n.target)) is Linear:  # not QuantLinear & co.
            mod = gm.get_submodule(n.target)
            with graph.inserting_before(n):
                w = graph.get_attr(f"{n.target}.weight")
                b = graph.get_attr(f"{n.target}.bias") if mod.bias is not None else None
                new = graph.call_function(torch.ops.strata.linear.default, (n.args[0], w, b))
        elif n.op == "call_function" and n.target is attend_cached:
            if len(n.args) > 6 or "window" in n.kwargs:
                raise ConfigError(
                    "--compile: the compiled decode step (strata::paged_decode) has no sliding-window "
                    "attention and this model has windowed layers; run without --compile (the eager step "
                    "and --fuse honour the window)"
                )
            q, _k, _v, kv_cache, meta, scale = n.args
            with graph.inserting_before(n):
                new = graph.call_function(_decode_attention, (q, kv_cache, meta, scale))
        else:
            continue
        n.replace_all_uses_with(new)
        graph.erase_node(n)
    if device_type == "cpu":
        dce(graph)
        _swiglu_pass(graph)
        _rope_store_pass(graph)
    dce(graph)
    graph.lint()
    return fx.GraphModule(gm, graph, "CompiledDecodeStep")


# Fusion passes in the compiled step. kv_write is always one: the cache write is an in-place
# update of a graph input, which dynamo would otherwise functionalise. On CPU the other patterns
# are left to inductor, which fuses each into one C++ loop: measured faster than calling the
# custom ops, whose CPU bodies are the torch references plus ~9 us of dispatch each (see
# docs/design-notes.md). On CUDA the custom ops carry the Triton kernels.
COMPILE_PATTERNS: dict[str, tuple[str, ...]] = {
    "cpu": ("add_rms_norm", "silu_mul", "rotary_qk", "kv_write"),
    "cuda": ("add_rms_norm", "silu_mul", "rotary_qk", "kv_write"),
}


def compiled_step(model, device_type: str) -> fx.GraphModule:
    """The graph torch.compile gets: the traced step with the compile fusion passes, lowered."""
    return lower_for_compile(fuse_model(model, COMPILE_PATTERNS[device_type]).graph_module, device_type)

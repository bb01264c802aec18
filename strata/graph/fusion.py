"""FX fusion passes: trace the decoder's step, find its small-op patterns, replace each by one op.

What is traced
--------------
The model's own `CausalLM.forward` (graph/models/llama.py), whole, on the engine's path: attention
metadata present and tokens flattened to [T, ...]. Nothing is patched for this (beyond what
torch.fx's tracer itself does, see the gate below); tracing relies on:

- Leaves. Projections (Linear, QuantLinear), embeddings and the rotary table lookup stay
  call_module leaves (their forward is kernel dispatch). Attention over the paged cache is one leaf
  function, `attention.attend_cached` (torch.fx.wrap in the model's module), because its
  prefill/decode split is Python control flow over the metadata; the model calls the KV-cache write
  (`attention.write_kv`) in front of it itself, and that is traced, so the passes see it.
- Reference paths. The hand-placed CPU kernels are chosen at run time from shapes and dtypes
  (cpu_gemv.few_fp32_rows, the cpu backend's fused decode, the quantised SwiGLU epilogue). The trace
  runs under kernels/dispatch.reference_kernels(): in this thread's context only, every such
  predicate answers False before it looks at its (Proxy) arguments, so the graph holds the torch
  reference ops that the patterns describe. The fused ops choose their kernel at run time themselves.
- Static facts. `x.dtype == torch.float32` (RMSNorm's branch) is answered with the model's dtype, so
  the graph is specialised to it, and `*qkv.shape[:-1]` unpacks to one leading dimension (the
  engine's [T] tokens). Anything else that needs a value raises a TraceError naming it.
- The trace gate. torch.fx's tracer patches torch.nn.Module.__call__ process-wide while it traces
  (the model's trace, and each pattern's), so tracing and rewriting hold graph/trace_gate.TRACE_GATE
  exclusively; forwards (CausalLM.forward, FusedStep.__call__) hold it shared, so a forward in
  another thread waits for the trace, or the trace for it, instead of being recorded into it.

Passes (torch.fx.subgraph_rewriter; literals, slices included, are re-checked by a filter)
--------------------------------------------------------------------------------------------
  add_rms_norm  x + residual, then RMSNorm          -> strata::add_rms_norm
  silu_mul      silu(gate_up[..., :I]) * gate_up[..., I:]   -> strata::silu_mul
  rotary_qk     rotate-half rotary of q and of k     -> strata::rotary_qk. Llama, Mistral and Qwen2
                                                        rotate q and k as one [T, h + kvh, d] view
                                                        and then split it (one pattern); Qwen3
                                                        rotates them separately after its q/k
                                                        norms (each rotation is rewritten, then the
                                                        two of a layer are paired into one op)
  kv_write      k and v index_copy_ into the cache   -> strata::kv_write

For a model of L layers the counts are fixed by its structure (`expected_counts`): add_rms_norm 2L
(every layer's post-attention norm, the input norm of layers 1..L-1 - layer 0's has no residual to
add - and the final norm), and L of each of the others. Qwen3's q/k norms have no add and stay
plain RMSNorm.

The patterns and their replacements are in graph/fusion_patterns.py; the fused ops themselves
(strata::add_rms_norm, silu_mul, rotary_qk, kv_write, and the kernel wrappers that keep the
compiled step opaque) in graph/fused_ops.py.
"""

from __future__ import annotations

import functools
import logging
import operator
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch import Tensor, nn
from torch.fx.subgraph_rewriter import replace_pattern_with_filters

from strata.errors import ConfigError
from strata.graph.fused_ops import register_gpu_kernels
from strata.graph.fusion_patterns import (
    ANY_EPS,
    joint_rotary_pattern,
    joint_rotary_replacement,
    kv_pattern,
    kv_replacement,
    norm_pattern_fp32,
    norm_pattern_lowp,
    norm_replacement,
    rotary_pattern,
    rotary_replacement,
    rotate_one,
    silu_pattern,
    silu_replacement,
)
from strata.graph.layers import GatedMLP, RMSNorm
from strata.graph.models.llama import Attention, CausalLM, DecoderLayer
from strata.graph.trace_gate import TRACE_GATE
from strata.kernels.attention import AttentionMetadata
from strata.kernels.dispatch import reference_kernels

logger = logging.getLogger(__name__)

PATTERNS = ("add_rms_norm", "silu_mul", "rotary_qk", "kv_write")
__all__ = ["PATTERNS", "FusedStep", "StepTracer", "dce", "expected_counts", "fuse_graph", "fuse_model",
           "rotate_one", "trace_model"]


# --- tracing -------------------------------------------------------------------------------------


_TRACED_THROUGH = (CausalLM, DecoderLayer, Attention, GatedMLP, RMSNorm, nn.ModuleList)


def _is_lead_shape(n: fx.Node) -> bool:
    """`x.shape[:-1]`: the leading dims of a row tensor."""
    return (
        n.op == "call_function" and n.target is operator.getitem and n.args[1] == slice(None, -1, None)
        and isinstance(n.args[0], fx.Node) and n.args[0].target is getattr and n.args[0].args[1] == "shape"
    )


class _StepProxy(fx.Proxy):
    def __len__(self) -> int:
        if _is_lead_shape(self.node):
            return 1  # the engine's tokens are flattened: [T, features]
        return super().__len__()


class StepTracer(fx.Tracer):
    """fx.Tracer for the engine's step: structure modules traced through, kernels as leaves."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype

    def proxy(self, node: fx.Node) -> fx.Proxy:
        return _StepProxy(node, self)

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return not isinstance(m, _TRACED_THROUGH)

    def to_bool(self, obj: fx.Proxy) -> bool:
        n = obj.node
        if (
            n.op == "call_function" and n.target in (operator.eq, operator.ne)
            and isinstance(n.args[0], fx.Node) and n.args[0].target is getattr
            and n.args[0].args[1] == "dtype" and isinstance(n.args[1], torch.dtype)
        ):
            same = self.dtype == n.args[1]
            return same if n.target is operator.eq else not same
        raise fx.proxy.TraceError(
            f"fusion tracer: cannot decide `{n.format_node()}` without values; only comparisons of "
            "an activation's dtype are answered (with the model's dtype)"
        )

    def iter(self, obj: fx.Proxy) -> Iterator:
        if _is_lead_shape(obj.node):
            return iter([obj[0]])  # x.shape[:-1] of the engine's flattened [T, features] rows
        return super().iter(obj)


def trace_model(model: CausalLM) -> fx.GraphModule:
    """The engine step of `model` as an FX graph (reference torch ops; see the module docstring).

    Waits for forwards running in other threads, and they for it (the trace gate)."""
    dtype = model.norm.weight.dtype
    tracer = StepTracer(dtype)
    with TRACE_GATE.exclusive(), reference_kernels():
        graph = tracer.trace(model)
    gm = fx.GraphModule(tracer.root, graph, "TracedStep")
    dce(gm.graph)
    _cse_getitems(gm.graph)
    gm.recompile()
    return gm


# --- graph hygiene ---------------------------------------------------------------------------------

_PURE_FUNCTIONS = {getattr, slice, operator.getitem, operator.eq, operator.ne, operator.floordiv, operator.neg}


def dce(graph: fx.Graph) -> None:
    """Drop unused nodes that are known to be pure (the traced dtype checks, shape arithmetic)."""
    changed = True
    while changed:
        changed = False
        for n in reversed(graph.nodes):
            if n.users:
                continue
            if n.op == "get_attr" or (n.op == "call_function" and n.target in _PURE_FUNCTIONS) or (
                n.op == "call_method" and n.target in ("view", "size", "dim")
            ):
                graph.erase_node(n)
                changed = True


def _cse_getitems(graph: fx.Graph) -> None:
    """One node per `rope[i]` / `kv_caches[i]` (indexing an input or a leaf's tuple output)."""
    seen: dict[tuple, fx.Node] = {}
    for n in list(graph.nodes):
        if n.op == "call_function" and n.target is operator.getitem and isinstance(n.args[0], fx.Node) \
                and n.args[0].op in ("placeholder", "call_module") and isinstance(n.args[1], int):
            key = (n.args[0], n.args[1])
            if key in seen:
                n.replace_all_uses_with(seen[key])
                graph.erase_node(n)
            else:
                seen[key] = n


# --- the passes --------------------------------------------------------------------------------------

def _same_literal(p, g, nodes_map: dict, wildcards: tuple) -> bool:
    """Pattern argument `p` equals graph argument `g`: literals by value (inside slices and
    tuples too), nodes by the match, or structurally for nodes the matcher never visited (the
    operands of a slice)."""
    if isinstance(p, fx.Node):
        if not isinstance(g, fx.Node):
            return p.op == "placeholder"
        if p in nodes_map:
            return nodes_map[p] is g
        return (
            p.op == g.op and p.target == g.target and len(p.args) == len(g.args)
            and all(_same_literal(a, b, nodes_map, wildcards) for a, b in zip(p.args, g.args))
            and p.kwargs.keys() == g.kwargs.keys()
            and all(_same_literal(p.kwargs[k], g.kwargs[k], nodes_map, wildcards) for k in p.kwargs)
        )
    if isinstance(p, slice):
        return isinstance(g, slice) and all(
            _same_literal(a, b, nodes_map, wildcards)
            for a, b in ((p.start, g.start), (p.stop, g.stop), (p.step, g.step))
        )
    if isinstance(p, list | tuple):
        return isinstance(g, list | tuple) and len(p) == len(g) and all(
            _same_literal(a, b, nodes_map, wildcards) for a, b in zip(p, g)
        )
    if isinstance(p, float) and p in wildcards:
        return isinstance(g, float)
    return type(p) is type(g) and p == g


def _literals_agree(wildcards: tuple = ()) -> Callable:
    """Match filter: the matcher runs with ignore_literals (so slices holding nodes can match at
    all); this re-checks every literal of every matched node, except the declared wildcards."""

    def check(match, original_graph, pattern_graph) -> bool:
        nm = match.nodes_map
        for pn, gn in nm.items():
            if pn.op in ("placeholder", "output") or not isinstance(gn, fx.Node):
                continue
            if not (
                _same_literal(tuple(pn.args), tuple(gn.args), nm, wildcards)
                and pn.kwargs.keys() == gn.kwargs.keys()
                and all(_same_literal(pn.kwargs[k], gn.kwargs[k], nm, wildcards) for k in pn.kwargs)
            ):
                return False
        return True

    return check


def _matched_eps(match) -> float:
    for pn, gn in match.nodes_map.items():
        if pn.op != "call_function":
            continue
        for pa, ga in zip((*pn.args, *pn.kwargs.values()), (*gn.args, *gn.kwargs.values())):
            if isinstance(pa, float) and pa == ANY_EPS:
                return float(ga)
    raise AssertionError("norm pattern matched without its eps")


def _lift_slices(graph: fx.Graph) -> None:
    """Turn each slice literal that holds a node (`x[..., half:]`) into a `slice(...)` node, so the
    matcher walks into its operands instead of comparing the slice as an opaque literal."""

    def lift(a):
        if isinstance(a, slice) and any(isinstance(v, fx.Node) for v in (a.start, a.stop, a.step)):
            return graph.call_function(slice, (a.start, a.stop, a.step))
        if isinstance(a, tuple):
            return tuple(lift(v) for v in a)
        if isinstance(a, list):
            return [lift(v) for v in a]
        return a

    for n in list(graph.nodes):
        if n.op in ("call_function", "call_method"):
            with graph.inserting_before(n):
                n.args = lift(n.args)


def _rewrite(gm: fx.GraphModule, pattern, replacement=None, wildcards: tuple = (), callback=None) -> int:
    pattern_graph = fx.symbolic_trace(pattern).graph
    _lift_slices(pattern_graph)
    _lift_slices(gm.graph)
    replaced = replace_pattern_with_filters(
        gm, pattern_graph, replacement, match_filters=[_literals_agree(wildcards)], ignore_literals=True,
        replacement_callback=callback,
    )
    return len(replaced)


def _fuse_add_rms_norm(gm: fx.GraphModule) -> int:
    def callback(match, original_graph, pattern_graph):
        return fx.symbolic_trace(norm_replacement(_matched_eps(match))).graph

    return sum(
        _rewrite(gm, pattern, wildcards=(ANY_EPS,), callback=callback)
        for pattern in (norm_pattern_fp32, norm_pattern_lowp)
    )


def _pair_rotaries(gm: fx.GraphModule) -> int:
    """Two single rotations of one layer with the same cos/sin (Qwen3's q and k) -> strata::rotary_qk.

    A plain pass rather than a pattern: every layer's rotaries share cos/sin, so a pattern would
    also pair q of one layer with k of the next. Here a pair is taken only when both inputs exist
    before either result is first used, which keeps it inside one layer.
    """
    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    rot = rotate_one
    nodes = [n for n in graph.nodes if n.op == "call_function" and n.target is rot]
    used: set[fx.Node] = set()
    pairs = 0
    for i, a in enumerate(nodes):
        if a in used:
            continue
        for b in nodes[i + 1:]:
            if b in used or b.args[1:] != a.args[1:]:
                continue
            first_use = min(order[u] for u in (*a.users, *b.users)) if (a.users or b.users) else len(order)
            if max(order[a.args[0]], order[b.args[0]]) >= first_use:
                continue
            if order[b.args[0]] < order[a.args[0]]:  # q first: its input is computed first
                a, b = b, a
            insert_at = min((u for u in (*a.users, *b.users)), key=order.__getitem__)
            with graph.inserting_before(insert_at):
                both = graph.call_function(torch.ops.strata.rotary_qk.default, (a.args[0], b.args[0], *a.args[1:]))
                qa = graph.call_function(operator.getitem, (both, 0))
                qb = graph.call_function(operator.getitem, (both, 1))
            a.replace_all_uses_with(qa)
            b.replace_all_uses_with(qb)
            graph.erase_node(a)
            graph.erase_node(b)
            used.update((a, b))
            pairs += 1
            break
    return pairs


def fuse_graph(gm: fx.GraphModule, model: CausalLM, patterns: tuple[str, ...] = PATTERNS) -> dict[str, int]:
    """Run the passes named in `patterns` over a traced step of `model` (in place); returns how
    many of each pattern were fused. (The model supplies the split patterns' literals: its layers'
    query-head counts and MLP widths.) Holds the trace gate: each pattern is FX-traced."""
    unknown = set(patterns) - set(PATTERNS)
    if unknown:
        raise ValueError(f"unknown fusion patterns {sorted(unknown)}; known: {', '.join(PATTERNS)}")
    with TRACE_GATE.exclusive():
        return _fuse_graph(gm, model, patterns)


def _fuse_graph(gm: fx.GraphModule, model: CausalLM, patterns: tuple[str, ...]) -> dict[str, int]:
    heads = sorted({m.heads for m in model.modules() if isinstance(m, Attention)})
    intermediates = sorted({m.intermediate for m in model.modules() if isinstance(m, GatedMLP)})
    counts = {}
    if "add_rms_norm" in patterns:
        counts["add_rms_norm"] = _fuse_add_rms_norm(gm)
    if "silu_mul" in patterns:
        counts["silu_mul"] = sum(_rewrite(gm, silu_pattern(i), silu_replacement) for i in intermediates)
    if "rotary_qk" in patterns:
        joint = sum(_rewrite(gm, joint_rotary_pattern(h), joint_rotary_replacement(h)) for h in heads)
        _rewrite(gm, rotary_pattern, rotary_replacement)
        counts["rotary_qk"] = joint + _pair_rotaries(gm)  # unpaired single rotations stay rotary_ref calls
    if "kv_write" in patterns:
        counts["kv_write"] = _rewrite(gm, kv_pattern, kv_replacement)
    dce(gm.graph)
    gm.graph.lint()
    gm.recompile()
    return counts


def expected_counts(num_layers: int) -> dict[str, int]:
    """What the decoder's structure implies: see the module docstring."""
    return {"add_rms_norm": 2 * num_layers, "silu_mul": num_layers, "rotary_qk": num_layers, "kv_write": num_layers}


@dataclass
class FusedStep:
    """The fused engine step: call it as the model (ids, positions, meta, kv_caches) -> hidden."""

    graph_module: fx.GraphModule
    counts: dict[str, int] = field(default_factory=dict)

    def __call__(self, input_ids: Tensor, positions: Tensor, meta: AttentionMetadata, kv_caches: list[Tensor]) -> Tensor:
        with TRACE_GATE.shared():  # its leaf modules' calls must not meet a trace's patched __call__
            return self.graph_module(input_ids, positions, meta, kv_caches)

    def summary(self) -> str:
        return ", ".join(f"{k} {self.counts.get(k, 0)}" for k in PATTERNS)


def fuse_model(model: CausalLM, patterns: tuple[str, ...] = PATTERNS) -> FusedStep:
    """Trace `model`'s engine step and apply the fusion passes (all by default). The model itself
    is not changed; the returned step shares its modules and parameters."""
    cfg = model.config
    if not cfg.llama_structure:
        raise ConfigError(
            f"--fuse / --compile: the FX fusion passes describe the Llama-shaped layers; {cfg.architecture} "
            "(Gemma norms, GeGLU, partial rotary or soft-capping) is not one of them: run without --fuse "
            "and --compile (the eager step is the default)"
        )
    _register_gpu_kernels_once()
    with TRACE_GATE.exclusive():
        gm = trace_model(model)
        counts = fuse_graph(gm, model, patterns)
    step = FusedStep(gm, counts)
    logger.debug("fusion: %s (rewritten patterns, %d layers)", step.summary(), len(model.layers))
    return step


@functools.cache
def _register_gpu_kernels_once() -> None:
    register_gpu_kernels()  # torch.library registrations are process-wide by nature

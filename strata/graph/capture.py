"""Step capture: the decode step under torch.compile and/or replayed as CUDA graphs.

Only all-decode steps are captured: one token per sequence, so the step's shapes are the batch B
and the block-table width W. Prefill steps (and mixed steps) run the eager path: their shapes
vary with every prompt, and on CPU their time is GEMM-bound, which compile does not change.

Buckets. B is padded up to the next of a fixed set of batch sizes (1, 2, 4, 8, 16, 24, ... up to
max_num_seqs), so the number of distinct shapes, hence compilations and graphs, is bounded. Padded
rows decode token 0 at position 0 with context length 1; their KV write lands in a scratch block
that the engine allocates past the block manager's range (so no sequence's cache is touched) and
their outputs are never read (the runner picks the real rows). W grows with the longest context:
torch.compile marks it dynamic (one graph for every width); CUDA graphs pad it to a power of two.

torch.compile. The model's own forward cannot be compiled in one piece on CPU: its decode path
calls numba kernels, which dynamo cannot trace (a graph break at every kernel call). What is
compiled is the FX-traced step of graph/fusion.py with the fusion passes of COMPILE_PATTERNS,
lowered so that every numba kernel is an opaque torch.library op: projections -> strata::linear,
decode attention -> strata::paged_decode, the KV write -> strata::kv_write; dynamo then captures
the whole step as one graph, and inductor generates code for the rest.
Batch 1 compiles a static graph; the first other bucket recompiles it with the batch dimension
dynamic (dynamo's automatic dynamic shapes), which then serves every bucket, so a run compiles
about twice. Compilations are counted and logged (`compiles`), and torch._dynamo's recompile
limit is raised to the number of buckets, so even with fully static shapes every bucket would get
its graph rather than falling back to eager. Quantised projections (QuantLinear) are not opaque ops
yet, so EngineConfig refuses compile with quantization.

CUDA graphs (GPU only). For each (batch bucket, width bucket) met, the decode step is captured once
into static input buffers (warm-up on a side stream first, one memory pool for all graphs) and
replayed after copying the step's inputs in. With torch.compile on as well, the compiled step is
what is captured.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Callable

import torch
import torch.fx as fx
from torch import Tensor

from strata.errors import ConfigError
from strata.graph.layers import Linear
from strata.kernels.attention import AttentionMetadata

logger = logging.getLogger(__name__)


def batch_buckets(max_num_seqs: int) -> list[int]:
    """Batch sizes a decode step is padded up to: 1, 2, 4, then multiples of 8, then max_num_seqs.

    Multiples of 8 rather than powers of two above 8: padded rows cost compute once batches run
    through GEMMs (33 sequences padded to 64 nearly doubles a step), and under torch.compile the
    batch dimension turns dynamic after the second bucket, so finer buckets cost no compilations;
    with CUDA graphs each bucket met is one more graph."""
    out = [b for b in (1, 2, 4) if b < max_num_seqs]
    out += list(range(8, max_num_seqs, 8))
    out.append(max_num_seqs)
    return out


def bucket_for(n: int, buckets: list[int]) -> int | None:
    for b in buckets:
        if b >= n:
            return b
    return None


def _width_bucket(w: int, cap: int) -> int:
    b = 2
    while b < w:
        b *= 2
    return max(w, min(b, cap))


def _decode_attention(q: Tensor, kv_cache: Tensor, meta: AttentionMetadata, scale: float) -> Tensor:
    """The compiled step's attention: all-decode, so the prefill branch of attend_cached is gone."""
    return torch.ops.strata.paged_decode.default(
        q, kv_cache, meta.decode_block_tables, meta.decode_context_lens, meta.decode_mask, scale, meta.backend
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
    from strata.graph.fusion import attend_cached, dce

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


class DecodeCapture:
    """Runs all-decode steps through torch.compile and/or CUDA graphs, padded to batch buckets.

    Call it with the runner's (ids, positions, meta); it returns the hidden states of the padded
    batch (real rows first), or None when the step is not one it captures (a prefill in the step,
    or more sequences than the largest bucket), and the runner then runs the eager step.
    """

    def __init__(
        self,
        step: Callable,
        kv_caches: list[Tensor],
        *,
        block_size: int,
        backend: str,
        scratch_block: int,
        max_num_seqs: int,
        max_model_len: int,
        compile: bool,
        cuda_graphs: bool,
        compile_backend: str = "inductor",
    ) -> None:
        device = kv_caches[0].device
        if cuda_graphs and device.type != "cuda":
            raise ConfigError(
                f"cuda_graphs (--cuda-graphs) captures the decode step as CUDA graphs and needs a CUDA "
                f"device; this engine runs on {device.type!r}"
            )
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.backend = backend
        self.device = device
        self.scratch_block = scratch_block
        self.buckets = batch_buckets(max_num_seqs)
        self.max_width = max(2, -(-max_model_len // block_size))
        self.compile = compile
        self.cuda_graphs = cuda_graphs
        self.compile_backend = compile_backend  # tests use "eager" (dynamo capture, no codegen)
        self.compiles = 0  # torch.compile backend invocations (graphs compiled, recompiles included)
        self.bucket_hits: dict[int, int] = {}
        self._graphs: dict[tuple[int, int], _CapturedDecode] = {}
        self._pool = None
        self._step = step
        fn = self._decode
        if compile:
            import torch._dynamo

            cfg = torch._dynamo.config
            cfg.recompile_limit = max(cfg.recompile_limit, len(self.buckets) + 2)
            cfg.accumulated_recompile_limit = max(cfg.accumulated_recompile_limit, 4 * len(self.buckets) + 8)
            fn = torch.compile(fn, backend=self._compiler)
        self._fn = fn

    # -- torch.compile --------------------------------------------------------------------------
    def _compiler(self, gm: fx.GraphModule, example_inputs: list) -> Callable:
        import torch._dynamo

        self.compiles += 1
        batch = next((t.shape[0] for t in example_inputs if isinstance(t, Tensor) and t.dim() == 1), None)
        logger.info("torch.compile: compiling decode graph #%d (%d FX nodes, batch %s)",
                    self.compiles, len(gm.graph.nodes), batch)
        return torch._dynamo.lookup_backend(self.compile_backend)(gm, example_inputs)

    def _decode(self, ids: Tensor, positions: Tensor, slots: Tensor, tables: Tensor, lens: Tensor,
                kv_caches: list[Tensor]) -> Tensor:
        mask = None
        if self.backend != "cpu":  # torch/sdpa decode take a padding mask; the numba kernel reads lens
            keys = torch.arange(tables.shape[1] * self.block_size, device=ids.device)
            mask = (keys[None, :] < lens[:, None]).view(ids.shape[0], 1, 1, -1)
        meta = AttentionMetadata(
            slot_mapping=slots, prefills=[], num_prefill_tokens=0, decode_block_tables=tables,
            decode_mask=mask, decode_context_lens=lens, backend=self.backend,
        )
        return self._step(ids, positions, meta, kv_caches)

    # -- the step -------------------------------------------------------------------------------
    def __call__(self, ids: Tensor, positions: Tensor, meta: AttentionMetadata) -> Tensor | None:
        n = ids.shape[0]
        if meta.num_prefill_tokens != 0 or meta.decode_block_tables is None:
            return None
        b = bucket_for(n, self.buckets)
        if b is None:
            return None
        self.bucket_hits[b] = self.bucket_hits.get(b, 0) + 1
        tables, lens = meta.decode_block_tables, meta.decode_context_lens
        w = tables.shape[1]
        width = _width_bucket(w, self.max_width) if self.cuda_graphs else max(w, 2)
        if self.cuda_graphs:
            graph = self._graphs.get((b, width))
            if graph is None:
                graph = self._capture(b, width)
            return graph.replay(ids, positions, meta.slot_mapping, tables, lens)
        pad = b - n
        if pad or width != w:
            ids, positions, slots, tables, lens = self._pad(ids, positions, meta.slot_mapping, tables, lens, b, width)
        else:
            slots = meta.slot_mapping
        if self.compile:
            torch._dynamo.mark_dynamic(tables, 1)
        return self._fn(ids, positions, slots, tables, lens, self.kv_caches)

    def _pad(self, ids, positions, slots, tables, lens, b: int, width: int):
        n, w = tables.shape
        pad = b - n
        scratch = self.scratch_block
        out_tables = torch.full((b, width), scratch, dtype=tables.dtype, device=tables.device)
        out_tables[:n, :w] = tables
        if pad == 0:
            return ids, positions, slots, out_tables, lens
        ids = torch.cat([ids, ids.new_zeros(pad)])
        positions = torch.cat([positions, positions.new_zeros(pad)])
        slots = torch.cat([slots, slots.new_full((pad,), scratch * self.block_size)])
        lens = torch.cat([lens, lens.new_ones(pad)])
        return ids, positions, slots, out_tables, lens

    # -- CUDA graphs ----------------------------------------------------------------------------
    def _capture(self, b: int, width: int) -> _CapturedDecode:
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = _CapturedDecode(self, b, width)
        self._graphs[(b, width)] = graph
        logger.info("CUDA graphs: captured the decode step for batch %d, %d blocks (%d graphs)",
                    b, width, len(self._graphs))
        return graph

    @torch.inference_mode()  # as the runner's steps: dynamo guards on the grad mode
    def warm_up(self, batch_sizes: list[int] | None = None) -> None:
        """Compile / capture ahead of serving: by default batch 1 and 2 under torch.compile (the
        static and the dynamic-batch graph), every bucket with CUDA graphs. Writes only into the
        scratch block."""
        if batch_sizes is None:
            batch_sizes = self.buckets if self.cuda_graphs else self.buckets[:2]
        dev, scratch = self.device, self.scratch_block
        for b in batch_sizes:
            meta = AttentionMetadata(
                slot_mapping=torch.full((b,), scratch * self.block_size, dtype=torch.long, device=dev),
                prefills=[], num_prefill_tokens=0,
                decode_block_tables=torch.full((b, 2), scratch, dtype=torch.long, device=dev),
                decode_mask=None, decode_context_lens=torch.ones(b, dtype=torch.long, device=dev),
                backend=self.backend,
            )
            ids = torch.zeros(b, dtype=torch.long, device=dev)  # two tensors: dynamo guards on aliasing
            self(ids, torch.zeros_like(ids), meta)
        self.bucket_hits.clear()

    def stats(self) -> dict:
        return {"compiles": self.compiles, "graphs": len(self._graphs), "bucket_hits": dict(self.bucket_hits)}


class _CapturedDecode:
    """One CUDA graph of the decode step for a fixed (batch, width), with its static buffers."""

    def __init__(self, owner: DecodeCapture, b: int, width: int) -> None:
        dev, scratch, bs = owner.device, owner.scratch_block, owner.block_size
        self.owner, self.b, self.width = owner, b, width
        self.ids = torch.zeros(b, dtype=torch.long, device=dev)
        self.positions = torch.zeros(b, dtype=torch.long, device=dev)
        self.slots = torch.full((b,), scratch * bs, dtype=torch.long, device=dev)
        self.tables = torch.full((b, width), scratch, dtype=torch.long, device=dev)
        self.lens = torch.ones(b, dtype=torch.long, device=dev)
        args = (self.ids, self.positions, self.slots, self.tables, self.lens, owner.kv_caches)
        if owner.compile:  # one compiled graph for every width bucket
            torch._dynamo.mark_dynamic(self.tables, 1)
        stream = torch.cuda.Stream(device=dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream):  # warm-up (and compilation) outside the capture
            for _ in range(2):
                owner._fn(*args)
        torch.cuda.current_stream(dev).wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=owner._pool):
            self.out = owner._fn(*args)

    def replay(self, ids: Tensor, positions: Tensor, slots: Tensor, tables: Tensor, lens: Tensor) -> Tensor:
        n, w = tables.shape
        bs, scratch = self.owner.block_size, self.owner.scratch_block
        self.ids[:n].copy_(ids)
        self.positions[:n].copy_(positions)
        self.slots[:n].copy_(slots)
        self.lens[:n].copy_(lens)
        self.tables[:n, :w].copy_(tables)
        if w < self.width:
            self.tables[:n, w:].fill_(scratch)
        if n < self.b:  # rows left by a larger batch: back to the harmless padding row
            self.ids[n:].zero_()
            self.positions[n:].zero_()
            self.slots[n:].fill_(scratch * bs)
            self.lens[n:].fill_(1)
            self.tables[n:].fill_(scratch)
        self.graph.replay()
        return self.out


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
    from strata.graph.fusion import fuse_model

    return lower_for_compile(fuse_model(model, COMPILE_PATTERNS[device_type]).graph_module, device_type)


def build_decode_capture(engine) -> DecodeCapture | None:
    """The engine's DecodeCapture per its config (compile / cuda_graphs), or None."""
    cfg = engine.config
    if not (cfg.compile or cfg.cuda_graphs):
        return None
    step = engine.runner.forward
    if cfg.compile:
        step = compiled_step(engine.model, "cuda" if cfg.device.startswith("cuda") else "cpu")
    return DecodeCapture(
        step, engine.kv_caches, block_size=cfg.block_size, backend=engine.runner.backend,
        scratch_block=engine.scratch_block, max_num_seqs=cfg.max_num_seqs, max_model_len=engine.max_model_len,
        compile=cfg.compile, cuda_graphs=cfg.cuda_graphs,
    )

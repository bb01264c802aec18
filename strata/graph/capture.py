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

torch.compile. What is compiled is the FX-traced, fused step lowered so that every numba kernel is
an opaque op (graph/capture_passes.py: compiled_step). Batch 1 compiles a static graph; every
larger bucket passes its padded inputs with the batch dimension marked dynamic
(torch._dynamo.mark_dynamic), so the first of them compiles one dynamic-batch graph that then
serves them all: a run compiles about twice, within dynamo's default recompile limits (no global
dynamo setting is changed). Compilations are counted and logged (`compiles`).

CUDA graphs (GPU only). For each (batch bucket, width bucket) met, the decode step is captured once
into static input buffers (warm-up on a side stream first, one memory pool for all graphs) and
replayed after copying the step's inputs in. With torch.compile on as well, the compiled step is
what is captured.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.fx as fx
from torch import Tensor

from strata.errors import ConfigError
from strata.graph.decode_step import DecodeStep
from strata.graph.trace_gate import TRACE_GATE
from strata.kernels.attention import AttentionBackend, AttentionMetadata, resolve_backend

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


def _mark_dynamic(b: int, ids: Tensor, positions: Tensor, slots: Tensor, tables: Tensor, lens: Tensor) -> None:
    """Dynamic dimensions for torch.compile: the block-table width always (one graph for every
    width), and the batch for buckets above 1 (batch 1 keeps its static graph; the others share one
    dynamic-batch graph, so compilations stay at about two without raising dynamo's limits)."""
    import torch._dynamo

    torch._dynamo.mark_dynamic(tables, 1)
    if b > 1:
        for t in (ids, positions, slots, tables, lens):
            torch._dynamo.mark_dynamic(t, 0)


class DecodeCapture(DecodeStep):
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
        backend: AttentionBackend | str,
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
        self.backend = resolve_backend(backend)
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
        if self.backend.uses_decode_mask:  # torch/sdpa read a padding mask; numba and triton read lens
            keys = torch.arange(tables.shape[1] * self.block_size, device=ids.device)
            mask = (keys[None, :] < lens[:, None]).view(ids.shape[0], 1, 1, -1)
        meta = AttentionMetadata(
            slot_mapping=slots, prefills=[], num_prefill_tokens=0, decode_block_tables=tables,
            decode_mask=mask, decode_context_lens=lens, backend=self.backend,
        )
        return self._step(ids, positions, meta, kv_caches)

    # -- the step -------------------------------------------------------------------------------
    def __call__(self, ids: Tensor, positions: Tensor, meta: AttentionMetadata) -> Tensor | None:
        if meta.num_prefill_tokens != 0 or meta.decode_block_tables is None:
            return None
        with TRACE_GATE.shared():  # a forward: no FX trace may patch module calls meanwhile
            return self._run(ids, positions, meta)

    def _run(self, ids: Tensor, positions: Tensor, meta: AttentionMetadata) -> Tensor | None:
        n = ids.shape[0]
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
            _mark_dynamic(b, ids, positions, slots, tables, lens)
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
        if owner.compile:  # one compiled graph for every width bucket (and every batch bucket > 1)
            _mark_dynamic(b, *args[:5])
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


def build_decode_capture(
    model: torch.nn.Module,
    step: Callable,
    kv_caches: list[Tensor],
    *,
    backend: AttentionBackend | str,
    scratch_block: int,
    block_size: int,
    max_num_seqs: int,
    max_model_len: int,
    device: str,
    compile: bool,
    cuda_graphs: bool,
) -> DecodeCapture | None:
    """The decode capture for these settings, or None when neither compile nor cuda_graphs is on.

    `step` is the eager step (the model, or its fused step) that CUDA graphs capture without
    compile; with compile, the step compiled is graph/capture_passes.compiled_step(model, ...).
    `scratch_block` is the KV block past the block manager's range that padded rows write into."""
    if not (compile or cuda_graphs):
        return None
    if compile:  # FX tracing and the fused ops are imported only when compile is on
        from strata.graph.capture_passes import (
            compiled_step,  # reason: FX and inductor passes, only with --compile
        )

        step = compiled_step(model, "cuda" if str(device).startswith("cuda") else "cpu")
    return DecodeCapture(
        step, kv_caches, block_size=block_size, backend=backend, scratch_block=scratch_block,
        max_num_seqs=max_num_seqs, max_model_len=max_model_len, compile=compile, cuda_graphs=cuda_graphs,
    )

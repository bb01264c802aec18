"""The CPU platform's decode step: an all-decode step's decoder layers in one loop
(kernels/cpu_decode_layer.decode_layers), then the final norm and the LM head in one more
compiled call.

ModelRunner tries it first for every all-decode step (graph/decode_step.py). It runs steps of at
most MAX_ROWS fp32 rows on CPU with the "cpu" attention backend and one rotary table, over a KV
cache the kernels read; for any other step it returns None and the model's forward runs. Each
layer runs in the form its kind registered (platform/cpu_layers.py); a layer whose kind has none,
or whose form refuses it (Phi-4-mini's partial rotary, a tensor-parallel shard), runs eagerly
inside the same loop, that layer only, and the step logs which and why. A model none of whose
layers fuse (Gemma 3, Phi-4-mini) is left to its forward as a whole, so its outputs are the eager
path's bit for bit.

What the step keeps lives here, never on the model: buffers per row count, the layers'
arguments (numpy views of weights, norms, biases, KV caches, kernel choices), the final norm's,
the head's and the embedding lookup's. They are rebuilt when a parameter or buffer is replaced or
moved or the caches change: the caches are compared every step, the layers' parameters and
buffers on the first step after `weights_may_have_changed` (the engine calls it when a request
is added: the caller held control and may have changed a weight), never per layer. The head runs
beside the final norm unless it has no kernel here (a vocabulary-parallel head) or `fused_head`
is off (the planner's decode probe times the layers and the head apart). STRATA_FUSED_DECODE=0
(strata/settings.py) turns the step off: the eager per-kernel path, e.g. to compare.

LoRA: a step run inside `graph.lora.lora_batch(batch)` with some row on an adapter takes a second
stack per row count, whose layers with banks add each row's adapter in the same compiled call
(kernels/cpu_lora.py); the batch's token slots are copied into that stack's buffer every call. No
batch (None): the plain stack, exactly as without banks. Banks attached after the first step are
noticed on the next re-check (weights_may_have_changed).
"""

from __future__ import annotations

import itertools
import logging
import operator
from collections.abc import Callable

import numpy as np
import torch

from strata.graph.decode_step import DecodeStep
from strata.graph.layers import RMSNorm
from strata.graph.lora import ACTIVE, LoRABatch
from strata.graph.trace_gate import TRACE_GATE
from strata.kernels import cpu_attention, cpu_decode_layer, cpu_gemv, cpu_quant
from strata.kernels.attention import AttentionMetadata
from strata.kernels.dispatch import KERNEL_MODE
from strata.platform import cpu_layers
from strata.settings import SETTINGS

logger = logging.getLogger(__name__)

MAX_ROWS = cpu_decode_layer.MAX_ROWS


class _Snapshot:
    """Every parameter and buffer of some modules, as (owning dict, name, tensor, storage address),
    kept column-wise so `unchanged` runs its comparisons in C (map over the columns). It runs on the
    first fused step after a request was added over ~200-400 tensors: 54 vs 70 us for a Python loop
    over the rows (smol-135m int8, warm caches; inside a step, after the weights streamed through
    the caches, ~3-5x that)."""

    def __init__(self, modules) -> None:
        rows = [(d, name, t) for m in modules for d in (m._parameters, m._buffers)
                for name, t in d.items() if t is not None]
        self.dicts, self.names, self.tensors = (tuple(col) for col in zip(*rows)) if rows else ((), (), ())
        self.ptrs = list(map(torch.Tensor.data_ptr, self.tensors))

    def unchanged(self) -> bool:
        """No parameter or buffer was replaced or given new storage (`.data = ...`) since taken."""
        return (all(map(operator.is_, map(dict.get, self.dicts, self.names), self.tensors))
                and list(map(torch.Tensor.data_ptr, self.tensors)) == self.ptrs)


class _Stack:
    """Every layer's (run, args) for one row count, which layers run eagerly, and (a LoRA stack) the
    token slots its LoRA layers read."""

    def __init__(self, entries: tuple, eager: dict[int, str], lora: cpu_layers.LoRARows | None = None) -> None:
        self.entries = entries
        self.eager = eager  # layer index -> why it runs eagerly
        self.fused = len(entries) - len(eager)
        self.lora = lora


class _Buffers:
    """One row count's scratch and output buffers, reused by every step of that count (allocating
    its ~10 buffers measured 5-10 us a step)."""

    def __init__(self, cfg, rows: int) -> None:
        heads, kv_heads, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        hidden, inter = cfg.hidden_size, cfg.intermediate_size
        e = np.float32
        q3, attn3 = np.empty((rows, heads, d), e), np.empty((rows, heads, d), e)
        self.out, self.res_out = np.empty((rows, hidden), e), np.empty((rows, hidden), e)
        self.out_t, self.res_t = torch.from_numpy(self.out), torch.from_numpy(self.res_out)
        self.scratch = (
            np.empty((rows, hidden), e), np.empty((rows, (heads + 2 * kv_heads) * d), e), q3, attn3,
            attn3.reshape(rows, heads * d), np.empty((rows, hidden), e), np.empty((rows, inter), e),
            self.out, self.res_out,
        )


class CpuDecodeStep(DecodeStep):
    """The fused CPU decode step of one model over its KV caches (owned by the engine's runner)."""

    supports_lora = True  # the active LoRABatch's adapters run inside the fused layers

    def __init__(self, model, kv_caches: list[torch.Tensor], block_size: int, fused_head: bool = True) -> None:
        self.model, self.kv_caches, self.block_size = model, kv_caches, block_size
        self.fused_head = fused_head
        self._buffers: dict[int, _Buffers] = {}
        self._stacks: dict[tuple[int, bool], _Stack | None] = {}  # by (rows, with adapters)
        self._snapshot: _Snapshot | None = None
        self._module_dicts: tuple = ()  # every layer module's _modules, and the banks they held
        self._banks: list = []
        self._caches: tuple = ()
        self._recheck = True
        self._norm: tuple | None = None  # (weight, its address, the norm's args or None)
        self._head: tuple | None = None  # (snapshot, {rows: the head's args or None})
        self.embed = EmbeddingLookup(model.embed_tokens)
        self._logged: set = set()
        # the last call's, for logits_of and next: its buffers, step arguments, hidden and logits
        self._last: tuple | None = None  # (buffers, stack, step args, rotary tables, tail args, hidden, logits, embedding lookup)
        self._meta: AttentionMetadata | None = None
        self._positions: torch.Tensor | None = None
        self._rows: tuple | None = None  # multi-step: positions, tables, slots, lengths (numpy)
        self._eager_rope: tuple | None = None

    # -- DecodeStep ---------------------------------------------------------------------------
    def weights_may_have_changed(self) -> None:
        self._recheck = True

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor | None:
        self._last = None
        model, rows = self.model, ids.shape[0]
        batch = ACTIVE.get()
        if not (
            KERNEL_MODE.get().fast_paths and meta.num_prefill_tokens == 0 and meta.decode_block_tables is not None
            and meta.backend.name == "cpu" and cpu_decode_layer.available() and SETTINGS.fused_decode
            and ids.dim() == 1 and rows <= MAX_ROWS and ids.is_cpu
            and model.rotary_local is None  # one rotary table for every layer
            and cpu_attention.reads_cache(self.kv_caches[0])  # fp32, bf16 or int8 (kv_cache_dtype) CPU cache
        ):
            return None
        stack = self._stack(rows, batch is not None)
        if stack is None:
            return None
        if batch is not None:
            _fill_slots(stack.lora, batch)
        with TRACE_GATE.shared():  # module calls (the embedding, eager layers): no FX trace meanwhile
            x = model.embed_tokens(ids)
            if model.config.embed_scale is not None:  # as the model's forward
                x = x * torch.tensor(model.config.embed_scale, dtype=x.dtype)
            if x.dtype is not torch.float32 or (torch.is_grad_enabled() and x.requires_grad):
                return None
            buffers = self._buffers.get(rows)
            if buffers is None:
                buffers = self._buffers[rows] = _Buffers(model.config, rows)
            threads = cpu_gemv.sync_threads()
            common = (np.ascontiguousarray(meta.slot_mapping.numpy()), meta.decode_block_tables.numpy(),
                      meta.decode_context_lens.numpy(), threads, *buffers.scratch)
            self._meta, self._positions, self._rows, self._eager_rope = meta, positions, None, None
            rope = model.rotary.cos.numpy(), model.rotary.sin.numpy()
            p = positions.numpy()
            cpu_decode_layer.decode_layers(x.contiguous().numpy(), stack.entries, (rope[0][p], rope[1][p]) + common)
            tail = self._tail_args(rows)
            hidden, logits = self._tail(buffers, rows, threads, tail)
        self._last = (buffers, stack, common, rope, tail, hidden, logits, self.embed.current())
        return hidden

    def logits_of(self, hidden: torch.Tensor) -> torch.Tensor | None:
        last = self._last
        return last[6] if last is not None and last[5] is hidden else None

    def next(self, token_ids: list[int]) -> torch.Tensor | None:
        """The step after the last call, from numpy rows; only after a call whose every layer ran
        fused and whose tail ran compiled: nothing that call checked can have changed in between,
        so its layer, norm and head arguments are reused as they are."""
        last = self._last
        if last is None or last[1].eager or last[4] is None:
            return None
        batch = ACTIVE.get()
        if (batch is not None) != (last[1].lora is not None):  # adapters on or off since: rebuild
            return None
        buffers, stack, common, rope, tail, _, _, embed = last
        if batch is not None:
            _fill_slots(stack.lora, batch)
        if self._rows is None:  # the step's rows as numpy arrays of its own, moved in place
            p = self._positions.numpy().copy()
            self._rows = (p, self._meta.decode_block_tables.numpy(), np.empty_like(p), np.empty_like(p))
        p, tables, slots, lens = self._rows
        cpu_decode_layer.advance_rows(p, tables, self.block_size, slots, lens)
        common = (slots, common[1], lens, *common[3:])
        ids = np.array(token_ids, np.int64)
        cpu_decode_layer.decode_layers(embed(ids), stack.entries, (rope[0][p], rope[1][p]) + common)
        hidden, logits = self._tail(buffers, len(ids), common[3], tail)
        self._last = (buffers, stack, common, rope, tail, hidden, logits, embed)
        return hidden

    # -- the pieces ---------------------------------------------------------------------------
    def _tail_args(self, rows: int) -> tuple | None:
        """(the final norm's args, the head's or None) for `_tail`; None when the model's norm is
        not a plain RMSNorm (then the model's own norm runs)."""
        norm = self.model.norm
        if self._norm is None or self._norm[0] is not norm.weight or self._norm[1] != norm.weight.data_ptr():
            self._norm = (norm.weight, norm.weight.data_ptr(), _norm_args(norm))
        if self._norm[2] is None:
            return None
        return self._norm[2], (self._head_args(rows) if self.fused_head else None)

    def _tail(self, buffers: _Buffers, rows: int, threads: int, tail: tuple | None):
        """(hidden, logits or None) after the last layer: the final norm on the step's buffers and,
        in the same compiled call, the LM head where it has a kernel."""
        if tail is None:
            return self.model.norm(buffers.out_t, buffers.res_t)[0], None
        norm, head = tail
        hidden = np.empty_like(buffers.out)
        if head is None:
            cpu_decode_layer.final_norm(buffers.out, buffers.res_out, *norm, hidden)
            return torch.from_numpy(hidden), None
        logits = np.empty((rows, head[0].shape[0]), np.float32)
        cpu_decode_layer.final_norm_head(buffers.out, buffers.res_out, *norm, hidden, head, threads, logits)
        return torch.from_numpy(hidden), torch.from_numpy(logits)

    def _head_args(self, rows: int) -> tuple | None:
        """The LM head's (weight, scale, bias, group, vnni) for a step of `rows`, or None when it has
        no kernel here; its parameters and buffers are compared every step (two or three tensors: ~2 us)."""
        head = self.model.lm_head
        if self._head is None or not self._head[0].unchanged():
            self._head = (_Snapshot(head.modules()), {})
        by_rows = self._head[1]
        if rows not in by_rows:
            p = cpu_layers.projection(head)
            by_rows[rows] = None if p is None else (*p[1:], cpu_layers.vnni(p, rows))
        return by_rows[rows]

    def _stack(self, rows: int, lora: bool = False) -> _Stack | None:
        """Every layer's entry for a step of `rows` (`lora`: with adapters), or None when no layer
        fuses. The cache tensors are compared every step; the parameters and buffers (all in place?)
        and which modules carry LoRA banks after weights_may_have_changed only: that check reads ~300
        tensors whose memory the step's weight stream evicted from the caches, ~0.16 ms of a 6-8 ms
        smol-135m int8 step, and between two steps of the engine's own loop nothing else runs that
        could change a weight."""
        layers, caches = self.model.layers, self.kv_caches
        if (self._snapshot is None or len(self._caches) != len(caches)
                or not all(map(operator.is_, self._caches, caches))
                or (self._recheck and (not self._snapshot.unchanged() or self._banks_changed()))):
            modules = [m for layer in layers for m in layer.modules()]
            self._snapshot = _Snapshot(modules)
            self._module_dicts = tuple(m._modules for m in modules)
            self._banks = self._banks_now()
            self._caches = tuple(caches)
            self._stacks = {}
        self._recheck = False
        key = (rows, lora)
        if key not in self._stacks:
            self._stacks[key] = self._build_stack(rows, lora)
        return self._stacks[key]

    def _banks_now(self) -> list:
        return list(map(dict.get, self._module_dicts, itertools.repeat("lora")))

    def _banks_changed(self) -> bool:
        """A LoRA bank attached, removed or replaced on some layer module (~5 us over ~400 modules)."""
        return not all(map(operator.is_, self._banks_now(), self._banks))

    def _build_stack(self, rows: int, lora: bool = False) -> _Stack | None:
        entries, eager = [], {}
        slots = cpu_layers.LoRARows(rows) if lora else None
        for i, (layer, kv) in enumerate(zip(self.model.layers, self.kv_caches)):
            entry = cpu_layers.build(layer, kv, rows, slots)
            if isinstance(entry, str):
                eager[i] = entry
                entry = (self._eager_layer(layer, kv), ())
            entries.append(entry)
        stack = _Stack(tuple(entries), eager, slots)
        self._log(stack)
        return stack if stack.fused else None

    def _log(self, stack: _Stack) -> None:
        if not stack.eager:
            return
        reasons = sorted(set(stack.eager.values()))
        key = (stack.fused == 0, tuple(reasons))
        if key in self._logged:
            return
        self._logged.add(key)
        if stack.fused == 0:
            logger.info("CPU decode step: no layer runs fused (%s); the model's forward runs the step", "; ".join(reasons))
        else:
            logger.info("CPU decode step: layers %s run eagerly (%s), the other %d fused",
                        ", ".join(map(str, stack.eager)), "; ".join(reasons), stack.fused)

    def _eager_layer(self, layer, kv_cache: torch.Tensor) -> Callable:
        """An eager layer in the fused loop's calling convention: torch views in, numpy out."""

        def run(x, residual, has_residual, *step) -> None:
            out, res_out = step[-2], step[-1]
            if self._eager_rope is None:
                self._eager_rope = self.model.rotary(self._positions, torch.float32)
            mlp, res = layer(torch.from_numpy(x), torch.from_numpy(residual) if has_residual else None,
                             self._eager_rope, self._meta, kv_cache)
            np.copyto(res_out, res.numpy())  # first: `res` may share memory with x (the `out` buffer)
            np.copyto(out, mlp.numpy())

        return run


def _fill_slots(lora: cpu_layers.LoRARows, batch: LoRABatch) -> None:
    """Copy the batch's token slots (one per row, in row order; -1: none) into the stack's buffer,
    checked: a wrong count or a slot outside the banks would add another row's adapter, or read
    outside them."""
    rows = lora.rows
    slots = batch.row_slots(rows)
    if slots is None:
        raise ValueError(f"LoRA batch: {len(batch.token_slots)} token slots for a decode step of {rows} rows; build "
                         "it with LoRABatch.of(one slot per row, in the step's row order, -1 for none)")
    if lora.slots is not None and rows and (slots.min() < -1 or slots.max() >= lora.slots):
        raise ValueError(f"LoRA batch: token slots {np.asarray(slots).tolist()} outside -1 (no adapter) .. "
                         f"{lora.slots - 1}: the banks hold {lora.slots} adapters (attach_banks slots=)")
    np.copyto(lora.token_slots, slots)


class EmbeddingLookup:
    """ids [n] int64 -> fp32 rows [n, hidden] of the model's embedding, equal to its forward:
    numpy for an fp32 nn.Embedding, a bf16 one widened (strata.memory.bf16_weights) and a tied
    quantised one (strata.memory.quant); the module itself otherwise. `current()` rebuilds it when
    the module's tensors (and a quantised one's head's) were replaced (_Snapshot)."""

    def __init__(self, embed) -> None:
        self.module = embed
        self._cache: tuple | None = None

    def current(self) -> Callable[[np.ndarray], np.ndarray]:
        """The lookup for the module's tensors as they are now."""
        if self._cache is None or not self._cache[0].unchanged():
            owners = [self.module, *getattr(self.module, "head", [])]  # QuantEmbedding reads its (unregistered) head
            self._cache = (_Snapshot(owners), _lookup(self.module))
        return self._cache[1]

    def __call__(self, ids: np.ndarray) -> np.ndarray:
        return self.current()(ids)


def _lookup(embed) -> Callable[[np.ndarray], np.ndarray]:
    kind, w = type(embed).__name__, getattr(embed, "weight", None)
    if kind == "Embedding" and w.dtype is torch.float32 and w.is_cpu and w.is_contiguous():
        return w.detach().numpy().__getitem__
    if kind == "WidenedEmbedding" and embed.out_dtype is torch.float32 and w.is_cpu and w.is_contiguous():
        table = w.detach().view(torch.int16).numpy()  # bf16 bits; widening is exact: bits << 16
        return lambda ids: (table[ids].astype(np.int32) << 16).view(np.float32)
    if kind == "QuantEmbedding" and embed.dtype is torch.float32 and cpu_quant.usable(embed.head[0].scale,
                                                                                      embed.head[0].qweight):
        head = embed.head[0]
        qw, sc = head.qweight.numpy(), head.scale.numpy()
        return lambda ids: cpu_quant.embedding_rows_np(head.method, qw, sc, ids, head.group_size)
    return lambda ids: embed(torch.from_numpy(ids)).contiguous().numpy()


def _norm_args(norm) -> tuple | None:
    """(weight, eps) of a plain fp32 RMSNorm (not Gemma's 1 + w), else None."""
    if type(norm) is not RMSNorm or norm.weight.dtype is not torch.float32 or type(norm.eps) is not float:
        return None
    return norm.weight.detach().numpy(), np.float32(norm.eps)

"""The model runner: turns the scheduler's decision into tensors and runs the forward pass.

It decides *how* (tensors, device, attention metadata), never *what*: no policy here. A step's
tokens are flattened: prefill chunks first, then one token per decoding sequence.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import torch

from strata.engine.scheduler import ScheduledSeq, SchedulerOutput
from strata.engine.speculative import DraftView
from strata.graph.decode_step import DecodeStep
from strata.graph.lora import LoRABatch, lora_batch
from strata.graph.models.llama import CausalLM
from strata.kernels.attention import (
    AttentionBackend,
    AttentionMetadata,
    PrefillSpan,
    resolve_backend,
)
from strata.memory.kv_cache import copy_blocks
from strata.memory.swap import KVSwapper


class ModelRunner:
    def __init__(
        self, model: CausalLM, kv_caches: list[torch.Tensor], block_size: int, device: str,
        attention_backend: AttentionBackend | str = "sdpa", *, forward: Callable | None = None,
        decode_step: DecodeStep | None = None, swapper: KVSwapper | None = None, lora=None,
    ) -> None:
        """forward: the step's forward, the model itself or its FX-fused step (graph/fusion.py);
        decode_step: the platform's, tried first for all-decode steps (graph/decode_step.py: the
        fused CPU layer loop, torch.compile / CUDA graphs; None for a step it does not run);
        swapper: copies swapped KV blocks (None without swap space); lora: the engine's LoRAManager
        (engine/lora_manager.py), whose slots each step's adapters are put in."""
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = torch.device(device)
        self.backend = resolve_backend(attention_backend)
        self.forward = forward or model
        self.decode_step = decode_step
        self.swapper = swapper
        self.prompt_rows: list[tuple] = []
        self.prompt_logits: list[tuple] = []
        self._next = None  # (positions, metadata, order) of the last all-decode step
        self.lora = lora
        self.lora_batch: LoRABatch | None = None  # the step's rows by adapter slot (graph/lora.py)

    def weights_may_have_changed(self) -> None:
        """The caller held control (a request was added): the decode step re-checks its weight views."""
        if self.decode_step is not None:
            self.decode_step.weights_may_have_changed()

    def _tensor(self, data) -> torch.Tensor:
        """An int64 tensor of `data` (a list, or a list of equal-length lists) on the device. On
        CPU through numpy: ~1 vs ~4 us a call, and a step makes 5-10 of them."""
        if self.device.type == "cpu":
            return torch.from_numpy(np.array(data, dtype=np.int64))
        return torch.tensor(data, dtype=torch.long, device=self.device)

    def prepare(self, out: SchedulerOutput):
        """Build input ids, positions, attention metadata and the rows whose logits are needed
        (None: every row, in order)."""
        bs = self.block_size
        # a decode computes one token and samples; a 1-token prompt chunk that does not finish
        # the prompt is a (tiny) prefill chunk
        is_decode = [s.num_tokens == 1 and s.samples for s in out.scheduled]
        prefills = [s for s, d in zip(out.scheduled, is_decode) if not d]
        decodes = [s for s, d in zip(out.scheduled, is_decode) if d]
        ids: list[int] = []
        positions: list[torch.Tensor] = []
        slots: list[torch.Tensor] = []
        spans: list[PrefillSpan] = []
        logit_rows: list[int] = []
        order = []
        prompt_rows: list[tuple] = []  # (sequence, first position, rows): prompt_logprobs requests
        for s in prefills:  # prompt chunks, and decodes verifying a draft (last token + draft)
            seq, start, n = s.seq, s.seq.num_computed_tokens, s.num_tokens
            begin = len(ids)
            ids += seq.token_ids[start : start + n] if not s.draft else [seq.token_ids[start], *s.draft]
            pos = torch.arange(start, start + n, device=self.device)
            table = self._tensor(seq.block_table)
            positions.append(pos)
            slots.append(table[pos // bs] * bs + pos % bs)
            mask = None
            if start > 0:
                keys = torch.arange(start + n, device=self.device)
                mask = keys[None, :] <= pos[:, None]
            spans.append(PrefillSpan(begin, begin + n, start, table, mask))
            want = getattr(getattr(seq, "request", None), "prompt_logprobs", None)
            if want is not None and start + 1 < seq.num_prompt_tokens:  # rows predicting prompt tokens
                end = min(start + n, seq.num_prompt_tokens - 1)
                prompt_rows.append((seq, start, list(range(begin, begin + end - start))))
            if s.draft:  # every position: row i samples as if draft[:i] were accepted
                logit_rows += range(begin, begin + n)
                order += [(s, i) for i in range(n)]
            elif s.samples:
                logit_rows.append(len(ids) - 1)
                order.append((s, 0))
        p = len(ids)
        decode_tables = decode_mask = decode_lens = None
        if decodes:
            dpos = [s.seq.num_computed_tokens for s in decodes]
            ids += [s.seq.token_ids[q] for s, q in zip(decodes, dpos)]
            max_blocks = max(len(s.seq.block_table) for s in decodes)
            tables = [s.seq.block_table + [0] * (max_blocks - len(s.seq.block_table)) for s in decodes]
            dslots = [s.seq.block_table[q // bs] * bs + q % bs for s, q in zip(decodes, dpos)]
            decode_tables = self._tensor(tables)
            dpos_t = self._tensor(dpos)
            positions.append(dpos_t)
            slots.append(self._tensor(dslots))
            decode_lens = self._tensor([q + 1 for q in dpos])
            if self.backend.uses_decode_mask:  # torch/sdpa; the numba and Triton kernels read lengths
                keys = torch.arange(max_blocks * bs, device=self.device)
                decode_mask = (keys[None, :] <= dpos_t[:, None]).view(len(decodes), 1, 1, -1)
            logit_rows += range(p, len(ids))
            order += [(s, 0) for s in decodes]
        meta = AttentionMetadata(
            slot_mapping=torch.cat(slots) if len(slots) > 1 else slots[0],
            prefills=spans,
            num_prefill_tokens=p,
            decode_block_tables=decode_tables,
            decode_mask=decode_mask,
            decode_context_lens=decode_lens,
            backend=self.backend,
        )
        pos_t = torch.cat(positions) if len(positions) > 1 else positions[0]
        self.prompt_rows = prompt_rows
        if self.lora is not None:
            self.lora_batch = self._lora_rows([*prefills, *decodes])
        # every row in order (an all-decode step): no gather, the hidden states are the rows
        every_row = len(logit_rows) == len(ids) and logit_rows == list(range(len(ids)))
        return self._tensor(ids), pos_t, meta, None if every_row else self._tensor(logit_rows), order

    def _decode_step(self) -> DecodeStep | None:
        """The platform's decode step, unless this step has adapters it does not apply."""
        step = self.decode_step
        return step if step is None or self.lora_batch is None or step.supports_lora else None

    def _lora_rows(self, scheduled: list[ScheduledSeq]) -> LoRABatch | None:
        """Each token row's adapter slot, in the step's row order (prefill chunks, then decodes)."""
        ids = {s.seq.request.lora_id for s in scheduled} - {0}
        if not ids:
            return None
        slot = self.lora.slots_for(ids, set())
        rows = np.concatenate([np.full(s.num_tokens, slot.get(s.seq.request.lora_id, -1), np.int64)
                               for s in scheduled])
        return LoRABatch.of(rows)

    def _sampling_rows(self, order: list[tuple[ScheduledSeq, int]]):
        """Each sampling sequence with its logits row: a request forking this step (n > 1) has
        its siblings sample from the parent's row; row i > 0 of a draft samples for a DraftView.
        Returns (sequences, row index or None)."""
        seqs = [s.seq if i == 0 else DraftView(s.seq, s.draft[:i]) for s, i in order]
        if not any(s.forks for s, _ in order):
            return seqs, None
        expanded, rows = [], []
        for r, ((s, i), seq) in enumerate(zip(order, seqs)):
            forks = s.forks if i == 0 else []
            expanded += [seq, *forks]
            rows += [r] * (1 + len(forks))
        seqs = expanded
        return seqs, torch.tensor(rows, device=self.device)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput):
        """Run one step; returns (logits [rows, vocab] fp32, the sequence sampling each row)."""
        if self.swapper is not None:
            self.swapper.wait()  # last step's prefetches: those sequences run now
            self.swapper.swap_out(out.swap_out)  # before the freed blocks are written again
            self.swapper.start_swap_in(out.swap_in)  # overlaps this step's forward
        copy_blocks(self.kv_caches, out.block_copies)
        self._next = None
        if not out.scheduled:
            return None, []
        ids, pos, meta, rows, order = self.prepare(out)
        # an all-decode step: what execute_next advances (multi-step decode)
        self._next = (pos, meta, order) if meta.num_prefill_tokens == 0 and rows is None else None
        return self._run(ids, pos, meta, rows, order)

    def execute_next(self, token_ids: list[int]):
        """The decode step after an all-decode `execute`: every sequence of that step computes the
        token it just sampled (`token_ids`, in its rows' order), one position further on. Its blocks
        are already in its table (the scheduler reserved them, Scheduler._steps_ahead), so only the
        positions, slots, lengths (and the torch backends' mask) move: in the decode step's own
        rows where it continues itself (the fused CPU step), else here."""
        if self._next is None:
            raise RuntimeError("execute_next: the last step was not an all-decode step")
        pos, meta, order = self._next
        if self._decode_step() is not None:
            with lora_batch(self.lora_batch):
                hidden = self.decode_step.next(token_ids)
            if hidden is not None:
                return self._logits(hidden, None, order)
        bs, tables = self.block_size, meta.decode_block_tables
        pos = pos + 1
        slots = tables.gather(1, (pos // bs)[:, None]).squeeze(1) * bs + pos % bs
        lens = pos + 1
        mask = None
        if meta.decode_mask is not None:
            keys = torch.arange(tables.shape[1] * bs, device=self.device)
            mask = (keys[None, :] <= pos[:, None]).view(len(order), 1, 1, -1)
        meta = dataclasses.replace(meta, slot_mapping=slots, decode_mask=mask, decode_context_lens=lens)
        self._next = (pos, meta, order)
        with torch.inference_mode():  # (not around the fused path: entering it costs ~10 us a step)
            return self._run(self._tensor(token_ids), pos, meta, None, order)

    def _run(self, ids, pos, meta, rows, order):
        """Forward and logits of a prepared step."""
        hidden = None
        with lora_batch(self.lora_batch):
            if self._decode_step() is not None and meta.num_prefill_tokens == 0:
                hidden = self.decode_step(ids, pos, meta)  # None: not a step it captures
            if hidden is None:
                hidden = self.forward(ids, pos, meta, self.kv_caches)
        self.prompt_logits = [(seq, start, self.model.compute_logits(hidden.index_select(0, self._tensor(r))).float())
                              for seq, start, r in self.prompt_rows]  # read by the engine (prompt_logprobs)
        if not order:
            return None, []
        return self._logits(hidden, rows, order)

    def _logits(self, hidden, rows, order):
        """(logits of the sampling rows, fp32; the sequence sampling each row)."""
        logits = None if self.decode_step is None or rows is not None else self.decode_step.logits_of(hidden)
        if logits is None:
            logits = self.model.compute_logits(hidden if rows is None else hidden.index_select(0, rows))
        else:  # the decode step ran the head with the final norm
            logits = self.model.cap_logits(logits)
        seqs, expand = self._sampling_rows(order)
        if expand is not None:
            logits = logits[expand]
        # (.float() of an fp32 tensor is a no-op that still costs a dispatch, ~17 us here)
        return logits if logits.dtype is torch.float32 else logits.float(), seqs

"""Structured output: a request's StructuredOutput -> an llguidance grammar -> per-token masks.

llguidance (PyPI, CPU wheels) compiles JSON schemas, regexes and Lark grammars against the
checkpoint's tokenizer and computes, per step, the set of tokens that keep the output inside
the grammar. Why llguidance rather than xgrammar: docs/design-notes.md, "Structured output"
(benchmarks/structured_engines.py measures both on our tokenizers).

Per sequence, a matcher (deep copy of a cached, compiled template) follows the sampled tokens.
Each step's masks are computed in a worker thread while the forward pass runs (they depend only
on tokens already sampled, and on a speculative draft: one mask per verify row, after its draft
prefix), then the sampler applies them to the constrained rows only, as one vectorised
masked_fill: unconstrained rows in the same batch are untouched.

Choices made here (a user can override the first two inside the schema: x-guidance):
- JSON is compact: ", " and ": " separators, no other whitespace (a random or weak model cannot
  loop on newlines, and the output is deterministic);
- an object schema without `additionalProperties` is closed (as xgrammar's strict mode does):
  the model writes the properties the schema names, and the output still validates;
- the completion stops as soon as the grammar is complete (finish_reason "stop").
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from strata.protocol.sampling_params import StructuredOutput
from strata.protocol.structured import grammar_text, load_llguidance, unusable

logger = logging.getLogger(__name__)

MAX_CACHED_GRAMMARS = 256  # compiled templates kept (LRU); a matcher per sequence is a deep copy


class GrammarCompiler:
    """Compiles StructuredOutputs against one tokenizer; hands each sequence its own matcher."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: list[int]) -> None:
        self._tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._tokenizer = None
        self._templates: OrderedDict[str, object] = OrderedDict()
        self._lock = threading.Lock()  # the mask thread never compiles, but be safe with callers

    @property
    def tokenizer(self):
        """llguidance's view of the vocabulary: built at the first structured request (~ms per
        thousand tokens), with the model's vocabulary size (logit rows may be padded past it)."""
        if self._tokenizer is None:
            llg = load_llguidance()
            eos = self.eos_token_ids[0] if len(self.eos_token_ids) == 1 else (self.eos_token_ids or None)
            self._tokenizer = llg.LLTokenizer(self._tokenizer_json, n_vocab=self.vocab_size, eos_token=eos)
        return self._tokenizer

    def matcher(self, so: StructuredOutput, param: str = "structured"):
        """A fresh matcher for one sequence; RequestError if the grammar does not compile."""
        text = grammar_text(so, param)
        with self._lock:
            template = self._templates.get(text)
            if template is None:
                template = load_llguidance().LLMatcher(self.tokenizer, text, log_level=0)
                if template.is_error():
                    raise unusable(so, param, template.get_error())
                self._templates[text] = template
                if len(self._templates) > MAX_CACHED_GRAMMARS:
                    self._templates.popitem(last=False)
            else:
                self._templates.move_to_end(text)
            return template.deep_copy()


class GrammarMasks:
    """Each step's token masks for the constrained sequences, computed beside the forward pass."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="strata-grammar")
        self._shifts = torch.arange(32, dtype=torch.int32)
        self.masks = 0  # masks computed, and the seconds spent (for `strata bench structured`)
        self.compute_seconds = 0.0  # in the worker thread, beside the forward pass
        self.wait_seconds = 0.0  # the step waited for the worker after the forward pass
        self.apply_seconds = 0.0  # unpacking and masking in the sampler (critical path)

    def start(self, scheduled) -> Future | None:
        """Begin computing masks for the constrained sequences sampling this step (ScheduledSeqs):
        one per sequence, and for a sequence verifying a speculative draft one per verify row
        (the grammar's state after each draft prefix). None when none is constrained."""
        todo = [(seq, s.draft if seq is s.seq else []) for s in scheduled if s.samples
                for seq in (s.seq, *s.forks) if seq.grammar is not None]
        if not todo:
            return None
        return self._pool.submit(self._compute, todo)

    def _compute(self, todo) -> tuple[dict[tuple[int, int], int], torch.Tensor]:
        t0 = time.perf_counter()
        bitmask = torch.empty(sum(1 + len(d) for _, d in todo), self.words, dtype=torch.int32)
        row_bytes = self.words * 4
        rows: dict[tuple[int, int], int] = {}  # (sequence, draft tokens before the row) -> mask row
        for seq, draft in todo:
            m, consumed = seq.grammar, 0
            for i in range(len(draft) + 1):  # llguidance drops the GIL while it computes
                rows[(seq.seq_id, i)] = len(rows)
                m.unsafe_compute_mask_ptr(bitmask[len(rows) - 1].data_ptr(), row_bytes)
                if i == len(draft) or m.validate_tokens(draft[i:i + 1]) != 1:
                    break  # later rows follow a draft token the grammar refuses: never accepted
                m.consume_token(draft[i])
                consumed += 1
            if consumed:
                m.rollback(consumed)  # the tokens kept are consumed again by the lifecycle
        self.masks += len(rows)
        self.compute_seconds += time.perf_counter() - t0
        return rows, bitmask

    def apply(self, logits: torch.Tensor, seqs, pending: Future | None) -> torch.Tensor:
        """Logits with every token a row's grammar forbids at -inf (constrained rows only)."""
        if pending is None:
            return logits
        t0 = time.perf_counter()
        rows_of, bitmask = pending.result()
        t1 = time.perf_counter()
        self.wait_seconds += t1 - t0
        keys = [(s.seq_id, len(getattr(s, "draft", ()))) for s in seqs]  # DraftViews carry their draft
        rows = [r for r, key in enumerate(keys) if key in rows_of]
        if not rows:
            return logits
        bits = bitmask[[rows_of[keys[r]] for r in rows]]
        allowed = ((bits.unsqueeze(-1) >> self._shifts) & 1).bool().view(len(rows), -1)
        width = logits.shape[-1]
        if allowed.shape[1] < width:  # rows past the grammar's vocabulary are never allowed
            allowed = torch.nn.functional.pad(allowed, (0, width - allowed.shape[1]))
        allowed = allowed[:, :width].to(logits.device)
        index = torch.tensor(rows, device=logits.device)
        logits = logits.clone()
        logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
        self.apply_seconds += time.perf_counter() - t1
        return logits

    def close(self) -> None:
        self._pool.shutdown(wait=False)

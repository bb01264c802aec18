"""A sequence's life between its tokens: how it is created and when it stops.

The scheduler owns the request lifecycle (scheduler.py) and asks this policy two things: make a
sequence for completion `index` of a request (with an incremental detokeniser when the engine
detokenises), and take one sampled token (timeline stamps, EOS / stop ids / max_tokens /
max_model_len / stop strings). It holds no sequences itself.
"""

from __future__ import annotations

import itertools
import logging
import math

from strata.engine.request import Request, Sequence
from strata.protocol.output_text import OutputText

logger = logging.getLogger(__name__)


class SequenceLifecycle:
    def __init__(self, eos_token_ids: list[int] = (), max_model_len: int | float = math.inf,
                 tokenizer=None, grammars=None) -> None:
        """tokenizer: detokenise each sequence's output (and apply stop strings) as tokens come;
        None leaves text and stop strings to the caller (the server's front end). grammars:
        engine/grammar.GrammarCompiler, for requests with structured output (None: refused)."""
        self.eos_token_ids = list(eos_token_ids)
        self.max_model_len = max_model_len
        self.tokenizer = tokenizer
        self.grammars = grammars
        self._seq_ids = itertools.count()

    def new_sequence(self, req: Request, index: int) -> Sequence:
        seq = Sequence(next(self._seq_ids), req, index, list(req.prompt_token_ids))
        if self.tokenizer is not None:
            seq.output_text = OutputText(self.tokenizer, req.prompt_token_ids, req.params)
        if req.params.structured is not None:  # the engine checked it compiles (LLMEngine.validate)
            seq.grammar = self.grammars.matcher(req.params.structured)
        req.seqs.append(seq)
        return seq

    def append(self, seq: Sequence, token: int, logprob: dict | None, now: float) -> bool:
        """Add one sampled token; True when the sequence is finished (finish_reason set)."""
        p = seq.request.params
        seq.token_ids.append(token)
        if logprob is not None:
            seq.logprobs.append(logprob)
        timeline = seq.request.timeline
        timeline.token_times.append(now)
        if timeline.first_token is None:
            timeline.first_token = now
        n_out = seq.num_output_tokens
        reason, stop_reason = None, None
        if n_out >= p.min_tokens:
            if not p.ignore_eos and token in self.eos_token_ids:
                reason = "stop"
            elif token in p.stop_token_ids:
                reason, stop_reason = "stop", token
        if seq.grammar is not None:
            reason = self._follow_grammar(seq, token) or reason
        if reason is None and (
            (p.max_tokens is not None and n_out >= p.max_tokens) or seq.num_tokens >= self.max_model_len
        ):
            reason = "length"
        if seq.output_text is not None:
            stop = seq.output_text.add(token, n_out, reason is not None)
            if stop is not None:
                reason, stop_reason = "stop", stop
        if reason is None:
            return False
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        return True

    @staticmethod
    def _follow_grammar(seq: Sequence, token: int) -> str | None:
        """Advance the sequence's grammar; "stop" once it is complete (nothing more may follow)."""
        if not seq.grammar.consume_token(token):  # the mask allowed only valid tokens: a bug if here
            logger.error("sequence %d: token %d broke its grammar (%s); stopping it", seq.seq_id, token,
                         seq.grammar.get_error())
            return "stop"
        return "stop" if seq.grammar.is_stopped() else None

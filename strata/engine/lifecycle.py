"""A sequence's life between its tokens: how it is created and when it stops.

The scheduler owns the request lifecycle (scheduler.py) and asks this policy two things: make a
sequence for completion `index` of a request (with an incremental detokeniser when the engine
detokenises), and take one sampled token (timeline stamps, EOS / stop ids / max_tokens /
max_model_len / stop strings). It holds no sequences itself.
"""

from __future__ import annotations

import itertools
import math

from strata.engine.request import Request, Sequence


class SequenceLifecycle:
    def __init__(self, eos_token_ids: list[int] = (), max_model_len: int | float = math.inf,
                 tokenizer=None) -> None:
        """tokenizer: detokenise each sequence's output (and apply stop strings) as tokens come;
        None leaves text and stop strings to the caller (the server's front end)."""
        self.eos_token_ids = list(eos_token_ids)
        self.max_model_len = max_model_len
        self.tokenizer = tokenizer
        self._seq_ids = itertools.count()

    def new_sequence(self, req: Request, index: int) -> Sequence:
        seq = Sequence(next(self._seq_ids), req, index, list(req.prompt_token_ids))
        if self.tokenizer is not None:
            from strata.engine.output_text import OutputText

            seq.output_text = OutputText(self.tokenizer, req.prompt_token_ids, req.params)
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
        if reason is None and (
            (p.max_tokens is not None and n_out >= p.max_tokens) or seq.num_tokens >= self.max_model_len
        ):
            reason = "length"
        if seq.output_text is not None:
            stop = seq.output_text.add(token, n_out, reason is not None)
            if stop is not None:
                reason, stop_reason = "stop", stop
            seq.text = seq.output_text.text
        if reason is None:
            return False
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        return True

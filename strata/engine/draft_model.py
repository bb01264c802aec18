"""A small draft model for speculative decoding (--speculative-model PATH).

The draft model shares the target's vocabulary and runs on its own paged KV cache (its own block
manager and runner: engine/build.draft_proposer assembles them). Each target sequence that drafts
has a shadow sequence here. To propose, the shadow is brought level with the target's tokens
(KV it computed for drafts the target rejected is dropped: its block table is truncated to the
common prefix), the tokens it has not computed yet run as one span, then K - 1 one-token steps
follow; every draft token is the draft model's argmax. A greedy draft is a one-hot q, so the
target's sample-and-compare verification (engine/speculative.accept) is exact rejection sampling.
A sequence whose shadow cannot get KV blocks here simply does not draft.
"""

from __future__ import annotations

import torch

from strata.engine.request import Request, Sequence
from strata.engine.scheduler import ScheduledSeq, SchedulerOutput
from strata.protocol.sampling_params import SamplingParams


class DraftModelProposer:
    def __init__(self, runner, blocks) -> None:
        """runner: a ModelRunner over the draft model and its KV cache; blocks: its BlockManager."""
        self.runner, self.blocks = runner, blocks
        self._shadows: dict[int, Sequence] = {}

    def _shadow(self, seq: Sequence) -> Sequence:
        shadow = self._shadows.get(seq.seq_id)
        if shadow is None:
            req = Request(f"draft-{seq.seq_id}", None, list(seq.request.prompt_token_ids), SamplingParams())
            shadow = self._shadows[seq.seq_id] = Sequence(seq.seq_id, req, 0, [])
        return shadow

    def propose_for(self, seq: Sequence, k: int) -> list[int]:
        if k <= 0:
            return []
        shadow = self._shadow(seq)
        common = 0
        # the target's last token is always (re)computed here: its logits give the first draft
        limit = min(len(shadow.token_ids), len(seq.token_ids) - 1, shadow.num_computed_tokens)
        while common < limit and shadow.token_ids[common] == seq.token_ids[common]:
            common += 1
        shadow.num_computed_tokens = common
        self.blocks.truncate(shadow, common)
        shadow.token_ids = list(seq.token_ids)
        drafts: list[int] = []
        while len(drafts) < k:
            n = shadow.num_tokens - shadow.num_computed_tokens
            if not self.blocks.can_allocate(shadow, shadow.num_tokens):
                break  # no room in the draft cache: propose what we have
            self.blocks.allocate(shadow, shadow.num_tokens)
            logits, _ = self.runner.execute(SchedulerOutput(scheduled=[ScheduledSeq(shadow, n)]))
            shadow.num_computed_tokens += n
            token = int(torch.argmax(logits[0]))
            drafts.append(token)
            shadow.token_ids.append(token)
        return drafts

    def forget(self, seq: Sequence) -> None:
        shadow = self._shadows.pop(seq.seq_id, None)
        if shadow is not None:
            self.blocks.free(shadow)

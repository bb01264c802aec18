"""Speculative decoding: draft K tokens cheaply, verify them in one forward, keep what the target
model would have produced.

Drafting: prompt lookup (n-gram): the last n tokens of a sequence (n from prompt_lookup_max down
to prompt_lookup_min) are looked up earlier in its prompt + output, and the K tokens that followed
become the draft. No draft model; it pays where the output repeats its context (summaries, edits,
code, extraction). Or a small draft model of the same vocabulary (engine/draft_model.py), greedy.

Verification: the scheduler gives a drafting sequence 1 + K tokens this step (its last token and
the draft), as one span over the paged cache; the runner returns logits for every position, and
row i is sampled as if drafts 1..i had been accepted (a DraftView gives the sampler the token
history, so penalties, min_tokens and per-request seeds see exactly what plain decoding would).
A draft token is accepted while it equals the token sampled at its position; the first sample
that differs (or the one after the last draft) is the step's bonus token. For a deterministic
draft (q = one-hot at d) this is rejection sampling: d is accepted with probability p(d) =
min(1, p(d)/q(d)), and on rejection the sample is drawn from p restricted to tokens != d, which is
the residual max(0, p - q) renormalised, so every emitted token has the target distribution
exactly (`rejection_sample` is the general rule, for any q; tests check both by chi-square). Under
greedy decoding the emitted tokens are the plain greedy tokens.

Rolled back: the KV written for rejected drafts is dropped by truncating the sequence's block
table (BlockManager.truncate); those positions are recomputed when they are decoded for real.
Structured output: each verify row gets its grammar's mask after that row's draft prefix
(engine/grammar.GrammarMasks), so a draft token the grammar forbids is simply rejected.
Off where it does not pay: a sequence whose drafts keep being rejected (acceptance below MIN_ACCEPTANCE after
WARMUP_DRAFTS drafted tokens) stops drafting; and, measured on this machine, while steps that
verify drafts cost more seconds per emitted token than plain decode steps (a verify step is a
small prefill: on a CPU running a small model it can cost several decode steps), drafting pauses,
with a short probe every PROBE_EVERY steps to notice when it pays again (and while drafting, one
step in PLAIN_EVERY decodes plainly, so the comparison always has both costs).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from strata.engine.request import Sequence

MIN_ACCEPTANCE = 0.15  # below this acceptance a sequence stops drafting (the verify rows cost compute)
WARMUP_DRAFTS = 24  # drafted tokens before that judgement
EMA = 0.1  # weight of the newest step in the measured seconds per token, with and without drafts
MIN_SAMPLES = 8  # steps of each kind measured before drafting can be paused
PROBE_EVERY = 64  # while paused, every this many steps draft again for PROBE_STEPS to re-measure
PROBE_STEPS = 8
PLAIN_EVERY = 16  # while drafting, one step in this many decodes plainly, to keep measuring that cost


class NgramProposer:
    """Prompt lookup: the continuation of the latest earlier occurrence of the context's suffix."""

    def __init__(self, max_n: int = 4, min_n: int = 2) -> None:
        self.max_n, self.min_n = max_n, min_n

    def propose_for(self, seq: Sequence, k: int) -> list[int]:
        return self.propose(seq.token_ids, k)

    def forget(self, seq: Sequence) -> None:
        pass

    def propose(self, tokens: list[int], k: int) -> list[int]:
        if k <= 0 or len(tokens) < self.min_n + 1:
            return []
        arr = np.asarray(tokens, dtype=np.int64)
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            pattern = arr[-n:]
            windows = np.lib.stride_tricks.sliding_window_view(arr[:-1], n)  # never the suffix itself
            hits = np.flatnonzero((windows == pattern).all(axis=1))
            if hits.size:  # the latest match followed by k tokens (a run or a loop has one), else the latest
                full = hits[hits + n + k <= len(tokens)]
                start = int(full[-1] if full.size else hits[-1]) + n
                return arr[start:start + k].tolist()
        return []


class DraftView:
    """Sequence `base` as if `draft` had been appended: what the sampler reads for a verify row
    (its grammar mask is keyed by the base's seq_id and len(draft): engine/grammar.py)."""

    def __init__(self, base: Sequence, draft: list[int]) -> None:
        self.base, self.draft = base, draft

    def __getattr__(self, name):  # request, index, seq_id, ...: the base's (lazily: tensor-parallel
        return getattr(self.base, name)  # ranks > 0 build views of plan items they never sample)

    @property
    def token_ids(self) -> list[int]:
        return self.base.token_ids + self.draft

    @property
    def num_output_tokens(self) -> int:
        return self.base.num_output_tokens + len(self.draft)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.base.num_prompt_tokens:]


@dataclass
class SpecStats:
    """Counters since the engine started (the server exports them in /metrics)."""

    steps: int = 0  # sequence-steps that verified a draft
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0  # tokens those steps produced (accepted + one each)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_step(self) -> float:
        return self.emitted / self.steps if self.steps else 0.0


@dataclass
class _SeqRecord:
    drafted: int = 0
    accepted: int = 0
    off: bool = False


@dataclass
class Speculator:
    """Which sequences draft, their drafts, and what the verification accepted."""

    num_tokens: int
    proposer: object  # NgramProposer or draft_model.DraftModelProposer: propose_for(seq, k), forget(seq)
    stats: SpecStats = field(default_factory=SpecStats)
    _records: dict[int, _SeqRecord] = field(default_factory=dict)
    # measured seconds per emitted token of steps with drafts ("spec") and without ("plain")
    cost: dict[str, float] = field(default_factory=dict)
    samples: dict[str, int] = field(default_factory=lambda: {"spec": 0, "plain": 0})
    paused: bool = False
    _since_pause: int = 0
    _steps: int = 0

    def observe_step(self, drafted: bool, seconds: float, tokens: int) -> None:
        """One engine step: its wall time and the tokens it produced (engine/llm_engine.py)."""
        self._steps += 1
        if tokens <= 0:
            return
        kind = "spec" if drafted else "plain"
        per = seconds / tokens
        self.cost[kind] = per if kind not in self.cost else (1 - EMA) * self.cost[kind] + EMA * per
        self.samples[kind] += 1
        if min(self.samples.values()) >= MIN_SAMPLES:
            self.paused = self.cost["spec"] > self.cost["plain"]
        self._since_pause = self._since_pause + 1 if self.paused else 0

    def _probing(self) -> bool:
        return self._since_pause % PROBE_EVERY < PROBE_STEPS

    def draft(self, seq: Sequence, limit: int) -> list[int]:
        """Up to min(K, limit) draft tokens for a decoding sequence ([] = decode plainly)."""
        if limit <= 0:
            return []
        if self.paused and not self._probing():
            return []
        if not self.paused and self._steps % PLAIN_EVERY == PLAIN_EVERY - 1:
            return []  # a measured plain step
        rec = self._records.get(seq.seq_id)
        if rec is not None and rec.off:
            return []
        return self.proposer.propose_for(seq, min(self.num_tokens, limit))

    def record(self, seq: Sequence, drafted: int, accepted: int) -> None:
        rec = self._records.setdefault(seq.seq_id, _SeqRecord())
        rec.drafted += drafted
        rec.accepted += accepted
        if rec.drafted >= WARMUP_DRAFTS and rec.accepted < MIN_ACCEPTANCE * rec.drafted:
            rec.off = True
        st = self.stats
        st.steps += 1
        st.drafted += drafted
        st.accepted += accepted
        st.emitted += accepted + 1

    def forget(self, seq: Sequence) -> None:
        self._records.pop(seq.seq_id, None)
        self.proposer.forget(seq)


def accept(scheduled, seqs: list, token_ids: list[int], logprobs: list, speculator: Speculator | None):
    """Sampled rows -> the tokens each sequence keeps, in order: (sequences, tokens, logprobs),
    a sequence repeated once per kept token. A drafting sequence owns 1 + K consecutive rows (its
    own, then DraftViews); it keeps row 0's token and then, while the token sampled at row i equals
    draft i + 1... (see the module doc). Sets each ScheduledSeq's `accepted`."""
    if speculator is None or not any(s.draft for s in scheduled):
        return seqs, token_ids, logprobs
    drafting = {s.seq.seq_id: s for s in scheduled if s.draft}
    out_seqs, out_tokens, out_lps = [], [], []
    i = 0
    while i < len(seqs):
        seq = seqs[i]
        s = drafting.get(seq.seq_id) if not isinstance(seq, DraftView) else None
        if s is None:
            out_seqs.append(seq)
            out_tokens.append(token_ids[i])
            out_lps.append(logprobs[i])
            i += 1
            continue
        k = len(s.draft)
        kept = 0
        while kept < k and token_ids[i + kept] == s.draft[kept]:
            kept += 1
        for j in range(kept + 1):
            out_seqs.append(seq)
            out_tokens.append(token_ids[i + j])
            out_lps.append(logprobs[i + j])
        s.accepted = kept
        speculator.record(seq, k, kept)
        i += k + 1
    return out_seqs, out_tokens, out_lps


def rejection_sample(p: torch.Tensor, q: torch.Tensor, draft: torch.Tensor, generator=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The general rule (Leviathan et al.; Chen et al.): for rows of target probabilities p, draft
    probabilities q and draft tokens d ~ q, accept d with probability min(1, p(d) / q(d)), else
    draw from normalise(max(0, p - q)). Returns (accepted mask, token). The emitted token is
    distributed as p whatever q is; with q one-hot at d this is `accept`'s sample-and-compare."""
    pd = p.gather(1, draft[:, None]).squeeze(1)
    qd = q.gather(1, draft[:, None]).squeeze(1)
    u = torch.rand(p.shape[0], generator=generator, device=p.device)
    ok = u * qd <= pd
    residual = (p - q).clamp_min(0)
    residual = residual / residual.sum(-1, keepdim=True).clamp_min(1e-30)
    resampled = torch.multinomial(residual, 1, generator=generator).squeeze(1)
    return ok, torch.where(ok, draft, resampled)

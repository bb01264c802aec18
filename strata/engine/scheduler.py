"""Iteration-level scheduler: which sequences run this step, and how many tokens each.

Each step has a token budget (max_num_batched_tokens). Running sequences go first (decodes take
one token, unfinished prefills take a chunk), then waiting sequences are admitted FCFS while the
budget, max_num_seqs and free blocks allow. Decode-first: while any sequence is decoding, the
step's prefill tokens (chunks of running prefills and new admissions together) are capped at
max_prefill_tokens_while_decoding, so a long prompt is spread over several steps instead of
freezing every running stream for one long step. When a running sequence needs a block and none is
free, the most recently admitted sequence is preempted: either by recompute (its blocks are freed
and it returns to the head of the queue, to re-prefill prompt + output later) or by swap (its
blocks are copied to the host pool and brought back, one step ahead, before new admissions). The
scheduler never touches tensors: it records block copies for the runner.

The scheduler also owns the request lifecycle: it creates a request's first sequence, forks a
request with n > 1 into n sequences in the step that computes its prompt's last token (the
children sample their first token from the parent's logits row, and after the step share the
parent's prompt blocks), and, in `update`, applies each step's sampled tokens and stop conditions
(engine/lifecycle.py) and frees what finished. The engine's step is schedule -> execute -> sample -> update.

Prefix caching: a sequence admitted with no computed tokens first takes the longest run of its
full blocks that the block manager has cached, and starts computing after them. Only blocks that
end before the last known token count, so at least that token is computed (its logits are needed)
and it is written into a block the sequence owns alone. After each step, blocks that became full
of computed KV are registered in the cache.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from strata.engine.lifecycle import SequenceLifecycle
from strata.engine.request import Request, SeqStatus, Sequence
from strata.memory.blocks import BlockManager, PrefixMatch
from strata.platform.policy import StepPolicy


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_tokens: int  # new tokens to compute this step (a decode's 1 + its draft's)
    forks: list[Sequence] = field(default_factory=list)  # n > 1: siblings sampling from seq's row
    draft: list[int] = field(default_factory=list)  # speculative decoding: tokens verified this step
    accepted: int = 0  # of the draft, set once the step is sampled (engine/speculative.accept)

    @property
    def samples(self) -> bool:
        """True when this step computes the last known token, so a new one is sampled."""
        return self.seq.num_computed_tokens + self.num_tokens - len(self.draft) == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, host block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host block, device block)
    # multi-step decode: decode steps this scheduler call may run (every sequence a plain decode,
    # their blocks reserved for that many tokens); the engine sets it to the steps it ran
    num_steps: int = 1

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)


class Scheduler:
    def __init__(
        self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
        prefer_swap: Callable[[Sequence], bool] | None = None, lifecycle: SequenceLifecycle | None = None,
        policy: StepPolicy | None = None, speculator=None, lora=None,
    ) -> None:
        """prefer_swap(seq): the preemption policy when the block manager has a host pool
        (default: always swap when it has room). lifecycle: sequence creation and stop rules.
        policy: the engine's StepPolicy (platform/policy.py), read every call: its prefill_cap is
        the decode-first cap on a step's prefill tokens whenever a sequence is decoding (None: only
        the step budget), its lookahead the most decode steps a call runs (default: one step, no
        cap). speculator: engine/speculative.Speculator, drafts for decoding sequences (None: no
        speculative decoding). lora: engine/lora_manager.LoRAManager: the running sequences hold
        at most its max_loras adapters, and one runs once its adapter's weights are read."""
        self.speculator = speculator
        self.lora = lora
        self.blocks = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.policy = policy if policy is not None else StepPolicy()
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.swapped: deque[Sequence] = deque()  # KV in host memory, resumed before new admissions
        self._prefetched: list[Sequence] = []  # swap-in started last step; they run this step
        self.prefer_swap = prefer_swap or (lambda seq: True)
        self.lifecycle = lifecycle or SequenceLifecycle()
        self._pending_copies: list[tuple[int, int]] = []
        self.num_preemptions = 0
        self.num_swapped_out = 0

    def add_request(self, req: Request) -> Sequence:
        """Queue a new request: its first sequence (the others fork from it later)."""
        seq = self.lifecycle.new_sequence(req, 0)
        self.add(seq)
        return seq

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def abort(self, req: Request) -> None:
        """Stop every unfinished sequence of `req` wherever it is; all of its blocks are freed."""
        for seq in req.seqs:
            if not seq.finished:
                self.finish(seq)
                seq.finish_reason = "abort"
        req.forked = True

    def finish_sequence(self, req: Request, index: int, reason: str, stop_reason: int | str | None = None) -> None:
        """End one completion of a request (e.g. a stop string a front end found)."""
        for seq in req.seqs:
            if seq.index == index and not seq.finished:
                seq.finish_reason, seq.stop_reason = reason, stop_reason
                self.finish(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.swapped or self._prefetched)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(block_copies=self._pending_copies)
        self._pending_copies = []
        for seq in self._prefetched:  # their blocks land before this step's forward (runner waits)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
        self._prefetched = []
        budget = self.max_num_batched_tokens
        prefill_left = self._prefill_cap()
        scheduled_ids: set[int] = set()
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            remaining = seq.num_tokens - seq.num_computed_tokens
            n = min(remaining, budget)
            if remaining > 1:  # a prefill chunk: under the decode-first cap
                n = min(n, prefill_left)
                if n == 0:
                    i += 1
                    continue
                prefill_left -= n
            draft = self._draft(seq, budget) if remaining == 1 else []
            if not self._reserve(seq, n + len(draft), out, scheduled_ids):
                break  # seq itself was preempted; everything after it already was too
            n += len(draft)
            out.scheduled.append(ScheduledSeq(seq, n, draft=draft))
            scheduled_ids.add(seq.seq_id)
            budget -= n
            i += 1
        if not out.preempted:
            self._prefetch(out)
        if not out.preempted and not self.swapped:
            passed: list[Sequence] = []  # waiting on their adapter's slot or weights: others may pass
            while (self.waiting and budget > 0 and prefill_left > 0
                   and len(self.running) + len(self._prefetched) < self.max_num_seqs):
                seq = self.waiting[0]
                if not self._lora_fits(seq):
                    passed.append(self.waiting.popleft())
                    continue
                match = self._match_prefix(seq)
                start = seq.num_computed_tokens + (match.num_tokens if match else 0)
                n = min(seq.num_tokens - start, budget)
                if n > 1:
                    n = min(n, prefill_left)
                    prefill_left -= n
                if not self.blocks.can_allocate(seq, start + n, match=match):
                    break  # FCFS: nobody overtakes the head of the queue
                self.waiting.popleft()
                self.blocks.allocate(seq, start + n, match=match)
                if match is not None:
                    seq.num_computed_tokens = seq.num_cached_tokens = match.num_tokens
                seq.status = SeqStatus.RUNNING
                self.running.append(seq)
                out.scheduled.append(ScheduledSeq(seq, n))
                budget -= n
            self.waiting.extendleft(reversed(passed))
        if self.policy.lookahead > 1:
            out.num_steps = self._steps_ahead(out)
        now = time.time()
        for s in out.scheduled:
            timeline = s.seq.request.timeline
            if timeline.first_scheduled is None:
                timeline.first_scheduled = now
            if s.samples and not s.seq.request.forked:
                self._fork_request(s)
        return out

    def _steps_ahead(self, out: SchedulerOutput) -> int:
        """How many decode steps this call may run (multi-step decode): up to `lookahead` when every
        scheduled sequence is a plain decode (no draft, fork or grammar mask), nobody waits, is swapped or
        preempted, and free blocks hold that many more tokens of every sequence; the blocks are
        reserved here. Each sequence's max_tokens and max_model_len bound it too: the steps after
        one sequence finishes are not run (the engine stops there)."""
        if (self.waiting or self.swapped or self._prefetched or out.preempted or out.swap_in or out.swap_out
                or not out.scheduled):
            return 1
        steps = self.policy.lookahead
        for s in out.scheduled:
            seq, p = s.seq, s.seq.request.params
            if s.num_tokens != 1 or s.draft or s.forks or not s.samples or seq.grammar is not None:
                return 1
            if p.max_tokens is not None:
                steps = min(steps, p.max_tokens - seq.num_output_tokens)
            steps = min(steps, self.lifecycle.max_model_len - seq.num_tokens + 1)
        if steps <= 1:
            return 1
        blocks = self.blocks
        need = sum(max(0, blocks.blocks_for(s.seq.num_computed_tokens + steps) - len(s.seq.block_table))
                   for s in out.scheduled)
        if need > blocks.num_free:
            return 1
        for s in out.scheduled:
            blocks.allocate(s.seq, s.seq.num_computed_tokens + steps)
        return steps

    def _draft(self, seq: Sequence, budget: int) -> list[int]:
        """Speculative tokens for a decoding sequence: within the step budget, max_tokens and
        max_model_len (counting the bonus token), and only where blocks are free without preempting."""
        if self.speculator is None:
            return []
        p = seq.request.params
        limit = min(budget - 1, self.lifecycle.max_model_len - seq.num_tokens - 1)
        if p.max_tokens is not None:
            limit = min(limit, p.max_tokens - seq.num_output_tokens - 1)
        draft = self.speculator.draft(seq, int(limit))
        if draft and not self.blocks.can_allocate(seq, seq.num_computed_tokens + 1 + len(draft)):
            return []
        return draft

    def _prefill_cap(self) -> int | float:
        """Prefill tokens this step may take: the decode-first cap while any sequence decodes
        (one token left to compute), else no cap beyond the step budget."""
        cap = self.policy.prefill_cap
        if cap is None:
            return float("inf")
        decoding = any(s.num_tokens - s.num_computed_tokens == 1 for s in (*self.running, *self._prefetched))
        return cap if decoding else float("inf")

    def _fork_request(self, s: ScheduledSeq) -> None:
        """n > 1: this step computes the prompt's last token, so the other n - 1 sequences are
        made now and sample their first token from the parent's logits row; they get the prompt's
        KV in `update`, once the step has written it (_start_forks)."""
        req = s.seq.request
        req.forked = True
        s.forks = [self.lifecycle.new_sequence(req, i) for i in range(1, req.params.n)]

    def _start_forks(self, s: ScheduledSeq) -> None:
        """The children share the parent's full prompt blocks; its partial last block is copied
        before the next step. With no block free for that copy, a child recomputes instead."""
        n = s.seq.num_computed_tokens
        for child in s.forks:
            if n % self.blocks.block_size and self.blocks.num_free == 0:
                self.add(child)
                continue
            self._pending_copies += self.blocks.fork(s.seq, child, n)
            child.num_computed_tokens = n
            child.status = SeqStatus.RUNNING
            self.running.append(child)

    def _match_prefix(self, seq: Sequence) -> PrefixMatch | None:
        """Cached blocks for a sequence starting from scratch: only blocks that end before its
        last token (that token is always computed, into a block the sequence owns alone)."""
        if seq.num_computed_tokens or seq.block_table or not self.blocks.enable_prefix_caching:
            return None
        if seq.request.params.prompt_logprobs is not None:  # every prompt position must be computed
            return None
        return self.blocks.match_prefix(seq, (seq.num_tokens - 1) // self.blocks.block_size)

    def _reserve(self, seq: Sequence, n: int, out: SchedulerOutput, scheduled: set[int]) -> bool:
        """Allocate blocks for seq's next n tokens, preempting from the back if needed."""
        target = seq.num_computed_tokens + n
        while not self.blocks.can_allocate(seq, target):
            victim = self.running[-1]
            if victim.seq_id in scheduled:  # cannot undo work already planned this step
                victim = seq
            self._preempt(victim, out)
            out.preempted.append(victim)
            if victim is seq:
                return False
        self.blocks.allocate(seq, target)
        return True

    def _lora_fits(self, seq: Sequence) -> bool:
        """Whether `seq` may join the running ones: no adapter, or one they hold, or a free slot for
        its adapter (max_loras) whose weights are read."""
        lid = seq.request.lora_id
        if not lid or self.lora is None:
            return True
        held = {s.request.lora_id for s in (*self.running, *self._prefetched) if s.request.lora_id}
        return lid in held or (len(held) < self.lora.max_loras and self.lora.ready(lid))

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Swap the victim's KV to host memory when the policy prefers it and the pool has room;
        otherwise drop it, to be recomputed from prompt + output when it is readmitted."""
        self.running.remove(seq)
        seq.num_preemptions += 1
        self.num_preemptions += 1
        if self.blocks.can_swap_out(seq) and self.prefer_swap(seq):
            out.swap_out += self.blocks.swap_out(seq)  # copied before the freed blocks are reused
            seq.status = SeqStatus.SWAPPED
            self.num_swapped_out += 1
            self.swapped.appendleft(seq)
            return
        self.blocks.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)

    def _prefetch(self, out: SchedulerOutput) -> None:
        """Bring swapped sequences back, FCFS, one step ahead: blocks are allocated and the copy
        starts now (asynchronously, in the runner); the sequences run from the next step."""
        while self.swapped and len(self.running) + len(self._prefetched) < self.max_num_seqs:
            seq = self.swapped[0]
            if not self.blocks.can_allocate(seq, seq.num_computed_tokens + 1) or not self._lora_fits(seq):
                break
            self.swapped.popleft()
            out.swap_in += self.blocks.swap_in(seq)
            self._prefetched.append(seq)

    def update(
        self, out: SchedulerOutput, seqs: list[Sequence] = (), sampled=None, now: float | None = None,
    ) -> list[Request]:
        """After the step ran: the scheduled tokens now have KV in the cache (blocks that became
        full of computed KV are offered to the prefix cache), each sequence in `seqs` takes its
        token from `sampled` (token_ids, logprobs), and finished sequences are freed. Returns the
        requests that advanced, in order."""
        bs = self.blocks.block_size
        drafted = []
        for s in out.scheduled:
            seq = s.seq
            before = seq.num_computed_tokens
            if s.draft:  # KV of the rejected draft tokens is dropped with their blocks
                seq.num_computed_tokens += s.num_tokens - len(s.draft) + s.accepted
                self.blocks.truncate(seq, seq.num_computed_tokens)
                drafted.append((s, before))
                continue
            seq.num_computed_tokens += s.num_tokens
            self.blocks.register(seq, before // bs, seq.num_computed_tokens // bs)
        for s in out.scheduled:
            if s.forks:
                self._start_forks(s)
        touched: dict[str, Request] = {}
        if seqs:
            now = time.time() if now is None else now
            for seq, tok, lp in zip(seqs, sampled.token_ids, sampled.logprobs):
                if seq.finished:
                    continue  # stopped at an earlier token of its accepted draft
                if self.lifecycle.append(seq, tok, lp, now):
                    self.finish(seq)
                touched[seq.request.request_id] = seq.request
        for s, before in drafted:  # their accepted tokens are in token_ids now: hashable
            if not s.seq.finished:
                self.blocks.register(s.seq, before // bs, s.seq.num_computed_tokens // bs)
        return list(touched.values())

    def finish(self, seq: Sequence, status: SeqStatus = SeqStatus.FINISHED) -> None:
        """Remove a finished or aborted sequence wherever it is and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        elif seq in self.swapped:
            self.swapped.remove(seq)
            self.blocks.free_host(seq)
        elif seq in self._prefetched:  # its in-flight copy completes before the blocks are reused
            self._prefetched.remove(seq)
        self.blocks.free(seq)
        seq.status = status
        if self.speculator is not None:
            self.speculator.forget(seq)

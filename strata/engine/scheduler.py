"""Iteration-level scheduler: which sequences run this step, and how many tokens each.

Each step has a token budget (max_num_batched_tokens). Running sequences go first (decodes take
one token, unfinished prefills take a chunk), then waiting sequences are admitted FCFS while the
budget, max_num_seqs and free blocks allow. When a running sequence needs a block and none is
free, the most recently admitted sequence is preempted by recompute: its blocks are freed and it
returns to the head of the queue, to re-prefill prompt + output later. The scheduler never
touches tensors.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from strata.engine.request import SeqStatus, Sequence
from strata.memory.blocks import BlockManager


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_tokens: int  # new tokens to compute this step

    @property
    def samples(self) -> bool:
        """True when this step computes the last known token, so a new one is sampled."""
        return self.seq.num_computed_tokens + self.num_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)


class Scheduler:
    def __init__(
        self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int
    ) -> None:
        self.blocks = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._pending_copies: list[tuple[int, int]] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(block_copies=self._pending_copies)
        self._pending_copies = []
        budget = self.max_num_batched_tokens
        scheduled_ids: set[int] = set()
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self._reserve(seq, n, out, scheduled_ids):
                break  # seq itself was preempted; everything after it already was too
            out.scheduled.append(ScheduledSeq(seq, n))
            scheduled_ids.add(seq.seq_id)
            budget -= n
            i += 1
        if not out.preempted:
            while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
                seq = self.waiting[0]
                n = min(seq.num_tokens - seq.num_computed_tokens, budget)
                if not self.blocks.can_allocate(seq, seq.num_computed_tokens + n):
                    break  # FCFS: nobody overtakes the head of the queue
                self.waiting.popleft()
                self.blocks.allocate(seq, seq.num_computed_tokens + n)
                seq.status = SeqStatus.RUNNING
                self.running.append(seq)
                out.scheduled.append(ScheduledSeq(seq, n))
                budget -= n
        return out

    def _reserve(self, seq: Sequence, n: int, out: SchedulerOutput, scheduled: set[int]) -> bool:
        """Allocate blocks for seq's next n tokens, preempting from the back if needed."""
        target = seq.num_computed_tokens + n
        while not self.blocks.can_allocate(seq, target):
            victim = self.running[-1]
            if victim.seq_id in scheduled:  # cannot undo work already planned this step
                victim = seq
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is seq:
                return False
        self.blocks.allocate(seq, target)
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def update(self, out: SchedulerOutput) -> None:
        """After the step ran: the scheduled tokens now have KV in the cache."""
        for s in out.scheduled:
            s.seq.num_computed_tokens += s.num_tokens

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Start `child` from the parent's computed prompt KV (shared full blocks)."""
        n = parent.num_computed_tokens
        if n % self.blocks.block_size and self.blocks.num_free == 0:
            self.add(child)  # no block for the partial copy: the child recomputes instead
            return
        self._pending_copies += self.blocks.fork(parent, child, n)
        child.num_computed_tokens = n
        child.status = SeqStatus.RUNNING
        self.running.append(child)

    def finish(self, seq: Sequence, status: SeqStatus = SeqStatus.FINISHED) -> None:
        """Remove a finished or aborted sequence wherever it is and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free(seq)
        seq.status = status

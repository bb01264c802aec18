"""Iteration-level scheduler: which sequences run this step, and how many tokens each.

Each step has a token budget (max_num_batched_tokens). Running sequences go first (decodes take
one token, unfinished prefills take a chunk), then waiting sequences are admitted FCFS while the
budget, max_num_seqs and free blocks allow. When a running sequence needs a block and none is
free, the most recently admitted sequence is preempted: either by recompute (its blocks are freed
and it returns to the head of the queue, to re-prefill prompt + output later) or by swap (its
blocks are copied to the host pool and brought back, one step ahead, before new admissions). The
scheduler never touches tensors: it records block copies for the runner.

Prefix caching: a sequence admitted with no computed tokens first takes the longest run of its
full blocks that the block manager has cached, and starts computing after them. Only blocks that
end before the last known token count, so at least that token is computed (its logits are needed)
and it is written into a block the sequence owns alone. After each step, blocks that became full
of computed KV are registered in the cache.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from strata.engine.request import SeqStatus, Sequence
from strata.memory.blocks import BlockManager, PrefixMatch
from strata.memory.swap import HostBlockPool


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
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, host block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host block, device block)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)


class Scheduler:
    def __init__(
        self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
        host_pool: HostBlockPool | None = None, prefer_swap: Callable[[Sequence], bool] | None = None,
    ) -> None:
        self.blocks = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.swapped: deque[Sequence] = deque()  # KV in host memory, resumed before new admissions
        self._prefetched: list[Sequence] = []  # swap-in started last step; they run this step
        self.host = host_pool
        self.prefer_swap = prefer_swap
        self._pending_copies: list[tuple[int, int]] = []
        self.num_preemptions = 0
        self.num_swapped_out = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

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
            self._prefetch(out)
        if not out.preempted and not self.swapped:
            while self.waiting and budget > 0 and len(self.running) + len(self._prefetched) < self.max_num_seqs:
                seq = self.waiting[0]
                match = self._match_prefix(seq)
                start = seq.num_computed_tokens + (match.num_tokens if match else 0)
                n = min(seq.num_tokens - start, budget)
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
        return out

    def _match_prefix(self, seq: Sequence) -> PrefixMatch | None:
        """Cached blocks for a sequence starting from scratch: only blocks that end before its
        last token (that token is always computed, into a block the sequence owns alone)."""
        if seq.num_computed_tokens or seq.block_table or not self.blocks.enable_prefix_caching:
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

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Swap the victim's KV to host memory when the policy prefers it and the pool has room;
        otherwise drop it, to be recomputed from prompt + output when it is readmitted."""
        self.running.remove(seq)
        seq.num_preemptions += 1
        self.num_preemptions += 1
        n = self.blocks.blocks_for(seq.num_computed_tokens)
        if n and self.host is not None and self.host.num_free >= n and self.prefer_swap(seq):
            seq.host_blocks = self.host.allocate(n)
            out.swap_out += list(zip(seq.block_table[:n], seq.host_blocks))  # copied before reuse
            self.blocks.free(seq)
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
            if not self.blocks.can_allocate(seq, seq.num_computed_tokens + 1):  # + its next token
                break
            self.swapped.popleft()
            self.blocks.allocate(seq, seq.num_computed_tokens)
            out.swap_in += list(zip(seq.host_blocks, seq.block_table))
            self.host.free(seq.host_blocks)  # later swap-outs wait for this copy (KVSwapper)
            seq.host_blocks = []
            self._prefetched.append(seq)

    def update(self, out: SchedulerOutput) -> None:
        """After the step ran: the scheduled tokens now have KV in the cache.

        Blocks that became full of computed KV are offered to the prefix cache.
        """
        bs = self.blocks.block_size
        for s in out.scheduled:
            seq = s.seq
            before = seq.num_computed_tokens
            seq.num_computed_tokens += s.num_tokens
            self.blocks.register(seq, before // bs, seq.num_computed_tokens // bs)

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
        elif seq in self.swapped:
            self.swapped.remove(seq)
            self.host.free(seq.host_blocks)
            seq.host_blocks = []
        elif seq in self._prefetched:  # its in-flight copy completes before the blocks are reused
            self._prefetched.remove(seq)
        self.blocks.free(seq)
        seq.status = status

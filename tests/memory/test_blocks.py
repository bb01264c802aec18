"""BlockManager: the sole owner of KV blocks never leaks or double-owns a block.

A hypothesis state machine interleaves admit / grow / finish / abort / preempt / re-admit /
fork against the real BlockManager with a shadow model, checking every invariant after each op.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    multiple,
    precondition,
    rule,
)

from strata.memory.blocks import BlockManager


class FakeSeq:
    def __init__(self, num_tokens: int) -> None:
        self.block_table: list[int] = []
        self.num_tokens = num_tokens  # tokens whose KV the sequence holds (or will, once admitted)

    def __repr__(self) -> str:
        return f"FakeSeq({self.num_tokens}, {self.block_table})"


class BlockMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.bm: BlockManager | None = None
        self.live: list[FakeSeq] = []  # own blocks
        self.preempted: list[FakeSeq] = []  # own none, may be re-admitted

    running = Bundle("running")

    @precondition(lambda self: self.bm is None)
    @rule(num_blocks=st.integers(1, 24), block_size=st.sampled_from([1, 2, 4, 16]))
    def init(self, num_blocks, block_size):
        self.bm = BlockManager(num_blocks, block_size)

    def _ready(self) -> bool:
        return self.bm is not None

    @precondition(_ready)
    @rule(target=running, num_tokens=st.integers(1, 80))
    def admit(self, num_tokens):
        seq = FakeSeq(num_tokens)
        free = self.bm.num_free
        ok = self.bm.can_allocate(seq, num_tokens)
        assert ok == (self.bm.blocks_for(num_tokens) <= free)
        if not ok:
            with pytest.raises(RuntimeError):
                self.bm.allocate(seq, num_tokens)
            assert self.bm.num_free == free and not seq.block_table
            return multiple()
        self.bm.allocate(seq, num_tokens)
        assert len(seq.block_table) == self.bm.blocks_for(num_tokens)
        assert self.bm.num_free == free - len(seq.block_table)
        self.live.append(seq)
        return seq

    @precondition(_ready)
    @rule(seq=running, grow=st.integers(1, 20))
    def step(self, seq, grow):
        if seq not in self.live:
            return
        target = seq.num_tokens + grow
        before = list(seq.block_table)
        if self.bm.can_allocate(seq, target):
            self.bm.allocate(seq, target)
            seq.num_tokens = target
            assert seq.block_table[: len(before)] == before  # existing blocks never move
            assert len(seq.block_table) == self.bm.blocks_for(target)

    @precondition(_ready)
    @rule(seq=consumes(running))
    def finish(self, seq):
        if seq not in self.live:
            return
        free, own = self.bm.num_free, len(seq.block_table)
        shared = sum(self.bm.ref_count(b) > 1 for b in seq.block_table)
        self.bm.free(seq)
        assert not seq.block_table
        assert self.bm.num_free == free + own - shared
        self.live.remove(seq)

    @precondition(_ready)
    @rule(seq=consumes(running))
    def abort(self, seq):
        """Abort is a finish at an arbitrary point; an already-finished sequence holds nothing."""
        self.bm.free(seq)  # idempotent on an empty table
        assert not seq.block_table
        if seq in self.live:
            self.live.remove(seq)
        if seq in self.preempted:
            self.preempted.remove(seq)

    @precondition(_ready)
    @rule(seq=running)
    def preempt(self, seq):
        if seq not in self.live:
            return
        self.bm.free(seq)
        self.live.remove(seq)
        self.preempted.append(seq)

    @precondition(lambda self: self.bm is not None and self.preempted)
    @rule(target=running, pick=st.integers(0, 100))
    def readmit(self, pick):
        seq = self.preempted[pick % len(self.preempted)]
        if not self.bm.can_allocate(seq, seq.num_tokens):
            return multiple()
        self.preempted.remove(seq)
        self.bm.allocate(seq, seq.num_tokens)
        self.live.append(seq)
        return seq

    @precondition(_ready)
    @rule(target=running, parent=running, n=st.integers(1, 3))
    def fork(self, parent, n):
        if parent not in self.live:
            return multiple()
        children = []
        for _ in range(n):
            bs = self.bm.block_size
            full, partial = divmod(parent.num_tokens, bs)
            if partial and self.bm.num_free == 0:
                with pytest.raises(RuntimeError):
                    self.bm.fork(parent, FakeSeq(parent.num_tokens), parent.num_tokens)
                break
            child = FakeSeq(parent.num_tokens)
            refs = [self.bm.ref_count(b) for b in parent.block_table[:full]]
            copies = self.bm.fork(parent, child, parent.num_tokens)
            assert child.block_table[:full] == parent.block_table[:full]
            assert [self.bm.ref_count(b) for b in parent.block_table[:full]] == [r + 1 for r in refs]
            if partial:
                assert copies == [(parent.block_table[full], child.block_table[full])]
                assert len(child.block_table) == full + 1
            else:
                assert copies == [] and len(child.block_table) == full
            self.live.append(child)
            children.append(child)
        return multiple(*children)

    @invariant()
    def blocks_consistent(self):
        if self.bm is None:
            return
        self.bm.check([s.block_table for s in self.live])
        assert all(not s.block_table for s in self.preempted)
        owned = {b for s in self.live for b in s.block_table}
        assert len(owned) + self.bm.num_free == self.bm.num_blocks
        for s in self.live:
            # each live sequence holds enough blocks for its tokens
            assert len(s.block_table) == self.bm.blocks_for(s.num_tokens)
            # a partially filled last block is never shared: a sequence writes only blocks it owns alone
            if s.num_tokens % self.bm.block_size:
                assert self.bm.ref_count(s.block_table[-1]) == 1

    def teardown(self):
        if self.bm is None:
            return
        for s in list(self.live):
            self.bm.free(s)
        self.bm.check([])
        assert self.bm.num_free == self.bm.num_blocks


TestBlockMachine = BlockMachine.TestCase
TestBlockMachine.settings = settings(max_examples=150, stateful_step_count=40)


# --- direct unit tests ---------------------------------------------------------------------


def test_fork_shares_full_blocks_and_copies_partial():
    bm = BlockManager(8, 4)
    parent = FakeSeq(10)
    bm.allocate(parent, 10)  # blocks 0,1 full, 2 partial
    child = FakeSeq(10)
    copies = bm.fork(parent, child, 10)
    assert child.block_table[:2] == parent.block_table[:2]
    assert copies == [(parent.block_table[2], child.block_table[2])]
    assert [bm.ref_count(b) for b in parent.block_table] == [2, 2, 1]
    bm.free(parent)
    assert [bm.ref_count(b) for b in child.block_table] == [1, 1, 1]
    bm.check([child.block_table])
    bm.free(child)
    assert bm.num_free == 8
    bm.check([])


def test_fork_refuses_owner_and_missing_block():
    bm = BlockManager(1, 4)
    parent = FakeSeq(3)
    bm.allocate(parent, 3)
    with pytest.raises(RuntimeError):
        bm.fork(parent, FakeSeq(3), 3)  # partial block, nothing free
    child = FakeSeq(0)
    child.block_table.append(0)
    with pytest.raises(RuntimeError):
        bm.fork(parent, child, 3)


def test_double_free_detected():
    bm = BlockManager(2, 4)
    a = FakeSeq(4)
    bm.allocate(a, 4)
    stale = list(a.block_table)
    bm.free(a)
    a.block_table.extend(stale)  # a stale table freed twice must not corrupt silently
    with pytest.raises(RuntimeError):
        bm.free(a)


def test_check_catches_leak_and_double_owner():
    bm = BlockManager(4, 2)
    a, b = FakeSeq(4), FakeSeq(2)
    bm.allocate(a, 4)
    bm.allocate(b, 2)
    with pytest.raises(AssertionError):
        bm.check([a.block_table])  # b's block is owned by nobody we know: a leak
    with pytest.raises(AssertionError):
        bm.check([a.block_table, b.block_table, [b.block_table[0]]])
    bm.check([a.block_table, b.block_table])


@settings(max_examples=50)
@given(st.integers(1, 64), st.integers(1, 32), st.integers(0, 300))
def test_blocks_for_is_ceiling(num_blocks, block_size, tokens):
    bm = BlockManager(num_blocks, block_size)
    n = bm.blocks_for(tokens)
    assert n * block_size >= tokens and (n - 1) * block_size < max(tokens, 1)
    assert bm.can_allocate(FakeSeq(0), tokens) == (n <= num_blocks)

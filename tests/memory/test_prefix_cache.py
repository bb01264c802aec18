"""Prefix caching in the BlockManager: free / owned / cached, exact hits, LRU eviction.

A hypothesis test drives random workloads (admit with prefix lookup, compute, register, grow,
finish) against the real BlockManager with a fake KV store (block -> token ids written into it)
and a plain-list reference model of the LRU order: every hit must hand back blocks holding exactly
the tokens looked up, every eviction must take the block the reference says is least recently
used, and every block must be exactly one of free / owned / cached after every operation.
"""

from __future__ import annotations

import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from strata.memory.blocks import BlockManager, extend_hashes


class Seq:
    """What the block manager sees of a sequence: tokens, hash chain, blocks, computed count."""

    def __init__(self, tokens: list[int]) -> None:
        self.token_ids = list(tokens)
        self.block_hashes: list[int] = []
        self.block_table: list[int] = []
        self.num_computed_tokens = 0

    def __repr__(self) -> str:
        return f"Seq({len(self.token_ids)} tokens, {self.block_table})"


def _admit(bm: BlockManager, seq: Seq, kv: dict[int, list[int | None]] | None = None) -> int:
    """Admit with a prefix lookup (last-token rule), 'compute' the rest, register full blocks.

    Returns the number of blocks served from the cache.
    """
    bs = bm.block_size
    match = bm.match_prefix(seq, (len(seq.token_ids) - 1) // bs)
    bm.allocate(seq, len(seq.token_ids), match=match)
    if kv is not None:
        for i, b in enumerate(seq.block_table):
            chunk = seq.token_ids[i * bs : (i + 1) * bs]
            if i < len(match.blocks):
                assert kv[b] == chunk, "a prefix hit handed back a block with other tokens"
            else:
                kv[b] = list(chunk)  # the forward pass writes this block's KV
    seq.num_computed_tokens = len(seq.token_ids)
    bm.register(seq, len(match.blocks), len(seq.token_ids) // bs)
    return len(match.blocks)


def test_hit_after_free_shares_blocks_and_counts_stats():
    bm = BlockManager(8, 4)
    a = Seq(list(range(10, 21)))  # 11 tokens: blocks 0, 1 full, block 2 partial
    assert _admit(bm, a) == 0
    assert bm.stats.queries == 2 and bm.stats.hits == 0
    assert [bm.is_cached(b) for b in a.block_table] == [True, True, False]
    blocks = list(a.block_table)
    bm.free(a)
    assert bm.num_cached == 2 and bm.num_free == 8  # cached blocks are still allocatable
    assert bm.lru_order() == [blocks[1], blocks[0]]  # the tail is evicted before the head
    bm.check([])

    b = Seq(list(range(10, 14)) + [99, 98, 97, 96, 1, 2, 3])  # same first block, other second
    assert _admit(bm, b) == 1
    assert b.block_table[0] == blocks[0]
    # b's own second block (its tokens differ from a's) is registered under its own hash
    assert b.block_table[1] != blocks[1] and bm.is_cached(b.block_table[1])
    assert bm.stats.queries == 4 and bm.stats.hits == 1
    assert bm.stats.hit_rate == pytest.approx(0.25)
    bm.check([b.block_table])
    c = Seq(list(range(10, 14)) + [99, 98, 97, 96, 5])
    assert _admit(bm, c) == 2 and c.block_table[:2] == b.block_table[:2]
    assert [bm.ref_count(x) for x in c.block_table[:2]] == [2, 2]
    bm.check([b.block_table, c.block_table])
    bm.free(b)
    bm.free(c)
    bm.check([])
    assert all(bm.ref_count(x) == 0 for x in range(8))


def test_lookup_is_pure_until_allocate():
    bm = BlockManager(4, 2)
    a = Seq([1, 2, 3, 4, 5])
    _admit(bm, a)
    bm.free(a)
    before = (bm.stats.queries, bm.stats.hits, bm.lru_order())
    m = bm.match_prefix(Seq([1, 2, 3, 4, 9]), 2)
    assert len(m.blocks) == 2 and m.num_tokens == 4 and m.queried == 2
    assert (bm.stats.queries, bm.stats.hits, bm.lru_order()) == before


def test_last_token_rule_whole_prompt_cached():
    """A prompt that is entirely cached still computes its last token, in a block of its own."""
    bm = BlockManager(8, 4)
    a = Seq(list(range(8)))  # exactly two full blocks
    _admit(bm, a)
    bm.free(a)
    again = Seq(list(range(8)))
    match = bm.match_prefix(again, (8 - 1) // 4)
    assert len(match.blocks) == 1  # block 1 holds the last token: not a hit
    bm.allocate(again, 8, match=match)
    assert bm.ref_count(again.block_table[1]) == 1 and not bm.is_cached(again.block_table[1])


def test_tokens_are_rechecked_on_a_hash_hit():
    bm = BlockManager(8, 2)
    a = Seq([1, 2, 3, 4, 5])
    _admit(bm, a)
    # a colliding sequence: its hash chain claims a's hashes but its tokens differ
    liar = Seq([1, 7, 3, 4, 5])
    liar.block_hashes = list(a.block_hashes)
    assert bm.match_prefix(liar, 2).blocks == []
    # the second block's tokens and (faked) hash match, but it was registered after another parent
    e = Seq([8, 8, 3, 4, 6])
    _admit(bm, e)  # e's first block [8, 8] is cached under its real hash
    f = Seq([8, 8, 3, 4, 6])
    f.block_hashes = [e.block_hashes[0], a.block_hashes[1]]
    m = bm.match_prefix(f, 2)
    assert m.blocks == [e.block_table[0]]  # a's [3, 4] hangs off a's first block, not e's


def test_evicted_parent_breaks_the_chain():
    """A child registered after a parent block that was evicted and reused is never matched
    through the reused block, even when the new content collides with the old hash."""
    bm = BlockManager(3, 2)
    a = Seq([1, 2, 3, 4])
    _admit(bm, a)
    a0, a1 = a.block_table
    z = Seq([0])
    bm.allocate(z, 1)  # holds the one free block
    bm.free(a)
    bm._cached.move_to_end(a1)  # white box: make the parent the least recently used block
    b = Seq([8, 8])
    b.block_hashes = [a.block_hashes[0]]  # collides with a's first block
    bm.allocate(b, 2)
    assert b.block_table == [a0] and bm.stats.evictions == 1
    bm.register(b, 0, 1)  # a0 is cached again under the same hash, with other tokens
    c = Seq([8, 8, 3, 4, 5])
    c.block_hashes = list(a.block_hashes)
    m = bm.match_prefix(c, 2)
    assert m.blocks == [a0]  # a1 hangs off the old a0 (another generation): not a hit
    bm.free(b)
    bm.free(z)
    bm.check([])


def test_duplicate_prefix_is_not_registered_twice():
    bm = BlockManager(8, 2)
    a, b = Seq([1, 2, 3, 4, 5]), Seq([1, 2, 3, 4, 6])
    bm.allocate(a, 5)
    bm.allocate(b, 5)  # computed concurrently, no sharing
    bm.register(a, 0, 2)
    bm.register(b, 0, 2)
    assert [bm.is_cached(x) for x in a.block_table[:2]] == [True, True]
    assert [bm.is_cached(x) for x in b.block_table[:2]] == [False, False]
    bm.free(a)
    bm.free(b)
    assert bm.num_cached == 2
    bm.check([])


def test_register_skips_partial_and_uncomputed_blocks():
    bm = BlockManager(8, 4)
    a = Seq(list(range(6)))
    bm.allocate(a, 6)
    bm.register(a, 0, 5)  # more blocks than the tokens fill: only block 0 is full
    assert [bm.is_cached(x) for x in a.block_table] == [True, False]
    bm.free(a)
    bm.check([])


def test_disabled_prefix_caching_is_the_old_free_list():
    bm = BlockManager(4, 2, enable_prefix_caching=False)
    a = Seq([1, 2, 3, 4, 5])
    assert _admit(bm, a) == 0
    assert not any(bm.is_cached(x) for x in a.block_table)
    bm.free(a)
    assert bm.num_cached == 0 and bm.num_free == 4
    assert bm.match_prefix(Seq([1, 2, 3, 4, 5]), 2).blocks == []
    assert bm.stats.queries == bm.stats.hits == 0
    bm.check([])


def test_check_catches_a_block_in_two_states():
    bm = BlockManager(4, 2)
    a = Seq([1, 2, 3])
    _admit(bm, a)
    bm.free(a)
    cached = bm.lru_order()[0]
    bm._free.append(cached)  # corrupt: cached and free at once
    with pytest.raises(AssertionError, match="exactly one of free / owned / cached"):
        bm.check([])


def test_fork_partial_copy_evicts_when_nothing_is_free():
    bm = BlockManager(3, 2)
    a = Seq([1, 2, 3, 4])
    _admit(bm, a)
    bm.free(a)  # two cached blocks, one free
    p = Seq([7, 7, 7])
    bm.allocate(p, 3)  # takes the free block, then evicts one cached
    assert bm.stats.evictions == 1
    child = Seq([7, 7, 7])
    copies = bm.fork(p, child, 3)  # the partial copy evicts the last cached block
    assert bm.stats.evictions == 2 and len(copies) == 1
    bm.check([p.block_table, child.block_table])


def test_kv_usage_counts_shared_blocks_once_and_partial_waste():
    bm = BlockManager(16, 4)
    a = Seq(list(range(10)))
    _admit(bm, a)
    b = Seq(list(range(8)) + [50, 51, 52])
    _admit(bm, b)  # shares a's first two blocks
    per_token = 3
    u = bm.kv_usage([a, b], per_token)
    block = 4 * per_token
    assert u.reserved_bytes == 16 * block
    assert u.owned_bytes == 4 * block  # 2 shared + 1 partial each
    assert u.token_bytes == (8 + 2 + 3) * per_token
    assert u.waste_bytes == ((12 - 10) + (12 - 11)) * per_token  # the spec's per-sequence formula
    assert u.shared_saved_bytes == 2 * block
    assert u.free_bytes + u.cached_bytes + u.owned_bytes == u.reserved_bytes
    assert 0 < u.efficiency < 1


def test_extend_hashes_chains_over_the_parent():
    h = extend_hashes([1, 2, 3, 4], [], 2, 2)
    g = extend_hashes([5, 5, 3, 4], [], 2, 2)
    assert len(h) == 2 and h[0] != g[0] and h[1] != g[1]  # equal block, different prefix
    assert extend_hashes([1, 2, 3, 4, 9], list(h[:1]), 2, 2) == h


# --- random workloads against a reference LRU --------------------------------------------------


class PrefixCacheMachine(RuleBasedStateMachine):
    """Random admit / grow / finish with shared prefixes; the reference is a plain list."""

    @initialize(num_blocks=st.integers(2, 12), block_size=st.sampled_from([1, 2, 4]),
                prefixes=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=12), min_size=1, max_size=3))
    def init(self, num_blocks, block_size, prefixes):
        self.bm = BlockManager(num_blocks, block_size)
        self.prefixes = prefixes
        self.kv: dict[int, list[int]] = {}
        self.live: list[Seq] = []
        self.lru: list[int] = []  # reference: evictable cached blocks, least recently used first

    def _expect_takes(self, k: int, free_list: int) -> list[int]:
        """Blocks the reference says `k` fresh allocations will evict, in order."""
        return self.lru[: max(0, k - free_list)]

    @rule(pick=st.integers(0, 2), suffix=st.lists(st.integers(0, 3), max_size=8))
    def admit(self, pick, suffix):
        tokens = self.prefixes[pick % len(self.prefixes)] + suffix
        seq = Seq(tokens)
        bm = self.bm
        match = bm.match_prefix(seq, (len(tokens) - 1) // bm.block_size)
        if not bm.can_allocate(seq, len(tokens), match=match):
            return
        fresh = bm.blocks_for(len(tokens)) - len(match.blocks)
        free_list = bm.num_free - len(self.lru)
        for b in match.blocks:  # revived hits leave the LRU first
            if b in self.lru:
                self.lru.remove(b)
        evicted = self._expect_takes(fresh, free_list)
        before = bm.stats.evictions
        hits = _admit(bm, seq, self.kv)
        assert bm.stats.evictions - before == len(evicted)
        for b in evicted:
            assert b in seq.block_table[hits:], "evicted a block other than the least recently used"
            self.lru.remove(b)
        self.live.append(seq)
        event(f"hit blocks: {min(hits, 2)}")
        event(f"evicted: {bool(evicted)}")

    @rule(pick=st.integers(0, 100), grow=st.lists(st.integers(0, 3), min_size=1, max_size=5))
    def decode(self, pick, grow):
        if not self.live:
            return
        seq = self.live[pick % len(self.live)]
        bm, bs = self.bm, self.bm.block_size
        target = len(seq.token_ids) + len(grow)
        if not bm.can_allocate(seq, target):
            return
        old_blocks = len(seq.block_table)
        evicted = self._expect_takes(bm.blocks_for(target) - old_blocks, bm.num_free - len(self.lru))
        bm.allocate(seq, target)
        for b in evicted:
            assert b in seq.block_table[old_blocks:]
            self.lru.remove(b)
        before = seq.num_computed_tokens
        seq.token_ids += grow
        for pos in range(before, target):  # the forward writes the new tokens' KV
            b = seq.block_table[pos // bs]
            if pos % bs == 0:
                self.kv[b] = []
            self.kv[b].append(seq.token_ids[pos])
        seq.num_computed_tokens = target
        bm.register(seq, before // bs, target // bs)

    @rule(pick=st.integers(0, 100))
    def finish(self, pick):
        if not self.live:
            return
        seq = self.live.pop(pick % len(self.live))
        for b in reversed(seq.block_table):
            if self.bm.ref_count(b) == 1 and self.bm.is_cached(b):
                self.lru.append(b)
        self.bm.free(seq)

    @invariant()
    def consistent(self):
        bm = self.bm
        bm.check([s.block_table for s in self.live])
        assert bm.lru_order() == self.lru
        for s in self.live:  # what attention would read: exactly the sequence's tokens
            bs = bm.block_size
            for i, b in enumerate(s.block_table):
                assert self.kv[b] == s.token_ids[i * bs : (i + 1) * bs]
        for b in self.lru:  # cached blocks keep their KV
            assert b in self.kv

    def teardown(self):
        for s in self.live:
            self.bm.free(s)
        self.bm.check([])
        assert self.bm.num_free == self.bm.num_blocks
        assert all(self.bm.ref_count(b) == 0 for b in range(self.bm.num_blocks))


TestPrefixCacheMachine = PrefixCacheMachine.TestCase
TestPrefixCacheMachine.settings = settings(max_examples=150, stateful_step_count=30)

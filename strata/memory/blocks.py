"""The block manager: sole owner of KV-cache blocks (one job, so one file, ~400 lines).

Every block is in exactly one of three states:

- free: in the free list, ref count 0, no prefix hash;
- owned: ref count >= 1, listed in the block tables of exactly that many sequences (it may also be
  registered under a prefix hash, so that new sequences can share it);
- cached: ref count 0, but its KV is kept under its prefix hash, in least-recently-used order. A
  prefix lookup turns it back into owned; when the free list is empty, allocation evicts the least
  recently used cached block (its hash is dropped) and reuses it.

Prefix hashes chain: block i's hash covers (block i-1's hash, block i's token ids), so one hash
names a whole prefix. A hit is never taken on the hash alone: the cached block's token ids are
compared, and the block it was registered after must be the block the lookup matched one position
earlier (same id and generation, so an evicted-and-reused parent breaks the chain). By induction
a matched run of blocks holds exactly the tokens looked up.

Full blocks may be shared (after a fork, or a prefix-cache hit); partially filled blocks never
are, and only full blocks of computed KV are registered, so a sequence only ever writes into
blocks it owns alone.

Two more kinds of block belong to the manager and to nobody else:

- the scratch block (when asked for): one device block past the shared range, never allocated,
  where the padded rows of a captured decode step (graph/capture.py) write their throw-away KV;
- host blocks (when a HostBlockPool is given): where a preempted sequence's KV waits, swapped
  out. `swap_out` / `swap_in` move a sequence between the two pools; the scheduler only decides
  when, and the runner's KVSwapper copies the bytes.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol


class HasBlocks(Protocol):
    block_table: list[int]


class HasHostBlocks(HasBlocks, Protocol):
    host_blocks: list[int]
    num_computed_tokens: int


class HostPool(Protocol):
    """What the manager needs of the host pool (memory.swap.HostBlockPool provides it)."""

    num_blocks: int

    @property
    def num_free(self) -> int: ...

    def allocate(self, n: int) -> list[int]: ...

    def free(self, blocks: list[int]) -> None: ...


class HasTokens(HasBlocks, Protocol):
    token_ids: list[int]
    block_hashes: list[int]  # prefix-hash chain of the full blocks of token_ids, filled lazily


class HasKV(HasBlocks, Protocol):
    num_computed_tokens: int


def extend_hashes(token_ids: list[int], hashes: list[int], num_blocks: int, block_size: int,
                  salt=None) -> list[int]:
    """Extend `hashes` in place to the chain of the first `num_blocks` full blocks of `token_ids`;
    `salt` (a LoRA adapter's id: its KV differs) is the first block's parent.

    Tokens are only ever appended to a sequence, so a chain computed once stays valid.
    """
    while len(hashes) < num_blocks:
        i = len(hashes)
        parent = hashes[-1] if hashes else salt
        hashes.append(hash((parent, tuple(token_ids[i * block_size : (i + 1) * block_size]))))
    return hashes


@dataclass
class PrefixCacheStats:
    """Prefix-cache counters since the engine started."""

    queries: int = 0  # full blocks looked up when admitting sequences
    hits: int = 0  # of those, found cached (their KV was not recomputed)
    evictions: int = 0  # cached blocks dropped to make room for new ones

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


@dataclass(frozen=True)
class PrefixMatch:
    """The cached blocks holding a sequence's longest cached prefix (from `match_prefix`)."""

    blocks: list[int]
    num_tokens: int  # len(blocks) * block_size
    queried: int  # full blocks looked up


@dataclass(frozen=True)
class KVUsage:
    """Where the KV cache's bytes are: reserved, owned by sequences, cached, free, and how full."""

    reserved_bytes: int  # the whole KV cache
    owned_bytes: int  # blocks referenced by running sequences (each shared block once)
    cached_bytes: int  # evictable prefix-cache blocks
    free_bytes: int
    token_bytes: int  # KV of computed tokens in owned blocks (each shared block once)
    waste_bytes: int  # unfilled slots of partially filled last blocks (owned - token)
    shared_saved_bytes: int  # bytes the sequences would hold without sharing blocks, minus owned

    @property
    def efficiency(self) -> float:
        """Fraction of owned bytes that hold live tokens."""
        return self.token_bytes / self.owned_bytes if self.owned_bytes else 1.0


class BlockManager:
    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, *,
        scratch_block: bool = False, host_pool: HostPool | None = None,
    ) -> None:
        self.num_blocks = num_blocks  # blocks sequences can own (the scratch block is not one)
        self.scratch_block = num_blocks if scratch_block else None
        self.num_device_blocks = num_blocks + (1 if scratch_block else 0)  # what the KV cache holds
        self.host = host_pool
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._free: deque[int] = deque(range(num_blocks))
        self._refs = [0] * num_blocks
        self._cached: OrderedDict[int, None] = OrderedDict()  # ref count 0, hashed; LRU first
        self._by_hash: dict[int, int] = {}
        self._hash: list[int | None] = [None] * num_blocks
        self._tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self._parent: list[tuple[int, int] | None] = [None] * num_blocks  # (block, its generation)
        self._gen = [0] * num_blocks  # bumped whenever a block's hash is dropped
        self.stats = PrefixCacheStats()

    @property
    def num_free(self) -> int:
        """Blocks an allocation can take: the free list plus evictable cached blocks."""
        return len(self._free) + len(self._cached)

    @property
    def num_cached(self) -> int:
        """Evictable cached blocks (ref count 0, KV kept under a prefix hash)."""
        return len(self._cached)

    @property
    def usage(self) -> float:
        """Fraction of blocks owned by sequences."""
        return 1.0 - self.num_free / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # --- allocation ----------------------------------------------------------------------
    def can_allocate(
        self, seq: HasBlocks, num_tokens: int, reserve: int = 0, match: PrefixMatch | None = None
    ) -> bool:
        """Whether `seq` can grow to hold `num_tokens` (starting from `match`), leaving `reserve`."""
        hits = match.blocks if match is not None else []
        need = self.blocks_for(num_tokens) - len(seq.block_table) - len(hits)
        revived = sum(1 for b in hits if self._refs[b] == 0)  # cached hits stop being evictable
        return need <= self.num_free - revived - reserve

    def allocate(self, seq: HasBlocks, num_tokens: int, match: PrefixMatch | None = None) -> None:
        """Grow `seq`'s block table to hold `num_tokens` tokens, first sharing `match`'s blocks."""
        if not self.can_allocate(seq, num_tokens, match=match):
            raise RuntimeError(
                f"allocate: {num_tokens} tokens need {self.blocks_for(num_tokens)} blocks, "
                f"{len(seq.block_table)} held, {self.num_free} free"
            )
        if match is not None:
            if seq.block_table:
                raise RuntimeError("allocate: a prefix match starts an empty block table")
            for b in match.blocks:
                self._acquire(b)
                seq.block_table.append(b)
            self.stats.queries += match.queried
            self.stats.hits += len(match.blocks)
        for _ in range(self.blocks_for(num_tokens) - len(seq.block_table)):
            seq.block_table.append(self._take())

    def _acquire(self, b: int) -> None:
        if self._refs[b] == 0:
            if b not in self._cached:
                raise RuntimeError(f"block {b} is free, not cached: it cannot be shared")
            del self._cached[b]
        self._refs[b] += 1

    def _take(self) -> int:
        """A fresh block (ref count 1): from the free list, else evict the LRU cached block."""
        if self._free:
            b = self._free.popleft()
        elif self._cached:
            b, _ = self._cached.popitem(last=False)
            self._drop_hash(b)
            self.stats.evictions += 1
        else:
            raise RuntimeError("no free or cached block to take")
        self._refs[b] = 1
        return b

    def _drop_hash(self, b: int) -> None:
        del self._by_hash[self._hash[b]]
        self._hash[b] = self._tokens[b] = self._parent[b] = None
        self._gen[b] += 1

    def free(self, seq: HasBlocks) -> None:
        """Release every block `seq` holds (shared blocks stay owned by the others).

        A released block with a prefix hash becomes cached (most recently used); the table is
        walked from its end, so a sequence's tail blocks are evicted before its head blocks.
        """
        for b in reversed(seq.block_table):
            self._release(b)
        seq.block_table.clear()

    def truncate(self, seq: HasBlocks, num_tokens: int) -> None:
        """Release the blocks of `seq` past the first `num_tokens` tokens (speculative decoding's
        rejected draft tokens: their KV is never read, and the blocks were taken this step)."""
        keep = self.blocks_for(num_tokens)
        while len(seq.block_table) > keep:
            self._release(seq.block_table.pop())

    def _release(self, b: int) -> None:
        self._refs[b] -= 1
        if self._refs[b] == 0:
            if self._hash[b] is not None:
                self._cached[b] = None
            else:
                self._free.appendleft(b)  # reused first: pages already resident (kv_cache.py)
        elif self._refs[b] < 0:
            raise RuntimeError(f"block {b} freed more often than owned")

    def fork(self, parent: HasBlocks, child: HasBlocks, num_tokens: int) -> list[tuple[int, int]]:
        """Give `child` the parent's first `num_tokens` tokens of KV.

        Full blocks are shared by ref count; a partially filled last block is copied into a fresh
        block. Returns the (src, dst) block copies the runner must perform before the next step.
        """
        if child.block_table:
            raise RuntimeError("fork: child already owns blocks")
        full, partial = divmod(num_tokens, self.block_size)
        if partial and not self.num_free:
            raise RuntimeError("fork: no free block for the partial last block")
        for b in parent.block_table[:full]:
            self._refs[b] += 1
            child.block_table.append(b)
        copies = []
        if partial:
            dst = self._take()
            child.block_table.append(dst)
            copies.append((parent.block_table[full], dst))
        return copies

    # --- swap space ----------------------------------------------------------------------
    def can_swap_out(self, seq: HasHostBlocks) -> bool:
        """Whether the host pool has room for `seq`'s computed KV (False without a pool)."""
        n = self.blocks_for(seq.num_computed_tokens)
        return bool(n) and self.host is not None and self.host.num_free >= n

    def swap_out(self, seq: HasHostBlocks) -> list[tuple[int, int]]:
        """Park `seq`'s computed blocks in host blocks and free its device blocks. Returns the
        (device, host) copies, which the runner makes before the freed blocks are written again."""
        n = self.blocks_for(seq.num_computed_tokens)
        seq.host_blocks = self.host.allocate(n)
        pairs = list(zip(seq.block_table[:n], seq.host_blocks))
        self.free(seq)
        return pairs

    def swap_in(self, seq: HasHostBlocks) -> list[tuple[int, int]]:
        """Device blocks for a swapped sequence's KV; its host blocks are freed at once (a later
        swap-out that reuses them waits for this copy: KVSwapper). Returns the (host, device) copies."""
        self.allocate(seq, seq.num_computed_tokens)
        pairs = list(zip(seq.host_blocks, seq.block_table))
        self.free_host(seq)
        return pairs

    def free_host(self, seq: HasHostBlocks) -> None:
        self.host.free(seq.host_blocks)
        seq.host_blocks = []

    def ref_count(self, block: int) -> int:
        return self._refs[block]

    # --- prefix cache --------------------------------------------------------------------
    def match_prefix(self, seq: HasTokens, max_blocks: int) -> PrefixMatch:
        """The longest run of cached blocks equal to `seq`'s first (at most `max_blocks`) blocks.

        Pure lookup: nothing is acquired or counted until the match is passed to `allocate`.
        """
        if not self.enable_prefix_caching or max_blocks <= 0:
            return PrefixMatch([], 0, 0)
        bs = self.block_size
        if not self._by_hash:
            return PrefixMatch([], 0, max_blocks)
        salt = getattr(seq, "cache_salt", None)
        hashes = extend_hashes(seq.token_ids, seq.block_hashes, max_blocks, bs, salt)
        blocks: list[int] = []
        parent: tuple | None = salt  # a first block is confirmed under its sequence's salt
        for i in range(max_blocks):
            b = self._by_hash.get(hashes[i])
            if (
                b is None
                or self._parent[b] != parent
                or self._tokens[b] != tuple(seq.token_ids[i * bs : (i + 1) * bs])
            ):
                break
            blocks.append(b)
            parent = (b, self._gen[b])
        return PrefixMatch(blocks, len(blocks) * bs, max_blocks)

    def register(self, seq: HasTokens, first: int, end: int) -> None:
        """Offer `seq`'s blocks [first, end), now full of computed KV, to the prefix cache.

        A block is registered only after its predecessor in the same table is (the chain must be
        confirmable), and not when an equal prefix is already cached under the same hash.
        """
        if not self.enable_prefix_caching:
            return
        table, bs = seq.block_table, self.block_size
        end = min(end, len(table), len(seq.token_ids) // bs)
        if first >= end:
            return
        salt = getattr(seq, "cache_salt", None)
        hashes = extend_hashes(seq.token_ids, seq.block_hashes, end, bs, salt)
        for i in range(first, end):
            b = table[i]
            if self._hash[b] is not None:
                continue  # shared from the cache (or already registered)
            parent = salt
            if i > 0:
                p = table[i - 1]
                if self._hash[p] is None:
                    return  # the chain is broken here; later blocks cannot be confirmed either
                parent = (p, self._gen[p])
            h = hashes[i]
            if h in self._by_hash:
                return  # an equal prefix computed concurrently is cached already
            self._by_hash[h] = b
            self._hash[b] = h
            self._tokens[b] = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            self._parent[b] = parent

    def is_cached(self, block: int) -> bool:
        """Whether `block` is registered under a prefix hash (owned or cached)."""
        return self._hash[block] is not None

    def lru_order(self) -> list[int]:
        """Cached (evictable) blocks, the next to be evicted first."""
        return list(self._cached)

    # --- accounting ----------------------------------------------------------------------
    def kv_usage(self, seqs: Iterable[HasKV], kv_bytes_per_token: int) -> KVUsage:
        """KV bytes reserved, owned, cached and free, and how much of the owned bytes hold tokens.

        `seqs` are the sequences holding blocks (the running ones); a block's filled slots are its
        computed tokens, and shared blocks (always full) are counted once.
        """
        bs = self.block_size
        block_bytes = bs * kv_bytes_per_token
        filled: dict[int, int] = {}
        logical = 0
        for s in seqs:
            logical += len(s.block_table)
            for i, b in enumerate(s.block_table):
                n = min(bs, max(0, s.num_computed_tokens - i * bs))
                filled[b] = max(filled.get(b, 0), n)
        owned = sum(1 for r in self._refs if r > 0)
        tokens = sum(filled.values())
        return KVUsage(
            reserved_bytes=self.num_blocks * block_bytes,
            owned_bytes=owned * block_bytes,
            cached_bytes=len(self._cached) * block_bytes,
            free_bytes=len(self._free) * block_bytes,
            token_bytes=tokens * kv_bytes_per_token,
            waste_bytes=owned * block_bytes - tokens * kv_bytes_per_token,
            shared_saved_bytes=(logical - owned) * block_bytes,
        )

    def check(self, tables: list[list[int]], host_tables: list[list[int]] = ()) -> None:
        """Invariant check: ref counts equal table membership; each block free, owned or cached;
        host blocks parked by sequences (`host_tables`) plus the free ones make the whole pool."""
        if self.host is not None:
            parked = sum(len(t) for t in host_tables)
            if parked + self.host.num_free != self.host.num_blocks:
                raise AssertionError(
                    f"host pool: {parked} parked + {self.host.num_free} free != {self.host.num_blocks}"
                )
        counts = [0] * self.num_blocks
        for t in tables:
            for b in t:
                counts[b] += 1
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError("a block is in the free list twice")
        for b in range(self.num_blocks):
            if counts[b] != self._refs[b]:
                raise AssertionError(f"block {b}: ref count {self._refs[b]} but {counts[b]} owners")
            states = (b in free) + (b in self._cached) + (counts[b] > 0)
            if states != 1:
                raise AssertionError(
                    f"block {b}: free={b in free} cached={b in self._cached} owners={counts[b]}; "
                    "a block must be exactly one of free / owned / cached"
                )
            if b in free and self._hash[b] is not None:
                raise AssertionError(f"block {b}: free but still registered under a prefix hash")
            if b in self._cached and self._hash[b] is None:
                raise AssertionError(f"block {b}: cached without a prefix hash")
        for h, b in self._by_hash.items():
            if self._hash[b] != h:
                raise AssertionError(f"prefix hash of block {b} disagrees with the hash index")
        if sum(h is not None for h in self._hash) != len(self._by_hash):
            raise AssertionError("a block carries a prefix hash missing from the hash index")
        if not self.enable_prefix_caching and self._by_hash:
            raise AssertionError("prefix caching is off but blocks are registered")

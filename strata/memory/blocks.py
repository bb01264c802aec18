"""The block manager: sole owner of KV-cache blocks.

Every block is either free (in the free list, ref count 0) or owned (ref count >= 1, listed in the
block tables of exactly that many sequences). Full blocks may be shared after a fork (n > 1);
partially filled blocks never are, so a sequence only ever writes into blocks it owns alone.
"""

from __future__ import annotations

from collections import deque
from typing import Protocol


class HasBlocks(Protocol):
    block_table: list[int]


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._refs = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, seq: HasBlocks, num_tokens: int, reserve: int = 0) -> bool:
        """Whether `seq` can grow to hold `num_tokens`, leaving `reserve` blocks free."""
        need = self.blocks_for(num_tokens) - len(seq.block_table)
        return need <= len(self._free) - reserve

    def allocate(self, seq: HasBlocks, num_tokens: int) -> None:
        """Grow `seq`'s block table to hold `num_tokens` tokens."""
        need = self.blocks_for(num_tokens) - len(seq.block_table)
        if need > len(self._free):
            raise RuntimeError(f"allocate: need {need} blocks, {len(self._free)} free")
        for _ in range(need):
            b = self._free.popleft()
            self._refs[b] = 1
            seq.block_table.append(b)

    def free(self, seq: HasBlocks) -> None:
        """Release every block `seq` holds (shared blocks stay owned by the others)."""
        for b in reversed(seq.block_table):
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._free.append(b)
            elif self._refs[b] < 0:
                raise RuntimeError(f"block {b} freed more often than owned")
        seq.block_table.clear()

    def fork(self, parent: HasBlocks, child: HasBlocks, num_tokens: int) -> list[tuple[int, int]]:
        """Give `child` the parent's first `num_tokens` tokens of KV.

        Full blocks are shared by ref count; a partially filled last block is copied into a fresh
        block. Returns the (src, dst) block copies the runner must perform before the next step.
        """
        if child.block_table:
            raise RuntimeError("fork: child already owns blocks")
        full, partial = divmod(num_tokens, self.block_size)
        if partial and not self._free:
            raise RuntimeError("fork: no free block for the partial last block")
        for b in parent.block_table[:full]:
            self._refs[b] += 1
            child.block_table.append(b)
        copies = []
        if partial:
            dst = self._free.popleft()
            self._refs[dst] = 1
            child.block_table.append(dst)
            copies.append((parent.block_table[full], dst))
        return copies

    def ref_count(self, block: int) -> int:
        return self._refs[block]

    def check(self, tables: list[list[int]]) -> None:
        """Invariant check: ref counts equal table membership; free iff unreferenced."""
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
            if (b in free) != (counts[b] == 0):
                raise AssertionError(f"block {b}: free={b in free} with {counts[b]} owners")

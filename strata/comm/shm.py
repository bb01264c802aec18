"""Shared-memory all-reduce and all-to-all for the ranks of one host (CPU tensors), the approach of
vLLM's CPU communicator and DeepSpeed's SHM all-reduce: no sockets, one copy in and one pass of
adds (all-reduce) or one copy out (all-to-all).

The region (a /dev/shm file rank 0 creates, named to the others over gloo, unlinked as soon as
every rank has mapped it, so nothing is left behind even when a rank is killed):

    header page   magic, ranks, slot bytes, creator pid
    control       one 64-byte line per rank: [round it has posted, its pid]
    data          2 buffers x n slots x slot_bytes

One round moves one chunk (<= slot_bytes) of the tensor: each rank copies its chunk into its slot
of buffer (round % 2), posts the round in its control line, waits until every rank has posted it
(spin ~40 us, then sched_yield to 2 ms, then sleeps of 20 us..1 ms; straight to the sleeps when
there are more ranks than cores, where a spinning rank would hold the core its peer needs; past
the timeout, or as soon as a missing rank's process has died, an error names the rank), then
adds the n slots in rank order into its tensor. Every rank
adds the same slots in the same order, so every rank ends with bitwise the same sum. Two buffers
make one barrier per round enough: a rank that posts round r+2 (overwriting buffer r % 2) has seen
every rank post r+1, which each did only after it finished reading round r.
16-bit tensors are summed in fp32 and rounded once; integers in their own type (wrapping as
gloo does).

The all-to-all (MoE dispatch and combine) uses the same slots and barriers: a rank's slot holds
a header [row bytes, its n send counts] and then a chunk of its send buffer (rows ordered by
destination); after the barrier each rank copies the bytes addressed to it out of every slot.
The header travels with the first chunk, so the counts cost no extra barrier; every rank then
knows every rank's buffer length and runs the same number of rounds (the longest buffer's
chunks). Any dtype: bytes are copied, never summed.
Ordering relies on x86-64 store order (TSO) plus the GIL/torch calls between the copy
and the flag store; other architectures would want an explicit fence here.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import os
import secrets
import struct
import time
from collections.abc import Callable

import torch
from torch import Tensor

from strata.errors import StrataError
from strata.settings import SETTINGS

SHM_DIR = "/dev/shm"
PREFIX = "strata-comm-"
DEFAULT_SLOT_BYTES = 4 * 2**20  # per rank and buffer: 2 x n x 4 MiB of /dev/shm
MAGIC = 0x53545241_544D5348
HEADER = 4096
LINE = 64
SPIN = SETTINGS.shm_spin  # flag polls before the first yield
YIELD_S = 0.002  # then sched_yield until this long, then sleeps
LIVENESS_EVERY_S = 0.02
STALE_S = 60.0  # an un-unlinked region older than this whose creator is gone is swept

# dtypes the region sums; 16-bit ones accumulate in fp32
SUMMED = (torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64, torch.int32,
          torch.int16, torch.int8, torch.uint8)
WIDE = {torch.bfloat16: torch.float32, torch.float16: torch.float32}


class CommError(StrataError, RuntimeError):
    """A collective that cannot complete: a rank died or did not arrive within the timeout."""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie (dead, not yet reaped by its parent) still answers kill(0)
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[-1].split()[0] not in (b"Z", b"X")
    except (OSError, IndexError):
        return True


def sweep_stale(now: float | None = None) -> list[str]:
    """Remove regions a crashed creator left (only possible if it died before every rank had
    attached): older than STALE_S and their creator's pid gone."""
    removed, now = [], time.time() if now is None else now
    try:
        names = [n for n in os.listdir(SHM_DIR) if n.startswith(PREFIX)]
    except OSError:
        return removed
    for name in names:
        path = os.path.join(SHM_DIR, name)
        try:
            pid = int(name[len(PREFIX):].split("-")[0])
            if now - os.stat(path).st_mtime > STALE_S and not _alive(pid):
                os.unlink(path)
                removed.append(path)
        except (ValueError, OSError):
            continue
    return removed


class ShmRegion:
    """The mapped file: header, control lines, slots (layout in the module docstring)."""

    def __init__(self, path: str, fd: int, mm: mmap.mmap, n: int, slot_bytes: int) -> None:
        self.path, self.fd, self.mm, self.n, self.slot_bytes = path, fd, mm, n, slot_bytes
        self.ctl_off = HEADER
        self.data_off = HEADER + -(-LINE * n // 4096) * 4096
        self.linked = True

    @staticmethod
    def size(n: int, slot_bytes: int) -> int:
        return HEADER + -(-LINE * n // 4096) * 4096 + 2 * n * slot_bytes

    @classmethod
    def create(cls, n: int, slot_bytes: int) -> ShmRegion:
        """A new region (O_EXCL, mode 0600), its pages reserved up front (posix_fallocate) so a
        full /dev/shm is an error here rather than a SIGBUS in the middle of a collective."""
        if slot_bytes <= 0 or slot_bytes % LINE:
            raise ValueError(f"slot_bytes must be a positive multiple of {LINE}, got {slot_bytes}")
        path = os.path.join(SHM_DIR, f"{PREFIX}{os.getpid()}-{secrets.token_hex(6)}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            size = cls.size(n, slot_bytes)
            os.posix_fallocate(fd, 0, size)
            mm = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        struct.pack_into("=4q", mm, 0, MAGIC, n, slot_bytes, os.getpid())
        return cls(path, fd, mm, n, slot_bytes)

    @classmethod
    def attach(cls, path: str, n: int, slot_bytes: int) -> ShmRegion:
        if not os.path.basename(path).startswith(PREFIX) or os.path.dirname(path) != SHM_DIR:
            raise ValueError(f"not a Strata region: {path!r}")
        fd = os.open(path, os.O_RDWR)
        try:
            size = cls.size(n, slot_bytes)
            if os.fstat(fd).st_size != size:
                raise ValueError(f"{path}: {os.fstat(fd).st_size} bytes, expected {size}")
            mm = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            raise
        magic, rn, rslot, _ = struct.unpack_from("=4q", mm, 0)
        if (magic, rn, rslot) != (MAGIC, n, slot_bytes):
            mm.close()
            os.close(fd)
            raise ValueError(f"{path}: header {(rn, rslot)} does not match {(n, slot_bytes)}")
        return cls(path, fd, mm, n, slot_bytes)

    def write_pid(self, rank: int) -> None:
        struct.pack_into("=q", self.mm, self.ctl_off + LINE * rank + 8, os.getpid())

    def pids(self) -> list[int]:
        return [struct.unpack_from("=q", self.mm, self.ctl_off + LINE * r + 8)[0] for r in range(self.n)]

    def unlink(self) -> None:
        if self.linked:
            self.linked = False
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    def close(self) -> None:
        if self.mm is not None:
            try:
                self.mm.close()
            except BufferError:  # a tensor view outlives us; the mapping goes with it
                pass
            os.close(self.fd)
            self.mm = None


class ShmAllReduce:
    """The all-reduce and the all-to-all over one mapped region; one per process group (see
    setup()). Both share the round counter, so they interleave in any order."""

    def __init__(self, region: ShmRegion, rank: int, timeout_s: float, check_pids: bool = True) -> None:
        self.region, self.rank, self.n = region, rank, region.n
        self.timeout_s = float(timeout_s)
        self.slot_bytes = region.slot_bytes
        self.broken: str | None = None
        self._what = "all-reduce"  # the collective in progress, for error messages
        self._round = 0
        self._flags = struct.Struct("=" + "q56x" * (self.n - 1) + "q")
        self._my_flag = region.ctl_off + LINE * rank
        self._pids = region.pids() if check_pids else []
        # more ranks than cores: a spinning rank would hold the core its peer needs to arrive
        self.oversubscribed = self.n > len(os.sched_getaffinity(0))
        self._spin = 0 if self.oversubscribed else SPIN
        self._yield_s = 0.0 if self.oversubscribed else YIELD_S
        u8 = torch.frombuffer(region.mm, dtype=torch.uint8, count=2 * self.n * self.slot_bytes,
                              offset=region.data_off)
        self._u8 = u8.view(2, self.n, self.slot_bytes)
        self._data = u8.data_ptr()  # the data area's address (the all-to-all's memmoves)
        self._views: dict[torch.dtype, list[list[Tensor]]] = {}
        self._scratch: Tensor | None = None
        # all-to-all slot header: [row bytes, n send counts], padded to whole lines
        self._head = struct.Struct(f"={self.n + 1}q")
        self.head_bytes = -(-self._head.size // LINE) * LINE

    @staticmethod
    def supports(t: Tensor, wire: torch.dtype | None = None) -> bool:
        return (t.device.type == "cpu" and t.is_contiguous() and t.dtype in SUMMED
                and (wire is None or wire in SUMMED))

    def chunk_elements(self, dtype: torch.dtype) -> int:
        return self.slot_bytes // dtype.itemsize

    def _slots(self, dtype: torch.dtype) -> list[list[Tensor]]:
        v = self._views.get(dtype)
        if v is None:
            v = [[self._u8[b, r].view(dtype) for r in range(self.n)] for b in range(2)]
            self._views[dtype] = v
        return v

    def all_reduce(self, t: Tensor, wire: torch.dtype | None = None) -> Tensor:
        """Sum `t` (contiguous, CPU) over the ranks in place; `wire` is the slot dtype (None: t's
        own; bfloat16/float16 for fp32 tensors is the compressed all-reduce)."""
        self._usable("all-reduce")
        wire = t.dtype if wire is None else wire
        flat = t.view(-1)
        per = self.chunk_elements(wire)
        wide = WIDE.get(wire) if t.dtype == wire else None
        if wide is not None and (self._scratch is None or self._scratch.numel() < per):
            self._scratch = torch.empty(per, dtype=wide)
        numel = flat.numel()
        for off in range(0, numel, per):
            k = min(per, numel - off)
            self._round += 1
            r = self._round
            slots = self._slots(wire)[r & 1]
            dst = flat[off:off + k]
            slots[self.rank][:k].copy_(dst)
            struct.pack_into("=q", self.region.mm, self._my_flag, r)
            self._wait(r)
            srcs = [s[:k] for s in slots]
            if wide is not None:  # 16-bit tensor: fp32 accumulator, rounded once
                acc = self._scratch[:k]
                acc.copy_(srcs[0])
                for s in srcs[1:]:
                    acc.add_(s)
                dst.copy_(acc)
            elif wire == t.dtype:
                torch.add(srcs[0], srcs[1], out=dst)
                for s in srcs[2:]:
                    dst.add_(s)
            else:  # compressed: 16-bit slots added into the fp32 tensor
                dst.copy_(srcs[0])
                for s in srcs[1:]:
                    dst.add_(s)
        return t

    def all_to_all(self, t: Tensor, send_counts: list[int]) -> tuple[Tensor, list[int]]:
        """Rows of `t` (CPU, [sum(send_counts), ...], ordered by destination) to the ranks:
        send_counts[j] rows to rank j. Returns the rows received, ordered by source rank, and
        how many each rank sent here. Every rank's rows must have the same bytes (the header
        says; a mismatch is a ValueError on every rank, after which the region is still usable).
        Bytes move by memmove: a torch copy costs ~2 us of dispatch per slice, which at small
        sizes was most of the collective."""
        self._usable("all-to-all")
        per = self.slot_bytes - self.head_bytes  # send-buffer bytes per round
        if per <= 0:
            raise ValueError(f"all_to_all: slot_bytes {self.slot_bytes} leaves no room after the "
                             f"{self.head_bytes}-byte header of {self.n} ranks")
        if len(send_counts) != self.n or min(send_counts) < 0 or sum(send_counts) != t.shape[0]:
            raise ValueError(f"all_to_all: send_counts {list(send_counts)} for {t.shape[0]} rows, {self.n} ranks")
        row = math.prod(t.shape[1:]) * t.element_size()
        src = t.contiguous()  # held until the last round has copied from it
        b = (self._round + 1) & 1  # the first round's buffer: the header goes with it
        self._head.pack_into(self.region.mm, self.region.data_off + self._slot_at(b, self.rank), row, *send_counts)
        self._a2a_round(src.data_ptr(), row * t.shape[0], 0)
        heads = [self._head.unpack_from(self.region.mm, self.region.data_off + self._slot_at(b, q))
                 for q in range(self.n)]
        if len({h[0] for h in heads}) > 1:
            raise ValueError(f"all_to_all: the ranks' rows differ in bytes ({[h[0] for h in heads]}): every "
                             "rank must send rows of one shape and dtype")
        recv = [h[1 + self.rank] for h in heads]
        spans, at = [], 0  # per source: (offset of my rows in its buffer, their bytes, where they go)
        for h, c in zip(heads, recv):
            spans.append((row * sum(h[1:1 + self.rank]), row * c, at))
            at += row * c
        out = t.new_empty((sum(recv), *t.shape[1:]))
        self._a2a_copy(b, 0, spans, out.data_ptr())
        longest = max(row * sum(h[1:]) for h in heads)  # every rank runs as many rounds
        for base in range(per, longest, per):
            b = self._a2a_round(src.data_ptr(), row * t.shape[0], base)
            self._a2a_copy(b, base, spans, out.data_ptr())
        return out, recv

    def _slot_at(self, b: int, q: int) -> int:
        """Rank q's slot of buffer b, as an offset into the data area."""
        return (b * self.n + q) * self.slot_bytes

    def _a2a_round(self, src: int, size: int, base: int) -> int:
        """Post bytes [base, base + per) of my `size`-byte send buffer at address `src`; wait for
        every rank. Returns the buffer the round used."""
        self._round += 1
        r = self._round
        k = min(self.slot_bytes - self.head_bytes, size - base)
        if k > 0:
            ctypes.memmove(self._data + self._slot_at(r & 1, self.rank) + self.head_bytes, src + base, k)
        struct.pack_into("=q", self.region.mm, self._my_flag, r)
        self._wait(r)
        return r & 1

    def _a2a_copy(self, b: int, base: int, spans: list[tuple[int, int, int]], dst: int) -> None:
        """Copy what this round's chunks [base, base + per) hold of my rows out of every slot into
        the output at address `dst` (spans: all_to_all's)."""
        per, hb = self.slot_bytes - self.head_bytes, self.head_bytes
        for q, (off, length, at) in enumerate(spans):
            lo, hi = max(off, base), min(off + length, base + per)
            if lo < hi:
                ctypes.memmove(dst + at + lo - off, self._data + self._slot_at(b, q) + hb + lo - base, hi - lo)

    def _usable(self, what: str) -> None:
        if self.broken:
            raise CommError(f"shared-memory {what} unusable after an earlier failure: {self.broken}")
        self._what = what

    def _wait(self, r: int) -> None:
        unpack, mm, off = self._flags.unpack_from, self.region.mm, self.region.ctl_off
        for _ in range(self._spin):
            if min(unpack(mm, off)) >= r:
                return
        t0 = time.monotonic()
        next_check, pause = t0 + LIVENESS_EVERY_S, 0.0
        while True:
            seen = unpack(mm, off)
            if min(seen) >= r:
                return
            now = time.monotonic()
            if now - t0 < self._yield_s:
                os.sched_yield()
                continue
            if now >= next_check:
                next_check = now + LIVENESS_EVERY_S
                self._check(r, seen, now - t0)
            pause = min(max(pause * 2, 20e-6), 1e-3)
            time.sleep(pause)

    def _check(self, r: int, seen: tuple[int, ...], waited: float) -> None:
        missing = [q for q in range(self.n) if seen[q] < r]
        for q in missing:
            if self._pids and not _alive(self._pids[q]):
                self.broken = f"rank {q} (pid {self._pids[q]}) died before arriving at round {r}"
                raise CommError(f"shared-memory {self._what} on rank {self.rank}: {self.broken}")
        if waited > self.timeout_s:
            last = ", ".join(f"rank {q} at round {seen[q]}" for q in missing)
            self.broken = (f"timed out after {self.timeout_s:g} s waiting for rank(s) "
                           f"{', '.join(map(str, missing))} at round {r} ({last})")
            raise CommError(f"shared-memory {self._what} on rank {self.rank}: {self.broken}")

    def close(self) -> None:
        self.broken = self.broken or "closed"  # the memmoves must never touch the unmapped area
        self._views.clear()
        self._u8 = None
        self._scratch = None
        self.region.close()


def setup(rank: int, n: int, slot_bytes: int, timeout_s: float,
          broadcast_bytes: Callable[[bytes | None], bytes],
          all_min: Callable[[int], int]) -> tuple[ShmAllReduce | None, str]:
    """Collective over a gloo group (given as its broadcast_bytes and an all-reduce MIN of one
    int): rank 0 creates the region and names it, the others map it, all post their pid, and once
    every rank has it (the MIN) rank 0 unlinks the file. Returns (the all-reduce, "") or (None,
    why not): a rank that cannot open the file (another host, another /dev/shm) turns SHM off
    for all."""
    region, reason, path = None, "", b""
    try:
        if rank == 0:
            sweep_stale()
            try:
                region = ShmRegion.create(n, slot_bytes)
                path = region.path.encode()
            except (OSError, ValueError) as e:
                reason = f"rank 0 cannot create a {ShmRegion.size(n, slot_bytes)}-byte region in {SHM_DIR}: {e}"
        path = broadcast_bytes(path if rank == 0 else None)
        if not path:
            return None, reason or "rank 0 could not create the shared-memory region"
        if rank != 0:
            try:
                region = ShmRegion.attach(path.decode(), n, slot_bytes)
            except (OSError, ValueError) as e:
                reason = f"rank {rank} cannot map {path.decode()} ({e}): not one host or /dev/shm"
        if region is not None:
            region.write_pid(rank)
        ok = all_min(1 if region is not None else 0)
    finally:
        if rank == 0 and region is not None:
            region.unlink()
    if not ok:
        if region is not None:
            region.close()
        return None, reason or "another rank could not map the shared-memory region"
    pids = region.pids()
    visible = all(p > 0 and _alive(p) for p in pids)  # other pid namespaces: no liveness checks
    return ShmAllReduce(region, rank, timeout_s, check_pids=visible), ""

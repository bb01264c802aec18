"""Shared-memory all-reduce for the ranks of one host (CPU tensors), the approach of vLLM's CPU
communicator and DeepSpeed's SHM all-reduce: no sockets, one copy in and one pass of adds.

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
gloo does). Ordering relies on x86-64 store order (TSO) plus the GIL/torch calls between the copy
and the flag store; other architectures would want an explicit fence here.
"""

from __future__ import annotations

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
    """The all-reduce over one mapped region; one per process group (see setup())."""

    def __init__(self, region: ShmRegion, rank: int, timeout_s: float, check_pids: bool = True) -> None:
        self.region, self.rank, self.n = region, rank, region.n
        self.timeout_s = float(timeout_s)
        self.slot_bytes = region.slot_bytes
        self.broken: str | None = None
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
        self._views: dict[torch.dtype, list[list[Tensor]]] = {}
        self._scratch: Tensor | None = None

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
        if self.broken:
            raise CommError(f"shared-memory all-reduce unusable after an earlier failure: {self.broken}")
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
                raise CommError(f"shared-memory all-reduce on rank {self.rank}: {self.broken}")
        if waited > self.timeout_s:
            last = ", ".join(f"rank {q} at round {seen[q]}" for q in missing)
            self.broken = (f"timed out after {self.timeout_s:g} s waiting for rank(s) "
                           f"{', '.join(map(str, missing))} at round {r} ({last})")
            raise CommError(f"shared-memory all-reduce on rank {self.rank}: {self.broken}")

    def close(self) -> None:
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

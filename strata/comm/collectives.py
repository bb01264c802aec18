"""Collectives behind one small interface: all_reduce, all_gather, all_to_all, broadcast (+ bytes).

The model's tensor-parallel layers and the engine's step broadcast call a Communicator; which
transport and algorithm runs is its business:
  CPU tensors, ranks on one host: the shared-memory all-reduce (shm.py), set up on the first
      all_reduce (or eagerly by Communicator.create); gloo when the ranks turn out not to share
      /dev/shm, for non-contiguous tensors and dtypes the region does not sum;
  where both are possible a fitted alpha-beta model (alpha_beta.CommModel, from the hardware
      profile: `strata bench comm` measures it) picks per message size; without one, SHM;
  CUDA tensors: NCCL; CPU tensors and bytes on an NCCL communicator go over a gloo group created
      alongside (as vLLM does), since NCCL moves only CUDA tensors.
all_to_all (MoE expert parallelism: rows to the rank owning their expert and back) runs on SHM
for CPU tensors on one host (shm.py), else all_to_all_single on gloo (CPU; gloo has the uneven
form on CPU) or NCCL; the counts are exchanged first unless the caller knows them.
`comm_dtype` ("bfloat16"/"float16") is the compressed all-reduce: fp32 tensors are reduced at 16
bits (SHM: 16-bit slots summed in fp32 straight into the fp32 tensor; gloo/NCCL: cast, reduce,
cast back). Every collective is bounded by the world's timeout (world.collective_timeout_s).
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch import Tensor
from torch.autograd.profiler import record_function

from strata.comm import shm as shm_mod
from strata.comm.alpha_beta import CommModel
from strata.comm.world import World, collective_timeout_s, init_world
from strata.errors import ConfigError
from strata.kernels.dispatch import KERNEL_MODE

logger = logging.getLogger(__name__)

COMM_DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
               "fp16": torch.float16}


def parse_comm_dtype(value: str | torch.dtype | None) -> torch.dtype | None:
    if value is None or isinstance(value, torch.dtype) and value in (torch.bfloat16, torch.float16):
        return value
    if value == torch.float32:
        return None
    if isinstance(value, str) and value.lower() in COMM_DTYPES:
        return COMM_DTYPES[value.lower()]
    if isinstance(value, str) and value.lower() in ("none", "float32", "fp32", ""):
        return None
    raise ConfigError(f"comm_dtype {value!r}: choose bfloat16 or float16 (or None for full precision)")


def _split_counts(t: Tensor, send_counts: list[int] | None, n: int) -> list[int]:
    """all_to_all's send counts, checked against `t` (None: an equal split)."""
    if t.dim() < 1:
        raise ValueError("all_to_all: needs a tensor of rows (at least one dimension)")
    rows = t.shape[0]
    if send_counts is None:
        if rows % n:
            raise ValueError(f"all_to_all: {rows} rows do not split equally over {n} ranks; pass send_counts")
        return [rows // n] * n
    counts = [int(c) for c in send_counts]
    if len(counts) != n or min(counts) < 0 or sum(counts) != rows:
        raise ValueError(f"all_to_all: send_counts {counts} must be {n} counts >= 0 summing to the "
                         f"{rows} rows of the tensor")
    return counts


class Communicator:
    """Collectives over one process group. Every method is collective: all ranks call it in the
    same order with tensors of the same shape and dtype.

    `shm`: allow the shared-memory all-reduce (one host, CPU). `cost`: the fitted model that
    picks SHM or gloo per message size (None: SHM whenever it can). `timeout_s`: the SHM
    barrier's bound (default: the world's collective timeout)."""

    def __init__(self, group: dist.ProcessGroup | None = None, *, comm_dtype: str | torch.dtype | None = None,
                 shm: bool = True, cost: CommModel | None = None, timeout_s: float | None = None,
                 shm_slot_bytes: int = shm_mod.DEFAULT_SLOT_BYTES) -> None:
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        self.backend = str(dist.get_backend(self.group)).lower()
        self.comm_dtype = parse_comm_dtype(comm_dtype)
        self._choices: dict[tuple[int, torch.dtype, torch.dtype], str] = {}
        self.cost = cost
        self.timeout_s = collective_timeout_s() if timeout_s is None else float(timeout_s)
        self.shm_slot_bytes = int(shm_slot_bytes)
        self.meta_group = self.group  # CPU tensors and bytes
        if self.backend == "nccl":
            import datetime

            ranks = dist.get_process_group_ranks(self.group)
            self.meta_group = dist.new_group(ranks, backend="gloo",
                                             timeout=datetime.timedelta(seconds=self.timeout_s))
        self._shm: shm_mod.ShmAllReduce | None = None
        self.shm_state = "not set up" if shm and self.world_size > 1 else "off"
        self.last_transport = ""  # which transport the latest all_reduce ran on (tests, bench)

    @classmethod
    def create(cls, world: World | None = None, device: str = "cpu", comm_dtype: str | None = None,
               *, shm: bool = True, cost: CommModel | None = None, timeout_s: float | None = None,
               shm_slot_bytes: int = shm_mod.DEFAULT_SLOT_BYTES) -> Communicator:
        """Join the world (init_world, unless already joined) and set SHM up now (on CPU, every
        rank together) rather than on the first all_reduce."""
        world = world or World.from_env()
        if world is None and not dist.is_initialized():
            raise ConfigError("Communicator.create: no world (RANK/WORLD_SIZE unset); pass World")
        if world is not None:
            kw = {} if timeout_s is None else {"timeout_s": timeout_s}
            init_world(world, device, **kw)
        comm = cls(comm_dtype=comm_dtype, shm=shm and not str(device).startswith("cuda"), cost=cost,
                   timeout_s=timeout_s, shm_slot_bytes=shm_slot_bytes)
        if comm.shm_state == "not set up" and world is not None and world.local_world_size < world.world_size:
            comm.shm_state = "off: ranks on several hosts (LOCAL_WORLD_SIZE < WORLD_SIZE)"
        comm.setup_shm()
        return comm

    # ------------------------------------------------------------ shared memory

    def setup_shm(self) -> bool:
        """Collective: map the region (once). False, with `shm_state` saying why, when SHM is
        off; the all-reduce then runs on gloo."""
        if self.shm_state != "not set up":
            return self._shm is not None
        self._shm, why = shm_mod.setup(self.rank, self.world_size, self.shm_slot_bytes, self.timeout_s,
                                       self.broadcast_bytes, self.all_min)
        self.shm_state = "on" if self._shm is not None else f"off: {why}"
        if self._shm is None:
            logger.info("shared-memory all-reduce off (%s); gloo instead", why)
        return self._shm is not None

    def all_min(self, v: int) -> int:
        """The smallest of every rank's `v` (ranks agreeing on a size)."""
        t = torch.tensor([v], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.meta_group)
        return int(t.item())

    @property
    def cost(self) -> CommModel | None:
        return self._cost

    @cost.setter
    def cost(self, model: CommModel | None) -> None:
        self._cost = model
        self._choices.clear()  # the per-size choices were the old model's

    @property
    def shm_available(self) -> bool:
        return self._shm is not None

    # ------------------------------------------------------------ collectives

    def all_reduce(self, t: Tensor, *, transport: str | None = None) -> Tensor:
        """Sum over ranks, in place; returns `t`. `transport` ("shm" | "gloo" | "nccl") forces
        one (benchmarks, tests); by default the rules of the module docstring choose. While the
        kernel mode names kernels (profiling, `strata analyze`), the call is a
        `strata::comm.all_reduce` range, so profiles count it as communication."""
        if KERNEL_MODE.get().named:
            with record_function("strata::comm.all_reduce"):
                return self._all_reduce(t, transport)
        return self._all_reduce(t, transport)

    def _all_reduce(self, t: Tensor, transport: str | None) -> Tensor:
        if self.world_size == 1:
            self.last_transport = "none"
            return t
        wire = self._wire(t)
        path = transport or self._choose(t, wire)
        self.last_transport = path
        if path == "shm":
            if not self.setup_shm():
                raise ConfigError(f"all_reduce(transport='shm'): {self.shm_state}")
            if not shm_mod.ShmAllReduce.supports(t, wire):
                raise ConfigError(f"all_reduce(transport='shm'): needs a contiguous CPU tensor of "
                                  f"{', '.join(str(d) for d in shm_mod.SUMMED)}; got {t.dtype}")
            return self._shm.all_reduce(t, None if wire == t.dtype else wire)
        group = self.meta_group if t.device.type == "cpu" else self.group
        work = t if t.is_contiguous() and wire == t.dtype else t.contiguous().to(wire)
        dist.all_reduce(work, group=group)
        if work is not t:
            t.copy_(work)
        return t

    def _wire(self, t: Tensor) -> torch.dtype:
        return self.comm_dtype if self.comm_dtype is not None and t.dtype == torch.float32 else t.dtype

    def _choose(self, t: Tensor, wire: torch.dtype) -> str:
        if t.device.type != "cpu":
            return self.backend
        if not shm_mod.ShmAllReduce.supports(t, wire) or not self.setup_shm():
            return "gloo"
        if self._cost is None:
            return "shm"
        key = (t.numel() * t.element_size(), t.dtype, wire)  # the tensor's bytes, compressed or not
        path = self._choices.get(key)
        if path is None:
            suffix = "" if wire == t.dtype else f"+{str(wire).replace('torch.', '')}"
            best = self._cost.best("all_reduce", key[0], self.world_size, [f"shm{suffix}", f"gloo{suffix}"])
            if best is None and suffix:  # no fit of the compressed variant: the full-width one
                best = self._cost.best("all_reduce", key[0], self.world_size, ["shm", "gloo"])
            path = "gloo" if best is not None and best[0].startswith("gloo") else "shm"
            if len(self._choices) < 4096:
                self._choices[key] = path
        return path

    def all_gather(self, t: Tensor, dim: int = -1) -> Tensor:
        """Every rank's `t`, concatenated along `dim` in rank order."""
        if KERNEL_MODE.get().named:
            with record_function("strata::comm.all_gather"):
                return self._all_gather(t, dim)
        return self._all_gather(t, dim)

    def _all_gather(self, t: Tensor, dim: int) -> Tensor:
        parts = [torch.empty_like(t) for _ in range(self.world_size)]
        group = self.meta_group if t.device.type == "cpu" else self.group
        dist.all_gather(parts, t.contiguous(), group=group)
        return torch.cat(parts, dim=dim)

    def all_to_all(self, t: Tensor, send_counts: list[int] | None = None, recv_counts: list[int] | None = None,
                   *, transport: str | None = None) -> tuple[Tensor, list[int]]:
        """MoE's exchange: `t`'s rows ([sum(send_counts), ...], ordered by destination rank) go
        send_counts[j] to rank j; returns the rows this rank received, ordered by source rank, and
        how many came from each. `send_counts=None`: equal split (rows divisible by the world
        size). `recv_counts`, when the caller knows them (the combine after a dispatch: the
        dispatch's send counts), skips the count exchange on gloo/NCCL; SHM checks them.
        `transport` as all_reduce's; by default SHM for CPU tensors on one host, whatever the
        size: ranks send different sizes, so a per-size choice could differ between ranks. A
        world of one returns `t` itself."""
        if KERNEL_MODE.get().named:
            with record_function("strata::comm.all_to_all"):
                return self._all_to_all(t, send_counts, recv_counts, transport)
        return self._all_to_all(t, send_counts, recv_counts, transport)

    def _all_to_all(self, t: Tensor, send_counts: list[int] | None, recv_counts: list[int] | None,
                    transport: str | None) -> tuple[Tensor, list[int]]:
        n = self.world_size
        if send_counts is None and recv_counts is None:  # equal split: every rank holds as many rows
            recv_counts = _split_counts(t, None, n)
        send_counts = _split_counts(t, send_counts, n)
        if n == 1:
            self.last_transport = "none"
            return t, list(send_counts)
        cpu = t.device.type == "cpu"
        path = transport or ("shm" if cpu and self.setup_shm() else "gloo" if cpu else self.backend)
        self.last_transport = path
        if path == "shm":
            if not cpu or not self.setup_shm():
                raise ConfigError(f"all_to_all(transport='shm'): {self.shm_state if cpu else 'needs a CPU tensor'}")
            out, got = self._shm.all_to_all(t, send_counts)
            if recv_counts is not None and list(recv_counts) != got:
                raise ValueError(f"all_to_all on rank {self.rank}: recv_counts {list(recv_counts)}, "
                                 f"but the ranks sent {got}")
            return out, got
        group = self.meta_group if cpu else self.group
        if recv_counts is None:
            sent = torch.tensor(send_counts, dtype=torch.int64)
            got_t = torch.empty(n, dtype=torch.int64)
            dist.all_to_all_single(got_t, sent, group=self.meta_group)
            recv_counts = got_t.tolist()
        out = t.new_empty((sum(recv_counts), *t.shape[1:]))
        dist.all_to_all_single(out, t.contiguous(), output_split_sizes=list(recv_counts),
                               input_split_sizes=list(send_counts), group=group)
        return out, list(recv_counts)

    def broadcast(self, t: Tensor, src: int = 0) -> Tensor:
        """`src`'s `t` to every rank, in place; `src` is a rank of this communicator's group."""
        group = self.meta_group if t.device.type == "cpu" else self.group
        if t.is_contiguous():
            dist.broadcast(t, group=group, group_src=src)
        else:
            work = t.contiguous()
            dist.broadcast(work, group=group, group_src=src)
            t.copy_(work)
        return t

    def broadcast_bytes(self, data: bytes | None, src: int = 0) -> bytes:
        """Plain bytes from `src` to every rank (length, then payload; never pickle); always over
        gloo (the side group on an NCCL communicator)."""
        n = torch.tensor([len(data) if self.rank == src else 0], dtype=torch.int64)
        dist.broadcast(n, group=self.meta_group, group_src=src)
        buf = (torch.frombuffer(bytearray(data), dtype=torch.uint8) if self.rank == src and data
               else torch.empty(int(n.item()), dtype=torch.uint8))
        if buf.numel():
            dist.broadcast(buf, group=self.meta_group, group_src=src)
        return bytes(buf.numpy())

    def barrier(self) -> None:
        self.all_min(0)

    def close(self) -> None:
        """Unmap the SHM region (the file itself is already gone). Later all_reduces use gloo."""
        if self._shm is not None:
            self._shm.close()
            self._shm = None
            self.shm_state = "off: closed"

"""The world of ranks: from torchrun's environment when present, else spawned locally by Strata.

Every collective has a timeout (the process group's), so a dead or hung rank is an error, never
a hang. Rendezvous is TCP to MASTER_ADDR:MASTER_PORT (loopback when Strata spawns the ranks).
"""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from strata.errors import ConfigError

DEFAULT_TIMEOUT_S = 60.0
_timeout_s: float | None = None  # what init_world gave the default group (collective_timeout_s)


@dataclass(frozen=True)
class World:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int

    @classmethod
    def from_env(cls, env: dict | None = None) -> World | None:
        """torchrun's (or Strata's own) environment; None when this process is not in a world."""
        env = os.environ if env is None else env
        if "RANK" not in env or "WORLD_SIZE" not in env:
            return None
        try:
            rank, size = int(env["RANK"]), int(env["WORLD_SIZE"])
            local_rank = int(env.get("LOCAL_RANK", rank))
            local_size = int(env.get("LOCAL_WORLD_SIZE", size))
            addr, port = env.get("MASTER_ADDR", "127.0.0.1"), int(env.get("MASTER_PORT", "29500"))
        except ValueError as e:
            raise ConfigError(f"torch.distributed environment: {e}; RANK, WORLD_SIZE, LOCAL_RANK and "
                              "MASTER_PORT must be integers (torchrun sets them)") from None
        if not 0 <= rank < size:
            raise ConfigError(f"torch.distributed environment: RANK={rank} outside WORLD_SIZE={size}")
        return cls(rank, size, local_rank, local_size, addr, port)

    def env(self) -> dict[str, str]:
        """The environment that puts a child process into this world (as torchrun would)."""
        return {
            "RANK": str(self.rank), "WORLD_SIZE": str(self.world_size), "LOCAL_RANK": str(self.local_rank),
            "LOCAL_WORLD_SIZE": str(self.local_world_size), "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
        }

    def with_rank(self, rank: int) -> World:
        return World(rank, self.world_size, rank, self.local_world_size, self.master_addr, self.master_port)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def local_world(world_size: int) -> World:
    """Rank 0 of a world Strata spawns itself on this host (loopback rendezvous)."""
    return World(0, world_size, 0, world_size, "127.0.0.1", free_port())


def backend_for(device: str) -> str:
    return "nccl" if str(device).startswith("cuda") else "gloo"


def init_world(world: World, device: str = "cpu", timeout_s: float = DEFAULT_TIMEOUT_S) -> dist.ProcessGroup:
    """Join the default process group (gloo on CPU, NCCL on CUDA), every collective bounded by
    `timeout_s`."""
    global _timeout_s
    if dist.is_initialized():
        return dist.group.WORLD
    _timeout_s = float(timeout_s)
    if str(device).startswith("cuda"):
        torch.cuda.set_device(world.local_rank)
    dist.init_process_group(
        backend_for(device), init_method=f"tcp://{world.master_addr}:{world.master_port}",
        rank=world.rank, world_size=world.world_size, timeout=datetime.timedelta(seconds=timeout_s),
    )
    return dist.group.WORLD


def collective_timeout_s() -> float:
    """The bound on one collective: init_world's `timeout_s`, else DEFAULT_TIMEOUT_S (the
    shared-memory all-reduce waits this long for a rank before naming it in an error)."""
    return _timeout_s if _timeout_s is not None else DEFAULT_TIMEOUT_S


def destroy_world() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()

"""Tensor parallelism in the engine: the ranks, and the step plan every rank follows.

Rank 0 owns the scheduler and the sampler. Each step, after scheduling, it broadcasts the step's
plan (per sequence: the tokens to compute, their start position, the block table, whether it
samples, its LoRA adapter id; plus block copies and swap pairs; with LoRA, the adapter slots that
changed since the last plan, engine/lora_manager.py step_plan) as msgpack bytes
(Communicator.broadcast_bytes; never pickle), and every rank runs the same ModelRunner on its shard of the model: the all-reduces
inside the model and the all-gather of the logits keep them in step. The other ranks only execute.

Ranks come from torchrun's environment when it is set (many hosts: every host runs the same
command; rank 0 does the work of the command, the others run `run_worker`), else rank 0 spawns
the other ranks on this host as `python -m strata.engine.tp_worker` with a loopback rendezvous;
they die with it (hardware/processes.py). A dead or hung rank makes the next collective fail
within comm_timeout: the engine raises, and nothing is left running.
"""

from __future__ import annotations

import datetime
import json
import logging
import subprocess
import sys
import threading
from dataclasses import asdict, dataclass, field

import msgspec
import torch.distributed as dist

from strata.comm.world import World, destroy_world, init_world, local_world
from strata.config import EngineConfig
from strata.errors import StrataError
from strata.hardware import processes

logger = logging.getLogger(__name__)

STOP = b""  # the plan that tells the other ranks to leave


class RankDied(StrataError):
    """A tensor-parallel rank stopped answering (dead, hung, or its collective failed)."""


# --- the plan ------------------------------------------------------------------------------------


class _Window:
    """The tokens of positions [start, start + n) of a sequence, indexed by absolute position."""

    __slots__ = ("start", "tokens")

    def __init__(self, start: int, tokens: list[int]) -> None:
        self.start, self.tokens = start, tokens

    def __getitem__(self, i):
        if isinstance(i, slice):
            return self.tokens[i.start - self.start : i.stop - self.start]
        return self.tokens[i - self.start]


@dataclass
class _PlanRequest:
    lora_id: int  # 0: the base model


@dataclass
class _PlanSeq:
    token_ids: _Window
    num_computed_tokens: int
    block_table: list[int]
    request: _PlanRequest


@dataclass
class _PlanItem:
    seq: _PlanSeq
    num_tokens: int
    samples: bool
    forks: list = field(default_factory=list)
    draft: list[int] = field(default_factory=list)


@dataclass
class PlanOutput:
    """What the runner reads of a SchedulerOutput, rebuilt from the bytes on ranks > 0."""

    scheduled: list[_PlanItem]
    block_copies: list[tuple[int, int]]
    swap_out: list[tuple[int, int]]
    swap_in: list[tuple[int, int]]
    lora: list | None = None  # LoRAManager.step_plan: slots to set before the step (None: none changed)


def _lora_id(s) -> int:
    return getattr(getattr(s.seq, "request", None), "lora_id", 0) or 0


def encode_step(out, lora=None) -> bytes:
    """The step's plan; `lora` (rank 0's LoRAManager) puts the step's adapters in slots first and
    adds the slots the other ranks must change."""
    items = []
    for s in out.scheduled:
        start = s.seq.num_computed_tokens
        items.append([start, s.seq.token_ids[start : start + s.num_tokens - len(s.draft)] + s.draft,
                      list(s.seq.block_table), bool(s.samples), len(s.forks), s.draft, _lora_id(s)])
    slots = None if lora is None else lora.step_plan({_lora_id(s) for s in out.scheduled} - {0})
    return msgspec.msgpack.encode([items, out.block_copies, out.swap_out, out.swap_in, slots])


def decode_step(data: bytes) -> PlanOutput:
    items, copies, swap_out, swap_in, slots = msgspec.msgpack.decode(data)
    scheduled = [
        _PlanItem(_PlanSeq(_Window(start, toks), start, table, _PlanRequest(lora_id)), len(toks), samples,
                  [None] * forks, draft)
        for start, toks, table, samples, forks, draft, lora_id in items
    ]
    pairs = [[tuple(p) for p in x] for x in (copies, swap_out, swap_in)]
    return PlanOutput(scheduled, *pairs, slots)


# --- the ranks -----------------------------------------------------------------------------------


class Ranks:
    """This process's place in the tensor-parallel world, and on rank 0 the ranks it spawned."""

    def __init__(self, config: EngineConfig, world: World | None = None) -> None:
        self.config = config
        self.procs: list[subprocess.Popen] = []
        env_world = World.from_env()
        if world is None and env_world is not None and env_world.world_size == config.tensor_parallel_size:
            world = env_world  # torchrun (or our own spawn): everyone already knows their rank
        if world is None:
            world = local_world(config.tensor_parallel_size)
            self._spawn(world)
        if world.world_size != config.tensor_parallel_size:
            raise StrataError(
                f"tensor_parallel_size={config.tensor_parallel_size} but the torch.distributed world has "
                f"{world.world_size} ranks (WORLD_SIZE); start as many ranks as --tensor-parallel-size"
            )
        self.world = world
        try:
            init_world(world, config.device, config.comm_timeout)
            # the step plans travel on a group of their own, without the collective timeout: the
            # other ranks wait there for rank 0's next step however long it idles (a dead peer
            # still breaks the connection at once)
            self.control = dist.new_group(backend="gloo", timeout=datetime.timedelta(days=365))
        except Exception:
            self.close()
            raise
        logger.info("tensor parallel: rank %d of %d (%s:%d)", world.rank, world.world_size,
                    world.master_addr, world.master_port)

    @property
    def rank(self) -> int:
        return self.world.rank

    def _spawn(self, world: World) -> None:
        cfg = json.dumps({k: v for k, v in asdict(self.config).items()})
        for r in range(1, world.world_size):
            env = processes.child_env(world.with_rank(r).env())
            self.procs.append(subprocess.Popen(
                [sys.executable, "-m", "strata.engine.tp_worker", "--config", cfg], env=env,
                stdin=subprocess.DEVNULL,
            ))

    def check_alive(self) -> None:
        for r, p in enumerate(self.procs, 1):
            code = p.poll()
            if code is not None:
                raise RankDied(f"tensor-parallel rank {r} exited ({processes_exit(code)})")

    def close(self, broken: bool = False) -> None:
        """Stop the spawned ranks (bounded) and leave the world. After a failure (`broken`) the
        world's teardown may wait on a dead peer: it gets comm_timeout, then is left behind."""
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.procs = []
        if not broken:
            destroy_world()
            return
        teardown = threading.Thread(target=destroy_world, name="strata-destroy-world", daemon=True)
        teardown.start()
        teardown.join(self.config.comm_timeout)
        if teardown.is_alive():
            logger.warning("the process group's teardown did not finish in %g s (a dead peer); "
                           "left behind", self.config.comm_timeout)


def processes_exit(code: int) -> str:
    return f"killed by signal {-code}" if code < 0 else f"exit code {code}"

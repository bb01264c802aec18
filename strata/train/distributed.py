"""Data parallelism over torch.distributed: DDP (gradient buckets all-reduced while backward still
runs, optional bf16/fp16 compression hook from comm/) or FSDP2 (`fully_shard` per decoder layer,
then the root: parameters, gradients and optimizer state sharded across ranks).

The world comes from torchrun's environment (one host or many) or from `--nproc-per-node N`,
which spawns the ranks locally on a loopback rendezvous (comm/launch.py); gloo on CPU, NCCL on
CUDA, every collective bounded by --comm-timeout-s.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch import nn

from strata.comm.ddp_hooks import compression_hook
from strata.comm.world import World, destroy_world, init_world
from strata.errors import ConfigError
from strata.train.config import FSDP_LORA, TrainConfig

logger = logging.getLogger(__name__)


def setup_world(cfg: TrainConfig) -> World | None:
    """Join the world torchrun (or our launcher) described; None for a single process."""
    world = World.from_env()
    if world is None or world.world_size == 1:
        return None
    device = cfg.device
    if device.startswith("cuda"):
        torch.cuda.set_device(world.local_rank)
    init_world(world, "cuda" if device.startswith("cuda") else "cpu", timeout_s=cfg.comm_timeout_s)
    return world


def _fully_shard():
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # torch >= 2.6
    except ImportError:
        try:
            from torch.distributed._composable.fsdp import MixedPrecisionPolicy, fully_shard
        except ImportError:
            raise ConfigError("--distributed fsdp needs FSDP2 (torch >= 2.4); use --distributed ddp") from None
    return fully_shard, MixedPrecisionPolicy


def wrap(module: nn.Module, layers: nn.ModuleList, cfg: TrainConfig, world: World | None,
         compute_dtype: torch.dtype, sparse: bool = False) -> nn.Module:
    """`module` (the training wrapper) made data parallel; unchanged for one process. `sparse`: a
    mixture of experts, where an expert no token of a rank picked has no gradient there, so the
    ranks must reduce the unused parameters too (DDP's find_unused_parameters, FSDP2's
    reduce_scatter_unused_params) or the collectives would not match.

    --lora: DDP reduces only the parameters that require grad (the adapter); the frozen base and
    its buffers (a quantized base's int weights among them) are equal on every rank from the
    start, so they are not re-broadcast every forward. FSDP is refused (config.FSDP_LORA)."""
    if world is None:
        return module
    cuda = cfg.device.startswith("cuda")
    if cfg.lora and cfg.distributed == "fsdp":
        raise ConfigError(FSDP_LORA)
    if cfg.distributed == "ddp":
        ddp = nn.parallel.DistributedDataParallel(
            module, device_ids=[world.local_rank] if cuda else None, bucket_cap_mb=cfg.ddp_bucket_mb,
            gradient_as_bucket_view=True, find_unused_parameters=sparse, broadcast_buffers=not cfg.lora)
        hook = compression_hook(cfg.ddp_comm_dtype)
        if hook is not None:
            ddp.register_comm_hook(state=None, hook=hook)
        return ddp
    if cfg.ddp_comm_dtype != "none":
        raise ConfigError("--ddp-comm-dtype applies to --distributed ddp; FSDP reduces in the compute dtype")
    fully_shard, MixedPrecisionPolicy = _fully_shard()
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cuda" if cuda else "cpu", (world.world_size,))
    mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32) \
        if compute_dtype != torch.float32 else MixedPrecisionPolicy()
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(module, mesh=mesh, mp_policy=mp)
    if sparse:
        if not hasattr(module, "set_reduce_scatter_unused_params"):
            raise ConfigError("--distributed fsdp of a mixture of experts needs FSDP2's "
                              "set_reduce_scatter_unused_params (a newer torch); use --distributed ddp")
        module.set_reduce_scatter_unused_params(True)
    return module


def all_mean(value: float, world: World | None, device: str) -> float:
    """The mean of a per-rank float over the world (for logging: every rank gets it)."""
    if world is None:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return float(t.item()) / world.world_size


def all_sum(t: torch.Tensor, world: World | None, device: str) -> torch.Tensor:
    """The sum of a per-rank tensor over the world, on the CPU (every rank gets it)."""
    if world is None:
        return t
    out = t.to(device)
    dist.all_reduce(out)
    return out.cpu()


def barrier(world: World | None) -> None:
    if world is not None:
        dist.barrier()


def leave_world(world: World | None, clean: bool) -> None:
    """Destroy the process group before the interpreter exits: left to exit, torch's teardown of
    it aborted a rank now and then ("terminate called without an active exception"). After a clean
    run the ranks meet first, so none leaves while another is still in a collective."""
    if world is None:
        return
    if clean:
        dist.barrier()
    destroy_world()

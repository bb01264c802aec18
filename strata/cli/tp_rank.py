"""A rank > 0 of a tensor-parallel command under torchrun: it follows rank 0's engine steps."""

from __future__ import annotations

import argparse

from strata.comm.world import World
from strata.engine.args import EngineArgs
from strata.engine.tp_worker import exit_now, run_worker


def follow_rank0(args: argparse.Namespace) -> int | None:
    """Run rank 0's steps until it stops (never returns there); None on rank 0 or without torchrun."""
    world = World.from_env()
    if world is None or world.rank == 0:
        return None
    exit_now(run_worker(EngineArgs.from_cli_args(args).create_engine_config()))

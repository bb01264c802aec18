"""`strata train --nproc-per-node N` without torchrun: this process becomes rank 0 of a loopback
world and starts ranks 1..N-1 as `python -m strata train ...` (the same command line), which die
with it (hardware/processes.py) and are reaped, even when training fails."""

from __future__ import annotations

import os
import subprocess
import sys

from strata.comm.world import World, local_world
from strata.hardware import processes


class LocalTrainRanks:
    def __init__(self, world_size: int, argv: list[str]) -> None:
        self.world: World = local_world(world_size)
        self.argv = argv
        self.procs: list[subprocess.Popen] = []
        self.threads = max(1, (os.cpu_count() or 1) // world_size)

    def __enter__(self) -> LocalTrainRanks:
        os.environ.update(self.world.with_rank(0).env())
        for r in range(1, self.world.world_size):
            env = processes.child_env({**self.world.with_rank(r).env(), "OMP_NUM_THREADS": str(self.threads)})
            self.procs.append(subprocess.Popen([sys.executable, "-m", "strata", "train", *self.argv], env=env,
                                               stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL))
        return self

    def failed(self) -> list[int]:
        return [p.returncode for p in self.procs if p.poll() not in (None, 0)]

    def __exit__(self, exc_type, *_) -> None:
        for p in self.procs:
            try:
                p.wait(timeout=30 if exc_type is None else 5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for key in self.world.env():
            os.environ.pop(key, None)

"""A tensor-parallel rank other than 0: `python -m strata.engine.tp_worker --config JSON`.

Spawned by rank 0 (engine/parallel.py) with the world in its environment, or reached from the
`strata` command under torchrun on ranks > 0. It builds the same engine on its shard, then runs
every step rank 0 broadcasts until rank 0 says stop (or disappears).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import sys

from strata.config import EngineConfig
from strata.engine.build import build_engine
from strata.engine.parallel import STOP, decode_step
from strata.errors import StrataError
from strata.hardware import processes
from strata.logs import setup_logging

logger = logging.getLogger("strata.engine.tp_worker")


def run_worker(config: EngineConfig) -> int:
    """Build this rank's engine parts and follow rank 0's steps; 0 when told to stop."""
    parts = build_engine(config, detokenize=False)
    ranks, control, runner = parts.ranks, parts.control, parts.runner
    parts = None
    rank = ranks.rank
    try:
        while True:
            data = control.broadcast_bytes(None, src=0)
            if data == STOP:
                return 0
            plan = decode_step(data)
            if plan.lora is not None:  # rank 0 changed adapter slots: the same ones here, first
                runner.lora.follow(plan.lora)
            runner.execute(plan)
    except RuntimeError as e:  # a collective failed: rank 0 (or a peer) is gone or hung
        logger.error("tensor-parallel rank %d: lost the other ranks (%s); exiting", rank, str(e).splitlines()[0])
        return 1
    finally:
        # nothing may hold a Communicator or its group when the world is destroyed: torch's
        # process-group teardown then aborts the process at exit now and then
        runner = control = None
        gc.collect()
        ranks.close()


def main(argv: list[str] | None = None) -> int:
    processes.die_with_parent()
    ap = argparse.ArgumentParser(prog="python -m strata.engine.tp_worker")
    ap.add_argument("--config", required=True, help="EngineConfig fields as JSON")
    args = ap.parse_args(argv)
    setup_logging("warning")
    try:
        code = run_worker(EngineConfig(**json.loads(args.config)))
    except StrataError as e:  # rank 0 reports the same problem; one line here
        logger.error("tensor-parallel rank: %s", e)
        code = 2
    except KeyboardInterrupt:
        code = 130
    exit_now(code)
    return code


def exit_now(code: int) -> None:
    """Leave without the interpreter's teardown (torch.distributed's can abort a finished rank)."""
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())

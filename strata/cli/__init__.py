"""`strata <command>`: parse (the registry imports the chosen command's module), then run it.

The commands are listed in registry.py; each lives in its own module (generate.py and hw.py here,
the others in their packages)."""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
from collections.abc import Callable

from strata import cli_options
from strata.cli.registry import build_parser, command
from strata.errors import StrataError
from strata.logs import setup_logging

__all__ = ["build_parser", "main"]


def _torchrun_worker(args: argparse.Namespace) -> int | None:
    """Under torchrun with --tensor-parallel-size N, ranks > 0 run the steps of rank 0's engine
    instead of the command (rank 0 serves, generates or benchmarks); None on rank 0 / no torchrun."""
    tp = getattr(args, "tensor_parallel_size", 1) or 1
    if tp < 2:
        return None
    from strata.cli import (
        tp_rank,  # imports torch and the engine: only a tensor-parallel command needs them
    )

    return tp_rank.follow_rank0(args)


def main(argv: list[str] | None = None, imported: Callable[[], None] | None = None) -> int:
    """Run a command; errors are one line (exit 2), Ctrl-C is one line "interrupted" (exit 130).

    `imported` is called once the command's modules are imported (strata/__main__.py: a Ctrl-C
    before then leaves at once). After a KeyboardInterrupt, SIGINT is ignored so that a second
    Ctrl-C while we unwind (threads joining, atexit hooks) cannot print a traceback. `strata serve`
    handles SIGINT itself once it has started (server/main.py: drain, stop the children, exit 130)."""
    try:
        argv = list(sys.argv[1:] if argv is None else argv)
        args = build_parser().parse_args(argv)
        if imported is not None:
            imported()
        args.raw_argv = argv  # a command that re-launches itself (strata train's local ranks) needs it
        setup_logging(cli_options.log_level(args, default=command(args.command).log_level))
        worker = _torchrun_worker(args)
        if worker is not None:
            return worker
        return args.func(args)
    except (StrataError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        with contextlib.suppress(Exception):
            sys.stdout.flush()
        print("interrupted", file=sys.stderr, flush=True)
        return 130

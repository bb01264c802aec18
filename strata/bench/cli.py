"""`strata bench ...` subcommands (filled in by strata/bench/throughput.py and latency.py)."""

from __future__ import annotations

import argparse


def add_module(bsub: argparse._SubParsersAction, mod) -> None:
    """One `strata bench NAME` subcommand from a module with NAME, HELP, add_arguments and main."""
    p = bsub.add_parser(mod.NAME, help=mod.HELP, description=mod.__doc__,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    mod.add_arguments(p)
    p.set_defaults(func=mod.main)


def register(sub: argparse._SubParsersAction) -> argparse._SubParsersAction:
    """Adds `strata bench` and the benchmarks in strata/bench; returns its subparsers, so that
    strata/cli.py can add those living above bench (strata/analyze/plan_accuracy.py) with
    add_module()."""
    bench = sub.add_parser("bench", help="benchmarks (print a table; --json FILE)")
    bsub = bench.add_subparsers(dest="bench_command", required=True)
    from strata.bench import latency, preempt, prefix, serve, spec, structured, throughput, train

    for mod in (throughput, latency, prefix, preempt, serve, train, structured, spec):
        add_module(bsub, mod)
    add_module(bsub, __import__("strata.bench.comm", fromlist=["comm"]))  # strata bench comm
    return bsub

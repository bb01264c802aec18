"""`strata bench ...` subcommands (filled in by strata/bench/throughput.py and latency.py)."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="benchmarks (print a table; --json FILE)")
    bsub = bench.add_subparsers(dest="bench_command", required=True)
    from strata.bench import latency, plan_accuracy, preempt, prefix, serve, throughput

    for mod in (throughput, latency, prefix, preempt, serve, plan_accuracy):
        p = bsub.add_parser(mod.NAME, help=mod.HELP, description=mod.__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
        mod.add_arguments(p)
        p.set_defaults(func=mod.main)

"""`strata hw`: this machine's identity and measured figures (strata/hardware/report.py)."""

from __future__ import annotations

import argparse
import json

from strata.hardware.report import build_report, format_report

NAME = "hw"
HELP = "this machine: CPU, caches, memory, GPUs, links; measured bandwidth and FLOP/s"
EPILOG = """examples:
  strata hw                 # identity + measured figures (cached under $STRATA_CACHE)
  strata hw --refresh       # re-measure
  strata hw --json          # everything as JSON
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print JSON instead of the report")
    p.add_argument("--refresh", action="store_true", help="re-measure instead of reading the cache")


def run(args: argparse.Namespace) -> int:
    report = build_report(refresh=args.refresh)
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        print(format_report(report))
    return 0

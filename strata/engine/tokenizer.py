"""Moved to strata/protocol/tokenizer.py. This re-export stays only while engine/build.py (the CPU
platform rework's file) and bench/serve_workload.py (the command-registry rework's) import it from here."""

from strata.protocol.tokenizer import Tokenizer  # noqa: F401

"""Moved to strata/protocol/sampling_params.py. This re-export stays only while cli.py, bench/ and
analyze/ (the command-registry rework's files) still import it from here."""

from strata.protocol.sampling_params import RequestOutputKind, SamplingParams, StructuredOutput  # noqa: F401

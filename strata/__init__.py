"""Strata: an LLM systems runtime that can say which layer limits a workload.

`from strata import LLM, SamplingParams` is the offline API. The names are imported on first use
(PEP 562), so `import strata` alone does not load torch: the `strata` command can then answer
Ctrl-C during its start-up with one line (strata/__main__.py).
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "strata.engine.llm",
    "SamplingParams": "strata.protocol.sampling_params",
    "StructuredOutput": "strata.protocol.sampling_params",
    "RequestOutput": "strata.protocol.outputs",
    "CompletionOutput": "strata.protocol.outputs",
    "LoRARequest": "strata.protocol.lora",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'strata' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])

"""Strata: an LLM systems runtime that can say which layer limits a workload."""

from strata.engine.llm import LLM
from strata.engine.request import CompletionOutput, RequestOutput
from strata.engine.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
